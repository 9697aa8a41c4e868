"""tune refuses a partition whose nodes are not the platform's before anything is queued: sinfo's text against the
platform (plan/node_shape.py). sinfo-shaped text in, one line with the fix out; no cluster."""

from __future__ import annotations

import dataclasses
import os

import pytest

from megatron_hpc.config.hardware import builtin_hardware
from megatron_hpc.config.platforms import get_platform, with_hardware
from megatron_hpc.plan.node_shape import gres_gpus, node_shape_mismatch, partition_nodes

# sinfo -h -N -o '%N|%P|%c|%m|%G|%f': the default partition marked with *, one line per node and partition.
SINFO = """\
gpu-a100-[1]|a100*|128|1031000|gpu:a100:8(S:0-1)|a100,ib
gpu-a100-2|a100*|128|1031000|gpu:a100:8(S:0-1)|a100,ib
gpu-h100-1|h100|192|2063000|gpu:h100:8(S:0-1),nvme:1|h100
gpu-h100-2|h100|192|2063000|gpu:h100:4(S:0)|h100,half
cpu-1|cpu|4|4096|(null)|(null)
trn-1|trn|128|507904|(null)|trn1
sinfo: warning: some line sinfo prints that is not a node
"""


def mismatch(platform_name, partition, *, constraint=None, platform=None):
    platform = platform or get_platform(platform_name)
    nodes, name = partition_nodes(SINFO, partition, constraint=constraint)
    return node_shape_mismatch(nodes, partition=name, platform=platform, hardware=platform_name,
                               workers_per_node=platform.workers_per_node)


@pytest.mark.parametrize(("gres", "gpus"), [("gpu:8", 8), ("gpu:h100:8(S:0-1)", 8), ("gpu:a100:4,gpu:t4:2", 6),
                                            ("gpu:h100:8(S:0-1),nvme:1", 8), ("(null)", 0), ("nvme:1", 0)])
def test_gres_gpus(gres, gpus):
    assert gres_gpus(gres) == gpus


def test_the_default_partition_and_the_named_one():
    nodes, name = partition_nodes(SINFO, None)
    assert name == "a100" and [n.name for n in nodes] == ["gpu-a100-[1]", "gpu-a100-2"]
    nodes, name = partition_nodes(SINFO, "h100")
    assert [(n.cpus, n.gpus, n.memory_mb) for n in nodes] == [(192, 8, 2063000), (192, 4, 2063000)]
    assert partition_nodes(SINFO, "none") == ([], "none")


def test_p5_on_its_own_nodes_passes_and_a_node_with_half_the_gpus_is_named():
    assert mismatch("p5", "a100") is None  # 8 GPUs each: the count matches (memory is the job's check)
    line = mismatch("p5", "h100")
    assert line == ("tune would run on partition h100, but sinfo reports 1 of its 2 nodes unlike platform p5 "
                    "(gpu-h100-2: 4 GPUs (GRES gpu:h100:4(S:0)); p5 states 8 GPUs and 8 workers per node), and a "
                    "calibration measured there would be kept under p5's name; use --partition (or the profile's "
                    "constraint) with the platform's nodes, or describe these with --platform-file "
                    "(workers_per_node: 4); nothing was queued")
    assert mismatch("p5", "h100", constraint="h100") is not None  # both nodes have the feature
    assert mismatch("p5", "h100", constraint="half") is not None
    assert mismatch("p5", "h100", constraint="nope") is None  # no node: sinfo says nothing, the job checks


def test_a_platform_file_for_the_half_nodes_passes_there():
    half = with_hardware(dataclasses.replace(builtin_hardware("p5"), name="h100-half", workers_per_node=4))
    nodes, _ = partition_nodes(SINFO, "h100")
    four = [n for n in nodes if n.gpus == 4]
    assert node_shape_mismatch(four, partition="h100", platform=half, hardware="h100-half",
                               workers_per_node=4) is None
    assert "(gpu-h100-1: 8 GPUs" in node_shape_mismatch(nodes, partition="h100", platform=half,
                                                       hardware="h100-half", workers_per_node=4)


def test_gpu_nodes_are_not_trainium_and_cpu_nodes_have_too_few_cores():
    assert "8 GPUs (GRES gpu:a100:8(S:0-1)), not Trainium devices" in mismatch("trn1", "a100")
    assert "(cpu-1: 4 CPUs for 32 workers;" in mismatch("trn1", "cpu")
    assert mismatch("trn1", "trn") is None
    assert "(cpu-1: 0 GPUs (GRES (null));" in mismatch("p5", "cpu")
    assert "use a platform file that describes them (--platform-file)" in mismatch("p5", "cpu")


def test_the_cpu_platform_is_not_checked():
    assert mismatch("cpu", "cpu") is None and mismatch("cpu", "a100") is None


def test_tune_refuses_before_writing_or_queueing(tmp_path, monkeypatch, cli_in_process):
    """`tune --cluster slurm` on a partition of 4-GPU nodes for p5: one line, no run folder, no sbatch."""
    bin_dir, queued = tmp_path / "bin", tmp_path / "queued"
    bin_dir.mkdir()
    tools = {"sbatch": f"touch {queued}; echo 'Submitted batch job 1'", "srun": "exit 0", "sacct": "exit 0",
             "scontrol": "echo 'Slurmctld(primary) at ctl is UP'",
             "sinfo": "echo 'gpu-h100-2|h100*|192|2063000|gpu:h100:4(S:0)|h100'"}
    for tool, body in tools.items():
        (bin_dir / tool).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.delenv("MEGATRON_HPC_CLUSTER_CONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no cluster profile: the default partition
    run_dir = tmp_path / "run"
    done = cli_in_process("tune", "--recipe", "tiny", "--nodes", "2", "--platform", "p5", "--set",
                          "data.source=synthetic", "--set", "compile.num_steps=6", "--top", "1", "--out", str(run_dir))
    assert done.returncode != 0
    assert "sinfo reports its nodes unlike platform p5 (gpu-h100-2: 4 GPUs" in done.stderr
    assert "nothing was queued" in done.stderr and done.stderr.count("\n") <= 2
    assert not run_dir.exists() and not queued.exists()

"""Dry runs against the hand-written goldens: the 16-node gpt3_6.7b trn1 run of the reference scripts, and a
2-node gpt2_small run on p5 (GPUs)."""

import os
import re
import shlex
from pathlib import Path

import yaml

from megatron_hpc.cli.main import main

GOLDEN = yaml.safe_load((Path(__file__).parent / "golden" / "gpt3_6.7b_trn1_16nodes.yaml").read_text())
GPU_GOLDEN = yaml.safe_load((Path(__file__).parent / "golden" / "gpt2_small_p5_2nodes.yaml").read_text())
NAMED_BY_US = ("--output=", "--job-name=", "--chdir=")
"""Directives that name our run folder, phase and working folder; checked apart from the goldens."""


def render(tmp_path: Path) -> Path:
    out = tmp_path / "d"
    assert main(["submit", "--recipe", "gpt3_6.7b", "--nodes", "16", "--platform", "trn1", "--dry-run",
                 "--set", "data.source=synthetic", "--out", str(out)]) == 0
    return out


def submit_lines(out: Path) -> list[str]:
    """The sbatch command lines of submit.sh, with the job id variables as written."""
    return [ln.split("=$(", 1)[1].removesuffix(")").replace('"', "")
            for ln in (out / "submit.sh").read_text().splitlines() if "=$(sbatch " in ln]


def directives(text: str) -> set[str]:
    return {line.split(None, 1)[1] for line in text.splitlines() if line.startswith("#SBATCH ")}


def srun_line(text: str) -> list[str]:
    (line,) = [ln for ln in text.splitlines() if ln.startswith("srun ")]
    return shlex.split(line)


def exports(text: str) -> dict[str, str]:
    env = {}
    for line in text.splitlines():
        if line.startswith("export ") and "=" in line and "$" not in line:
            key, _, value = line[len("export "):].partition("=")
            env[key] = shlex.split(value)[0] if value else ""
    return env


def test_sbatch_directives_match_the_reference(tmp_path):
    out = render(tmp_path)
    expected = set(GOLDEN["reference"]["sbatch"]) | set(GOLDEN["ours"]["sbatch_extra"])
    for phase in ("compile", "run"):
        found = directives((out / f"{phase}.sbatch").read_text())
        assert f"--output={out}/logs/%x-%j.out" in found and f"--job-name=gpt3_6.7b-{phase}" in found
        assert f"--chdir={os.getcwd()}" in found  # where submit ran: relative recipe paths resolve there
        found = {d for d in found if not d.startswith(NAMED_BY_US)}
        assert found == expected | {GOLDEN["ours"]["time"][phase]}, phase


def test_phases_are_queued_with_the_golden_command_lines(tmp_path):
    out = render(tmp_path)
    queue = GOLDEN["ours"]["queue"]
    assert submit_lines(out) == [queue["compile"].format(out=out), queue["run"].format(out=out)]


def test_srun_lines_match_the_reference(tmp_path):
    out = render(tmp_path)
    ours = GOLDEN["ours"]["srun_args"].split()
    compile_cmd = srun_line((out / "compile.sbatch").read_text())
    run_cmd = srun_line((out / "run.sbatch").read_text())
    assert compile_cmd[1:1 + len(ours)] == ours and run_cmd[1:1 + len(ours)] == ours
    # the reference's compile prefix runs inside node.sh, around torchrun (`ours` says why)
    assert GOLDEN["ours"]["compile_torchrun_prefix"] == GOLDEN["reference"]["compile_srun_prefix"]
    prefix = GOLDEN["ours"]["compile_srun_prefix"].split()
    assert compile_cmd[1 + len(ours):] == [*prefix, "bash", str(out / "node.sh"), "compile"]
    assert run_cmd[1 + len(ours):] == [*GOLDEN["reference"]["run_srun_prefix"].split(), "bash",
                                       str(out / "node.sh"), "run"]


def test_the_compile_phase_runs_torchrun_under_the_reference_prefix(tmp_path):
    node = (render(tmp_path) / "node.sh").read_text()
    wrapper = GOLDEN["ours"]["compile_torchrun_prefix"]
    assert ('TORCHRUN_WRAPPER=()\nif [ "$PHASE" = compile ]; then\n'
            f"  TORCHRUN_WRAPPER=({wrapper})\nfi\n") in node
    assert 'exec "${TORCHRUN_WRAPPER[@]}" torchrun ' in node


def test_node_environment_matches_the_reference(tmp_path):
    node = (render(tmp_path) / "node.sh").read_text()
    env = exports(node)
    expected = {**GOLDEN["reference"]["env"], **GOLDEN["ours"]["env_extra"]}
    assert set(env) == set(expected)
    for key, value in expected.items():
        assert env[key] == value, key
    # the compile cache is the node-local one, known only on the node (synced from the shared cache)
    assert 'export NEURON_COMPILE_CACHE_URL="$LOCAL_CACHE/neuron"' in node
    for name in GOLDEN["reference"]["must_not_set"]:
        assert name not in node
    assert f"ulimit -n {GOLDEN['ours']['ulimit_nofile']}" in node


def test_torchrun_arguments_match_the_reference(tmp_path):
    node = (render(tmp_path) / "node.sh").read_text()
    joined = re.sub(r"\\\n\s*", " ", node)
    lines = [ln for ln in joined.splitlines()
             if not ln.lstrip().startswith("#") and (" torchrun --" in ln or ln.strip().startswith("torchrun "))]
    # The phase's own torchrun, and the tune phase's graphs-only pass before it on Trainium: both as the reference's.
    assert len(lines) == 2, lines
    for line in lines:
        args = dict(re.findall(r"--(\w+)=\"?([^\s\"]+)\"?", line))
        for key, value in GOLDEN["reference"]["torchrun"].items():
            assert args[key] == value, key
    assert "scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1" in node


def render_gpu(tmp_path: Path) -> Path:
    out = tmp_path / "gpu"
    assert main(["submit", "--recipe", "gpt2_small", "--nodes", "2", "--platform", "p5", "--dry-run",
                 "--set", "data.path=/fsx/data/codeparrot_text_document", "--out", str(out)]) == 0
    return out


def test_gpu_run_asks_for_its_gpus_and_queues_only_the_run_phase(tmp_path):
    out = render_gpu(tmp_path)
    assert sorted(p.stem for p in out.glob("*.sbatch")) == GPU_GOLDEN["phases"]
    text = (out / "run.sbatch").read_text()
    found = {d for d in directives(text) if not d.startswith(NAMED_BY_US)}
    assert found == set(GPU_GOLDEN["run"]["sbatch"])
    srun = srun_line(text)
    assert srun[1:] == [*GPU_GOLDEN["run"]["srun_args"].split(), "bash", str(out / "node.sh"), "run"]
    assert submit_lines(out) == [GPU_GOLDEN["run"]["queue"].format(out=out)]


def test_gpu_node_script_matches_the_golden(tmp_path):
    node = (render_gpu(tmp_path) / "node.sh").read_text()
    env = exports(node)
    assert set(env) == set(GPU_GOLDEN["env"])  # exports() skips PATH, which names this venv
    for key, value in GPU_GOLDEN["env"].items():
        assert env[key] == value, key
    for name in GPU_GOLDEN["must_not_set"]:
        assert name not in node
    joined = re.sub(r"\\\n\s*", " ", node)
    assert f"--nproc_per_node={GPU_GOLDEN['torchrun']['nproc_per_node']} " in joined

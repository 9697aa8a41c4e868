"""Compile fingerprints: what changes the graphs changes the fingerprint, nothing else does; submit
leaves the compile phase out when the shared cache holds it."""

import json
import subprocess
import sys
from importlib import metadata

from megatron_hpc.compile_cache import fingerprint

from megatron_hpc.cli.main import main
from megatron_hpc.run_folder import FINGERPRINT_FILE

BASE = ["submit", "--recipe", "gpt3_6.7b", "--nodes", "16", "--platform", "trn1", "--dry-run", "--json",
        "--set", "data.source=synthetic"]


def dry_run(capsys, out, *sets: str, recompile: bool = False) -> dict:
    args = [*BASE, "--out", str(out)]
    for item in sets:
        args += ["--set", item]
    if recompile:
        args.append("--recompile")
    capsys.readouterr()
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)


def test_graph_inputs_change_it_and_the_rest_does_not(tmp_path, capsys):
    base = dry_run(capsys, tmp_path / "a")["fingerprint"]
    same = [dry_run(capsys, tmp_path / f"s{i}", s)["fingerprint"]
            for i, s in enumerate(["optim.lr=1e-4", "train.num_steps=7", "train.seed=9", "train.log_interval=3",
                                   "checkpoint.save_interval=50"])]
    assert same == [base] * len(same)
    changed = [dry_run(capsys, tmp_path / f"c{i}", s)["fingerprint"]
               for i, s in enumerate(["train.global_batch_size=512", "model.recompute=true",
                                      "parallel.tensor=32", "model.seq_length=1024", "model.num_layers=30",
                                      "train.compile_backend=aot_eager"])]
    assert base not in changed and len(set(changed)) == len(changed)


def test_compiler_flags_count_but_not_where_the_cache_is():
    cfg, plan = {"model": {"hidden_size": 8}, "train": {"micro_batch_size": 1}}, {"num_nodes": 1}
    fp = lambda env: fingerprint.compute(cfg, plan, env=env, compiler="neuronx-cc 2.15").sha256  # noqa: E731
    plain = fp({"NEURON_CC_FLAGS": "--model-type transformer"})
    assert fp({"NEURON_CC_FLAGS": "--model-type transformer --cache_dir=/somewhere",
               "NEURON_COMPILE_CACHE_URL": "/shared/neuron"}) == plain
    assert fp({"NEURON_CC_FLAGS": "--model-type transformer -O1"}) != plain
    assert fingerprint.compute(cfg, plan, env={}, compiler="neuronx-cc 2.16").sha256 != \
        fingerprint.compute(cfg, plan, env={}, compiler="neuronx-cc 2.15").sha256


def test_the_same_in_another_process(tmp_path, capsys):
    ours = dry_run(capsys, tmp_path / "a")["fingerprint"]
    proc = subprocess.run([sys.executable, "-m", "megatron_hpc", *BASE, "--out", str(tmp_path / "b")],
                          capture_output=True, text=True, check=True)
    assert json.loads(proc.stdout)["fingerprint"] == ours


def test_submit_skips_the_compile_phase_only_for_a_recorded_fingerprint(tmp_path, capsys, own_compile_cache):
    first = dry_run(capsys, tmp_path / "first")
    assert first["compile_skipped"] is False and (tmp_path / "first" / "compile.sbatch").exists()
    # what the node script does after a successful compile phase on node 0
    fp = json.loads((tmp_path / "first" / FINGERPRINT_FILE).read_text())
    fingerprint.record(own_compile_cache, fp, run_dir=str(tmp_path / "first"), job_id="11")

    second = dry_run(capsys, tmp_path / "second")
    assert second["compile_skipped"] is True
    assert not (tmp_path / "second" / "compile.sbatch").exists()
    run_sbatch = (tmp_path / "second" / "run.sbatch").read_text()
    assert "afterok" not in run_sbatch and "dependency" not in (tmp_path / "second" / "submit.sh").read_text()

    forced = dry_run(capsys, tmp_path / "forced", recompile=True)
    assert forced["compile_skipped"] is False and (tmp_path / "forced" / "compile.sbatch").exists()
    other_batch = dry_run(capsys, tmp_path / "gbs", "train.global_batch_size=512")
    assert other_batch["compile_skipped"] is False


def test_cpu_mesh_and_torch_compile_switches_change_it(tmp_path, capsys):
    base = ["submit", "--recipe", "tiny", "--cluster", "local", "--dry-run", "--json",
            "--set", "launch.workers_per_node=2"]

    def fp(out: str, *sets: str) -> dict:
        capsys.readouterr()
        assert main([*base, "--out", str(tmp_path / out), *[a for s in sets for a in ("--set", s)]]) == 0
        return json.loads(capsys.readouterr().out)["fingerprint"]

    dp2 = fp("dp2")
    assert fp("tp2", "parallel.tensor=2") != dp2
    assert fp("mbs", "train.micro_batch_size=2", "train.global_batch_size=8") != dp2
    compiled = fp("compiled", "train.compile=true")
    assert compiled != dp2
    record = json.loads((tmp_path / "compiled" / FINGERPRINT_FILE).read_text())
    assert record["inputs"]["env"]["TORCHINDUCTOR_FX_GRAPH_CACHE"] == "1"
    assert record["inputs"]["compiler"].startswith("torch ")


def test_compiler_identity_reads_torch_version_without_importing_it():
    code = ("import sys; from megatron_hpc.compile_cache import fingerprint; "
            "print(fingerprint.compiler_identity('gloo')); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == f"torch {metadata.version('torch')}" and out[1] == "False"

"""Every script under benchmarks/ runs end to end at a smoke size and prints its ratios line, so none rots.

Each runs as its users run it (`python benchmarks/NAME.py ...` from the repository root; for the scripts in
IN_PROCESS the same main() with the same sys.argv, working directory and sys.path, in the test's process) on the
smallest model and the fewest rounds that still take every path of the script to its summary; the figures mean
nothing at that size (benchmarks/RESULTS.md has the real ones), so only the shape of the summary is checked. Two
scripts time us against another project's tool that the suite does not install (megatron-core, Megatron-LM): their
smoke runs time megatron-hpc against itself (--self-anchor), so everything but the other tool's command runs. The
GPU benchmark runs its CPU path (--allow-cpu) and, without it, must refuse with the fix. A script with a second model
family (--family llama) runs once per family: a case named "script.py[family]".
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
PREPROCESS = ROOT / "tests" / "fixtures" / "preprocess"
TINY = ["--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "16", "--vocab", "64"]

CASES: dict[str, tuple[list[str], str]] = {
    # script: (arguments, a regular expression for its ratios line; {tmp} is the test's temp folder)
    "activation_bytes.py": ([*TINY, "--batch", "1", "--out", "{tmp}/out", "--modes", "sp_tp2_selective"],
                            r"^\| sp_tp2_selective \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$"),
    "cache_stats.py": (["--entries", "200", "--rounds", "1", "--dir", "{tmp}"],
                       r"^ratio stats/du = [\d.]+ wall, [\d.]+ CPU; target for 200 entries: < 2 s -> (met|NOT met)$"),
    "ckpt_io.py": (["--dir", "{tmp}/ckpt", "--gib", "0.001", "--hidden", "32", "--rounds", "1", "--keep-caches",
                    "--step-matmuls", "1", "--mode", "blocked", "split", "io"],
                   r"^resume: copy/dd [\d.]+x, in place/dd [\d.]+x, in place/copy [\d.]+x; weights into existing "
                   r"memory/dd [\d.]+x$"),
    # aot_eager: the compile phase, the cache sync and both starts, without Inductor's minute of kernel compiling
    # (tests/multiprocess/test_compile_tree_publish.py checks Inductor's warm start itself)
    "compile_warm_start.py": (["--rounds", "1", "--dir", "{tmp}", "--set", "train.compile_backend=aot_eager",
                               "--set", "model.num_layers=1",
                               "--set", "model.hidden_size=32", "--set", "model.num_attention_heads=2",
                               "--set", "model.seq_length=16", "--set", "model.max_position_embeddings=16",
                               "--set", "model.vocab_size=64"],
                              r"^ratio warm/cold = [\d.]+; goal <= 0.30 -> (met|NOT met)$"),
    "convert_cpu.py": (["--dir", "{tmp}/convert", "--layers", "1", "--hidden", "64", "--heads", "8", "--vocab", "300",
                        "--seq", "32"],
                       r"^time goal \(<= 2x copy\): (met|NOT met); memory goal \(< two output ranks' shards\): "
                       r"(met|NOT met)$"),
    "convert_torch_dist_cpu.py": (["--dir", "{tmp}/td", "--layers", "1", "--hidden", "64", "--heads", "8",
                                   "--vocab", "300", "--seq", "32", "--files", "2", "--optimizer", "--to", "torch",
                                   "xser", "torch_dist", "hf", "--shard-size-gb", "0.0001"],
                                  r"^time goal \(each convert <= 2x copy\): (met|NOT met); worst [\d.]+x; convert "
                                  r"peak RSS / source [\d.]+x$"),
    "convert_torch_dist_cpu.py[dp_reshardable]": (
        ["--dir", "{tmp}/td", "--layers", "2", "--hidden", "64", "--heads", "8", "--vocab", "300", "--seq", "32",
         "--files", "2", "--dp-reshardable", "--to", "torch", "torch_dist", "--workers", "1", "2"],
        r"^time goal \(each convert <= 2x copy\): (met|NOT met); worst [\d.]+x; convert peak RSS / source [\d.]+x$"),
    "convert_torch_dist_cpu.py[ours]": (
        ["--dir", "{tmp}/td", "--layers", "2", "--hidden", "64", "--heads", "8", "--vocab", "300", "--seq", "32",
         "--files", "2", "--optimizer", "--ours", "xser", "--ours-pp", "2", "--to", "hf",
         "--baseline", "."],
        r"^time goal \(each convert <= 2x copy\): (met|NOT met); worst [\d.]+x; convert peak RSS / source [\d.]+x$"),
    "data_index_build.py": (["--self-anchor", "--docs", "200", "--mean-tokens", "50", "--seq-length", "64",
                             "--epochs", "1", "--rounds", "1", "--dir", "{tmp}"],
                            r"^ 1 epoch\(s\) megatron-hpc/megatron-hpc again \(\d+ samples\), per round: build "
                            r"[\d.]+x .*own peak [\d.]+x; growth during the build [\d.]+x$"),
    "dist_optim_cpu.py": (["--dp", "2", *TINY, "--steps", "1", "--warmup", "0", "--part-reps", "1",
                           "--overlap-blocks", "1", "--overlap-block-steps", "1"],
                          r"^\| 2 \| \d+ ms \| \d+ ms \| [\d.]+ \| [\d.]+ \| [\d.e+-]+ \(1\) \|$"),
    "generate_cpu.py": (["--layers", "1", "--hidden", "64", "--heads", "4", "--vocab", "300", "--context", "16",
                         "--prompt-len", "4", "--new-tokens", "2", "--batches", "1", "--rounds", "1", "--threads", "1"],
                        r"^    1 +[\d.]+, +[\d.]+ +[\d.]+, +[\d.]+ +[\d.]+x +[\d.]+x  (met|missed)$"),
    "generate_cpu.py[llama]": (["--family", "llama", "--layers", "1", "--hidden", "64", "--heads", "4", "--groups",
                                "2", "--ffn", "96", "--vocab", "300", "--context", "16", "--prompt-len", "4",
                                "--new-tokens", "2", "--batches", "1", "--rounds", "1", "--threads", "1"],
                               r"^    1 +[\d.]+, +[\d.]+ +[\d.]+, +[\d.]+ +[\d.]+x +[\d.]+x  (met|missed)$"),
    "generate_floor.py": (["--rounds", "1", "--batches", "1", "--cached", "4", "--copy-mib", "1", "--threads", "1",
                           "--layers", "1", "--hidden", "64", "--heads", "4", "--vocab", "300", "--context", "16",
                           "--prompt-len", "1", "--new-tokens", "1"],
                          r"^batch  1  transformers: best +[\d.]+ ms  median +[\d.]+ ms  best / floor +[\d.]+  "
                          r"\([\d.]+ GB/s of weights\)$"),
    "heartbeat_overhead.py": (["--steps", "2", "--warmup", "0", *TINY, "--reps", "10"],
                              r"^overhead = \(pulse \+ per gather x \d+/\d+\) / off step = [\d.]+%; goal < 1% -> "
                              r"(met|NOT met)$"),
    "mfu_gpu.py": (["--allow-cpu", *TINY, "--micro-batch-size", "1", "--steps", "1", "--warmup", "0"],
                   r"^achieved [\d.]+ TFLOP/s; MFU [\d.]+% of 989 TFLOP/s$"),
    "pipeline_cpu.py": (["--layers", "4", *TINY[2:], "--micro-batches", "4", "--steps", "1", "--warmup", "0",
                         "--rounds", "1"],
                        r"^m=4: interleaved / 1F1B round medians [\d.]+: .*; best steps [\d.]+$"),
    "plan_fits.py": (["--platforms", "trn1", "--recipes", "neox_20b", "--max-nodes", "64"],
                     r"^\| full\S* \| \d+x\d+x\d+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$"),
    "plan_speed.py": (["--recipes", "tiny", "--nodes", "16", "--platforms", "trn1", "--repeats", "1"],
                      r"^slowest: [\d.]+ s$"),
    "preprocess_throughput.py": (["--self-anchor", "--demo", "{tmp}/demo", "--repeat", "1", "--workers", "1",
                                  "--rounds", "1"],
                                 r"^ratios megatron-hpc/megatron-hpc again: start-up [\d.]+x the time; throughput "
                                 r"without start-up -?[\d.]+x; whole run [\d.]+x$"),
    "serve_latency.py": (["--rounds", "1", "--tokens", "1"],
                         r"^overhead \(median - median\): -?[\d.]+ ms; goal < 10 ms: (met|missed)$"),
    "steptime_published.py": ([], r"^within 20%: \d+ of \d+ rows \(A100 \d+ of \d+, H100 \d+ of \d+\)$"),
    "tp_scaling_cpu.py": ([*TINY, "--batch", "1", "--steps", "1", "--warmup", "0", "--threads", "2"],
                          r"^ratio TP=2 / TP=1 step time: [\d.]+$"),
    "train_step_cpu.py": (["--rounds", "1", "--steps", "1", "--warmup", "0", "--threads", "1", *TINY,
                           "--batch", "1"],
                          r"^ratio ours/hf-kept: throughput [\d.]+x \(median steps\), [\d.]+x \(best steps\), peak "
                          r"memory [\d.]+x$"),
    "train_step_cpu.py[llama]": (["--rounds", "1", "--steps", "1", "--warmup", "0", "--threads", "1", *TINY,
                                  "--batch", "1", "--family", "llama", "--groups", "1", "--ffn", "64"],
                                 r"^ratio ours/hf-kept: throughput [\d.]+x \(median steps\), [\d.]+x \(best steps\), "
                                 r"peak memory [\d.]+x$"),
}

IN_PROCESS = {
    # Scripts whose main() runs in the test's process (_run_in_process), as their command would run it: each parent
    # process is one more interpreter importing torch, and these need none of their own. They start their ranks,
    # servers and torchrun as they always do. The others keep theirs: convert_*, data_index_build and train_step_cpu
    # read their children's peak RSS from wait4, which starts at the parent's own high-water mark (the test
    # process's, here); generate_cpu and generate_floor load transformers, whose logger keeps the sys.stderr (and its
    # flush) of its first use for good, a test's capture that is closed by the next run's warning; the rest start
    # little but other processes.
    "activation_bytes.py", "cache_stats.py", "ckpt_io.py", "dist_optim_cpu.py", "heartbeat_overhead.py", "mfu_gpu.py",
    "pipeline_cpu.py", "plan_fits.py", "plan_speed.py", "serve_latency.py", "steptime_published.py",
    "tp_scaling_cpu.py",
}

HELPERS = {"rendezvous.py"}
"""Modules the scripts import, not scripts: each script that uses one runs it in its smoke run."""

SMOKED_ELSEWHERE = {
    # script: the test module that runs it at its smoke size
    "launcher_latency.py": "test_benchmark_launcher.py",
    "in_job_restart.py": "../slurm/test_benchmark_in_job_slurm.py",  # needs a SLURM controller
}


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _run(script: str, args: list[str], tmp: Path, **env_vars: str) -> subprocess.CompletedProcess[str]:
    # One thread each, as the suite's other processes: the sizes are too small for more to help.
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env_vars}
    for var in TORCHRUN_VARS:
        env.pop(var, None)
    return subprocess.run([sys.executable, str(BENCHMARKS / script), *(a.format(tmp=tmp) for a in args)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _run_in_process(script: str, args: list[str], monkeypatch: pytest.MonkeyPatch,
                    capfd: pytest.CaptureFixture[str]) -> subprocess.CompletedProcess[str]:
    """`python benchmarks/SCRIPT ARGS` without the interpreter: the script's main() in this process, with what
    that command sets up (the repository root as working directory, benchmarks/ first on sys.path, sys.argv, the
    environment of _run), and its exit status from main's return or SystemExit. The output is captured at the file
    descriptors, so the lines of the processes it starts count too. What a script changes in the process (torch's
    threads, grad mode and RNG, a process group it leaves) is put back for the tests after it."""
    import torch
    import torch.distributed as dist

    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # its ranks (spawned) import the script by name from there
    monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / script), *args])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
    spec = importlib.util.spec_from_file_location(Path(script).stem, BENCHMARKS / script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses and pickled functions name it
    threads, grad, rng = torch.get_num_threads(), torch.is_grad_enabled(), torch.get_rng_state()
    capfd.readouterr()
    try:
        spec.loader.exec_module(module)
        returned = module.main()
        code = returned if isinstance(returned, int) else 0  # sys.exit(main()) or a bare main()
    except SystemExit as exc:  # argparse's refusals, sys.exit(message)
        code = exc.code if isinstance(exc.code, int) else 1
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    finally:
        if dist.is_initialized():  # a script's world ends with its process
            dist.destroy_process_group()
        torch.set_num_threads(threads)
        torch.set_grad_enabled(grad)
        torch.set_rng_state(rng)
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(sys.argv, code or 0, out, err)


def _script(case: str) -> str:
    return case.split("[")[0]


def test_every_benchmark_has_a_smoke_run() -> None:
    scripts = {p.name for p in BENCHMARKS.glob("*.py")} - HELPERS
    assert scripts == {_script(case) for case in CASES} | SMOKED_ELSEWHERE.keys()
    assert all((BENCHMARKS / name).is_file() for name in HELPERS), HELPERS
    assert scripts >= IN_PROCESS, IN_PROCESS - scripts
    for script, module in SMOKED_ELSEWHERE.items():
        assert script in (Path(__file__).parent / module).read_text(), (script, module)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_script_runs_end_to_end_and_prints_its_ratios(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capfd: pytest.CaptureFixture[str]) -> None:
    script = _script(case)
    if script == "preprocess_throughput.py":  # its --demo folder: a corpus and the tokenizer that encodes it
        (tmp_path / "demo").mkdir()
        shutil.copy(PREPROCESS / "corpus.jsonl", tmp_path / "demo" / "stdlib.jsonl")
        for name in ("vocab.json", "merges.txt"):
            shutil.copy(PREPROCESS / name, tmp_path / "demo" / name)
    args, ratios = CASES[case]
    if script in IN_PROCESS:
        proc = _run_in_process(script, [a.format(tmp=tmp_path) for a in args], monkeypatch, capfd)
    else:
        proc = _run(script, args, tmp_path)
    assert proc.returncode == 0, f"{case} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert [line for line in proc.stdout.splitlines() if re.search(ratios, line)], proc.stdout[-3000:]
    if script == "generate_cpu.py":  # the two models are one: the weights' mapping into transformers holds
        assert re.search(r"^batch 1: 1/1 rows identical over 2 greedy tokens$", proc.stdout, re.M), proc.stdout


def test_the_gpu_benchmark_refuses_a_machine_without_one_and_names_the_fix(tmp_path: Path) -> None:
    proc = _run("mfu_gpu.py", [], tmp_path, CUDA_VISIBLE_DEVICES="")  # no GPU, even on a machine with one
    assert proc.returncode == 2 and not proc.stdout
    assert re.fullmatch(r"mfu_gpu: no CUDA GPU here \(.+\); run it on a GPU machine \(or pass --allow-cpu with a "
                        r"small model to smoke-test the script\)\n", proc.stderr), proc.stderr


def test_in_process_a_refusal_exits_as_the_command_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capfd: pytest.CaptureFixture[str]) -> None:
    # What the in-process runs above pass on must be what the command's exit status and output would be.
    args = ["--platforms", "no_such", "--recipes", "neox_20b"]
    own = _run("plan_fits.py", args, tmp_path)
    here = _run_in_process("plan_fits.py", args, monkeypatch, capfd)
    assert own.returncode == here.returncode == 2
    assert own.stdout == here.stdout == ""
    assert "plan_fits.py: error: argument --platforms: invalid choice: 'no_such'" in here.stderr
    assert own.stderr == here.stderr

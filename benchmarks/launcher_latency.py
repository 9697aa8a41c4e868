"""Launcher latency: `megatron-hpc --help`, `plan` and `submit --dry-run` of a 16-node run, as whole processes.

Issue 6's figures: `--help` and `plan` start in under 0.5 s (no torch import), and `submit` of a 16-node run
returns in under 2 s of its own time, sbatch excluded; issue 26 tightened `plan` and `submit --dry-run` to under
0.3 s (the parsers are built without numpy). `submit --dry-run` does all of submit's own work (recipe, plan,
data check, fingerprint, run folder, scripts) and stops where sbatch would start, so it is what is timed: once on
synthetic tokens, and once on a small real .bin/.idx pair written here (the data check then opens it, which
imports numpy). Anchors run in the same rounds, alternating with ours so machine drift hits all alike: the bare
interpreter (`python -c pass`, the floor) and `python -c "import torch"` (what any launcher that imported the
trainer would pay before doing anything).

Bytecode: by default every child runs with its own PYTHONPYCACHEPREFIX in the temporary folder (nothing is
written into the source tree); the warm-up round fills it and the timed rounds read it, as an installed package
reads its bytecode. --no-bytecode-cache runs the children with PYTHONDONTWRITEBYTECODE=1 and the usual caches: the
standard library's bytecode is read, and a checkout that never wrote its own compiles this package's modules in
every run (what a shell with PYTHONDONTWRITEBYTECODE=1 pays).

    python benchmarks/launcher_latency.py --rounds 7
    python benchmarks/launcher_latency.py --smoke      # one round, no torch anchor: checks that it still runs
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

GOALS_S = {"--help": 0.5, "plan 16 nodes": 0.3, "submit --dry-run 16 nodes, synthetic": 0.3,
           "submit --dry-run 16 nodes, .bin/.idx": 2.0}
TORCH_ANCHOR = 'python -c "import torch" (anchor)'
FLOOR = "python -c pass (floor)"


def write_dataset(prefix: Path, *, documents: int = 64, tokens: int = 2048) -> None:
    """A small real .bin/.idx pair (uint16 tokens below the GPT-2 vocabulary), enough for the data check and the
    data line; its contents do not matter to the launcher."""
    import numpy as np

    from megatron_hpc.data.indexed import IndexedDatasetWriter

    prefix.parent.mkdir(parents=True, exist_ok=True)
    writer = IndexedDatasetWriter(prefix, dtype=np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(documents):
        writer.add_document(rng.integers(0, 50000, size=tokens, dtype=np.uint16))
    writer.finalize()


def commands(tmp: Path, *, anchor: bool) -> dict[str, list[str]]:
    cli = [sys.executable, "-m", "megatron_hpc"]
    job = ["--recipe", "gpt3_6.7b", "--nodes", "16", "--platform", "trn1"]
    prefix = tmp / "data" / "tiny_text_document"
    cmds = {FLOOR: [sys.executable, "-c", "pass"]}
    if anchor:
        cmds[TORCH_ANCHOR] = [sys.executable, "-c", "import torch"]
    return {**cmds,
            "--help": [*cli, "--help"],
            "plan 16 nodes": [*cli, "plan", *job],
            "submit --dry-run 16 nodes, synthetic": [*cli, "submit", *job, "--set", "data.source=synthetic",
                                                     "--dry-run", "--json", "--out", str(tmp / "synthetic")],
            "submit --dry-run 16 nodes, .bin/.idx": [*cli, "submit", *job, "--set", f"data.path={prefix}",
                                                     "--dry-run", "--json", "--out", str(tmp / "indexed")]}


@dataclass
class Timing:
    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    """user + sys of the child: less sensitive than wall time to other jobs on the machine."""


def time_once(cmd: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """Wall and CPU seconds of one run of `cmd`, and its stdout; SystemExit with its stderr when it fails."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr[-500:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return elapsed, cpu, proc.stdout


def child_env(tmp: Path, *, bytecode_cache: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    if bytecode_cache:
        env["PYTHONPYCACHEPREFIX"] = str(tmp / "pycache")
    else:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def measure(rounds: int, *, anchor: bool, bytecode_cache: bool, warm_up: bool = True) -> dict[str, Timing]:
    """Times of every command, alternating in each round, after one warm-up round (page cache, bytecode)."""
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        write_dataset(tmp / "data" / "tiny_text_document")
        env = child_env(tmp, bytecode_cache=bytecode_cache)
        cmds = commands(tmp, anchor=anchor)
        times = {name: Timing() for name in cmds}
        for index in range(rounds + warm_up):
            for name, cmd in cmds.items():
                wall, cpu, out = time_once(cmd, env)
                if name.endswith(".bin/.idx") and '"source": "indexed"' not in out:
                    raise SystemExit(f"{name} did not read the dataset it was given: {out[-500:]}")
                if index >= warm_up:
                    times[name].wall_s.append(wall)
                    times[name].cpu_s.append(cpu)
    return times


def report(times: dict[str, Timing], *, rounds: int, bytecode_cache: bool) -> list[str]:
    floor = statistics.median(times[FLOOR].wall_s)
    torch_s = statistics.median(times[TORCH_ANCHOR].wall_s) if TORCH_ANCHOR in times else None
    lines = [f"{rounds} round(s), medians (min-max) of whole-process wall time, and median CPU (user + sys); python "
             f"{sys.version.split()[0]}; bytecode cache {'on' if bytecode_cache else 'off'}; 1-min load average "
             f"{os.getloadavg()[0]:.1f}"]
    for name, timing in times.items():
        med = statistics.median(timing.wall_s)
        goal = GOALS_S.get(name)
        verdict = f"  goal < {goal} s: {'met' if med < goal else 'NOT met'}" if goal else ""
        versus = f"{med / torch_s:5.2f}x import torch, " if torch_s else ""
        lines.append(f"  {name:<38} {med:6.3f} s ({min(timing.wall_s):.3f}-{max(timing.wall_s):.3f}), CPU "
                     f"{statistics.median(timing.cpu_s):.3f} s  {versus}{med - floor:+.3f} s over the bare "
                     f"interpreter{verdict}")
    return lines


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--smoke", action="store_true",
                        help="one round, no warm-up, no torch anchor: that every command still runs (the unit test)")
    parser.add_argument("--no-bytecode-cache", action="store_true",
                        help="children compile every module they import (PYTHONDONTWRITEBYTECODE, empty cache)")
    args = parser.parse_args(argv)
    rounds = 1 if args.smoke else args.rounds
    cache = not args.no_bytecode_cache
    times = measure(rounds, anchor=not args.smoke, bytecode_cache=cache, warm_up=not args.smoke)
    lines = report(times, rounds=rounds, bytecode_cache=cache)
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()

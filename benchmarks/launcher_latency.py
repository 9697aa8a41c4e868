"""Launcher latency: `megatron-hpc --help`, `plan` and `submit` of a 16-node run, as whole processes.

Issue 6's figures: `--help` and `plan` start in under 0.5 s (no torch import), and `submit` of a
16-node run returns in under 2 s of its own time, sbatch excluded. `submit --dry-run` does all of
submit's own work (recipe, plan, fingerprint, run folder, scripts) and stops where sbatch would
start, so it is what is timed. Anchors run in the same rounds, alternating with ours so machine drift
hits all alike: the bare interpreter (`python -c pass`, the floor) and `python -c "import torch"`
(what any launcher that imported the trainer would pay before doing anything).

    python benchmarks/launcher_latency.py --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOALS_S = {"--help": 0.5, "plan 16 nodes": 0.5, "submit --dry-run 16 nodes": 2.0}


def commands(tmp: Path) -> dict[str, list[str]]:
    cli = [sys.executable, "-m", "megatron_hpc"]
    job = ["--recipe", "gpt3_6.7b", "--nodes", "16", "--platform", "trn1"]
    return {
        "python -c pass (floor)": [sys.executable, "-c", "pass"],
        'python -c "import torch" (anchor)': [sys.executable, "-c", "import torch"],
        "--help": [*cli, "--help"],
        "plan 16 nodes": [*cli, "plan", *job],
        "submit --dry-run 16 nodes": [*cli, "submit", *job, "--dry-run", "--json", "--out", str(tmp / "run")],
    }


def time_once(cmd: list[str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{cmd} failed: {proc.stderr[-500:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cmds = commands(Path(tmp))
        for cmd in cmds.values():  # warm the page cache once
            time_once(cmd)
        times: dict[str, list[float]] = {name: [] for name in cmds}
        for _ in range(args.rounds):
            for name, cmd in cmds.items():
                times[name].append(time_once(cmd))
    floor = statistics.median(times["python -c pass (floor)"])
    torch_s = statistics.median(times['python -c "import torch" (anchor)'])
    print(f"{args.rounds} rounds, medians (min-max) of whole-process wall time; python {sys.version.split()[0]}")
    for name, values in times.items():
        med = statistics.median(values)
        goal = GOALS_S.get(name)
        verdict = f"  goal < {goal} s: {'met' if med < goal else 'NOT met'}" if goal else ""
        print(f"  {name:<34} {med:6.3f} s ({min(values):.3f}-{max(values):.3f})  "
              f"{med / torch_s:5.2f}x import torch, {med - floor:+.3f} s over the bare interpreter{verdict}")


if __name__ == "__main__":
    main()

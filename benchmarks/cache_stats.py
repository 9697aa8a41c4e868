"""`megatron-hpc cache stats` against `du -s` on the same generated compile cache tree.

Builds a stand-in tree (tests/fixtures/fake_neuron_cache.py, the documented neuronxcc-*/MODULE_* layout) in a
temp dir, then times each tool `--rounds` times, alternating, warm page cache. The target is 100,000 entries
in under 2 s; `du -s` does the same directory walk and lstat calls, so the ratio says how much Python costs.
Besides wall time it prints each tool's CPU time (user + system, from the kernel's accounting of the child),
which other processes on a shared machine inflate far less.

    python benchmarks/cache_stats.py --entries 100000 --rounds 3 [--dir /dev/shm]
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "fixtures"))
import fake_neuron_cache as fake


def _time(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run of `cmd`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to build the tree (default: the system temp dir)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="cache-stats-bench-", dir=args.dir))
    try:
        t = time.perf_counter()
        fake.build_large_tree(root, num_entries=args.entries)
        print(f"built {args.entries} entries in {root} in {time.perf_counter() - t:.1f}s")
        ours_cmd = [sys.executable, "-m", "megatron_hpc", "cache", "stats", "--root", str(root)]
        du_cmd = ["du", "-s", str(root)]
        _time(du_cmd)  # warm the page cache for both
        ours, du = [], []
        for _ in range(args.rounds):
            ours.append(_time(ours_cmd))
            du.append(_time(du_cmd))
        o, d = statistics.median(w for w, _ in ours), statistics.median(w for w, _ in du)
        oc, dc = statistics.median(c for _, c in ours), statistics.median(c for _, c in du)
        print(f"{'tool':<26} {'median wall s':>13} {'median CPU s':>12}   all rounds (wall/CPU)")
        for name, runs, wall, cpu in (("megatron-hpc cache stats", ours, o, oc), ("du -s", du, d, dc)):
            print(f"{name:<26} {wall:>13.2f} {cpu:>12.2f}   {' '.join(f'{w:.2f}/{c:.2f}' for w, c in runs)}")
        print(f"ratio stats/du = {o / d:.2f} wall, {oc / dc:.2f} CPU; target for {args.entries} entries: < 2 s -> "
              f"{'met' if o < 2.0 else 'NOT met'}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

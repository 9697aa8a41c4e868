"""Checkpoint save and load throughput: megatron-hpc's saver and loader against `dd` and torch.save/torch.load.

One process, one disk, one run: a GPT-shaped model state plus Adam's two moments (float32, about
`--gib` GiB in all) is written and read back by each contender in turn, `--rounds` times, with the page
cache dropped before every read (`echo 3 > /proc/sys/vm/drop_caches`, root) and fsync in every write, so
the numbers are the disk's and not memory's. Ours is the trainer's own path: `save_checkpoint` (xser:
one file per tensor, manifest with checksums, tracker last) and `load_checkpoint` with the checksums
verified, as a resuming run does.

    python benchmarks/ckpt_io.py --dir ./ckpt-bench --gib 1 --rounds 3

Goals (issue 5): save >= 2x torch.save and >= 0.7x dd; load >= 0.8x dd.

`--mode blocked` (issue 15): how long a training loop is blocked by one save of the state, synchronous
(`save_checkpoint`) against asynchronous (`AsyncSave`, what checkpoint.async_save runs): blocked = the start (temp
folder, host snapshot, thread start) plus the commit at the next save (manifest, rename, tracker), the main thread
doing a stand-in training step (a 1024 x 1024 matmul loop) until the writer is done. The write itself overlaps the
steps. Goal: async at most 0.1x sync.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

from megatron_hpc.checkpoint.async_save import AsyncSave
from megatron_hpc.checkpoint.compat import PipelineLayout
from megatron_hpc.checkpoint.loader import load_checkpoint
from megatron_hpc.checkpoint.ranks import RankInfo
from megatron_hpc.checkpoint.saver import save_checkpoint

GIB = 1 << 30


def gpt_state(gib: float, *, hidden: int = 2048) -> dict:
    """Weights of 3x their size in Adam state: layers of (qkv, proj, fc, fc2) matrices until `gib` is reached."""
    per_param = 4 * 3  # float32 weight + exp_avg + exp_avg_sq
    target = int(gib * GIB / per_param)
    model, state, n, i = {}, {}, 0, 0
    shapes = [(3 * hidden, hidden), (hidden, hidden), (4 * hidden, hidden), (hidden, 4 * hidden)]
    while n < target:
        for j, shape in enumerate(shapes):
            w = torch.randn(shape)
            model[f"h.{i}.w{j}"] = w
            state[len(state)] = {"step": torch.tensor(10.0), "exp_avg": torch.randn(shape),
                                 "exp_avg_sq": torch.rand(shape)}
            n += w.numel()
        i += 1
    return {"iteration": 10, "model": model,
            "optimizer": {"state": state, "param_groups": [{"params": list(state), "lr": 1e-4}]}}


def nbytes(obj: object) -> int:
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj)
    return 0


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def dd_write(path: Path, size: int) -> None:
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=16M", f"count={size // (16 << 20)}", "conv=fsync"],
                   check=True, capture_output=True)


def dd_read(path: Path) -> None:
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M"], check=True, capture_output=True)


def torch_save(state: dict, path: Path) -> None:
    with open(path, "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())


def blocked(state: dict, *, work: Path, rounds: int) -> None:
    """Seconds the loop is blocked per save, sync against async (see the module docstring)."""
    ranks, layout = RankInfo(), PipelineLayout(pipeline=1)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    sync_s, async_s, write_s, steps, start_s = [], [], [], [], []
    host = None  # the trainer reuses the previous save's host memory: round 0 allocates it, later rounds do not
    for r in range(rounds):
        shutil.rmtree(work, ignore_errors=True)
        sync_s.append(timed(lambda it=10 + r: save_checkpoint(work / "sync", it, state, ranks=ranks)))
        drop_caches()
        t0 = time.perf_counter()
        pending = AsyncSave(work / "async", 10 + r, state, ranks=ranks, fmt="xser", keep_last=0, layout=layout,
                            reuse=host)
        start = time.perf_counter() - t0
        n = 0
        while pending.writing:  # training goes on while the writer writes
            torch.mm(a, b)
            n += 1
        write_s.append(time.perf_counter() - t0)
        async_s.append(start + timed(pending.finish))
        start_s.append(start)
        host = pending.host
        steps.append(n)
        drop_caches()
    sync, asyn = statistics.median(sync_s), statistics.median(async_s[1:] or async_s)
    print(f"sync  blocked median {sync:6.3f} s  ({', '.join(f'{t:.3f}' for t in sync_s)})")
    print(f"async blocked median {asyn:6.3f} s  without round 0, which allocates the host memory "
          f"({', '.join(f'{t:.3f}' for t in async_s)}); writer done after median {statistics.median(write_s):.2f} s, "
          f"{statistics.median(steps):.0f} 1024^3 matmuls meanwhile")
    starts = statistics.median(start_s[1:] or start_s)
    print(f"  of which the start (folder, host copy, thread) median {starts:.3f} s, the commit {asyn - starts:.3f} s")
    print(f"async/sync {asyn / sync:.3f}x (goal <= 0.1); first save {async_s[0] / sync:.3f}x")
    shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("ckpt-bench"), help="a folder on the disk to measure")
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mode", choices=("io", "blocked"), default="io",
                        help="io: save/load throughput against dd and torch; blocked: sync against async save")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    state = gpt_state(args.gib)
    size = nbytes(state)
    print(f"state: {size / GIB:.2f} GiB in {len(state['model'])} weights + Adam moments; disk: {args.dir.resolve()}")
    if args.mode == "blocked":
        blocked(state, work=args.dir / "blocked", rounds=args.rounds)
        return 0
    times: dict[str, list[float]] = {k: [] for k in ("dd write", "dd read", "torch.save", "torch.load",
                                                     "ours save", "ours load")}
    ranks = RankInfo()
    for r in range(args.rounds):
        work = args.dir / f"round{r}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        steps: list[tuple[str, Callable[[], object], bool]] = [
            ("dd write", lambda w=work: dd_write(w / "dd.bin", size), True),
            ("dd read", lambda w=work: dd_read(w / "dd.bin"), False),
            ("torch.save", lambda w=work: torch_save(state, w / "torch.pt"), True),
            ("torch.load", lambda w=work: torch.load(w / "torch.pt", weights_only=True), False),
            ("ours save", lambda w=work: save_checkpoint(w / "ours", 10, state, ranks=ranks), True),
            ("ours load", lambda w=work: load_checkpoint(w / "ours", ranks=ranks), False),
        ]
        for name, fn, then_drop in steps:
            times[name].append(timed(fn))
            if then_drop:  # the next step reads what this one wrote: from the disk, not the page cache
                drop_caches()
        shutil.rmtree(work)
    rate = {k: size / GIB / statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        runs = ", ".join(f"{t:.2f}" for t in v)
        print(f"{k:<11} median {statistics.median(v):6.2f} s  {rate[k]:5.2f} GiB/s   ({runs})")
    print(f"save: ours/torch.save {rate['ours save'] / rate['torch.save']:.2f}x (goal >= 2), "
          f"ours/dd {rate['ours save'] / rate['dd write']:.2f}x (goal >= 0.7)")
    print(f"load: ours/dd {rate['ours load'] / rate['dd read']:.2f}x (goal >= 0.8), "
          f"ours/torch.load {rate['ours load'] / rate['torch.load']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

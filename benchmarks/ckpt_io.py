"""Checkpoint save and load throughput: megatron-hpc's saver and loader against `dd` and torch.save/torch.load.

One process, one disk, one run: a GPT-shaped model state plus Adam's two moments (float32, about
`--gib` GiB in all) is written and read back by each contender in turn, `--rounds` times, with the page
cache dropped before every read (`echo 3 > /proc/sys/vm/drop_caches`, root) and fsync in every write, so
the numbers are the disk's and not memory's. Ours is the trainer's own path: `save_checkpoint` (xser:
one file per tensor, manifest with checksums, tracker last) and `load_checkpoint` with the checksums
verified, as a resuming run does.

    python benchmarks/ckpt_io.py --dir ./ckpt-bench --gib 1 --rounds 3
    python benchmarks/ckpt_io.py --dir ./ckpt-bench --gib 0.001 --hidden 32 --rounds 1 --keep-caches \
        --mode io blocked split       # smoke test (the suite runs it): every mode, no figure

Goals (issue 5): save >= 2x torch.save and >= 0.7x dd; load >= 0.8x dd.

`--mode blocked` (issue 15): how long a training loop is blocked by one save of the state, synchronous
(`save_checkpoint`) against asynchronous (`AsyncSave`, what checkpoint.async_save runs), both ways it copies the state
to host memory: at the save (XLA) or on the writer thread while the next step's forward and backward run (CPU,
CUDA). Blocked = the start (temp folder, host copy when made there, thread start) + the wait for the host copy
before the optimizer step + the commit at the next save (manifest, rename, tracker); the main thread runs 1024^3
matmuls as stand-in steps (`--step-matmuls` of them for a forward and backward) until the writer is done.
Goal: async at most 0.1x sync.

`--mode split` (issue 15): where one load's time goes. The checkpoint's own files, each part timed alone: reading
the bytes (from the disk, cache dropped, IO_THREADS threads into reused buffers; and from the page cache, one thread:
the copy alone), the checksum (zlib's and ours), the first write of fresh memory (what the loader allocates for the
tensors) less a second write of it, and the unpickling of every file (torch.load mmap=True: dtype, shape, strides);
then whole loads, warm and cold, and dd over the same files. All but the cold reads are one thread's CPU seconds.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from megatron_hpc.checkpoint.store import (
    AsyncSave,
    PipelineLayout,
    RankInfo,
    load_checkpoint,
    safe_load,
    save_checkpoint,
)
from megatron_hpc.checkpoint.store.checksum import IMPLEMENTATION as CHECKSUM_IMPLEMENTATION
from megatron_hpc.checkpoint.store.checksum import crc32
from megatron_hpc.checkpoint.store.file_io import CHUNK
from megatron_hpc.checkpoint.store.xser import IO_THREADS, TensorReference

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


def keep_caches() -> None:
    """--keep-caches: the reads that should come from the disk come from memory (a smoke test on a shared machine,
    whose other users a dropped page cache would slow down; the figures then mean nothing)."""


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def cpu_seconds() -> float:
    """User + system CPU of this process (every thread) and of its finished children (dd)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def timed_cpu(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of fn(): on a shared machine the CPU seconds move less than the wall."""
    c = cpu_seconds()
    wall = timed(fn)
    return wall, cpu_seconds() - c


def dd_write(path: Path, size: int) -> None:
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=16M", f"count={size // (16 << 20)}", "conv=fsync"],
                   check=True, capture_output=True)


def dd_read(path: Path) -> None:
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M"], check=True, capture_output=True)


IN_PLACE_ROWS = ("resume, copy", "resume, in place", "into existing")
"""Issue 15's resume rows: a CPU resume's model is allocated but never written (its random init is skipped), so
`untouched` stands for it. `resume, copy` loads into fresh memory and copies the weights into the model (the
trainer's restore before); `resume, in place` reads them straight into it; `into existing` reads them into memory
already written once (the saved state's own tensors): the loader alone, no page faults for the weights."""


def untouched(model: dict) -> dict:
    """Memory for each weight, allocated and never written: its first write faults it in, as in a resumed model."""
    return {k: torch.empty_like(t) for k, t in model.items()}


def resume_by_copy(root: Path, model: dict) -> None:
    """The trainer's resume before issue 15's change: fresh tensors, then copied into the model."""
    _found, loaded = load_checkpoint(root, ranks=RankInfo())
    for name, target in untouched(model).items():
        target.copy_(loaded["model"][name])


def torch_save(state: dict, path: Path) -> None:
    with open(path, "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())


def _async_round(state: dict, work: Path, iteration: int, *, host: object, in_background: bool,
                 step_matmuls: int) -> tuple[float, float, float, int, object]:
    """One asynchronous save beside stand-in training: (blocked s, of which start s, writer done after s, matmuls
    meanwhile, host memory for the next round)."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    t0 = time.perf_counter()
    pending = AsyncSave(work, iteration, state, ranks=RankInfo(), fmt="xser", keep_last=0,
                        layout=PipelineLayout(pipeline=1), reuse=host, copy_in_background=in_background)
    start = time.perf_counter() - t0
    for _ in range(step_matmuls):  # the next step's forward and backward: they only read the state
        torch.mm(a, b)
    blocked = start + timed(pending.wait_copied)  # the optimizer step waits for the host copy
    n = step_matmuls
    while pending.writing:  # later steps, while the writer writes
        torch.mm(a, b)
        n += 1
    written = time.perf_counter() - t0
    blocked += timed(pending.finish)  # the commit, at the next save
    return blocked, start, written, n, pending.host


def blocked(state: dict, *, work: Path, rounds: int, step_matmuls: int,
            drop: Callable[[], None] = drop_caches) -> None:
    """Seconds the loop is blocked per save, sync against async (see the module docstring)."""
    sync_s: list[float] = []
    runs: dict[bool, list[tuple[float, float, float, int]]] = {False: [], True: []}
    hosts: dict[bool, object] = {False: None, True: None}  # the trainer reuses the previous save's host memory
    for r in range(rounds):
        shutil.rmtree(work, ignore_errors=True)
        sync_s.append(timed(lambda it=10 + r: save_checkpoint(work / "sync", it, state, ranks=RankInfo())))
        drop()
        for in_background in (False, True):
            *result, hosts[in_background] = _async_round(state, work / f"async{int(in_background)}", 10 + r,
                                                         host=hosts[in_background], in_background=in_background,
                                                         step_matmuls=step_matmuls)
            runs[in_background].append(tuple(result))
            drop()
    sync = statistics.median(sync_s)
    print(f"sync blocked median {sync:6.3f} s  ({', '.join(f'{t:.3f}' for t in sync_s)})")
    for in_background, rows in runs.items():
        later = rows[1:] or rows  # round 0 allocates the host memory
        med = statistics.median(r[0] for r in later)
        label = "async, copy on the writer during the step" if in_background else "async, copy at the save"
        print(f"{label}: blocked median {med:.3f} s ({', '.join(f'{r[0]:.3f}' for r in rows)}; start "
              f"{statistics.median(r[1] for r in later):.3f} s); writer done after "
              f"{statistics.median(r[2] for r in later):.2f} s, {statistics.median(r[3] for r in later):.0f} matmuls; "
              f"async/sync {med / sync:.3f}x (goal <= 0.1), first save {rows[0][0] / sync:.3f}x")
    shutil.rmtree(work, ignore_errors=True)


def read_reusing(files: list[Path], *, threads: int) -> None:
    """Every file's bytes, read into one reused buffer per file: the disk and the kernel's copy, no fresh memory."""
    def one(path: Path) -> None:
        buf = memoryview(bytearray(CHUNK))
        with open(path, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(one, files))


def checksum_all(data: list[memoryview], crc: Callable[[memoryview, int], int]) -> None:
    for view in data:
        value = 0
        for start in range(0, view.nbytes, CHUNK):
            value = crc(view[start:start + CHUNK], value)


def first_writes(sizes: list[int]) -> float:
    """Seconds to allocate and write each size once, less a second write of the same memory: the page faults."""
    t0 = time.perf_counter()
    held = [torch.empty(n, dtype=torch.uint8).fill_(1) for n in sizes]
    first = time.perf_counter() - t0
    again = timed(lambda: [t.fill_(2) for t in held])
    return first - again


SPLIT_PARTS = ("dd read, cold (the files, one by one)", "read, cold (disk + copy, threads)",
               "read, warm (page-cache copy)", "checksum, zlib.crc32", "checksum, ours",
               "fresh memory faults (first write)", "unpickle (mmap=True, every file)",
               "load_checkpoint, warm", "load_checkpoint, cold")


def split(state: dict, *, work: Path, rounds: int, drop: Callable[[], None] = drop_caches) -> dict[str, list[float]]:
    """Seconds of each part of a load (see the module docstring), `rounds` times."""
    shutil.rmtree(work, ignore_errors=True)
    folder = save_checkpoint(work, 10, state, ranks=RankInfo())
    files = sorted(folder.rglob("*.pt"))
    meta = [safe_load(f, what=f, mmap=True, allowed=(TensorReference,)) for f in files]
    sizes = [m.untyped_storage().nbytes() for m in meta if torch.is_tensor(m)]
    del meta
    times: dict[str, list[float]] = {k: [] for k in SPLIT_PARTS}

    def cold(fn: Callable[[], object]) -> float:
        drop()
        return timed(fn)

    for _ in range(rounds):
        times["dd read, cold (the files, one by one)"].append(cold(lambda: [dd_read(f) for f in files]))
        times["read, cold (disk + copy, threads)"].append(cold(lambda: read_reusing(files, threads=IO_THREADS)))
        times["read, warm (page-cache copy)"].append(timed(lambda: read_reusing(files, threads=1)))
        data = [memoryview(f.read_bytes()) for f in files]
        times["checksum, zlib.crc32"].append(timed(lambda d=data: checksum_all(d, zlib.crc32)))
        times["checksum, ours"].append(timed(lambda d=data: checksum_all(d, crc32)))
        del data
        times["fresh memory faults (first write)"].append(first_writes(sizes))
        times["unpickle (mmap=True, every file)"].append(
            timed(lambda: [safe_load(f, what=f, mmap=True, allowed=(TensorReference,)) for f in files]))
        times["load_checkpoint, warm"].append(timed(lambda: load_checkpoint(work, ranks=RankInfo())))
        times["load_checkpoint, cold"].append(cold(lambda: load_checkpoint(work, ranks=RankInfo())))
    shutil.rmtree(work, ignore_errors=True)
    return times


def split_table(times: dict[str, list[float]], *, size: int) -> list[str]:
    """One line a part: median seconds, GiB/s and seconds per GiB, then the runs."""
    lines = []
    for part, runs in times.items():
        med = statistics.median(runs)
        lines.append(f"{part:<40} {med:6.3f} s  {size / GIB / med if med > 0 else float('inf'):6.2f} GiB/s  "
                     f"{med / (size / GIB):6.3f} s/GiB  ({', '.join(f'{t:.3f}' for t in runs)})")
    return lines


def io(state: dict, *, size: int, work_dir: Path, rounds: int, drop: Callable[[], None]) -> None:
    """Save and load throughput against dd and torch.save/torch.load (the module docstring's first part)."""
    times: dict[str, list[float]] = {k: [] for k in ("dd write", "dd read", "torch.save", "torch.load",
                                                     "ours save", "ours load", *IN_PLACE_ROWS)}
    cpus: dict[str, list[float]] = {k: [] for k in times}
    ranks = RankInfo()
    for r in range(rounds):
        work = work_dir / f"round{r}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        steps: list[tuple[str, Callable[[], object], bool]] = [
            ("dd write", lambda w=work: dd_write(w / "dd.bin", size), True),
            ("dd read", lambda w=work: dd_read(w / "dd.bin"), False),
            ("torch.save", lambda w=work: torch_save(state, w / "torch.pt"), True),
            ("torch.load", lambda w=work: torch.load(w / "torch.pt", weights_only=True), False),
            ("ours save", lambda w=work: save_checkpoint(w / "ours", 10, state, ranks=ranks), True),
            ("ours load", lambda w=work: load_checkpoint(w / "ours", ranks=ranks), False),
            ("resume, copy", lambda w=work: resume_by_copy(w / "ours", state["model"]), False),
            ("resume, in place", lambda w=work: load_checkpoint(w / "ours", ranks=ranks,
                                                                into={"model": untouched(state["model"])}), False),
            ("into existing", lambda w=work: load_checkpoint(w / "ours", ranks=ranks,
                                                             into={"model": state["model"]}), False),
        ]
        for name, fn, then_drop in steps:
            wall, cpu = timed_cpu(fn)
            times[name].append(wall)
            cpus[name].append(cpu)
            if then_drop:  # the next step reads what this one wrote: from the disk, not the page cache
                drop()
        shutil.rmtree(work)
    rate = {k: size / GIB / statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        runs = ", ".join(f"{t:.2f}" for t in v)
        print(f"{k:<16} median {statistics.median(v):6.2f} s  {rate[k]:5.2f} GiB/s  "
              f"CPU {statistics.median(cpus[k]):5.2f} s   ({runs})")
    print(f"save: ours/torch.save {rate['ours save'] / rate['torch.save']:.2f}x (goal >= 2), "
          f"ours/dd {rate['ours save'] / rate['dd write']:.2f}x (goal >= 0.7)")
    print(f"load: ours/dd {rate['ours load'] / rate['dd read']:.2f}x (goal >= 0.8), "
          f"ours/torch.load {rate['ours load'] / rate['torch.load']:.2f}x")
    print(f"resume: copy/dd {rate['resume, copy'] / rate['dd read']:.2f}x, in place/dd "
          f"{rate['resume, in place'] / rate['dd read']:.2f}x, in place/copy "
          f"{rate['resume, in place'] / rate['resume, copy']:.2f}x; weights into existing memory/dd "
          f"{rate['into existing'] / rate['dd read']:.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("ckpt-bench"), help="a folder on the disk to measure")
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--hidden", type=int, default=2048, help="the state's matrices are multiples of it")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mode", choices=("io", "blocked", "split"), nargs="+", default=["io"],
                        help="io: save/load throughput against dd and torch; blocked: sync against async save; "
                             "split: where a load's time goes (several: one after the other)")
    parser.add_argument("--step-matmuls", type=int, default=10,
                        help="blocked: 1024^3 matmuls standing in for a step's forward and backward")
    parser.add_argument("--keep-caches", action="store_true",
                        help="never drop the page cache (smoke test only: cold reads come from memory)")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    drop = keep_caches if args.keep_caches else drop_caches
    state = gpt_state(args.gib, hidden=args.hidden)
    size = nbytes(state)
    print(f"state: {size / GIB:.2f} GiB in {len(state['model'])} weights + Adam moments; disk: {args.dir.resolve()}")
    for mode in args.mode:
        if mode == "blocked":
            blocked(state, work=args.dir / "blocked", rounds=args.rounds, step_matmuls=args.step_matmuls, drop=drop)
        elif mode == "split":
            times = split(state, work=args.dir / "split", rounds=args.rounds, drop=drop)
            print(f"our checksum: {CHECKSUM_IMPLEMENTATION}'s crc32; the loader's I/O threads: {IO_THREADS}")
            print("\n".join(split_table(times, size=size)))
        else:
            io(state, size=size, work_dir=args.dir, rounds=args.rounds, drop=drop)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""GPTDataset index build: megatron-hpc against megatron-core, side by side, same machine, same data.

Issue 3's figure: building the document/sample/shuffle indices of the train split for 5,000,000
documents (mean 600 tokens), seq 2048, enough samples for 1 epoch and for 10 epochs. Each build is
its own process with a fresh cache folder (so it builds, never loads), timed whole. The `.bin` is a
sparse file of the right size: building indices reads only `.idx`.

Memory: each process reports its own peak, VmHWM of /proc/self/status read at its end, and its resident
size just before the build (after the imports). Not the parent's view: wait4's ru_maxrss of a child starts
from the high-water mark of the memory it was spawned from (Linux sets it at exec from the old mm, which a
posix_spawn child shares with this script), so it reported this script's own peak (about 283 MiB, the dataset
arrays it generates) instead of a small build's. getrusage(RUSAGE_SELF) inside the child carries the same
inherited value; VmHWM belongs to the new process image alone.

Paired ratios: every round runs both builds back to back, and the ratio of each round is reported with the
median, so the spread shows whether a difference is larger than the machine's noise.

megatron-core runs from a separate virtualenv (never a project dependency):
    python3 -m venv /tmp/mcore-venv && /tmp/mcore-venv/bin/pip install torch==2.13.0 megatron-core==0.16.1
    python benchmarks/data_index_build.py --mcore-python /tmp/mcore-venv/bin/python
    python benchmarks/data_index_build.py --self-anchor --docs 200 --mean-tokens 50 --seq-length 64 --epochs 1 \
        --rounds 1      # smoke test (the suite runs it, without megatron-core): the script, not the figure
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Both children end with this: their own resident peak (VmHWM) and size before the build, in KiB.
MEMORY = """
def _status_kib(field):
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(field + ":"))
"""

OURS = MEMORY + """
import sys, time
from megatron_hpc.data.gpt_dataset import GPTIndexConfig, build_gpt_dataset
prefix, n, seq, cache = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
before = _status_kib("VmRSS")
start = time.perf_counter()
ds = build_gpt_dataset(prefix, split_name="train", num_samples=n,
                       config=GPTIndexConfig(seed=1234, seq_length=seq, split="100,0,0", cache_path=cache))
print("BUILD", time.perf_counter() - start, len(ds))
print("MEMORY", before, _status_kib("VmHWM"))
"""

MCORE = MEMORY + """
import sys, time
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer
prefix, n, seq, cache = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
config = GPTDatasetConfig(random_seed=1234, sequence_length=seq, blend=([prefix], None), split="100,0,0",
                          tokenizer=NullTokenizer(65000), reset_position_ids=False, reset_attention_mask=False,
                          eod_mask_loss=False, path_to_cache=cache)
before = _status_kib("VmRSS")
start = time.perf_counter()
train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [n, None, None], lambda: True, config).build()
print("BUILD", time.perf_counter() - start, len(train))
print("MEMORY", before, _status_kib("VmHWM"))
"""


def make_dataset(folder: Path, *, docs: int, mean_tokens: int, seed: int = 0) -> tuple[str, int]:
    """A `.idx` with random document lengths (uniform 1..2*mean-1) and a sparse `.bin` to match."""
    from megatron_hpc.data.indexed import CODE_BY_DTYPE, MAGIC, VERSION

    lengths = np.random.default_rng(seed).integers(1, 2 * mean_tokens, size=docs, dtype=np.int32)
    pointers = np.zeros(docs, dtype=np.int64)
    np.cumsum(lengths[:-1].astype(np.int64) * 2, out=pointers[1:])
    prefix = folder / "bench_text_document"
    with open(f"{prefix}.idx", "wb") as out:
        out.write(MAGIC + VERSION.to_bytes(8, "little") + bytes([CODE_BY_DTYPE[np.dtype(np.uint16)]]))
        out.write(docs.to_bytes(8, "little") + (docs + 1).to_bytes(8, "little"))
        out.write(lengths.tobytes() + pointers.tobytes() + np.arange(docs + 1, dtype=np.int64).tobytes())
    tokens = int(lengths.sum(dtype=np.int64))
    with open(f"{prefix}.bin", "wb") as out:
        out.truncate(tokens * 2)
    return str(prefix), tokens


@dataclass(frozen=True, kw_only=True, slots=True)
class Run:
    build_s: float
    """Timed inside the child around the build call (imports excluded)."""
    wall_s: float
    """The whole process, as this script sees it."""
    peak_mib: float
    """The child's own VmHWM at its end."""
    before_mib: float
    """The child's VmRSS just before the build: what the imports took."""
    samples: int


def run(python: str, code: str, args: list[str], env: dict[str, str]) -> Run:
    read, write = os.pipe()
    start = time.perf_counter()
    pid = os.posix_spawn(python, [python, "-c", code, *args], env,
                         file_actions=[(os.POSIX_SPAWN_DUP2, write, 1), (os.POSIX_SPAWN_OPEN, 2, os.devnull,
                                                                       os.O_WRONLY, 0)])
    os.close(write)
    with os.fdopen(read) as fh:
        out = fh.read()
    _, status = os.waitpid(pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{python} failed building indices:\n{out}")
    fields = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith(("BUILD", "MEMORY"))}
    (build_s, length), (before, peak) = fields["BUILD"], fields["MEMORY"]
    return Run(build_s=float(build_s), wall_s=wall, peak_mib=int(peak) / 1024, before_mib=int(before) / 1024,
               samples=int(length))


def verdict(ratios: list[float]) -> str:
    """'parity' when the paired ratios fall on both sides of 1, else which side all of them fall on."""
    if min(ratios) < 1.0 < max(ratios):
        return "parity (the rounds disagree on which is faster)"
    return "faster in every round" if max(ratios) < 1.0 else "slower in every round"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mcore-python", help="python of a venv with megatron-core 0.16.1")
    parser.add_argument("--self-anchor", action="store_true",
                        help="smoke test only: megatron-hpc's build stands in for megatron-core's (ratios near 1)")
    parser.add_argument("--docs", type=int, default=5_000_000)
    parser.add_argument("--mean-tokens", type=int, default=600)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--epochs", type=int, nargs="+", default=[1, 10])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="scratch folder (default: a temp folder)")
    args = parser.parse_args()
    if not args.mcore_python and not args.self_anchor:
        parser.error("--mcore-python is required (a venv with megatron-core 0.16.1, see above)")
    anchor, anchor_python, anchor_code = (("megatron-hpc again", sys.executable, OURS) if args.self_anchor
                                          else ("megatron-core", args.mcore_python, MCORE))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        prefix, tokens = make_dataset(Path(tmp), docs=args.docs, mean_tokens=args.mean_tokens)
        print(f"dataset: {args.docs:,} documents, {tokens:,} tokens (mean {tokens / args.docs:.0f}), "
              f"seq {args.seq_length}; {args.rounds} rounds, A B A B ...")
        for epochs in args.epochs:
            # just under `epochs` epochs of samples, so Megatron's epoch count is exactly `epochs`
            num_samples = int((epochs - 0.2) * (tokens - 1) / args.seq_length)
            rows: dict[str, list[Run]] = {"megatron-hpc": [], anchor: []}
            for r in range(args.rounds):
                for name, python, code in (("megatron-hpc", sys.executable, OURS),
                                           (anchor, anchor_python, anchor_code)):
                    cache = Path(tmp) / f"cache-{name}-{epochs}-{r}"
                    rows[name].append(run(python, code, [prefix, str(num_samples), str(args.seq_length),
                                                         str(cache)], env))
            lengths = {v.samples for rows_ in rows.values() for v in rows_}
            assert len(lengths) == 1, f"the two builds disagree on the number of samples: {lengths}"
            for name, runs in rows.items():
                med = {f: statistics.median(getattr(x, f) for x in runs)
                       for f in ("build_s", "wall_s", "peak_mib", "before_mib")}
                print(f"{epochs:>2} epoch(s) {name:<18} build median {med['build_s']:6.2f} s (runs "
                      f"{', '.join(f'{x.build_s:.2f}' for x in runs)}); whole process {med['wall_s']:6.2f} s; "
                      f"own peak RSS {med['peak_mib']:5.0f} MiB ({med['before_mib']:.0f} MiB before the build)")
            pairs = list(zip(rows["megatron-hpc"], rows[anchor]))
            build = [a.build_s / b.build_s for a, b in pairs]
            peak = [a.peak_mib / b.peak_mib for a, b in pairs]
            growth = [(a.peak_mib - a.before_mib) / max(b.peak_mib - b.before_mib, 1 / 1024) for a, b in pairs]
            print(f"{epochs:>2} epoch(s) megatron-hpc/{anchor} ({lengths.pop():,} samples), per round: "
                  f"build {', '.join(f'{x:.2f}' for x in build)}x (median {statistics.median(build):.2f}x: "
                  f"{verdict(build)}); own peak {', '.join(f'{x:.2f}' for x in peak)}x; growth during the "
                  f"build {', '.join(f'{x:.2f}' for x in growth)}x")


if __name__ == "__main__":
    main()

"""GPTDataset index build: megatron-hpc against megatron-core, side by side, same machine, same data.

Issue 3's figure: building the document/sample/shuffle indices of the train split for 5,000,000
documents (mean 600 tokens), seq 2048, enough samples for 1 epoch and for 10 epochs. Each build is
its own process with a fresh cache folder (so it builds, never loads), timed whole, with its peak
RSS from wait4. The `.bin` is a sparse file of the right size: building indices reads only `.idx`.

megatron-core runs from a separate virtualenv (never a project dependency):
    python3 -m venv /tmp/mcore-venv && /tmp/mcore-venv/bin/pip install torch==2.13.0 megatron-core==0.16.1
    python benchmarks/data_index_build.py --mcore-python /tmp/mcore-venv/bin/python
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

OURS = """
import sys, time
from megatron_hpc.data.gpt_dataset import GPTIndexConfig, build_gpt_dataset
prefix, n, seq, cache = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
start = time.perf_counter()
ds = build_gpt_dataset(prefix, split_name="train", num_samples=n,
                       config=GPTIndexConfig(seed=1234, seq_length=seq, split="100,0,0", cache_path=cache))
print("BUILD", time.perf_counter() - start, len(ds))
"""

MCORE = """
import sys, time
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer
prefix, n, seq, cache = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
config = GPTDatasetConfig(random_seed=1234, sequence_length=seq, blend=([prefix], None), split="100,0,0",
                          tokenizer=NullTokenizer(65000), reset_position_ids=False, reset_attention_mask=False,
                          eod_mask_loss=False, path_to_cache=cache)
start = time.perf_counter()
train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [n, None, None], lambda: True, config).build()
print("BUILD", time.perf_counter() - start, len(train))
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


def run(python: str, code: str, args: list[str], env: dict[str, str]) -> tuple[float, float, float, int]:
    """Build seconds (timed inside the child, imports excluded), whole-process seconds, peak RSS (MiB),
    number of samples."""
    read, write = os.pipe()
    start = time.perf_counter()
    pid = os.posix_spawn(python, [python, "-c", code, *args], env,
                         file_actions=[(os.POSIX_SPAWN_DUP2, write, 1), (os.POSIX_SPAWN_OPEN, 2, os.devnull,
                                                                       os.O_WRONLY, 0)])
    os.close(write)
    with os.fdopen(read) as fh:
        out = fh.read()
    _, status, usage = os.wait4(pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{python} failed building indices:\n{out}")
    _, build_s, length = next(line for line in out.splitlines() if line.startswith("BUILD")).split()
    return float(build_s), wall, usage.ru_maxrss / 1024, int(length)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mcore-python", required=True, help="python of a venv with megatron-core 0.16.1")
    parser.add_argument("--docs", type=int, default=5_000_000)
    parser.add_argument("--mean-tokens", type=int, default=600)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--epochs", type=int, nargs="+", default=[1, 10])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="scratch folder (default: a temp folder)")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        prefix, tokens = make_dataset(Path(tmp), docs=args.docs, mean_tokens=args.mean_tokens)
        print(f"dataset: {args.docs:,} documents, {tokens:,} tokens (mean {tokens / args.docs:.0f}), "
              f"seq {args.seq_length}; {args.rounds} rounds, A B A B ...")
        for epochs in args.epochs:
            # just under `epochs` epochs of samples, so Megatron's epoch count is exactly `epochs`
            num_samples = int((epochs - 0.2) * (tokens - 1) / args.seq_length)
            rows: dict[str, list[tuple[float, float, float, int]]] = {"megatron-hpc": [], "megatron-core": []}
            for r in range(args.rounds):
                for name, python, code in (("megatron-hpc", sys.executable, OURS),
                                           ("megatron-core", args.mcore_python, MCORE)):
                    cache = Path(tmp) / f"cache-{name}-{epochs}-{r}"
                    rows[name].append(run(python, code, [prefix, str(num_samples), str(args.seq_length),
                                                         str(cache)], env))
            lengths = {v[3] for rows_ in rows.values() for v in rows_}
            assert len(lengths) == 1, f"the two builds disagree on the number of samples: {lengths}"
            med = {k: tuple(statistics.median(x[i] for x in v) for i in range(3)) for k, v in rows.items()}
            for name, (build, wall, rss) in med.items():
                runs = ", ".join(f"{x[0]:.2f}" for x in rows[name])
                print(f"{epochs:>2} epoch(s) {name:<14} build median {build:6.2f} s (runs {runs}); "
                      f"whole process {wall:6.2f} s; peak RSS {rss:7.0f} MiB")
            ours, ref = med["megatron-hpc"], med["megatron-core"]
            print(f"{epochs:>2} epoch(s) ratio megatron-hpc/megatron-core ({lengths.pop():,} samples): "
                  f"build time {ours[0] / ref[0]:.2f}x, whole process {ours[1] / ref[1]:.2f}x, "
                  f"peak memory {ours[2] / ref[2]:.2f}x")


if __name__ == "__main__":
    main()

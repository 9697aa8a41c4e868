"""Preprocessing throughput: `megatron-hpc data preprocess` against Megatron-LM's tools/preprocess_data.py.

Issue 3's figure: tokens/s on the same JSONL corpus, the same GPT-2 BPE vocab/merges and the same
worker count, both tools run whole (start-up included, as a user runs them), alternating A B A B.
The corpus is the stdlib demo corpus (`megatron-hpc data demo`) repeated --repeat times. Megatron's
tool runs from a Megatron-LM checkout (fetched, never committed) in its own venv, with
--legacy-tokenizer: its default tokenizer path needs the HF hub, which is offline here. The first
round also checks that both wrote identical .bin/.idx bytes.

    python benchmarks/preprocess_throughput.py --megatron-lm /tmp/mlm-src --megatron-python /tmp/mlm-venv/bin/python
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Megatron's training package imports a triton kernel module at import time that
# preprocess_data.py never calls; only that module is replaced with a stub.
RUNNER = (
    "import runpy, sys\n"
    "from unittest import mock\n"
    "sys.modules.setdefault('megatron.core.transformer.custom_layers.batch_invariant_kernels', mock.MagicMock())\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def timed(cmd: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megatron-lm", type=Path, required=True)
    parser.add_argument("--megatron-python", required=True)
    parser.add_argument("--demo", type=Path, default=Path("~/.cache/megatron-hpc/demo").expanduser())
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    vocab, merges = args.demo / "vocab.json", args.demo / "merges.txt"
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        text = (args.demo / "stdlib.jsonl").read_text()
        corpus.write_text(text * args.repeat)
        common = ["--input", str(corpus), "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab),
                  "--merge-file", str(merges), "--append-eod", "--workers", str(args.workers)]
        ours_cmd = [sys.executable, "-m", "megatron_hpc", "data", "preprocess", "--output-prefix",
                    f"{tmp}/ours", *common]
        theirs_cmd = [args.megatron_python, "-W", "ignore", "-c", RUNNER,
                      str(args.megatron_lm / "tools" / "preprocess_data.py"), "--output-prefix", f"{tmp}/theirs",
                      "--legacy-tokenizer", *common]
        theirs_env = {"PYTHONPATH": str(args.megatron_lm), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
        times: dict[str, list[float]] = {"megatron-hpc": [], "Megatron-LM": []}
        for r in range(args.rounds):
            times["megatron-hpc"].append(timed(ours_cmd, dict(os.environ)))
            times["Megatron-LM"].append(timed(theirs_cmd, theirs_env))
            if r == 0:
                for ext in ("bin", "idx"):
                    same = (Path(f"{tmp}/ours_text_document.{ext}").read_bytes()
                            == Path(f"{tmp}/theirs_text_document.{ext}").read_bytes())
                    print(f"identical .{ext}: {same}")
        size = Path(f"{tmp}/ours_text_document.bin").stat().st_size
        tokens = size // 2  # uint16 ids: the vocab is under 65500
        print(f"corpus: {corpus.stat().st_size / 2**20:.1f} MiB, {tokens:,} tokens, {args.workers} workers, "
              f"{args.rounds} rounds")
        med = {k: statistics.median(v) for k, v in times.items()}
        for name, values in times.items():
            runs = ", ".join(f"{v:.2f}" for v in values)
            print(f"{name:<13} wall median {med[name]:6.2f} s (runs {runs}); {tokens / med[name]:,.0f} tokens/s")
        print(f"throughput ratio megatron-hpc/Megatron-LM: {med['Megatron-LM'] / med['megatron-hpc']:.2f}x")


if __name__ == "__main__":
    main()

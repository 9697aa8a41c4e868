"""Preprocessing throughput: `megatron-hpc data preprocess` against Megatron-LM's tools/preprocess_data.py.

Issue 3's figure: the same JSONL corpus, the same GPT-2 BPE vocab/merges and the same worker count,
alternating A B A B. Start-up and throughput are reported apart, since they differ by an order of
magnitude in weight (Megatron's imports alone take seconds): "start-up" is the whole run of the same
command on a one-document corpus (interpreter, imports, tokenizer files, worker pool, output files);
"throughput" is tokens over the corpus run's wall time less that start-up. Both, and the ratio of each,
are printed, as is the whole-run ratio a user sees. The corpus is the stdlib demo corpus (`megatron-hpc
data demo`) repeated --repeat times. Megatron's tool runs from a Megatron-LM checkout (fetched, never
committed) in its own venv, with --legacy-tokenizer: its default tokenizer path needs the HF hub, which
is offline here. The first round also checks that both wrote identical .bin/.idx bytes.

    # Megatron-LM at tag core_v0.16.1 unpacked in /tmp/mlm-src; a venv for it (what its imports need):
    python3 -m venv /tmp/mlm-venv && /tmp/mlm-venv/bin/pip install torch==2.13.0 megatron-core==0.16.1 six regex \
        pyyaml pydantic
    python benchmarks/preprocess_throughput.py --megatron-lm /tmp/mlm-src --megatron-python /tmp/mlm-venv/bin/python
    python benchmarks/preprocess_throughput.py --self-anchor --demo DEMO --repeat 1 --workers 1 --rounds 1
        # smoke test (the suite runs it, without Megatron-LM; DEMO from `megatron-hpc data demo --out DEMO`)
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
    parser.add_argument("--megatron-lm", type=Path)
    parser.add_argument("--megatron-python")
    parser.add_argument("--self-anchor", action="store_true",
                        help="smoke test only: megatron-hpc's preprocess stands in for Megatron-LM's (ratios near 1)")
    parser.add_argument("--demo", type=Path, default=Path("~/.cache/megatron-hpc/demo").expanduser())
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not args.self_anchor and not (args.megatron_lm and args.megatron_python):
        parser.error("--megatron-lm and --megatron-python are required (a Megatron-LM checkout and a venv for it)")
    anchor = "megatron-hpc again" if args.self_anchor else "Megatron-LM"
    vocab, merges = args.demo / "vocab.json", args.demo / "merges.txt"
    with tempfile.TemporaryDirectory() as tmp:
        corpus, one_doc = Path(tmp) / "corpus.jsonl", Path(tmp) / "one.jsonl"
        text = (args.demo / "stdlib.jsonl").read_text()
        corpus.write_text(text * args.repeat)
        one_doc.write_text(text.splitlines(keepends=True)[0])

        def commands(source: Path, out: str) -> dict[str, tuple[list[str], dict[str, str]]]:
            common = ["--input", str(source), "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab),
                      "--merge-file", str(merges), "--append-eod", "--workers", str(args.workers)]
            ours = [sys.executable, "-m", "megatron_hpc", "data", "preprocess", "--output-prefix", f"{tmp}/{out}-ours",
                    *common]
            if args.self_anchor:
                theirs = [*ours[:ours.index("--output-prefix") + 1], f"{tmp}/{out}-theirs", *common]
                return {"megatron-hpc": (ours, dict(os.environ)), anchor: (theirs, dict(os.environ))}
            theirs = [args.megatron_python, "-W", "ignore", "-c", RUNNER,
                      str(args.megatron_lm / "tools" / "preprocess_data.py"), "--output-prefix",
                      f"{tmp}/{out}-theirs", "--legacy-tokenizer", *common]
            theirs_env = {"PYTHONPATH": str(args.megatron_lm), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
            return {"megatron-hpc": (ours, dict(os.environ)), anchor: (theirs, theirs_env)}

        runs = {"start-up": commands(one_doc, "one"), "corpus": commands(corpus, "corpus")}
        times: dict[str, dict[str, list[float]]] = {kind: {"megatron-hpc": [], anchor: []} for kind in runs}
        for r in range(args.rounds):
            for kind, tools in runs.items():
                for name, (cmd, env) in tools.items():
                    times[kind][name].append(timed(cmd, env))
            if r == 0:
                for ext in ("bin", "idx"):
                    same = (Path(f"{tmp}/corpus-ours_text_document.{ext}").read_bytes()
                            == Path(f"{tmp}/corpus-theirs_text_document.{ext}").read_bytes())
                    print(f"identical .{ext}: {same}")
        size = Path(f"{tmp}/corpus-ours_text_document.bin").stat().st_size
        tokens = size // 2  # uint16 ids: the vocab is under 65500
        print(f"corpus: {corpus.stat().st_size / 2**20:.1f} MiB, {tokens:,} tokens, {args.workers} workers, "
              f"{args.rounds} rounds")
        med = {kind: {k: statistics.median(v) for k, v in tools.items()} for kind, tools in times.items()}
        for name in ("megatron-hpc", anchor):
            start, whole = med["start-up"][name], med["corpus"][name]
            print(f"{name:<18} start-up median {start:6.2f} s (runs "
                  f"{', '.join(f'{v:.2f}' for v in times['start-up'][name])}); corpus run median {whole:6.2f} s "
                  f"(runs {', '.join(f'{v:.2f}' for v in times['corpus'][name])}); throughput without start-up "
                  f"{tokens / (whole - start):,.0f} tokens/s; whole run {tokens / whole:,.0f} tokens/s")
        ours, theirs = (med["start-up"]["megatron-hpc"], med["corpus"]["megatron-hpc"]), \
            (med["start-up"][anchor], med["corpus"][anchor])
        print(f"ratios megatron-hpc/{anchor}: start-up {ours[0] / theirs[0]:.2f}x the time; throughput without "
              f"start-up {(theirs[1] - theirs[0]) / (ours[1] - ours[0]):.2f}x; whole run "
              f"{theirs[1] / ours[1]:.2f}x")

if __name__ == "__main__":
    main()

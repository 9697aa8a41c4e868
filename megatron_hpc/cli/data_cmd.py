"""`megatron-hpc data`: preprocess, inspect and sample Megatron `.bin/.idx` datasets.

Subcommands: preprocess (JSONL -> .bin/.idx as Megatron's tools/preprocess_data.py),
train-tokenizer (GPT-2 vocab.json + merges.txt), inspect (counts and a decoded peek),
samples (token ids exactly as the trainer sees them), demo (stdlib corpus end to end).
Results go to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_hpc.cli.preprocess_args import add_preprocess_parser, run_preprocess

if TYPE_CHECKING:
    from megatron_hpc.data.text_tokenizers import TokenizerSpec

DEMO_DIR = "~/.cache/megatron-hpc/demo"
DEMO_VOCAB_SIZE = 8192  # the tiny recipe's model.vocab_size
DEMO_NAME = "stdlib"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="data_command", metavar="SUBCOMMAND", required=True)

    add_preprocess_parser(sub)

    p = sub.add_parser("train-tokenizer", help="train byte-level BPE; writes vocab.json and merges.txt")
    p.add_argument("--input", nargs="+", required=True, help="text files, or JSONL files (their --json-key text)")
    p.add_argument("--vocab-size", type=int, required=True, help="ids in total, <|endoftext|> being the last")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--json-key", default="text", help="key read from JSONL inputs (default text)")

    p = sub.add_parser("inspect", help="counts, dtype and a decoded peek of a dataset")
    p.add_argument("prefix", help="dataset prefix without .bin/.idx")
    p.add_argument("--tokenizer-type", default="GPT2BPETokenizer", help="tokenizer that made it (as preprocess)")
    p.add_argument("--vocab-file", "--vocab", dest="vocab_file", help="GPT-2 vocab.json, to decode the first document")
    p.add_argument("--merge-file", help="GPT-2 merges.txt, to decode the first document")
    p.add_argument("--tokenizer-model", help="Hugging Face folder or SentencePiece .model, to decode it")
    p.add_argument("--legacy-tokenizer", action="store_true", help="Megatron's pre-rewrite tokenizer (as preprocess)")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = sub.add_parser("samples", help="token ids of training samples exactly as the trainer sees them")
    p.add_argument("--data-path", required=True, help="dataset prefix (or Megatron blend string)")
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--split", default="969,30,1")
    p.add_argument("--split-name", default="train", choices=["train", "valid", "test"])
    p.add_argument("--start", type=int, default=0, help="first sample index")
    p.add_argument("--count", type=int, default=1, help="number of samples")
    p.add_argument("--num-samples", type=int, default=None, help="samples the split is built for")
    p.add_argument("--data-cache-path", default=None, help="where the index .npy files are cached")
    p.add_argument("--json", action="store_true", help="print JSON (one object per sample)")

    p = sub.add_parser("demo", help="build a stdlib code corpus, train a tokenizer and preprocess it")
    p.add_argument("--out", default=DEMO_DIR, help=f"output directory (default {DEMO_DIR})")


def demo_paths(out: Path) -> dict[str, Path]:
    """Files `data demo` writes under `out`; the dataset prefix has no extension."""
    return {"corpus": out / f"{DEMO_NAME}.jsonl", "vocab": out / "vocab.json", "merges": out / "merges.txt",
            "prefix": out / f"{DEMO_NAME}_text_document"}


def _train_tokenizer(args: argparse.Namespace) -> int:
    from megatron_hpc.data.tokenizer import train_tokenizer

    vocab, merges = train_tokenizer(args.input, vocab_size=args.vocab_size, output_dir=args.output_dir,
                                    json_key=args.json_key)
    print(vocab)
    print(merges)
    return 0


def inspect_dataset(prefix: str, *, vocab_file: str | None = None, merge_file: str | None = None,
                    tokenizer: TokenizerSpec | None = None, peek_tokens: int = 64) -> dict:
    """Summary of a dataset; `peek` (the first document's first tokens, decoded) needs a tokenizer: `tokenizer`,
    or GPT-2's `vocab_file` and `merge_file`."""
    from megatron_hpc.data.indexed import IndexedDataset
    from megatron_hpc.data.text_tokenizers import build_tokenizer, tokenizer_spec

    ds = IndexedDataset(prefix)
    info: dict = {"prefix": ds.prefix, "sequences": len(ds), "documents": ds.num_documents,
                  "tokens": ds.num_tokens, "dtype": str(ds.dtype),
                  "bin_bytes": ds.bin_path.stat().st_size, "idx_bytes": ds.idx_path.stat().st_size}
    if len(ds):
        info["sequence_length"] = {"min": int(ds.sequence_lengths.min()), "max": int(ds.sequence_lengths.max()),
                                   "mean": round(float(ds.sequence_lengths.mean()), 1)}
    if tokenizer is None and vocab_file and merge_file:
        tokenizer = tokenizer_spec(vocab_file=vocab_file, merge_file=merge_file)
    if tokenizer is not None:
        first, end = (int(x) for x in ds.document_indices[:2]) if ds.num_documents else (0, 0)
        ids: list[int] = []
        for seq in range(first, end):
            ids.extend(int(t) for t in ds[seq][: peek_tokens - len(ids)])
        info["peek_ids"] = ids
        info["peek"] = build_tokenizer(tokenizer).decode(ids)
    elif vocab_file or merge_file:
        print("megatron-hpc: warning: --vocab-file and --merge-file go together; no peek", file=sys.stderr)
    return info


def _inspect(args: argparse.Namespace) -> int:
    from megatron_hpc.data.text_tokenizers import tokenizer_spec

    tokenizer = None
    if args.tokenizer_model or args.tokenizer_type != "GPT2BPETokenizer":
        tokenizer = tokenizer_spec(args.tokenizer_type, vocab_file=args.vocab_file, merge_file=args.merge_file,
                                   model=args.tokenizer_model, legacy=args.legacy_tokenizer)
    info = inspect_dataset(args.prefix, vocab_file=args.vocab_file, merge_file=args.merge_file, tokenizer=tokenizer)
    if args.json:
        print(json.dumps(info, ensure_ascii=False))
        return 0
    rows = [(k, info[k]) for k in ("prefix", "sequences", "documents", "tokens", "dtype") if k in info]
    if "sequence_length" in info:
        rows.append(("seq len", "min {min}, mean {mean}, max {max}".format(**info["sequence_length"])))
    if "peek" in info:
        rows.append(("peek", repr(info["peek"])))
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    return 0


def _samples(args: argparse.Namespace) -> int:
    from megatron_hpc.data.loader import gpt_samples  # numpy-heavy; imported only here

    samples = gpt_samples(data_path=args.data_path, seq_length=args.seq_length, seed=args.seed, split=args.split,
                          split_name=args.split_name, num_samples=args.num_samples, start=args.start,
                          count=args.count, cache_path=args.data_cache_path)
    for sample in samples:
        row = {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in sample.items()}
        print(json.dumps(row) if args.json else f"{row['index']}: {row['tokens']}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    out = Path(args.out).expanduser()
    paths = demo_paths(out)
    outputs = (paths["vocab"], paths["merges"], Path(f"{paths['prefix']}.bin"), Path(f"{paths['prefix']}.idx"))
    if all(p.is_file() for p in outputs):
        print(f"megatron-hpc: demo data already in {out}; nothing to do (delete it to rebuild)", file=sys.stderr)
        print(paths["prefix"])
        return 0
    from megatron_hpc.data.demo_corpus import write_demo_corpus
    from megatron_hpc.data.preprocess import preprocess
    from megatron_hpc.data.tokenizer import train_tokenizer

    files, size = write_demo_corpus(paths["corpus"])
    print(f"demo: corpus {paths['corpus']}: {files} stdlib files, {size / 2**20:.1f} MiB", file=sys.stderr)
    train_tokenizer([paths["corpus"]], vocab_size=DEMO_VOCAB_SIZE, output_dir=out)
    print(f"demo: tokenizer {paths['vocab']}, {paths['merges']} ({DEMO_VOCAB_SIZE} ids)", file=sys.stderr)
    preprocess(paths["corpus"], output_prefix=out / DEMO_NAME, vocab_file=paths["vocab"],
               merge_file=paths["merges"], append_eod=True, workers=1, progress=sys.stderr)
    print(paths["prefix"])
    return 0


def run(args: argparse.Namespace) -> int:
    handlers = {"preprocess": run_preprocess, "train-tokenizer": _train_tokenizer, "inspect": _inspect,
                "samples": _samples, "demo": _demo}
    return handlers[args.data_command](args)

"""`megatron-hpc data preprocess`: Megatron's tools/preprocess_data.py command line, accepted as pasted.

The tutorials' lines run unchanged after `megatron-hpc data preprocess` (tests/unit/test_data_tutorial_commands.py
runs each): Megatron-LM's README (`--vocab` for --vocab-file, `--dataset-impl mmap`), the Hugging Face GPT-2
tutorial (`--chunk-size 25`), Megatron-LM's docs (`--tokenizer-type HuggingFaceTokenizer --tokenizer-model`) and
GPT-NeoX's Pythia line (`--tokenizer-type HFTokenizer --vocab-file 20B_tokenizer.json`). Flags that only tune
Megatron's own process pool (--chunk-size, --log-interval) are accepted and said to change nothing; a dataset
format other than mmap is refused with the fix.
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_hpc.errors import DataError

_IGNORED = {"chunk_size": "--chunk-size (documents per hand-over to Megatron's pool; batches here are sized by "
                          "characters)",
            "log_interval": "--log-interval (progress is printed every second here)",
            "tokenizer_hf_use_fast": "--tokenizer-hf-use-fast (tokenizer.json is always run by `tokenizers`)"}


def add_preprocess_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("preprocess", help="tokenize JSONL into {prefix}_{key}_document.bin/.idx (Megatron's flags)")
    p.add_argument("--input", required=True, help="corpus.jsonl or corpus.jsonl.gz, one JSON document per line")
    p.add_argument("--output-prefix", required=True, help="output path prefix (Megatron's --output-prefix)")
    p.add_argument("--tokenizer-type", default="GPT2BPETokenizer",
                   help="GPT2BPETokenizer (default), HuggingFaceTokenizer (HFTokenizer), SentencePieceTokenizer, "
                        "GPTSentencePieceTokenizer or Llama2Tokenizer")
    p.add_argument("--vocab-file", "--vocab", dest="vocab_file", help="GPT-2 vocab.json (HFTokenizer: tokenizer.json)")
    p.add_argument("--merge-file", help="GPT-2 merges.txt")
    p.add_argument("--tokenizer-model", help="Hugging Face tokenizer folder or tokenizer.json; SentencePiece .model")
    p.add_argument("--legacy-tokenizer", action="store_true",
                   help="Megatron's tokenizers before its rewrite (SentencePieceTokenizer's <EOD>, Llama2's BOS)")
    p.add_argument("--tokenizer-hf-include-special-tokens", action="store_true",
                   help="keep what the Hugging Face post-processor adds (the default here, as Megatron-LM HEAD)")
    p.add_argument("--tokenizer-hf-no-include-special-tokens", action="store_true",
                   help="leave those special tokens out (Megatron-LM 0.16.1's default path)")
    p.add_argument("--tokenizer-hf-use-fast", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json-keys", "--jsonl-keys", dest="json_keys", nargs="+", default=["text"],
                   help="keys to tokenize, one dataset each (GPT-NeoX: --jsonl-keys)")
    p.add_argument("--append-eod", action="store_true", help="end every document with the tokenizer's EOD id")
    p.add_argument("--split-sentences", action="store_true",
                   help="one sequence per sentence (nltk punkt); outputs {prefix}_{key}_sentence")
    p.add_argument("--keep-newlines", action="store_true", help="with --split-sentences: keep newlines in sentences")
    p.add_argument("--lang", default="english", help="punkt language for --split-sentences (default english)")
    p.add_argument("--dataset-impl", default="mmap", help="mmap (the only format Megatron-core reads)")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    p.add_argument("--chunk-size", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--log-interval", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--strict", action="store_true", help="stop at the first malformed line instead of skipping it")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def run_preprocess(args: argparse.Namespace) -> int:
    from megatron_hpc.data.preprocess import SplitOptions, preprocess
    from megatron_hpc.data.text_tokenizers import tokenizer_spec

    if args.dataset_impl != "mmap":
        raise DataError(f"--dataset-impl {args.dataset_impl} writes the old fairseq TNTIDX files, which Megatron-core "
                        f"no longer reads; use --dataset-impl mmap (the default)")
    if args.tokenizer_hf_include_special_tokens and args.tokenizer_hf_no_include_special_tokens:
        raise DataError("--tokenizer-hf-include-special-tokens and --tokenizer-hf-no-include-special-tokens "
                        "contradict each other; pass one")
    for name, what in _IGNORED.items():
        if getattr(args, name):
            print(f"megatron-hpc: note: {what} does not change the output; ignored", file=sys.stderr)
    if args.keep_newlines and not args.split_sentences:
        print("megatron-hpc: note: --keep-newlines only matters with --split-sentences (as in Megatron); the "
              "documents keep their newlines anyway", file=sys.stderr)
    spec = tokenizer_spec(args.tokenizer_type, vocab_file=args.vocab_file, merge_file=args.merge_file,
                          model=args.tokenizer_model, legacy=args.legacy_tokenizer,
                          special_tokens=not args.tokenizer_hf_no_include_special_tokens)
    split = SplitOptions(lang=args.lang, keep_newlines=args.keep_newlines) if args.split_sentences else None
    result = preprocess(args.input, output_prefix=args.output_prefix, tokenizer=spec, json_keys=args.json_keys,
                        append_eod=args.append_eod, workers=args.workers, strict=args.strict, split=split,
                        progress=sys.stderr)
    if args.json:
        print(json.dumps({"prefixes": result.prefixes, "documents": result.num_documents,
                          "tokens": result.num_tokens, "skipped_lines": [n for n, _ in result.skipped],
                          "seconds": round(result.seconds, 3), "workers": result.workers}))
    else:
        for prefix in result.prefixes.values():
            print(prefix)
    return 0

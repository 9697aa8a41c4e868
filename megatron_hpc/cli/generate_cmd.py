"""`megatron-hpc generate CKPT --prompt "..."`: continue prompts with a trained checkpoint, greedy unless
--temperature says otherwise.

Alone it runs in this process at TP 1 (the checkpoint's TP x PP shards merged), on the device of --platform or the
run's platform (CPU, CUDA or XLA; the CPU when this machine lacks the run's device). Under torchrun (`torchrun
--nproc_per_node T -m megatron_hpc generate ...`) it runs at TP T on the CPU (gloo), as `serve` does: every rank
parses the same arguments, loads its shard, computes its heads and its vocabulary columns in the same `generate`
call (the sampling exchanges only what the choice needs), and rank 0 alone prints.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from megatron_hpc.config.platforms import PLATFORMS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", type=Path, help="checkpoint folder (the tracker picks the iteration) or iter_XXXXXXX")
    parser.add_argument("--prompt", action="append", default=[], help="text to continue (repeat for a batch)")
    parser.add_argument("--prompt-ids", action="append", default=[], metavar="IDS",
                        help="a prompt as comma-separated token ids (repeat for a batch; needs no tokenizer)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate at most (default 32)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; above 0: sample")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1: off)")
    parser.add_argument("--seed", type=int, help="seed of the draws (default: a fresh one)")
    parser.add_argument("--stop-token", type=int, action="append", default=[], metavar="ID",
                        help="stop a prompt after this token id (repeatable; default: the tokenizer's <|endoftext|>)")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at <|endoftext|>")
    parser.add_argument("--vocab-file", type=Path, help="GPT-2 vocab.json, when the run's is missing or gone")
    parser.add_argument("--merge-file", type=Path, help="GPT-2 merges.txt, with --vocab-file")
    parser.add_argument("--iteration", type=int, help="use this iteration instead of the tracker's")
    parser.add_argument("--platform", choices=sorted(PLATFORMS),
                        help="generate on this platform's device (default: the platform the run was planned on)")
    parser.add_argument("--json", action="store_true", help="print JSON: tokens, log-probs and text per prompt")


def _parse_ids(text: str) -> list[int]:
    from megatron_hpc.errors import GenerationError

    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise GenerationError(f"--prompt-ids {text!r} is not comma-separated integers, e.g. 464,3290,318") from None


def run(args: argparse.Namespace) -> int:
    from megatron_hpc.errors import GenerationError
    from megatron_hpc.generate.engine import generate
    from megatron_hpc.generate.loading import (
        TOKENIZER_FLAGS,
        choose_device,
        end_of_text,
        generation_stops,
        leave_group,
        load_for_generation,
        torchrun_context,
    )
    from megatron_hpc.generate.sampling import SamplingParams

    if not args.prompt and not args.prompt_ids:
        raise GenerationError("nothing to continue: pass --prompt TEXT or --prompt-ids IDS")
    id_prompts = [_parse_ids(p) for p in args.prompt_ids]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)  # checked before the (slow) load
    asked = choose_device(args.platform, {}) if args.platform else None
    if asked is not None and asked.info.kind != "cpu" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise GenerationError(f"--platform {args.platform} runs in one process; under torchrun every rank generates "
                              "on the cpu (gloo), so drop --platform or run without torchrun")
    ctx = torchrun_context()
    loaded = load_for_generation(args.path, iteration=args.iteration, vocab_file=args.vocab_file,
                                 merge_file=args.merge_file, ctx=ctx)
    kind = "cpu"
    if ctx is None:
        chosen = asked or choose_device(None, loaded.resolved_config, loaded.resolved_plan)
        if chosen.note:
            print(f"megatron-hpc: note: {chosen.note}", file=sys.stderr)
        loaded.model.to(chosen.info.device)
        kind = chosen.info.kind
    tok = loaded.tokenizer
    if args.prompt and tok is None:
        raise GenerationError(f"text prompts need a tokenizer and {args.path} has none ({loaded.no_tokenizer}); "
                              f"pass {TOKENIZER_FLAGS}, or token ids with --prompt-ids")
    prompts = [tok.encode(p) for p in args.prompt] + id_prompts if tok is not None else id_prompts
    stops = list(args.stop_token)
    if tok is not None and not args.ignore_eos:
        # GPT-2's <|endoftext|>, or the tokenizer.json's / SentencePiece model's end-of-sequence id (serve's too)
        eod = end_of_text(tok)
        stops += [eod] if eod is not None else []
        # and every id an imported model's generation_config.json stops at, as transformers' generate does
        stops += [i for i in generation_stops(loaded.resolved_config) if i not in stops]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop_tokens=tuple(stops))
    results = generate(loaded.model, prompts, params)  # under torchrun: every rank, the same call
    leave_group()
    if ctx is not None and ctx.rank != 0:
        return 0
    rows: list[dict[str, Any]] = []
    for gen in results:
        row: dict[str, Any] = {"prompt_ids": gen.prompt, "tokens": gen.tokens, "logprobs": gen.logprobs,
                               "finish_reason": gen.finish_reason}
        if tok is not None:
            row.update(prompt=tok.decode(gen.prompt), text=tok.decode(gen.tokens))
        rows.append(row)
    if args.json:
        print(json.dumps({"checkpoint": str(args.path), "iteration": loaded.iteration,
                          "tensor_parallel": loaded.source_tp, "device": kind, "results": rows},
                         indent=1))
        return 0
    for row in rows:
        if tok is not None:
            print(row["prompt"] + row["text"])
        else:
            print(" ".join(str(t) for t in row["prompt_ids"] + row["tokens"]))
    return 0

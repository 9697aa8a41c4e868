"""`megatron-hpc evaluate CKPT`: loss and perplexity of a checkpoint on its run's valid and test splits (the
samples Megatron evaluates), or a zero-shot task on a local file (--task wikitext|lambada --file F). Runs in
this process, the checkpoint's TP x PP shards merged to TP 1, on the device of --platform or the run's platform (CPU,
CUDA or XLA; the CPU when this machine lacks the run's device); under torchrun with as many processes as the
checkpoint's TP x PP ranks, each process evaluates its own shard on the CPU (gloo), its pipeline stages passing
activations as the trainer's do. The vocabulary keeps the padding of the checkpoint's TP size: Megatron's loss
takes the softmax over the padded vocabulary, so other padding would give another loss than the run's."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from megatron_hpc.config.platforms import PLATFORMS

DEFAULT_BATCH = 4
"""Rows per forward pass of a task when the checkpoint records no train.micro_batch_size."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", type=Path, help="checkpoint folder (the tracker picks the iteration) or iter_XXXXXXX")
    parser.add_argument("--split", choices=["valid", "test", "both"],
                        help="splits of the run's data to evaluate (default: both, or none with --task)")
    parser.add_argument("--eval-iters", type=int,
                        help="global batches per split (default: the run's train.eval_iters)")
    parser.add_argument("--data-path", help="evaluate the splits of this .bin/.idx prefix (or blend) instead of "
                                            "the run's data.path, with the run's data.split")
    parser.add_argument("--task", choices=["wikitext", "lambada"],
                        help="zero-shot task on --file: windowed perplexity, or last-word accuracy")
    parser.add_argument("--file", type=Path, help="the task's file: plain text (wikitext) or JSON lines with "
                                                  "\"text\" (lambada)")
    parser.add_argument("--overlapping-eval", type=int, metavar="STRIDE",
                        help="wikitext: a window every STRIDE tokens, scoring only its new ones (default: "
                             "seq_length, disjoint windows)")
    parser.add_argument("--strict-lambada", action="store_true",
                        help="lambada: the target is every token of the last word (default: the last token)")
    parser.add_argument("--vocab-file", type=Path, help="GPT-2 vocab.json, when the run's is missing or gone")
    parser.add_argument("--merge-file", type=Path, help="GPT-2 merges.txt, with --vocab-file")
    parser.add_argument("--iteration", type=int, help="use this iteration instead of the tracker's")
    parser.add_argument("--platform", choices=sorted(PLATFORMS),
                        help="evaluate on this platform's device (default: the platform the run was planned on)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def _check_args(args: argparse.Namespace) -> None:
    from megatron_hpc.errors import DataError

    if (args.task is None) != (args.file is None):
        raise DataError("pass --task and --file together, e.g. --task wikitext --file wiki.test.tokens")
    if args.overlapping_eval is not None and args.task != "wikitext":
        raise DataError("--overlapping-eval applies to --task wikitext only")
    if args.strict_lambada and args.task != "lambada":
        raise DataError("--strict-lambada applies to --task lambada only")
    if args.file is not None and not args.file.is_file():
        raise DataError(f"--file {args.file} does not exist; pass the {args.task} task's file")
    if args.platform not in (None, "cpu") and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise DataError(f"--platform {args.platform} runs in one process; under torchrun each shard is evaluated on "
                        f"the cpu (gloo), so drop --platform or run without torchrun")


def _split_names(args: argparse.Namespace) -> tuple[str, ...]:
    split = args.split or ("both" if args.task is None else None)
    return () if split is None else ("valid", "test") if split == "both" else (split,)


def _batch_size(resolved: dict[str, Any]) -> int:
    from megatron_hpc.config.loader import from_dict
    from megatron_hpc.config.schema import TrainConfig

    if "train" not in resolved:
        return DEFAULT_BATCH
    return from_dict(TrainConfig, resolved["train"], where="train").micro_batch_size


def _seq_length(resolved: dict[str, Any]) -> int:
    from megatron_hpc.config.loader import from_dict
    from megatron_hpc.config.schema import ModelConfig

    return from_dict(ModelConfig, resolved["model"], where="model").seq_length


def _load(args: argparse.Namespace, *, world: int) -> tuple[Any, Any]:
    """The checkpoint, and what scores inputs with it: the (sharded) GPT, or under PP its pipelined stages."""
    from megatron_hpc.evaluate.pipelined import PipelinedScorer
    from megatron_hpc.evaluate.sharded import ShardRank, load_shard
    from megatron_hpc.generate.loading import load_for_generation

    if world > 1:  # under torchrun: one TP x PP shard per process
        shard = load_shard(args.path, ShardRank(rank=int(os.environ["RANK"]), world_size=world),
                           iteration=args.iteration, vocab_file=args.vocab_file, merge_file=args.merge_file)
        loaded = shard.loaded
        if shard.ctx.pp_size == 1:
            return loaded, loaded.model
        resolved = loaded.resolved_config
        return loaded, PipelinedScorer(loaded.model, shard.ctx, batch_size=_batch_size(resolved),
                                       seq_length=_seq_length(resolved))
    loaded = load_for_generation(args.path, iteration=args.iteration, vocab_file=args.vocab_file,
                                 merge_file=args.merge_file, keep_padded_vocab=True)
    return loaded, loaded.model


def _task(args: argparse.Namespace, loaded: Any, scorer: Any, *, seq_length: int,
          batch_size: int) -> dict[str, Any]:
    from megatron_hpc.errors import GenerationError
    from megatron_hpc.evaluate.zeroshot import evaluate_lambada, evaluate_wikitext
    from megatron_hpc.generate.loading import TOKENIZER_FLAGS

    tok = loaded.tokenizer
    if tok is None:
        raise GenerationError(f"--task {args.task} needs the run's tokenizer and {args.path} has none "
                              f"({loaded.no_tokenizer}); pass {TOKENIZER_FLAGS}")
    if args.task == "wikitext":
        wiki = evaluate_wikitext(scorer, tok, args.file, seq_length=seq_length, stride=args.overlapping_eval,
                                 batch_size=batch_size)
        return {"loss": wiki.avg_loss, "token_ppl": wiki.token_ppl, "word_loss": wiki.word_loss,
                "word_ppl": wiki.word_ppl, "tokens": wiki.tokens, "words": wiki.words, "stride": wiki.stride}
    lam = evaluate_lambada(scorer, tok, args.file, seq_length=seq_length, strict=args.strict_lambada,
                           batch_size=batch_size)
    return {"accuracy": lam.accuracy, "correct": lam.correct, "total": lam.total, "strict": lam.strict}


def run(args: argparse.Namespace) -> int:
    from megatron_hpc.config.loader import from_dict
    from megatron_hpc.config.schema import DataConfig, TrainConfig
    from megatron_hpc.errors import DataError
    from megatron_hpc.evaluate.perplexity import capped_ppl
    from megatron_hpc.evaluate.splits import evaluate_split, split_requests
    from megatron_hpc.generate.loading import choose_device, leave_group

    _check_args(args)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    asked = choose_device(args.platform, {}) if args.platform and world == 1 else None  # checked before the load
    loaded, scorer = _load(args, world=world)
    resolved = loaded.resolved_config
    kind = "cpu"
    if world == 1:
        chosen = asked or choose_device(None, resolved, loaded.resolved_plan)
        if chosen.note:
            print(f"megatron-hpc: note: {chosen.note}", file=sys.stderr)
        loaded.model.to(chosen.info.device)
        kind = chosen.info.kind
    seq = _seq_length(resolved)
    report: dict[str, Any] = {"checkpoint": str(args.path), "iteration": loaded.iteration,
                              "tensor_parallel": loaded.source_tp, "pipeline_parallel": loaded.source_pp,
                              "device": kind, "splits": {}, "tasks": {}}
    names, batch_size = _split_names(args), _batch_size(resolved)
    if names:
        if "train" not in resolved:
            raise DataError(f"{args.path} records no train config (an imported checkpoint), so its splits are "
                            f"unknown; evaluate a --task, or a checkpoint of a megatron-hpc run")
        train = from_dict(TrainConfig, resolved["train"], where="train")
        data = from_dict(DataConfig, resolved.get("data", {}), where="data")
        if args.data_path:
            data = dataclasses.replace(data, path=args.data_path, source="indexed")
        eval_iters = train.eval_iters if args.eval_iters is None else args.eval_iters
        for request in split_requests(train, data, splits=names, eval_iters=eval_iters):  # type: ignore[arg-type]
            res = evaluate_split(scorer, request, data, seed=train.seed, seq_length=seq, batch_size=batch_size)
            report["splits"][res.split] = {"loss": res.loss, "ppl": capped_ppl(res.loss),
                                           "samples": res.num_samples}
    if args.task is not None:
        report["tasks"][args.task] = _task(args, loaded, scorer, seq_length=seq, batch_size=batch_size)
    if int(os.environ.get("RANK", "0")) == 0:
        where = "" if world > 1 else f", evaluated at tp 1 on the {kind}"
        print(json.dumps(report, indent=1) if args.json else _text(report, where=where))
    leave_group()
    return 0


def _text(report: dict[str, Any], *, where: str) -> str:
    lines = [f"checkpoint {report['checkpoint']} iteration {report['iteration']} "
             f"(tp {report['tensor_parallel']} pp {report['pipeline_parallel']}{where})"]
    for split, r in report["splits"].items():
        lines.append(f" {split:<5} | lm loss value: {r['loss']:.6E} | lm loss PPL: {r['ppl']:.6E} | "
                     f"samples: {r['samples']}")
    if "wikitext" in report["tasks"]:
        w = report["tasks"]["wikitext"]
        lines.append(f" wikitext | avg loss: {w['loss']:.4E} | ppl: {w['token_ppl']:.4E} | word ppl: "
                     f"{w['word_ppl']:.4E} | tokens: {w['tokens']} | words: {w['words']} | stride: {w['stride']}")
    if "lambada" in report["tasks"]:
        la = report["tasks"]["lambada"]
        lines.append(f" lambada{' (strict)' if la['strict'] else ''} | accuracy: {la['accuracy']:.4f} | "
                     f"correct: {la['correct']} | total: {la['total']}")
    return "\n".join(lines)

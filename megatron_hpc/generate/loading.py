"""A checkpoint of ours as one in-process GPT for generation: every TP x PP shard merged and loaded at TP 1 on
the CPU (the reshard tool's merge and vocabulary re-padding), with the run's tokenizer when it has one; then moved to
the device of the platform chosen as the trainer chooses it (choose_device)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_hpc.checkpoint.conversion import pp_layout, read_whole, tokenizer_files, tp_layout
from megatron_hpc.config.loader import from_dict
from megatron_hpc.config.platforms import PLATFORMS, resolve_platform
from megatron_hpc.config.schema import ModelConfig
from megatron_hpc.data.text_tokenizers import TextTokenizer, build_tokenizer, tokenizer_spec
from megatron_hpc.data.tokenizer import EOD_TOKEN, GPT2BPETokenizer
from megatron_hpc.errors import CheckpointError, DataError, GenerationError, MegatronHpcError, TrainingError
from megatron_hpc.model.gpt import GPT
from megatron_hpc.model.init_skip import skip_random_init
from megatron_hpc.parallel.context import ParallelContext
from megatron_hpc.parallel.device import DeviceInfo, resolve_device
from megatron_hpc.plan.mesh import Mesh
from megatron_hpc.plan.vocab import padded_vocab_size

TOKENIZER_FLAGS = "--vocab-file and --merge-file"


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadedModel:
    model: GPT
    iteration: int
    source_tp: int
    source_pp: int
    tokenizer: GPT2BPETokenizer | TextTokenizer | None
    no_tokenizer: str
    """Why there is no tokenizer (empty when there is one)."""
    resolved_config: dict[str, Any] = field(default_factory=dict)
    """The run's resolved config as the checkpoint stores it (JSON sections: model, train, data, ...)."""
    resolved_plan: dict[str, Any] = field(default_factory=dict)
    """The run's plan as the checkpoint stores it (empty for a checkpoint without one, e.g. an import)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ChosenDevice:
    info: DeviceInfo
    platform: str
    note: str
    """Why the checkpoint's own platform was not used (empty when it was, or when --platform chose)."""


def choose_device(requested: str | None, resolved_config: dict[str, Any],
                  resolved_plan: dict[str, Any] | None = None) -> ChosenDevice:
    """The device a single-process evaluate or generate runs on: the platform asked for (--platform), else the
    run's own, as the trainer chooses (resolve_platform); its backend picks CPU, CUDA or XLA. The run's own is the
    platform its plan ran on (`submit --platform p5` of a recipe whose launch.platform is trn1 ran on p5, and the
    resolved config keeps the recipe's trn1), else launch.platform. A platform asked for must be usable here. The
    run's own platform falls back to the CPU when this machine lacks its device (a Trainium run evaluated on a
    laptop), with a note, as these commands always worked on the CPU."""
    launch = resolved_config.get("launch") if isinstance(resolved_config.get("launch"), dict) else {}
    planned = (resolved_plan or {}).get("platform")
    # A --platform-file run's plan names its own hardware, not a built-in: launch.platform then decides.
    default = next((p for p in (planned, launch.get("platform")) if p in PLATFORMS), "cpu")
    platform = resolve_platform(requested, default=default)
    try:
        info = resolve_device(platform.backend, local_rank=0)
    except TrainingError as exc:
        if requested is not None:
            raise GenerationError(f"--platform {platform.name}: {exc}") from None
        info = resolve_device("gloo", local_rank=0)
        return ChosenDevice(info=info, platform="cpu", note=f"the run's platform {platform.name} cannot run here "
                                                            f"({exc}); using the cpu (pass --platform to choose)")
    return ChosenDevice(info=info, platform=platform.name, note="")


def resolved_plan_of(state: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint shard's resolved_plan, or {} where it has none (imports, older checkpoints)."""
    plan = state.get("resolved_plan")
    return plan if isinstance(plan, dict) else {}


def _single_process_context() -> ParallelContext:
    # The TP layers take their group from a ParallelContext: a one-rank gloo world gives it, in memory.
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    return ParallelContext.build(Mesh(num_nodes=1, workers_per_node=1, tensor_parallel=1), rank=0)


def torchrun_context() -> ParallelContext | None:
    """Under torchrun (WORLD_SIZE > 1): joins the gloo world, all of whose ranks form one TP group (the contract of
    `serve` and `generate`: T processes load the checkpoint at TP T). Alone: None (the merged TP 1 model)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return ParallelContext.build(Mesh(num_nodes=world // local, workers_per_node=local, tensor_parallel=world),
                                 rank=dist.get_rank())


def leave_group() -> None:
    """Under torchrun: every rank past its last collective before any rank exits. gloo completes a collective on one
    rank while its last bytes may still be in flight to another; a rank whose peer's sockets close under it then
    aborts (SIGABRT) and torchrun fails the whole command."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def check_tp_size(cfg: ModelConfig, *, tp: int, source_tp: int) -> None:
    """A TP size the model splits into: it must divide the attention heads, the key/value groups (each rank holds
    whole groups) and the MLP's hidden size."""
    whole = math.gcd(cfg.num_attention_heads, cfg.query_groups, cfg.ffn_size)
    if whole % tp:
        valid = [d for d in range(1, whole + 1) if whole % d == 0]
        groups = f", {cfg.query_groups} key/value groups" if cfg.query_groups != cfg.num_attention_heads else ""
        raise GenerationError(f"{tp} processes run the model at tp {tp}, which does not divide its "
                              f"{cfg.num_attention_heads} attention heads{groups} and MLP size {cfg.ffn_size}; run "
                              f"torchrun --nproc_per_node={source_tp} (the checkpoint's tp) or another of "
                              f"{valid}, or no torchrun for tp 1")


def end_of_text(tok: GPT2BPETokenizer | TextTokenizer) -> int | None:
    """The id generation stops at by default: GPT-2's <|endoftext|> where its vocabulary has one, else the
    tokenizer.json's or SentencePiece model's end-of-sequence id; None where it has none."""
    if isinstance(tok, GPT2BPETokenizer):
        return tok.vocab.get(EOD_TOKEN)
    try:
        return tok.eod
    except DataError:  # a tokenizer.json that names no eos_token: nothing to stop at by default
        return None


def generation_stops(resolved: dict[str, Any]) -> list[int]:
    """The eos_token_id of the generation_config.json an import copied beside the run's tokenizer (Llama 3.1
    Instruct stops at three ids, its tokenizer's eos_token is one of them), as transformers' generate stops;
    empty without one or when it cannot be read."""
    model = ((resolved.get("data") or {}).get("tokenizer_model")) if isinstance(resolved, dict) else None
    if not model:
        return []
    given = Path(model).expanduser()
    path = (given if given.is_dir() else given.parent) / "generation_config.json"
    try:
        eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return []
    ids = eos if isinstance(eos, list) else [eos]
    return [i for i in ids if isinstance(i, int) and not isinstance(i, bool)]


def load_tokenizer(whole_reason: tuple[Path, Path] | str, *, vocab_file: Path | None,
                   merge_file: Path | None) -> tuple[GPT2BPETokenizer | None, str]:
    if (vocab_file is None) != (merge_file is None):
        raise GenerationError(f"pass both {TOKENIZER_FLAGS} (GPT-2 vocab.json and merges.txt), not one")
    files = (vocab_file, merge_file) if vocab_file is not None else whole_reason
    if isinstance(files, str):
        return None, files
    return GPT2BPETokenizer(*files), ""


def run_tokenizer(resolved: dict[str, Any]) -> TextTokenizer | None:
    """The run's own tokenizer when its data section names one by a model file or folder (HuggingFaceTokenizer's
    tokenizer.json, a SentencePiece model such as Llama2Tokenizer's); None when it names none or GPT-2's."""
    data = resolved.get("data") or {}
    kind, model = data.get("tokenizer_type"), data.get("tokenizer_model")
    if not model or kind in (None, "GPT2BPETokenizer"):
        return None
    try:
        return build_tokenizer(tokenizer_spec(kind, model=model))
    except MegatronHpcError as exc:
        raise GenerationError(f"the run's tokenizer ({kind}, {model}) cannot be read: {exc}") from None


def load_for_generation(path: Path, *, iteration: int | None = None, vocab_file: Path | None = None,
                        merge_file: Path | None = None, ctx: ParallelContext | None = None,
                        keep_padded_vocab: bool = False) -> LoadedModel:
    """The checkpoint at TP 1 in this process, or, given `ctx` (every rank of its TP group calls this), this
    rank's shard at ctx's TP size: merged whole first, then split, so any saved TP x PP loads at any TP.
    keep_padded_vocab (TP 1 only) keeps the checkpoint's own padded vocabulary (padded for its TP size) instead of
    TP 1's: the dummy rows take part in the softmax, so a loss is the one the run computed."""
    whole = read_whole(path, iteration=iteration)
    try:
        raw = whole.first["resolved_config"]["model"]
    except (KeyError, TypeError):
        raise CheckpointError(f"{whole.found.folder} has no resolved_config (not written by megatron-hpc); "
                              "convert it first: megatron-hpc ckpt convert SRC --to torch OUT") from None
    cfg = from_dict(ModelConfig, raw, where="model")
    tp = 1 if ctx is None else ctx.tp_size
    check_tp_size(cfg, tp=tp, source_tp=whole.tensor_parallel)
    if keep_padded_vocab and tp != 1:
        raise ValueError("keep_padded_vocab is for the merged TP 1 model; a sharded load pads for its own TP")
    padded = padded_vocab_size(cfg.vocab_size, divisible_by=cfg.make_vocab_size_divisible_by,
                               tensor_parallel=whole.tensor_parallel if keep_padded_vocab else tp)
    full = pp_layout.merge_grid([[s["model"] for s in row] for row in whole.grid], num_layers=cfg.num_layers)
    for name in ("wte.weight", "lm_head.weight"):
        if name in full:
            full[name] = tp_layout.repad_vocab(full[name], vocab_size=cfg.vocab_size, padded=padded)
    with skip_random_init(True):
        model = GPT(cfg, ctx=_single_process_context() if ctx is None else ctx, padded_vocab=padded, seed=0)
    mine = full if tp == 1 else tp_layout.split_model(full, tp)[model.tp_rank]
    model.load_state_dict({k: v.to(torch.float32) for k, v in mine.items()})
    tokenizer, why = load_tokenizer(tokenizer_files(whole), vocab_file=vocab_file, merge_file=merge_file)
    if tokenizer is None and vocab_file is None:
        tokenizer = run_tokenizer(whole.first["resolved_config"]) or tokenizer
    if tokenizer is not None and tokenizer.vocab_size > cfg.vocab_size:
        raise GenerationError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                              f"{cfg.vocab_size}; pass the run's {TOKENIZER_FLAGS}")
    return LoadedModel(model=model.eval(), iteration=whole.iteration, source_tp=whole.tensor_parallel,
                       source_pp=whole.pipeline_parallel, tokenizer=tokenizer, no_tokenizer=why,
                       resolved_config=whole.first["resolved_config"],
                       resolved_plan=resolved_plan_of(whole.first))

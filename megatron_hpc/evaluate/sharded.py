"""A checkpoint at its own TP size, one shard per process (`torchrun --nproc_per_node=TP megatron-hpc evaluate`):
each rank reads only its shard, computes its heads and its vocabulary columns, and the vocab-parallel loss and
argmax combine the columns (scoring.py). Pipeline-parallel checkpoints are evaluated merged, at TP 1."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_hpc.checkpoint.loader import read_shard
from megatron_hpc.checkpoint.tools import resolved_tokenizer_files
from megatron_hpc.checkpoint.whole import locate
from megatron_hpc.config.loader import from_dict
from megatron_hpc.config.schema import ModelConfig
from megatron_hpc.errors import CheckpointError
from megatron_hpc.generate.loading import LoadedModel, load_tokenizer
from megatron_hpc.model.gpt import GPT
from megatron_hpc.parallel.context import ParallelContext
from megatron_hpc.plan.mesh import Mesh
from megatron_hpc.train.init_skip import skip_random_init


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardRank:
    rank: int
    world_size: int


def load_shard(path: Path, ranks: ShardRank, *, iteration: int | None = None, vocab_file: Path | None = None,
               merge_file: Path | None = None) -> LoadedModel:
    """This rank's TP shard as a GPT in a TP group of the whole world; joins the world (gloo, env://)."""
    found = locate(path, iteration=iteration)
    tp, pp = found.manifest.tensor_parallel, found.manifest.pipeline_parallel
    if pp != 1 or tp != ranks.world_size:
        raise CheckpointError(f"{found.folder} was saved at tp {tp} pp {pp} and this evaluate has "
                              f"{ranks.world_size} processes; run it with torchrun --nproc_per_node={tp} (pp 1 "
                              f"only), or without torchrun to evaluate it merged to tp 1")
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=ranks.rank, world_size=ranks.world_size)
    ctx = ParallelContext.build(Mesh(num_nodes=1, workers_per_node=tp, tensor_parallel=tp), rank=ranks.rank)
    state = read_shard(found, tp_rank=ctx.tp_rank)
    resolved = state.get("resolved_config")
    if not isinstance(resolved, dict) or "model" not in resolved:
        raise CheckpointError(f"{found.folder} has no resolved_config (not written by megatron-hpc); "
                              "convert it first: megatron-hpc ckpt convert SRC --to torch OUT")
    cfg = from_dict(ModelConfig, resolved["model"], where="model")
    with skip_random_init(True):
        model = GPT(cfg, ctx=ctx, padded_vocab=state["padded_vocab_size"], seed=0)
    model.load_state_dict({k: v.to(torch.float32) for k, v in state["model"].items()})
    tokenizer, why = load_tokenizer(resolved_tokenizer_files(resolved), vocab_file=vocab_file,
                                    merge_file=merge_file)
    return LoadedModel(model=model.eval(), iteration=found.manifest.iteration, source_tp=tp, source_pp=pp,
                       tokenizer=tokenizer, no_tokenizer=why, resolved_config=resolved)

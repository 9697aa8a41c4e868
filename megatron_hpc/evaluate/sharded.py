"""A checkpoint at its own TP x PP size, one shard per process (`torchrun --nproc_per_node=TP*PP megatron-hpc
evaluate`): each rank reads only its shard, computes its heads and its vocabulary columns, and the vocab-parallel
loss and argmax combine the columns (scoring.py). With PP > 1 each rank holds its pipeline stages, laid out as the
checkpoint's manifest records them, and a PipelinedScorer runs them (pipelined.py). Ranks are laid out as the
trainer lays them out (plan/mesh.py: tp fastest, then pp)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_hpc.checkpoint.conversion import locate, resolved_tokenizer_files
from megatron_hpc.checkpoint.store import PipelineLayout, read_shard
from megatron_hpc.config.loader import from_dict
from megatron_hpc.config.schema import ModelConfig
from megatron_hpc.errors import CheckpointError
from megatron_hpc.generate.loading import LoadedModel, load_tokenizer, resolved_plan_of
from megatron_hpc.model.gpt import GPT
from megatron_hpc.model.init_skip import skip_random_init
from megatron_hpc.parallel.context import ParallelContext
from megatron_hpc.plan.mesh import Mesh
from megatron_hpc.plan.stages import StageLayout, rank_stages, stage_layouts


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardRank:
    rank: int
    world_size: int


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadedShard:
    loaded: LoadedModel
    """This rank's part: the whole model at its TP shard, or (PP > 1) its pipeline stages only."""
    ctx: ParallelContext


def _stages(found_layout: PipelineLayout, *, num_layers: int, pp_rank: int) -> list[StageLayout] | None:
    if found_layout.pipeline == 1:
        return None
    layouts = stage_layouts(num_layers, pipeline=found_layout.pipeline, virtual=found_layout.virtual,
                            first_stage_layers=found_layout.first_stage_layers,
                            last_stage_layers=found_layout.last_stage_layers)
    return rank_stages(layouts, pp_rank)


def load_shard(path: Path, ranks: ShardRank, *, iteration: int | None = None, vocab_file: Path | None = None,
               merge_file: Path | None = None) -> LoadedShard:
    """This rank's TP x PP shard as a GPT (its stages when PP > 1) in a mesh of the whole world at the checkpoint's
    sizes; joins the world (gloo, env://)."""
    found = locate(path, iteration=iteration)
    tp, pp = found.manifest.tensor_parallel, found.manifest.pipeline_parallel
    if tp * pp != ranks.world_size:
        raise CheckpointError(f"{found.folder} was saved at tp {tp} x pp {pp} and this evaluate has "
                              f"{ranks.world_size} processes; run it with torchrun --nproc_per_node={tp * pp}, or "
                              f"without torchrun to evaluate it merged to tp 1")
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=ranks.rank, world_size=ranks.world_size)
    mesh = Mesh(num_nodes=1, workers_per_node=tp * pp, tensor_parallel=tp, pipeline_parallel=pp)
    ctx = ParallelContext.build(mesh, rank=ranks.rank)
    state = read_shard(found, tp_rank=ctx.tp_rank, pp_rank=ctx.pp_rank)
    resolved = state.get("resolved_config")
    if not isinstance(resolved, dict) or "model" not in resolved:
        raise CheckpointError(f"{found.folder} has no resolved_config (not written by megatron-hpc); "
                              "convert it first: megatron-hpc ckpt convert SRC --to torch OUT")
    cfg = from_dict(ModelConfig, resolved["model"], where="model")
    stages = _stages(PipelineLayout.of_manifest(found.manifest), num_layers=cfg.num_layers, pp_rank=ctx.pp_rank)
    with skip_random_init(True):
        model = GPT(cfg, ctx=ctx, padded_vocab=state["padded_vocab_size"], seed=0, stages=stages)
    model.load_state_dict({k: v.to(torch.float32) for k, v in state["model"].items()})
    tokenizer, why = load_tokenizer(resolved_tokenizer_files(resolved), vocab_file=vocab_file,
                                    merge_file=merge_file)
    loaded = LoadedModel(model=model.eval(), iteration=found.manifest.iteration, source_tp=tp, source_pp=pp,
                         tokenizer=tokenizer, no_tokenizer=why, resolved_config=resolved,
                         resolved_plan=resolved_plan_of(state))
    return LoadedShard(loaded=loaded, ctx=ctx)

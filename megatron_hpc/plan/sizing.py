"""TP x PP x DP for a recipe on a cluster: the recipe's sizes, checked, or the planner's choice. Pure.

A size of 0 in the recipe (parallel.tensor, parallel.pipeline) lets the planner choose it the way table 1 of
Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters") is laid out: tensor
parallelism inside a node, pipeline parallelism across nodes, data parallelism with what is left. Their takeaways
give the order: TP up to the 8 GPUs of a server before pipelining (1), and a model-parallel size no larger than
the parameters and activations need (2). So the search takes the smallest PP at which some TP fits, and there the
smallest TP that fits, first among TP <= 8 and only then among the wider TP sizes a node allows (Trainium nodes
have 32 or 64 workers; Neuron's own NeMo run of GPT-NeoX 20B also stays at TP 8 and pipelines, TP 8 x PP 4). On
p5 (8 x 80 GB) this reproduces the table: 1.7B TP 1, 3.6B TP 2, 7.5B TP 4, 18.4B TP 8, 39.1B..310.1B TP 8 x PP
2, 4, 8, 16. A mesh must also leave room for the global batch: one micro-batch per stage for every data-parallel
replica (at hundreds of Trainium nodes this, not memory, is what widens TP).

When even the widest TP leaves too many replicas for the global batch (TP is capped by the heads and the node) and
only the batch, not memory, rules every mesh out, choose_sizes_for_batch plans with fewer workers per node instead of
refusing, unless the user set the count: the recipe's batch is part of its training recipe, so the plan keeps it and
reports the idle workers and the batch that would occupy them.

This search finds the memory rule's layout, the first that fits; plan/layout_choice.py then predicts the step time
of every layout that fits (fit_mesh) and, with parallel.choose_layout=fastest (the default), takes the fastest.

A candidate mesh must divide the world, split the layers evenly into its stages (plan/stages.py), split the global
batch into micro-batches (at least one per stage, a multiple of the stages when interleaved) and fit in memory.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from megatron_hpc.config.platforms import Platform
from megatron_hpc.config.schema import ModelConfig, RunConfig
from megatron_hpc.errors import PlanError
from megatron_hpc.plan.batch import num_micro_batches
from megatron_hpc.plan.fixes import Fix, FixablePlanError, nearest, one_of, set_fix, sizes_choice, values_of
from megatron_hpc.plan.memory import MemoryEstimate, PipelineShape, estimate_memory, xla_fp32_master
from megatron_hpc.plan.mesh import Mesh
from megatron_hpc.plan.recompute import FULL_UNIFORM_1, resolve_recompute
from megatron_hpc.plan.stages import split_layers
from megatron_hpc.plan.vocab import padded_vocab_size

USABLE_MEMORY_FRACTION = 0.9
"""Share of a worker's device memory a plan may fill. The rest is for what the estimate leaves out: the runtime
(CUDA context and NCCL buffers, the Neuron runtime's scratchpad), the caching allocator's fragmentation and the
small tensors of plan/memory.py's simplifications. A planning margin, not a measured figure."""

TP_BEFORE_PIPELINING = 8
"""The widest TP the planner tries before pipelining (Narayanan et al. 2021, takeaway 1: TP up to the 8 GPUs of
a server, then PP across servers); wider TP inside a node is the fallback when nothing fits below it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Sizes:
    """One mesh that works for the recipe, with what the plan reports about it."""

    mesh: Mesh
    num_micro_batches: int
    stage_layers: tuple[range, ...]
    """Global layer indices of each virtual stage, in stage order."""
    padded_vocab: int
    memory: MemoryEstimate
    global_batch_for_all_workers: int | None = None
    """Set when the mesh takes fewer workers per node than asked because the global batch cannot occupy them all:
    the smallest global batch at which a mesh uses every worker."""


def usable_gib(platform: Platform) -> float:
    return platform.memory_per_worker_gib * USABLE_MEMORY_FRACTION


def memory_for(cfg: RunConfig, platform: Platform, *, tp: int, pp: int, micro_batches: int, data_parallel: int,
               recompute: bool | None = None, distributed_optimizer: bool | None = None) -> MemoryEstimate:
    """The heaviest pipeline rank's estimate at TP tp x PP pp x DP data_parallel (the layers must split: see
    stage_ranges). `recompute` and `distributed_optimizer` true try that setting instead of the recipe's."""
    model = cfg.model if not recompute else full_recompute(cfg.model)
    sharded = distributed_optimizer or (distributed_optimizer is None and cfg.parallel.distributed_optimizer)
    shape = PipelineShape(stage_layers=tuple(len(s) for s in stage_ranges(cfg, pp=pp)), pipeline=pp,
                          virtual=cfg.parallel.virtual_pipeline, schedule=cfg.parallel.pipeline_schedule,
                          num_micro_batches=micro_batches)
    return estimate_memory(model, padded_vocab=_vocab(cfg, tp), tensor_parallel=tp,
                           micro_batch=cfg.train.micro_batch_size, precision=cfg.train.precision,
                           backend=platform.backend, pipeline=shape,
                           sequence_parallel=cfg.parallel.sequence_parallel and tp > 1,
                           optimizer_shards=data_parallel if sharded else 1,
                           fp32_master=xla_fp32_master(backend=platform.backend, distributed_optimizer=sharded))


def full_recompute(model: ModelConfig) -> ModelConfig:
    """`model` with every layer checkpointed on its own (full / uniform / 1), the leanest setting we suggest."""
    return dataclasses.replace(model, recompute=False, recompute_granularity="full", recompute_method="uniform",
                               recompute_num_layers=1)


def recompute_fix(model: ModelConfig) -> Fix | None:
    """The --set that turns on full / uniform / 1 recomputation, or None when it is on already."""
    if resolve_recompute(model) == FULL_UNIFORM_1:
        return None
    if model.recompute_granularity is None and model.recompute_method is None and model.recompute_num_layers is None:
        return set_fix("model.recompute", True)
    return Fix(sets=(("model.recompute_granularity", "full"), ("model.recompute_method", "uniform"),
                     ("model.recompute_num_layers", 1)))


def stage_ranges(cfg: RunConfig, *, pp: int) -> tuple[range, ...]:
    """Layers of each virtual stage at PP pp (plan/stages.py); PlanError with the fix when they do not split."""
    par = cfg.parallel
    key = (cfg.model.num_layers, pp, par.virtual_pipeline, par.pipeline_first_stage_layers,
           par.pipeline_last_stage_layers)
    split = split_or_none(*key)
    if split is None:  # split_layers refuses again, with the fix
        return tuple(split_layers(key[0], pipeline=pp, virtual=key[2], first_stage_layers=key[3],
                                  last_stage_layers=key[4]))
    return split


@functools.lru_cache(maxsize=4096)
def split_or_none(num_layers: int, pp: int, virtual: int, first: int, last: int) -> tuple[range, ...] | None:
    """split_layers kept per argument set, None where it refuses: the searches ask for the same split at every
    TP and node count, and mostly for PP sizes that do not split (whose refusal is costly to build)."""
    try:
        return tuple(split_layers(num_layers, pipeline=pp, virtual=virtual, first_stage_layers=first,
                                  last_stage_layers=last))
    except PlanError:
        return None


def _vocab(cfg: RunConfig, tp: int) -> int:
    return padded_vocab_size(cfg.model.vocab_size, divisible_by=cfg.model.make_vocab_size_divisible_by,
                             tensor_parallel=tp)


def fit_mesh(cfg: RunConfig, platform: Platform, *, num_nodes: int, per_node: int, tp: int,
         pp: int) -> Sizes | MemoryEstimate:
    """The mesh if it works, its memory estimate if only memory is short; PlanError for anything else."""
    world = num_nodes * per_node
    if world % (tp * pp):
        raise _indivisible(cfg, platform, num_nodes=num_nodes, per_node=per_node, tp=tp, pp=pp)
    stages = stage_ranges(cfg, pp=pp)
    mesh = Mesh(num_nodes=num_nodes, workers_per_node=per_node, tensor_parallel=tp, pipeline_parallel=pp)
    micro = num_micro_batches(global_batch=cfg.train.global_batch_size, micro_batch=cfg.train.micro_batch_size,
                              data_parallel=mesh.data_parallel)
    check_micro_batches(cfg, pp=pp, micro_batches=micro, data_parallel=mesh.data_parallel)
    estimate = memory_for(cfg, platform, tp=tp, pp=pp, micro_batches=micro, data_parallel=mesh.data_parallel)
    if estimate.total_gib > usable_gib(platform):
        return estimate
    return Sizes(mesh=mesh, num_micro_batches=micro, stage_layers=stages, padded_vocab=_vocab(cfg, tp),
                 memory=estimate)


NEAREST_TRIED = 4
"""Candidates tried on each side of a batch size or node count: the nearest one can fail another check (memory, a
micro-batch per stage) where the next one plans."""


def _indivisible(cfg: RunConfig, platform: Platform, *, num_nodes: int, per_node: int, tp: int,
                 pp: int) -> FixablePlanError:
    """TP x PP does not divide the world: node counts where it does, or the PP sizes that divide it at this TP."""
    world = num_nodes * per_node
    step = tp * pp // math.gcd(tp * pp, per_node)

    def wording(kept: list[Fix]) -> str:
        options = []
        nodes = nearest([f.nodes for f in kept if f.nodes is not None], num_nodes)
        if nodes:
            plans = " or ".join(f"--nodes {n}" for n in nodes)
            options.append(f"--nodes a multiple of {step} ({plans} plan{'s' if len(nodes) == 1 else ''})")
        pipeline = sizes_choice("parallel.pipeline", kept)
        options += [pipeline] if pipeline else []
        use = f"; use {', or '.join(options)}" if options else ""
        return (f"TP {tp} x PP {pp} = {tp * pp} does not divide the {world} workers of {num_nodes} x {platform.name} "
                f"({per_node} per node), so DP would not be an integer{use}")

    def candidates() -> list[Fix]:
        counts = [n for n in range(step, (num_nodes // step + NEAREST_TRIED + 1) * step, step) if n != num_nodes]
        counts = [n for n in counts if n < num_nodes][-NEAREST_TRIED:] + [n for n in counts if n > num_nodes]
        pipelines = [*pipeline_candidates(cfg, world=world, tp=tp), 0]
        return [*(Fix(nodes=n) for n in counts), *(set_fix("parallel.pipeline", p) for p in pipelines)]

    return FixablePlanError(wording, candidates)


def check_micro_batches(cfg: RunConfig, *, pp: int, micro_batches: int, data_parallel: int) -> None:
    """PlanError unless the pipeline has a micro-batch per stage (and interleaving a multiple of the stages)."""
    if pp == 1:
        return
    per_micro = cfg.train.micro_batch_size * data_parallel
    batch = cfg.train.global_batch_size
    if micro_batches < pp:

        def too_few(kept: list[Fix]) -> str:
            batches = values_of(kept, "train.global_batch_size")
            options = [f"--set train.global_batch_size={batches[0]} (or a larger multiple of {per_micro})"] \
                if batches else []
            pipelines = values_of(kept, "parallel.pipeline")
            options += [one_of("parallel.pipeline", sorted(pipelines))] if pipelines else []
            # A recipe's pinned sizes (gpt3_175b's TP 8 x PP 16 at 512 trn1 nodes) may plan as another mesh.
            options += [_fix_text(f) for f in kept if f.sets == FREE_SIZES.sets]
            use = f"; use {', or '.join(options)}" if options else ""
            return (f"train.global_batch_size={batch} gives {micro_batches} micro-batch(es) per step (micro "
                    f"{cfg.train.micro_batch_size} x DP {data_parallel}), fewer than the {pp} pipeline stages, and "
                    f"the pipeline needs at least one per stage{use}")

        def candidates() -> list[Fix]:
            smaller = [p for p in range(1, pp) if (data_parallel * pp) % p == 0 and _splits(cfg, p)]
            free = _free_choice(cfg)
            return [*(set_fix("train.global_batch_size", per_micro * k) for k in range(pp, pp + NEAREST_TRIED)),
                    *(set_fix("parallel.pipeline", p) for p in reversed(smaller)), *([free] if free else [])]

        raise FixablePlanError(too_few, candidates)
    if cfg.parallel.virtual_pipeline > 1 and micro_batches % pp:
        up = -(-micro_batches // pp) * pp

        def interleaved(kept: list[Fix]) -> str:
            options = [f"--set train.global_batch_size={b}" for b in values_of(kept, "train.global_batch_size")[:1]]
            options += ["--set parallel.virtual_pipeline=1"] if values_of(kept, "parallel.virtual_pipeline") else []
            use = f"; use {', or '.join(options)}" if options else ""
            return (f"parallel.virtual_pipeline={cfg.parallel.virtual_pipeline}: the interleaved schedule needs the "
                    f"micro-batches per step ({micro_batches}) to be a multiple of parallel.pipeline={pp} "
                    f"(Megatron's rule, and torch's ScheduleInterleaved1F1B's){use}")

        raise FixablePlanError(interleaved, [*(set_fix("train.global_batch_size", per_micro * (up + pp * k))
                                          for k in range(NEAREST_TRIED)),
                                        set_fix("parallel.virtual_pipeline", 1)])


def tensor_candidates(cfg: RunConfig, platform: Platform, *, per_node: int) -> list[int]:
    """TP sizes that divide workers per node, heads, key/value groups and FFN size and that the runtime supports,
    ascending. With grouped-query attention the groups bound TP: each rank holds whole groups (plan/checks.py)."""
    choices = platform.tp_choices or tuple(range(1, per_node + 1))
    model = cfg.model
    return [t for t in choices if per_node % t == 0 and model.num_attention_heads % t == 0
            and model.query_groups % t == 0 and model.ffn_size % t == 0]


def auto_tensor_candidates(cfg: RunConfig, platform: Platform, *, per_node: int) -> list[int]:
    """The TP sizes the planner may choose itself: tensor_candidates, from 2 with sequence parallelism (which needs
    TP, and a sequence length the TP size divides)."""
    sp = cfg.parallel.sequence_parallel
    return [t for t in tensor_candidates(cfg, platform, per_node=per_node)
            if not sp or (t > 1 and cfg.model.seq_length % t == 0)]


def pipeline_candidates(cfg: RunConfig, *, world: int, tp: int) -> list[int]:
    """PP sizes that leave an integer DP at TP tp and split the layers evenly, ascending."""
    slots = world // tp
    return [p for p in range(1, min(slots, cfg.model.num_layers) + 1) if slots % p == 0 and _splits(cfg, p)]


def _splits(cfg: RunConfig, pp: int) -> bool:
    par = cfg.parallel
    return split_or_none(cfg.model.num_layers, pp, par.virtual_pipeline, par.pipeline_first_stage_layers,
                          par.pipeline_last_stage_layers) is not None


def check_mesh(cfg: RunConfig, platform: Platform, *, num_nodes: int, per_node: int, tp: int, pp: int) -> Sizes:
    """The recipe's own TP x PP, checked in the order a user fixes it: PlanError with the fix at the first problem."""
    result = fit_mesh(cfg, platform, num_nodes=num_nodes, per_node=per_node, tp=tp, pp=pp)
    if isinstance(result, MemoryEstimate):
        raise memory_advice(cfg, platform, num_nodes=num_nodes, per_node=per_node, tp=tp, pp=pp, need=result)
    return result


def choose_sizes(cfg: RunConfig, platform: Platform, *, num_nodes: int, per_node: int) -> Sizes:
    """The recipe's TP x PP checked, or with 0 for either, the first that works in the module's search order."""
    tp_fixed, pp_fixed = cfg.parallel.tensor, cfg.parallel.pipeline
    if tp_fixed and pp_fixed:
        return check_mesh(cfg, platform, num_nodes=num_nodes, per_node=per_node, tp=tp_fixed, pp=pp_fixed)
    world = num_nodes * per_node
    tps = [tp_fixed] if tp_fixed else auto_tensor_candidates(cfg, platform, per_node=per_node)
    if not tps and cfg.parallel.sequence_parallel:
        raise _no_tensor_size_for_sequence_parallel(cfg, platform, per_node=per_node)
    if pp_fixed:  # the recipe's PP must split the layers and the world before TP is searched
        stage_ranges(cfg, pp=pp_fixed)
        if all(world % (t * pp_fixed) for t in tps):
            fit_mesh(cfg, platform, num_nodes=num_nodes, per_node=per_node, tp=tps[0], pp=pp_fixed)  # raises
    leanest: tuple[int, int, MemoryEstimate] | None = None
    too_many_replicas = False
    for tier in ([t for t in tps if t <= TP_BEFORE_PIPELINING], [t for t in tps if t > TP_BEFORE_PIPELINING]):
        pps = sorted({p for t in tier for p in ([pp_fixed] if pp_fixed else pipeline_candidates(cfg, world=world,
                                                                                                  tp=t))})
        for pp in pps:
            for tp in tier:
                if world % (tp * pp):
                    continue
                per_micro = cfg.train.micro_batch_size * world // (tp * pp)
                if per_micro * pp > cfg.train.global_batch_size:
                    too_many_replicas = True  # not even one micro-batch per stage: more model parallelism
                    continue
                estimate = memory_for(cfg, platform, tp=tp, pp=pp, data_parallel=world // (tp * pp),
                                      micro_batches=cfg.train.global_batch_size // per_micro)
                if estimate.total_gib <= usable_gib(platform):
                    # The first mesh with room for the batch and the model; a batch that does not divide into its
                    # micro-batches is the recipe's to fix (check_mesh says how), not a reason to pipeline more.
                    return check_mesh(cfg, platform, num_nodes=num_nodes, per_node=per_node, tp=tp, pp=pp)
                if leanest is None or estimate.total_gib < leanest[2].total_gib:
                    leanest = (tp, pp, estimate)
    raise _nothing_fits(cfg, platform, num_nodes=num_nodes, per_node=per_node, leanest=leanest,
                        too_many_replicas=too_many_replicas)


def choose_sizes_for_batch(cfg: RunConfig, platform: Platform, *, num_nodes: int, per_node: int,
                           may_idle: bool) -> Sizes:
    """choose_sizes; where only the global batch rules out every mesh and may_idle, the largest divisor of per_node
    at which a mesh fits (same search order, so the table's TP and PP stay preferred), leaving the rest idle."""
    try:
        return choose_sizes(cfg, platform, num_nodes=num_nodes, per_node=per_node)
    except PlanError as exc:
        refusal = exc
    full_batch = batch_too_small(cfg, platform, num_nodes=num_nodes, per_node=per_node) if may_idle else None
    if full_batch is None:
        raise refusal
    for fewer in sorted((d for d in range(1, per_node) if per_node % d == 0), reverse=True):
        if cfg.parallel.tensor and fewer % cfg.parallel.tensor:
            continue  # a pinned TP must stay inside a node
        if not tensor_candidates(cfg, platform, per_node=fewer):
            continue
        try:
            sizes = choose_sizes(cfg, platform, num_nodes=num_nodes, per_node=fewer)
        except PlanError:
            continue
        return dataclasses.replace(sizes, global_batch_for_all_workers=full_batch)
    raise refusal


def batch_too_small(cfg: RunConfig, platform: Platform, *, num_nodes: int, per_node: int) -> int | None:
    """The smallest global batch that lets a mesh use every worker, when the recipe's batch leaves no mesh room for
    a micro-batch per stage in every replica; None when some mesh has that room, or memory rules out every mesh."""
    world, micro = num_nodes * per_node, cfg.train.micro_batch_size
    tps = [cfg.parallel.tensor] if cfg.parallel.tensor else auto_tensor_candidates(cfg, platform, per_node=per_node)
    # DP x PP = world / TP at any PP, and each (replica, stage) pair needs a micro-batch: only TP makes room.
    if any(micro * world <= cfg.train.global_batch_size * tp for tp in tps):
        return None
    return smallest_global_batch(cfg, platform, num_nodes=num_nodes, per_node=per_node)


def _no_tensor_size_for_sequence_parallel(cfg: RunConfig, platform: Platform, *, per_node: int) -> FixablePlanError:
    # Without this the search finds no mesh and blames the global batch (an MQA model, whose one key/value group
    # TP cannot split, after a Llama recipe that turns sequence parallelism on).
    m = cfg.model
    allowed = ", ".join(map(str, tensor_candidates(cfg, platform, per_node=per_node)))
    what = (f"no TP size works for {cfg.name} on {platform.name}: parallel.sequence_parallel needs TP above 1 that "
            f"divides model.seq_length={m.seq_length}, but TP must divide the {per_node} workers per node, the "
            f"{m.num_attention_heads} attention heads, the {m.query_groups} key/value groups "
            f"(model.num_query_groups) and model.ffn_hidden_size={m.ffn_size}, which allow TP in {{{allowed}}}")
    off = set_fix("parallel.sequence_parallel", False)
    return FixablePlanError(lambda kept: what + ("; use --set parallel.sequence_parallel=false" if off in kept else ""),
                            [off], toward=None)


def _nothing_fits(cfg: RunConfig, platform: Platform, *, num_nodes: int, per_node: int,
                  leanest: tuple[int, int, MemoryEstimate] | None, too_many_replicas: bool) -> FixablePlanError:
    sizes = (f"parallel.tensor={cfg.parallel.tensor or 'any'}, parallel.pipeline={cfg.parallel.pipeline or 'any'}")
    what = f"no TP x PP works for {cfg.name} on {num_nodes} x {platform.name} ({sizes})"
    if too_many_replicas:
        batch = smallest_global_batch(cfg, platform, num_nodes=num_nodes, per_node=per_node)
        if batch is not None:
            def too_small(kept: list[Fix]) -> str:
                fix = "".join(f"--set train.global_batch_size={b}, or " for b in values_of(kept,
                                                                                          "train.global_batch_size"))
                return (f"{what}: train.global_batch_size={cfg.train.global_batch_size} is too small for "
                        f"{num_nodes * per_node} workers: every data-parallel replica needs a micro-batch of "
                        f"{cfg.train.micro_batch_size} per pipeline stage, and no mesh that fits in memory has so few "
                        f"replicas; use {fix}fewer nodes")

            return FixablePlanError(too_small, [set_fix("train.global_batch_size", batch)], toward="fewer")
    if leanest is None:
        return FixablePlanError(lambda _: f"{what}: the global batch is too small for every mesh; use fewer nodes or a "
                                     "larger global batch", toward="fewer", name_nodes=True)
    tp, pp, need = leanest
    candidates = [fix for fix in (_free_choice(cfg), None if cfg.parallel.distributed_optimizer else
                                  set_fix("parallel.distributed_optimizer", True), recompute_fix(cfg.model)) if fix]

    def wording(kept: list[Fix]) -> str:
        fixes = [_fix_text(f) for f in kept] + ["a platform with more memory per worker, or a smaller model"]
        return (f"{what}: the leanest, TP {tp} x PP {pp}, needs about {need.total_gib:.1f} GiB per worker but a "
                f"{platform.name} worker has {platform.memory_per_worker_gib:g} GiB ({usable_gib(platform):.1f} for "
                f"the plan); use {' or '.join(fixes)}")

    return FixablePlanError(wording, candidates, name_nodes=True)


FREE_SIZES = Fix(sets=(("parallel.tensor", 0), ("parallel.pipeline", 0)))
"""Let the planner choose both sizes."""


def _free_choice(cfg: RunConfig) -> Fix | None:
    """The --set that lets the planner choose both sizes, when the recipe pins one."""
    return FREE_SIZES if cfg.parallel.tensor or cfg.parallel.pipeline else None


def _fix_text(fix: Fix) -> str:
    """A fix as the refusal names it; the free choice says what the planner picks once it has planned."""
    if fix.sets == FREE_SIZES.sets:
        return f"{fix.text()} (the planner then picks {fix.planned or 'its own'})"
    return fix.text()


def smallest_global_batch(cfg: RunConfig, platform: Platform, *, num_nodes: int, per_node: int) -> int | None:
    """The smallest global batch >= the recipe's at which some mesh fits; None when memory rules out every mesh."""
    world, micro = num_nodes * per_node, cfg.train.micro_batch_size
    best = None
    tps = [cfg.parallel.tensor] if cfg.parallel.tensor else auto_tensor_candidates(cfg, platform, per_node=per_node)
    for tp in tps:
        pps = [cfg.parallel.pipeline] if cfg.parallel.pipeline else pipeline_candidates(cfg, world=world, tp=tp)
        for pp in pps:
            if world % (tp * pp) or not _splits(cfg, pp):
                continue
            per_step = micro * world // (tp * pp)  # samples of one micro-batch over all DP replicas
            steps = max(pp, -(-cfg.train.global_batch_size // per_step))
            if cfg.parallel.virtual_pipeline > 1:
                steps = -(-steps // pp) * pp
            if best is not None and steps * per_step >= best:
                continue
            if memory_for(cfg, platform, tp=tp, pp=pp, micro_batches=steps,
                          data_parallel=world // (tp * pp)).total_gib <= usable_gib(platform):
                best = steps * per_step
    return best


def memory_advice(cfg: RunConfig, platform: Platform, *, num_nodes: int, per_node: int, tp: int, pp: int,
                  need: MemoryEstimate) -> FixablePlanError:
    """Why the recipe's TP tp x PP pp does not fit in memory, and the changes that make it fit."""
    head = (f"{cfg.name} needs about {need.total_gib:.1f} GiB per worker at parallel.tensor={tp} x "
            f"parallel.pipeline={pp} (weights, grads, Adam states and activations of pipeline rank {need.pp_rank}), "
            f"but a {platform.name} worker has {platform.memory_per_worker_gib:g} GiB "
            f"({usable_gib(platform):.1f} for the plan); ")
    world = num_nodes * per_node
    dp = world // (tp * pp)
    micro = cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp)

    def candidates() -> list[Fix]:
        """The estimate rules out most candidates cheaply; make_plan then plans the ones left."""
        found = []
        if (not cfg.parallel.distributed_optimizer and dp > 1
                and memory_for(cfg, platform, tp=tp, pp=pp, micro_batches=micro, data_parallel=dp,
                               distributed_optimizer=True).total_gib <= usable_gib(platform)):
            found.append(set_fix("parallel.distributed_optimizer", True))
        fix = recompute_fix(cfg.model)
        if fix and memory_for(cfg, platform, tp=tp, pp=pp, micro_batches=micro, data_parallel=dp,
                              recompute=True).total_gib <= usable_gib(platform):
            found.append(fix)
        for wider in tensor_candidates(cfg, platform, per_node=per_node):
            if wider > tp and world % (wider * pp) == 0:
                wider_micro = cfg.train.global_batch_size // (cfg.train.micro_batch_size * world // (wider * pp))
                if memory_for(cfg, platform, tp=wider, pp=pp, micro_batches=max(1, wider_micro),
                              data_parallel=world // (wider * pp)).total_gib <= usable_gib(platform):
                    found.append(set_fix("parallel.tensor", wider))
        free = _free_choice(cfg)
        return found + ([free] if free else [])

    def wording(kept: list[Fix]) -> str:
        tensor = values_of(kept, "parallel.tensor")
        # one wider TP is enough to name: the narrowest that plans
        options = [_fix_text(f) for f in kept if not values_of([f], "parallel.tensor") or f.sets[0][1] == tensor[0]]
        if options:
            return head + "use " + " or ".join(options)
        return head + (f"it does not fit at any TP x PP that {num_nodes} x {platform.name} allows; use a platform "
                       "with more memory per worker, or a smaller model")

    return FixablePlanError(wording, candidates, name_nodes=True)

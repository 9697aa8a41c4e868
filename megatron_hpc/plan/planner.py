"""The run plan: mesh, pipeline stages, batch math, padded vocabulary, LR schedule, memory and throughput figures.
Pure.

`make_plan` takes a RunConfig, a node count and a Platform and returns a frozen Plan, or raises
ConfigError/PlanError with a one-line fix. Nothing here reads the environment, the clock or files. TP x PP x DP
come from plan/sizing.py (the recipe's sizes, or the planner's choice where they are 0): the trainer reads them
from the plan, never from config.parallel.

The plan is the trainer's only source of derived numbers: the run folder keeps it (plan.json) beside the
config it was made from (config.json, whose digest the plan records), and the trainer reads both as one
RunSpec (plan/spec.py). Each derived value is computed here, once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, Literal

from megatron_hpc.config.hardware import BUILTIN_HARDWARE, Hardware
from megatron_hpc.config.platforms import Platform, get_platform
from megatron_hpc.config.schema import DataConfig, RunConfig
from megatron_hpc.errors import ConfigError, MegatronHpcError, PlanError
from megatron_hpc.plan.batch import BatchLayout
from megatron_hpc.plan.calibration import DEFAULT_CALIBRATION, Calibration
from megatron_hpc.plan.checks import (
    PIPELINE_SCHEDULES,
    check_distributed_optimizer,
    check_model_shape,
    check_overlap_param_gather,
    check_sequence_parallel,
    check_values,
)
from megatron_hpc.plan.fixes import Fix, FixableError, FixablePlanError, set_fix, sizes_choice, values_of
from megatron_hpc.plan.layout_choice import choose_layout, with_choice
from megatron_hpc.plan.lr_schedule import LrSchedule, resolve_schedule
from megatron_hpc.plan.memory import GIB, heaviest_rank, rank_terms, xla_fp32_master
from megatron_hpc.plan.mesh import Mesh
from megatron_hpc.plan.model_math import (
    FLOPS_FORMULA,
    flops_per_token,
    flops_per_token_6n,
    num_parameters,
)
from megatron_hpc.plan.recompute import check_recompute_stages, resolve_recompute
from megatron_hpc.plan.sizing import choose_sizes_for_batch, split_or_none, tensor_candidates
from megatron_hpc.plan.stages import bubble_fraction

DataSource = Literal["indexed", "synthetic", "missing"]
CHECKPOINT_BYTES_PER_PARAMETER = 12
"""fp32 weights and Adam's two fp32 moments (what model.state_dict() and optimizer.state_dict() hold)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    recipe: str
    platform: str
    backend: str
    num_nodes: int
    workers_per_node: int
    """Workers (torchrun processes) on each node: the platform's, the user's launch.workers_per_node, or fewer when
    the global batch cannot occupy every worker (idle_workers_per_node)."""
    idle_workers_per_node: int
    """Workers of each node the planner left idle because the global batch cannot occupy them all (0 when none)."""
    global_batch_for_all_workers: int | None
    """With idle workers: the smallest global batch at which a mesh uses every worker of the nodes; else None."""
    world_size: int
    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    micro_batch_size: int
    global_batch_size: int
    num_micro_batches: int
    virtual_pipeline: int
    """Model chunks per pipeline rank; above 1 the 1F1B schedule is interleaved."""
    pipeline_schedule: Literal["1f1b", "afab"]
    distributed_optimizer: bool
    """Adam's moments sharded over the DP ranks (parallel.distributed_optimizer, ZeRO-1)."""
    fp32_master: bool
    """fp32 master weights kept beside the model's, sharded over DP (plan/memory.py `xla_fp32_master`: the
    distributed optimizer on XLA, torch_xla's ZeRO-1). The trainer reads it from here: it picks the optimizer, the
    model weights' dtype (bf16 under train.precision=bf16), the XLA precision variables and the banner."""
    stage_layers: list[list[int]]
    """[start, stop) of the transformer layers of each virtual stage, in stage order (pipeline_parallel x
    virtual_pipeline entries); virtual stage k runs on pipeline rank k % pipeline_parallel (plan/stages.py)."""
    bubble_fraction: float
    """Idle share of a step in the pipeline flush: (p - 1) / (m + p - 1), divided by virtual_pipeline."""
    seq_length: int
    tokens_per_step: int
    padded_vocab_size: int
    num_parameters: int
    memory_per_worker_gib: float
    """Estimate for the pipeline rank that needs the most (plan/memory.py)."""
    memory_breakdown_gib: dict[str, float]
    """memory_per_worker_gib by kind: weights, grads, optimizer (Adam's moments), activations, logits."""
    memory_pp_rank: int
    """The pipeline rank the memory figures are for (the heaviest)."""
    recompute: str
    """The effective activation recomputation (plan/recompute.py): none, selective, full with its method."""
    memory_limit_gib: float
    flops_per_token: float
    flops_formula: str
    flops_per_token_6n: float
    data_source: DataSource
    """What the trainer reads: indexed (data.path), synthetic, or missing (refused by submit and the trainer)."""
    lr_schedule_unit: Literal["iterations", "samples"]
    lr_warmup: float
    """Warmup length in lr_schedule_unit."""
    lr_decay: int
    """Decay horizon in lr_schedule_unit; past it the LR is min_lr."""
    checkpoint_gib: float
    """Size of one checkpoint (weights and Adam moments, fp32) over all its files."""
    config_sha256: str
    """Digest of the resolved config this plan was made from (config_digest)."""
    hardware: str
    """The hardware figures the step time was predicted with: the platform's own, or a platform file's name (the
    platform field then names the runtime it runs as)."""
    calibration: str
    """Which calibration of the step-time model (plan/calibration.py) the prediction used."""
    predicted_step_time_s: float
    """Predicted seconds of one training step (plan/steptime.py)."""
    predicted_tokens_per_s: float
    predicted_mfu: float
    """Model FLOPs per second (flops_per_token, no recomputation) over the world's dense peak, predicted."""
    peak_tflops_per_worker: float
    """Dense peak TFLOP/s of one worker of the hardware planned for (a platform file's, not the runtime's) at
    train.precision: the denominator of predicted_mfu and of the MFU the trainer logs, so the two compare."""
    step_time_breakdown_s: dict[str, float]
    """predicted_step_time_s by term: compute, recompute, tp_comm, pp_comm, pipeline_bubble, dp_comm, optimizer."""
    layout_choice: str
    """Why the planner chose this TP x PP (plan/layout_choice.py)."""
    layout_alternatives: list[dict[str, Any]]
    """The next best layouts that fit, fastest first, with their predicted step time and what limits each."""

    @property
    def mesh(self) -> Mesh:
        return Mesh(num_nodes=self.num_nodes, workers_per_node=self.workers_per_node,
                    tensor_parallel=self.tensor_parallel, pipeline_parallel=self.pipeline_parallel)

    @property
    def stage_ranges(self) -> list[range]:
        """stage_layers as ranges: the layers of each virtual stage, in stage order."""
        return [range(start, stop) for start, stop in self.stage_layers]

    @property
    def batch(self) -> BatchLayout:
        return BatchLayout(micro_batch_size=self.micro_batch_size, global_batch_size=self.global_batch_size,
                           num_micro_batches=self.num_micro_batches, data_parallel=self.data_parallel)

    @property
    def lr_schedule(self) -> LrSchedule:
        per_step = self.global_batch_size if self.lr_schedule_unit == "samples" else 1
        return LrSchedule(per_step=per_step, warmup=self.lr_warmup, decay=self.lr_decay)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any], *, source: str = "plan.json") -> Plan:
        """The plan a run folder holds, checked field by field and for consistency."""
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in data]
        unknown = [k for k in data if k not in names]
        if missing or unknown:
            what = "; ".join(part for part in (f"missing {', '.join(missing)}" if missing else "",
                                               f"unknown {', '.join(unknown)}" if unknown else "") if part)
            raise PlanError(f"{source} does not fit this megatron-hpc ({what}); it was written by another version: "
                            "re-plan the run with `megatron-hpc submit --resume RUN`")
        plan = cls(**{n: data[n] for n in names})
        check_plan(plan, source=source)
        return plan


def check_plan(plan: Plan, *, source: str = "the plan") -> None:
    """PlanError when a plan's numbers contradict each other (a plan.json edited by hand)."""
    problems = []
    if plan.world_size != plan.num_nodes * plan.workers_per_node:
        problems.append(f"world_size {plan.world_size} != num_nodes {plan.num_nodes} x workers_per_node "
                        f"{plan.workers_per_node}")
    if plan.tensor_parallel * plan.pipeline_parallel * plan.data_parallel != plan.world_size:
        problems.append(f"tensor_parallel {plan.tensor_parallel} x pipeline_parallel {plan.pipeline_parallel} x "
                        f"data_parallel {plan.data_parallel} != world_size {plan.world_size}")
    if plan.micro_batch_size * plan.data_parallel * plan.num_micro_batches != plan.global_batch_size:
        problems.append(f"micro_batch_size {plan.micro_batch_size} x data_parallel {plan.data_parallel} x "
                        f"num_micro_batches {plan.num_micro_batches} != global_batch_size {plan.global_batch_size}")
    problems += _pipeline_problems(plan)
    if not plan.peak_tflops_per_worker > 0:
        problems.append(f"peak_tflops_per_worker {plan.peak_tflops_per_worker} is not a positive figure")
    if plan.fp32_master != xla_fp32_master(backend=plan.backend, distributed_optimizer=plan.distributed_optimizer):
        problems.append(f"fp32_master {plan.fp32_master} is not that of backend {plan.backend} with "
                        f"distributed_optimizer {plan.distributed_optimizer}")
    problems += _idle_problems(plan)
    if plan.padded_vocab_size % plan.tensor_parallel:
        problems.append(f"padded_vocab_size {plan.padded_vocab_size} is not divisible by tensor_parallel "
                        f"{plan.tensor_parallel}")
    if problems:
        raise PlanError(f"{source} is inconsistent: {'; '.join(problems)}; re-plan the run with "
                        "`megatron-hpc submit --resume RUN` (or submit the recipe again)")


def _pipeline_problems(plan: Plan) -> list[str]:
    p, v, m = plan.pipeline_parallel, plan.virtual_pipeline, plan.num_micro_batches
    problems = []
    bounds = [b for stage in plan.stage_layers for b in stage]
    contiguous = all(len(s) == 2 and s[0] < s[1] for s in plan.stage_layers) and \
        bounds[1:-1:2] == bounds[2::2] and bounds[:1] == [0]
    if len(plan.stage_layers) != p * v or not contiguous:
        problems.append(f"stage_layers {plan.stage_layers} are not {p} x {v} contiguous, non-empty layer ranges "
                        "from 0")
    if plan.pipeline_schedule not in PIPELINE_SCHEDULES:
        problems.append(f"pipeline_schedule {plan.pipeline_schedule!r} is not one of {', '.join(PIPELINE_SCHEDULES)}")
    if p > 1 and (m < p or (v > 1 and m % p)):
        problems.append(f"num_micro_batches {m} does not suit pipeline_parallel {p} x virtual_pipeline {v}")
    if v > 1 and p == 1:
        problems.append(f"virtual_pipeline {v} needs pipeline_parallel > 1")
    if v < 1:
        problems.append(f"virtual_pipeline {v} must be at least 1")
    elif abs(plan.bubble_fraction - bubble_fraction(pipeline=p, micro_batches=m, virtual=v)) > 1e-9:
        problems.append(f"bubble_fraction {plan.bubble_fraction} is not that of PP {p}, {m} micro-batches, "
                        f"virtual {v}")
    return problems


def _idle_problems(plan: Plan) -> list[str]:
    idle, full_batch = plan.idle_workers_per_node, plan.global_batch_for_all_workers
    if idle < 0:
        return [f"idle_workers_per_node {idle} is negative"]
    if (idle > 0) != (full_batch is not None):
        return [f"idle_workers_per_node {idle} and global_batch_for_all_workers {full_batch} disagree (both or "
                "neither are set)"]
    if full_batch is not None and full_batch <= plan.global_batch_size:
        return [f"global_batch_for_all_workers {full_batch} is not above global_batch_size {plan.global_batch_size}"]
    return []


def distributed_optimizer_warning(plan: Plan) -> str | None:
    """The line `plan` and `submit` print when the distributed optimizer has nothing to shard over (DP 1)."""
    if not plan.distributed_optimizer or plan.data_parallel > 1:
        return None
    masters = (" On XLA it keeps fp32 master weights all the same (train/xla_zero.py): in bf16 that is 4 + 12/DP "
               "bytes a parameter against pure bf16's 8, less only from DP 4." if plan.backend == "xla" else "")
    return ("parallel.distributed_optimizer=true with DP 1 shards nothing: the one data-parallel rank keeps all of "
            "Adam's state, as without it (the run works, with no memory saved); it pays off from DP 2 (more nodes, "
            "or a smaller parallel.tensor / parallel.pipeline)." + masters)


def idle_workers_warning(plan: Plan) -> str | None:
    """The loud line `plan` and `submit` print when the planner left workers idle for the global batch; else None."""
    if not plan.idle_workers_per_node:
        return None
    full = plan.workers_per_node + plan.idle_workers_per_node
    return (f"the global batch {plan.global_batch_size} cannot occupy the {plan.num_nodes * full} workers of "
            f"{plan.num_nodes} x {plan.platform} (every data-parallel replica needs a micro-batch of "
            f"{plan.micro_batch_size} per pipeline stage, and no TP the model and a node allow is wide enough); "
            f"planned {plan.workers_per_node} of {full} workers per node: "
            f"{plan.num_nodes * plan.idle_workers_per_node} workers idle; use --set "
            f"train.global_batch_size={plan.global_batch_for_all_workers} to use them all")


def config_digest(config: dict[str, Any]) -> str:
    """sha256 of a resolved config's canonical JSON: ties a plan to the config it was made from."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def resolve_data_source(data: DataConfig, platform: Platform) -> DataSource:
    """indexed with a path; else synthetic when asked for (or on the cpu platform); else missing."""
    if data.source is not None:
        return data.source
    if data.path:
        return "indexed"
    return "synthetic" if platform.name == "cpu" else "missing"


def check_data_source(plan: Plan) -> None:
    """ConfigError when the plan has no training data (a real cluster must not train on made-up tokens by default)."""
    if plan.data_source == "missing":
        raise ConfigError(f"{plan.recipe} on {plan.platform} has no training data: set --set data.path=PREFIX (a "
                          "Megatron .bin/.idx prefix, or a blend \"0.3 prefixA 0.7 prefixB\"; `megatron-hpc data "
                          "preprocess` makes one), or train on synthetic tokens on purpose with --set "
                          "data.source=synthetic")


PIPELINE_ON_XLA = (
    "torch_xla 2.9's ProcessGroupXla has no coalesced batch_isend_irecv (each send or recv is its own "
    "collective_permute graph, run at once), so the send and receive that torch.distributed.pipelining's 1F1B posts "
    "together between neighbouring stages would run as collective_permutes in opposite orders on the two ranks and "
    "not pair up"
)
"""Why pipeline parallelism does not run on XLA in this release. Evidence, read 2026: torch_xla v2.9.0
torch_xla/distributed/xla_backend.py: ProcessGroupXla.send/recv run `xm.collective_permute(t, pairs=[[src, dst]])`
and `torch_xla.sync()` per tensor; there is no isend/irecv and no coalescing, so torch's batch_isend_irecv
(distributed_c10d.py) issues the ops one by one in list order. torch/distributed/pipelining/schedules.py fuses a
stage's forward send with its backward receive ("fwd_send_bwd_recv") and the next stage's backward send with its
forward receive, and leaves mixed batches to batch_isend_irecv "for deadlock avoidance": stage i would issue the
permute i -> i+1 first while stage i+1 issues i+1 -> i first."""


def check_pipeline_runtime(plan: Plan, *, cfg: RunConfig | None = None) -> None:
    """PlanError when the plan pipelines on a platform whose runtime cannot run a pipeline (XLA, for now).

    The planner sizes such a plan anyway (sizing needs no device, and `plan` says so in a warning); `submit` and
    the trainer call this before anything is queued or built. Given the config the plan was made from, the fixes
    it names are planned first (make_plan's rule); without it they are named untried.
    """
    if plan.pipeline_parallel == 1 or plan.backend != "xla":
        return
    what = (f"{plan.recipe} on {plan.platform} plans PP {plan.pipeline_parallel} (TP {plan.tensor_parallel} x PP "
            f"{plan.pipeline_parallel}), but pipeline parallelism does not run on XLA in this release: "
            f"{PIPELINE_ON_XLA}")
    no_pipeline, cuda = set_fix("parallel.pipeline", 1), Fix(platform="p5")

    def wording(kept: list[Fix]) -> str:
        then = "the planner then " + (f"picks {kept[0].planned}" if kept and kept[0].planned else
                                      "fits the model with TP alone, if it can")
        options = [f"{no_pipeline.text()} ({then})"] if no_pipeline in kept else []
        options += ["a CUDA platform (--platform p5)"] if cuda in kept else []
        return what + (f"; use {' or '.join(options)}" if options else "")

    refusal = FixablePlanError(wording, [no_pipeline, cuda], toward=None)  # more nodes never make a pipeline run
    if cfg is None:
        raise refusal
    raise _tried(refusal, cfg, num_nodes=plan.num_nodes, platform=get_platform(plan.platform))


def pipeline_runtime_warning(plan: Plan, *, cfg: RunConfig | None = None) -> str | None:
    """The one-line warning `plan` prints for a plan that check_pipeline_runtime would refuse; None otherwise."""
    try:
        check_pipeline_runtime(plan, cfg=cfg)
    except PlanError as exc:
        return f"{exc} (`plan` sizes it anyway; `submit` refuses it)"
    return None


def check_torchrun_world(plan: Plan, *, world_size: int, local_world_size: int) -> None:
    """PlanError when torchrun started another world than the plan's mesh (one check, one message)."""
    if (world_size, local_world_size) != (plan.world_size, plan.workers_per_node):
        raise PlanError(f"torchrun started {world_size} worker(s), {local_world_size} per node, but the plan "
                        f"({plan.recipe} on {plan.num_nodes} x {plan.platform}) has {plan.world_size}, "
                        f"{plan.workers_per_node} per node (TP {plan.tensor_parallel} x PP {plan.pipeline_parallel} "
                        f"x DP {plan.data_parallel}); start the job from its run folder's node.sh, or re-plan with "
                        f"--nodes/--platform matching the allocation")


def workers_per_node(cfg: RunConfig, platform: Platform) -> int:
    requested = cfg.launch.workers_per_node
    if requested is None:
        return platform.workers_per_node
    if requested < 1:
        raise PlanError(f"launch.workers_per_node={requested} must be at least 1")
    if not platform.workers_configurable and requested > platform.workers_per_node:
        # Fewer workers than devices is a slice of the node (debugging, a single-core XLA run); more is impossible.
        raise PlanError(
            f"launch.workers_per_node={requested}: a {platform.name} node has {platform.workers_per_node} devices, "
            f"one worker each; use at most {platform.workers_per_node}, or remove the setting"
        )
    return requested


def _check_tensor_parallel(cfg: RunConfig, platform: Platform, *, per_node: int) -> None:
    tp = cfg.parallel.tensor
    valid = tensor_candidates(cfg, platform, per_node=per_node)
    if tp == 0 or tp in valid:  # 0: the planner chooses among `valid`
        return
    reasons = []
    if per_node % tp:
        reasons.append(f"it must divide the {per_node} workers per node")
    if cfg.model.num_attention_heads % tp:
        reasons.append(f"it must divide the {cfg.model.num_attention_heads} attention heads")
    if cfg.model.query_groups % tp and cfg.model.query_groups != cfg.model.num_attention_heads:
        reasons.append(f"it must divide the {cfg.model.query_groups} key/value groups of model.num_query_groups: "
                       "each TP rank holds whole groups")
    if cfg.model.ffn_size % tp:
        reasons.append(f"it must divide the FFN size {cfg.model.ffn_size}")
    if platform.tp_choices and tp not in platform.tp_choices:
        reasons.append(f"the {platform.name} runtime supports TP {', '.join(map(str, platform.tp_choices))}")
    what = f"parallel.tensor={tp} is invalid for {cfg.name} on {platform.name} ({'; '.join(reasons)})"
    rule = f"these rules allow parallel.tensor=N with N in {{{', '.join(map(str, valid))}}}, of which " if valid else ""

    # Where the node's worker count is a choice (the cpu platform: processes, not devices), the TP asked for can
    # keep its size with as many workers per node: what a checkpoint imported at TP N needs to fine-tune on CPU.
    more_workers = (set_fix("launch.workers_per_node", math.lcm(per_node, tp))
                    if per_node % tp and platform.workers_configurable else None)

    def wording(kept: list[Fix]) -> str:
        sizes = sizes_choice("parallel.tensor", kept)
        workers = f"{more_workers.text()} (keeps TP {tp})" if more_workers in kept else None
        if not sizes:
            return f"{what}; use {workers}" if workers else what
        some = [v for v in values_of(kept, "parallel.tensor") if v] != valid  # the others fail another check
        return f"{what}; {rule + 'these plan: ' if some else ''}use {sizes}" + (f", or {workers}" if workers else "")

    raise FixablePlanError(wording, [*([more_workers] if more_workers else []),
                                     *(set_fix("parallel.tensor", t) for t in [*valid, 0])])


NODE_SEARCH_LIMIT = 1024
"""The most nodes a refusal with no working fix searches for a node count that plans the recipe."""
NODE_SEARCH_PLANS = 300
"""The most plans that search makes (a few milliseconds each): a recipe that fits nowhere is refused in about a
second, naming the node counts it tried."""


def hardware_of(platform: Platform) -> Hardware:
    """The hardware figures of a platform (a platform file's, or the built-in's of its name)."""
    if platform.hardware is not None:
        return platform.hardware
    if platform.name not in BUILTIN_HARDWARE:
        raise PlanError(f"platform {platform.name!r} states no hardware figures; describe it with --platform-file")
    return BUILTIN_HARDWARE[platform.name]


def make_plan(cfg: RunConfig, *, num_nodes: int, platform: Platform,
              calibration: Calibration = DEFAULT_CALIBRATION) -> Plan:
    """Check the recipe against the cluster and compute every derived value.

    A refusal names only the fixes that plan when fed back (plan/fixes.py): each candidate is planned here first;
    when none plans, the refusal says so and names the node count that plans the recipe."""
    try:
        return _make_plan(cfg, num_nodes=num_nodes, platform=platform, calibration=calibration)
    except FixableError as refusal:
        raise _tried(refusal, cfg, num_nodes=num_nodes, platform=platform) from None


def _planned(cfg: RunConfig, fix: Fix, *, num_nodes: int, platform: Platform) -> Fix | None:
    """`fix` with the mesh it plans, or None when the recipe with it is refused (by any check)."""
    try:
        plan = _make_plan(fix.apply(cfg), num_nodes=num_nodes if fix.nodes is None else fix.nodes,
                          platform=get_platform(fix.platform) if fix.platform else platform)
    except MegatronHpcError:
        return None
    return dataclasses.replace(fix, planned=f"TP {plan.tensor_parallel} x PP {plan.pipeline_parallel}")


def _tried(refusal: FixableError, cfg: RunConfig, *, num_nodes: int, platform: Platform) -> MegatronHpcError:
    """The refusal worded with the fixes that plan; with none, the node count that plans the recipe."""
    kept = [f for f in (_planned(cfg, fix, num_nodes=num_nodes, platform=platform) for fix in refusal.fixes) if f]
    if kept or refusal.toward is None or not (refusal.fixes or refusal.name_nodes):
        return refusal.kept(kept)
    here = f"none fits at this size ({num_nodes} x {platform.name})"
    found, last = _other_node_count(cfg, refusal, num_nodes=num_nodes, platform=platform)
    if found is None:
        tried = f"up to {last}" if refusal.toward == "more" else f"from {last} to {num_nodes - 1}"
        return refusal.kept([], none_fits=f"{here}, nor at any node count {tried}" if last != num_nodes else here)
    which = "smallest node count" if refusal.toward == "more" else f"largest node count below {num_nodes}"
    with_fix = f" with {Fix(sets=found.sets).text()}" if found.sets else ""
    return refusal.kept([], none_fits=f"{here}; the {which} that plans it{with_fix} is {found.nodes} (use "
                                      f"{found.text()})")


def _other_node_count(cfg: RunConfig, refusal: FixableError, *, num_nodes: int,
                      platform: Platform) -> tuple[Fix | None, int]:
    """The first node count, in the refusal's direction, at which the recipe plans as given or with one of the
    refusal's --set fixes (as a Fix with that --nodes); else None and the last count searched in full."""
    counts = range(1, NODE_SEARCH_LIMIT + 1) if refusal.toward == "more" else range(num_nodes - 1, 0, -1)
    variants = [Fix(), *(f for f in refusal.fixes if f.nodes is None and f.platform is None)]
    last, budget = num_nodes, NODE_SEARCH_PLANS
    for count in counts:
        if count == num_nodes:
            continue
        if budget < len(variants):
            break
        budget -= len(variants)
        for fix in variants:
            found = _planned(cfg, dataclasses.replace(fix, nodes=count), num_nodes=count, platform=platform)
            if found:
                return found, count
        last = count
    return None, last


def _make_plan(cfg: RunConfig, *, num_nodes: int, platform: Platform,
               calibration: Calibration = DEFAULT_CALIBRATION) -> Plan:
    """make_plan without trying the fixes of a refusal."""
    if num_nodes < 1:
        raise PlanError(f"--nodes {num_nodes}: a run needs at least 1 node; use --nodes 1 or more")
    check_values(cfg)
    check_distributed_optimizer(cfg, backend=platform.backend)
    check_overlap_param_gather(cfg, pipeline_parallel=cfg.parallel.pipeline)  # 0: the planner chooses, below
    per_node = workers_per_node(cfg, platform)
    _check_tensor_parallel(cfg, platform, per_node=per_node)
    check_model_shape(cfg.model, tensor_parallel=cfg.parallel.tensor or 1)
    if cfg.parallel.tensor:  # refused before sizing when the recipe names TP; after it when the planner chooses
        check_sequence_parallel(cfg, tensor_parallel=cfg.parallel.tensor)
    # A user's launch.workers_per_node is kept: a batch too small for it is refused with the fix.
    sizes = choose_sizes_for_batch(cfg, platform, num_nodes=num_nodes, per_node=per_node,
                                   may_idle=cfg.launch.workers_per_node is None)
    hardware = hardware_of(platform)
    choice = choose_layout(cfg, platform, rule=sizes, hardware=hardware, calibration=calibration)
    sizes, predicted = with_choice(sizes, choice), choice.chosen.time
    mesh, micro, vocab = sizes.mesh, sizes.num_micro_batches, sizes.padded_vocab
    check_recompute_stages(cfg.model, [len(r) for r in sizes.stage_layers])
    check_sequence_parallel(cfg, tensor_parallel=mesh.tensor_parallel)
    check_overlap_param_gather(cfg, pipeline_parallel=mesh.pipeline_parallel)
    params = num_parameters(cfg.model, padded_vocab=vocab)
    sched = resolve_schedule(cfg.optim, num_steps=cfg.train.num_steps, global_batch_size=cfg.train.global_batch_size)
    return Plan(
        recipe=cfg.name,
        platform=platform.name,
        backend=platform.backend,
        num_nodes=num_nodes,
        workers_per_node=mesh.workers_per_node,
        idle_workers_per_node=per_node - mesh.workers_per_node,
        global_batch_for_all_workers=sizes.global_batch_for_all_workers,
        world_size=mesh.world_size,
        tensor_parallel=mesh.tensor_parallel,
        pipeline_parallel=mesh.pipeline_parallel,
        data_parallel=mesh.data_parallel,
        micro_batch_size=cfg.train.micro_batch_size,
        global_batch_size=cfg.train.global_batch_size,
        num_micro_batches=micro,
        virtual_pipeline=cfg.parallel.virtual_pipeline,
        pipeline_schedule=cfg.parallel.pipeline_schedule,
        distributed_optimizer=cfg.parallel.distributed_optimizer,
        fp32_master=xla_fp32_master(backend=platform.backend, distributed_optimizer=cfg.parallel.distributed_optimizer),
        stage_layers=[[r.start, r.stop] for r in sizes.stage_layers],
        bubble_fraction=bubble_fraction(pipeline=mesh.pipeline_parallel, micro_batches=micro,
                                        virtual=cfg.parallel.virtual_pipeline),
        seq_length=cfg.model.seq_length,
        tokens_per_step=cfg.train.global_batch_size * cfg.model.seq_length,
        padded_vocab_size=vocab,
        num_parameters=params,
        memory_per_worker_gib=round(sizes.memory.total_gib, 3),
        memory_breakdown_gib=sizes.memory.breakdown(),
        memory_pp_rank=sizes.memory.pp_rank,
        recompute=resolve_recompute(cfg.model).label(),
        memory_limit_gib=platform.memory_per_worker_gib,
        flops_per_token=flops_per_token(cfg.model, padded_vocab=vocab),
        flops_formula=FLOPS_FORMULA,
        flops_per_token_6n=flops_per_token_6n(cfg.model, padded_vocab=vocab),
        data_source=resolve_data_source(cfg.data, platform),
        lr_schedule_unit="samples" if sched.per_step != 1 else "iterations",
        lr_warmup=sched.warmup,
        lr_decay=sched.decay,
        checkpoint_gib=round(params * CHECKPOINT_BYTES_PER_PARAMETER / GIB, 3),
        config_sha256=config_digest(dataclasses.asdict(cfg)),
        hardware=hardware.name,
        calibration=calibration.source,
        predicted_step_time_s=round(predicted.step_time_s, 6),
        predicted_tokens_per_s=round(predicted.tokens_per_s, 3),
        predicted_mfu=round(predicted.mfu, 4),
        peak_tflops_per_worker=hardware.peak_flops(cfg.train.precision) / 1e12,
        step_time_breakdown_s={k: round(v, 6) for k, v in predicted.breakdown_s.items()},
        layout_choice=choice.reason,
        layout_alternatives=[r.to_json() for r in choice.alternatives],
    )


def clear_plan_caches() -> None:
    """Forget what the planner's pure helpers remember between calls (memory estimates, layer splits, checked
    configs), so that a measurement or a test starts cold, as one `plan` command does."""
    for cached in (rank_terms, heaviest_rank, split_or_none, check_values):
        cached.cache_clear()

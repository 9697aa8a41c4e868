"""The run plan: mesh, batch math, padded vocabulary, LR schedule, memory and throughput figures. Pure.

`make_plan` takes a RunConfig, a node count and a Platform and returns a frozen Plan, or raises
ConfigError/PlanError with a one-line fix. Nothing here reads the environment, the clock or files.

The plan is the trainer's only source of derived numbers: the run folder keeps it (plan.json) beside the
config it was made from (config.json, whose digest the plan records), and the trainer reads both as one
RunSpec (plan/spec.py). Each derived value is computed here, once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal

from megatron_hpc.config.platforms import Platform
from megatron_hpc.config.schema import DataConfig, RunConfig
from megatron_hpc.errors import ConfigError, PlanError
from megatron_hpc.plan.batch import BatchLayout, num_micro_batches
from megatron_hpc.plan.checks import check_model_shape, check_values
from megatron_hpc.plan.lr_schedule import LrSchedule, resolve_schedule
from megatron_hpc.plan.memory import GIB, estimate_memory
from megatron_hpc.plan.mesh import Mesh
from megatron_hpc.plan.model_math import (
    FLOPS_FORMULA,
    flops_per_token,
    flops_per_token_6n,
    num_parameters,
)
from megatron_hpc.plan.stages import split_layers
from megatron_hpc.plan.vocab import padded_vocab_size

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
    world_size: int
    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    micro_batch_size: int
    global_batch_size: int
    num_micro_batches: int
    seq_length: int
    tokens_per_step: int
    padded_vocab_size: int
    num_parameters: int
    memory_per_worker_gib: float
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

    @property
    def mesh(self) -> Mesh:
        return Mesh(num_nodes=self.num_nodes, workers_per_node=self.workers_per_node,
                    tensor_parallel=self.tensor_parallel, pipeline_parallel=self.pipeline_parallel)

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
    if plan.padded_vocab_size % plan.tensor_parallel:
        problems.append(f"padded_vocab_size {plan.padded_vocab_size} is not divisible by tensor_parallel "
                        f"{plan.tensor_parallel}")
    if problems:
        raise PlanError(f"{source} is inconsistent: {'; '.join(problems)}; re-plan the run with "
                        "`megatron-hpc submit --resume RUN` (or submit the recipe again)")


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


def valid_tensor_parallel(cfg: RunConfig, platform: Platform, *, per_node: int) -> list[int]:
    """TP sizes that divide workers per node, heads and FFN size (and the runtime allows)."""
    candidates = platform.tp_choices or tuple(range(1, per_node + 1))
    return [
        t for t in candidates
        if per_node % t == 0
        and cfg.model.num_attention_heads % t == 0
        and cfg.model.ffn_size % t == 0
    ]


def _check_tensor_parallel(cfg: RunConfig, platform: Platform, *, per_node: int) -> None:
    tp = cfg.parallel.tensor
    valid = valid_tensor_parallel(cfg, platform, per_node=per_node)
    if tp in valid:
        return
    reasons = []
    if per_node % tp:
        reasons.append(f"it must divide the {per_node} workers per node")
    if cfg.model.num_attention_heads % tp:
        reasons.append(f"it must divide the {cfg.model.num_attention_heads} attention heads")
    if cfg.model.ffn_size % tp:
        reasons.append(f"it must divide the FFN size {cfg.model.ffn_size}")
    if platform.tp_choices and tp not in platform.tp_choices:
        reasons.append(f"the {platform.name} runtime supports TP {', '.join(map(str, platform.tp_choices))}")
    valid_text = ", ".join(map(str, valid)) or "none"
    raise PlanError(f"parallel.tensor={tp} is invalid for {cfg.name} on {platform.name} ({'; '.join(reasons)}); "
                    f"use --set parallel.tensor=N with N in {{{valid_text}}}")


def _check_pipeline(cfg: RunConfig) -> None:
    # Interim (the planner's pipeline checks land separately): the stages must split the layers.
    if cfg.parallel.pipeline > 1:
        split_layers(cfg.model.num_layers, pipeline=cfg.parallel.pipeline, virtual=cfg.parallel.virtual_pipeline,
                     first_stage_layers=cfg.parallel.pipeline_first_stage_layers,
                     last_stage_layers=cfg.parallel.pipeline_last_stage_layers)


def make_plan(cfg: RunConfig, *, num_nodes: int, platform: Platform) -> Plan:
    """Check the recipe against the cluster and compute every derived value."""
    if num_nodes < 1:
        raise PlanError(f"--nodes {num_nodes}: a run needs at least 1 node; use --nodes 1 or more")
    check_values(cfg)
    _check_pipeline(cfg)
    per_node = workers_per_node(cfg, platform)
    _check_tensor_parallel(cfg, platform, per_node=per_node)
    check_model_shape(cfg.model, tensor_parallel=cfg.parallel.tensor)
    mesh = Mesh(num_nodes=num_nodes, workers_per_node=per_node, tensor_parallel=cfg.parallel.tensor,
                pipeline_parallel=cfg.parallel.pipeline)
    micro = num_micro_batches(global_batch=cfg.train.global_batch_size,
                              micro_batch=cfg.train.micro_batch_size, data_parallel=mesh.data_parallel)
    vocab = padded_vocab_size(cfg.model.vocab_size, divisible_by=cfg.model.make_vocab_size_divisible_by,
                              tensor_parallel=mesh.tensor_parallel)
    params = num_parameters(cfg.model, padded_vocab=vocab)
    memory = _memory_gib(cfg, platform, params=params, vocab=vocab, tp=mesh.tensor_parallel)
    if memory > platform.memory_per_worker_gib:
        raise PlanError(_memory_advice(cfg, platform, per_node=per_node, params=params, need=memory))
    sched = resolve_schedule(cfg.optim, num_steps=cfg.train.num_steps, global_batch_size=cfg.train.global_batch_size)
    return Plan(
        recipe=cfg.name,
        platform=platform.name,
        backend=platform.backend,
        num_nodes=num_nodes,
        workers_per_node=per_node,
        world_size=mesh.world_size,
        tensor_parallel=mesh.tensor_parallel,
        pipeline_parallel=mesh.pipeline_parallel,
        data_parallel=mesh.data_parallel,
        micro_batch_size=cfg.train.micro_batch_size,
        global_batch_size=cfg.train.global_batch_size,
        num_micro_batches=micro,
        seq_length=cfg.model.seq_length,
        tokens_per_step=cfg.train.global_batch_size * cfg.model.seq_length,
        padded_vocab_size=vocab,
        num_parameters=params,
        memory_per_worker_gib=round(memory, 3),
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
    )


def _memory_gib(cfg: RunConfig, platform: Platform, *, params: int, vocab: int, tp: int,
                recompute: bool | None = None) -> float:
    model = cfg.model if recompute is None else dataclasses.replace(cfg.model, recompute=recompute)
    return estimate_memory(model, num_parameters=params, padded_vocab=vocab, tensor_parallel=tp,
                           micro_batch=cfg.train.micro_batch_size, precision=cfg.train.precision,
                           backend=platform.backend).total_gib


def _memory_advice(cfg: RunConfig, platform: Platform, *, per_node: int, params: int, need: float) -> str:
    have = platform.memory_per_worker_gib
    head = (f"{cfg.name} needs about {need:.1f} GiB per worker at parallel.tensor={cfg.parallel.tensor} "
            f"(weights, grads, Adam states and activations of {params / 1e9:.2f}B parameters), "
            f"but a {platform.name} worker has {have:g} GiB; ")
    options = []
    for tp in valid_tensor_parallel(cfg, platform, per_node=per_node):
        if tp <= cfg.parallel.tensor:
            continue
        tp_vocab = padded_vocab_size(cfg.model.vocab_size, divisible_by=cfg.model.make_vocab_size_divisible_by,
                                     tensor_parallel=tp)
        tp_params = num_parameters(cfg.model, padded_vocab=tp_vocab)
        for recompute in (False, True) if not cfg.model.recompute else (True,):
            if _memory_gib(cfg, platform, params=tp_params, vocab=tp_vocab, tp=tp, recompute=recompute) <= have:
                extra = " --set model.recompute=true" if recompute and not cfg.model.recompute else ""
                options.append(f"--set parallel.tensor={tp}{extra}")
                break
        if options:
            break
    if not cfg.model.recompute and _memory_gib(cfg, platform, params=params,
                                                vocab=padded_vocab_size(
                                                    cfg.model.vocab_size,
                                                    divisible_by=cfg.model.make_vocab_size_divisible_by,
                                                    tensor_parallel=cfg.parallel.tensor),
                                                tp=cfg.parallel.tensor, recompute=True) <= have:
        options.insert(0, "--set model.recompute=true")
    if options:
        return head + "use " + " or ".join(options)
    return head + ("it does not fit at any tensor-parallel size this platform allows; use a platform with "
                   "more memory per worker or a smaller model (pipeline parallelism is not available yet)")

"""The run plan: mesh, batch math, memory and throughput figures. Pure.

`make_plan` takes a RunConfig, a node count and a Platform and returns a frozen Plan, or raises
PlanError with a one-line fix. Nothing here reads the environment, the clock or files.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from megatron_hpc.config.platforms import Platform
from megatron_hpc.config.schema import RunConfig
from megatron_hpc.errors import PlanError
from megatron_hpc.plan.batch import num_micro_batches
from megatron_hpc.plan.memory import estimate_memory
from megatron_hpc.plan.mesh import Mesh
from megatron_hpc.plan.model_math import (
    FLOPS_FORMULA,
    flops_per_token,
    flops_per_token_6n,
    num_parameters,
)
from megatron_hpc.plan.vocab import padded_vocab_size


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    recipe: str
    platform: str
    backend: str
    num_nodes: int
    workers_per_node: int
    world_size: int
    tensor_parallel: int
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

    @property
    def mesh(self) -> Mesh:
        return Mesh(num_nodes=self.num_nodes, workers_per_node=self.workers_per_node,
                    tensor_parallel=self.tensor_parallel)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def workers_per_node(cfg: RunConfig, platform: Platform) -> int:
    requested = cfg.launch.workers_per_node
    if requested is None:
        return platform.workers_per_node
    if requested < 1:
        raise PlanError(f"launch.workers_per_node={requested} must be at least 1")
    if not platform.workers_configurable and requested != platform.workers_per_node:
        raise PlanError(
            f"launch.workers_per_node={requested} cannot change {platform.name}, which runs "
            f"{platform.workers_per_node} workers per node; remove the setting or use --platform cpu"
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


def _check_model(cfg: RunConfig) -> None:
    m = cfg.model
    if m.seq_length > m.max_position_embeddings:
        raise PlanError(
            f"model.seq_length={m.seq_length} is longer than model.max_position_embeddings="
            f"{m.max_position_embeddings}; lower seq_length or raise max_position_embeddings"
        )
    if m.hidden_size % m.num_attention_heads:
        raise PlanError(f"model.hidden_size={m.hidden_size} is not divisible by "
                        f"model.num_attention_heads={m.num_attention_heads}")
    for key, value in (("num_layers", m.num_layers), ("hidden_size", m.hidden_size),
                       ("num_attention_heads", m.num_attention_heads), ("seq_length", m.seq_length)):
        if value < 1:
            raise PlanError(f"model.{key}={value} must be at least 1")
    if cfg.train.micro_batch_size < 1:
        raise PlanError(f"train.micro_batch_size={cfg.train.micro_batch_size} must be at least 1")


def make_plan(cfg: RunConfig, *, num_nodes: int, platform: Platform) -> Plan:
    """Check the recipe against the cluster and compute every derived value."""
    if num_nodes < 1:
        raise PlanError(f"--nodes {num_nodes}: a run needs at least 1 node; use --nodes 1 or more")
    _check_model(cfg)
    per_node = workers_per_node(cfg, platform)
    _check_tensor_parallel(cfg, platform, per_node=per_node)
    mesh = Mesh(num_nodes=num_nodes, workers_per_node=per_node, tensor_parallel=cfg.parallel.tensor)
    micro = num_micro_batches(global_batch=cfg.train.global_batch_size,
                              micro_batch=cfg.train.micro_batch_size, data_parallel=mesh.data_parallel)
    vocab = padded_vocab_size(cfg.model.vocab_size, divisible_by=cfg.model.make_vocab_size_divisible_by,
                              tensor_parallel=mesh.tensor_parallel)
    params = num_parameters(cfg.model, padded_vocab=vocab)
    memory = _memory_gib(cfg, platform, params=params, vocab=vocab, tp=mesh.tensor_parallel)
    if memory > platform.memory_per_worker_gib:
        raise PlanError(_memory_advice(cfg, platform, per_node=per_node, params=params, need=memory))
    return Plan(
        recipe=cfg.name,
        platform=platform.name,
        backend=platform.backend,
        num_nodes=num_nodes,
        workers_per_node=per_node,
        world_size=mesh.world_size,
        tensor_parallel=mesh.tensor_parallel,
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

"""Checks of recipe values that would otherwise fail later (in a queued job, or with a ZeroDivisionError). Pure.

`check_values` refuses out-of-range numbers with the key, the value and the range; `check_model_shape` refuses a
model that cannot be built or split `tensor_parallel` ways. The planner runs both before it computes anything, and
the model calls `check_model_shape` too, so the rule lives here once, with one exception type.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from megatron_hpc.config.schema import ModelConfig, RunConfig
from megatron_hpc.errors import ConfigError, PlanError
from megatron_hpc.plan.fixes import Fix, FixableConfigError, FixablePlanError, offer, one_of, set_fix, values_of
from megatron_hpc.plan.model_math import rotary_dims
from megatron_hpc.plan.recompute import resolve_recompute

_Rule = tuple[str, Callable[[Any], bool], str]

_AT_LEAST_1 = (lambda v: v >= 1, "at least 1")
_POSITIVE = (lambda v: v > 0, "above 0")
_NOT_NEGATIVE = (lambda v: v >= 0, "0 or more")
_PROBABILITY = (lambda v: 0.0 <= v < 1.0, "in [0, 1)")
_AUTO_OR_SIZE = (lambda v: v >= 0, "0 (the planner chooses) or more")

PIPELINE_SCHEDULES = ("1f1b", "afab")
"""parallel.pipeline_schedule values: 1F1B (interleaved with virtual stages) and all-forward-all-backward."""


def _rules() -> list[_Rule]:
    """(key, test, what it must be) for every numeric key a run cannot start without."""
    return [
        *[(f"model.{k}", *_AT_LEAST_1) for k in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                                                  "max_position_embeddings", "vocab_size",
                                                  "make_vocab_size_divisible_by")],
        ("model.ffn_hidden_size", lambda v: v is None or v >= 1, "at least 1 (or unset for 4 x hidden_size)"),
        ("model.rotary_percent", lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
        ("model.rotary_base", *_POSITIVE),
        ("model.init_method_std", *_NOT_NEGATIVE),
        ("model.layernorm_epsilon", *_POSITIVE),
        ("model.attention_dropout", *_PROBABILITY),
        ("model.hidden_dropout", *_PROBABILITY),
        ("parallel.tensor", *_AUTO_OR_SIZE),
        ("parallel.pipeline", *_AUTO_OR_SIZE),
        ("parallel.virtual_pipeline", *_AT_LEAST_1),
        ("parallel.pipeline_first_stage_layers", lambda v: v >= 0, "0 (an even split) or more"),
        ("parallel.pipeline_last_stage_layers", lambda v: v >= 0, "0 (an even split) or more"),
        ("parallel.grad_bucket_mb", *_POSITIVE),
        *[(f"train.{k}", *_AT_LEAST_1) for k in ("num_steps", "micro_batch_size", "global_batch_size",
                                                  "log_interval", "max_skipped_steps")],
        ("train.eval_interval", *_NOT_NEGATIVE),
        ("train.eval_iters", *_NOT_NEGATIVE),
        ("optim.lr", *_POSITIVE),
        ("optim.min_lr", *_NOT_NEGATIVE),
        ("optim.weight_decay", *_NOT_NEGATIVE),
        ("optim.adam_beta1", *_PROBABILITY),
        ("optim.adam_beta2", *_PROBABILITY),
        ("optim.adam_eps", *_POSITIVE),
        ("optim.clip_grad", lambda v: v >= 0, "0 (no clipping) or more"),
        ("optim.lr_warmup_iters", *_NOT_NEGATIVE),
        ("optim.lr_warmup_fraction", lambda v: v is None or 0.0 <= v <= 1.0, "in [0, 1] (or unset)"),
        ("optim.lr_decay_iters", lambda v: v is None or v >= 1, "at least 1 (or unset for train.num_steps)"),
        ("optim.lr_warmup_samples", *_NOT_NEGATIVE),
        ("optim.lr_decay_samples", lambda v: v is None or v >= 1, "at least 1 (or unset)"),
        ("checkpoint.save_interval", lambda v: v >= 0, "0 (save at the end only) or more"),
        ("checkpoint.keep_last", *_AT_LEAST_1),
        ("checkpoint.io_workers_per_node", *_AT_LEAST_1),
        ("checkpoint.time_budget_min", lambda v: v >= 0, "0 (no budget) or more"),
        ("compile.num_steps", *_AT_LEAST_1),
        ("launch.nofile_limit", *_AT_LEAST_1),
        ("launch.time_limit_min", *_AT_LEAST_1),
        ("launch.compile_time_limit_min", *_AT_LEAST_1),
        ("launch.init_timeout_s", *_POSITIVE),
        ("launch.collective_timeout_s", *_POSITIVE),
        ("launch.spare_nodes", *_NOT_NEGATIVE),
        ("launch.max_in_job_restarts", *_NOT_NEGATIVE),
        ("launch.hang_timeout_s", lambda v: v is None or v > 0, "above 0 (or unset to derive it from the step time)"),
        ("launch.straggler_threshold", lambda v: v > 1.0, "above 1.0 (a multiple of the median node's step time)"),
    ]


def _value(cfg: RunConfig, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


@functools.lru_cache(maxsize=256)
def check_values(cfg: RunConfig) -> None:
    """ConfigError naming the first key whose value no run can use, with its range and a fix. A config that passes
    is remembered (a refusal's search checks the same one at every node count it tries); one that fails raises
    each time."""
    for key, ok, requirement in _rules():
        value = _value(cfg, key)
        if not ok(value):
            raise ConfigError(f"{key}={value!r} must be {requirement}; fix the recipe or use --set {key}=...")
    resolve_recompute(cfg.model)  # contradicting recompute keys; the stage fit is checked once stages are known
    schedule = cfg.parallel.pipeline_schedule
    if schedule not in PIPELINE_SCHEDULES:
        what = f"parallel.pipeline_schedule={schedule!r} is not a schedule"

        def wording(kept: list[Fix]) -> str:
            schedules = values_of(kept, "parallel.pipeline_schedule")
            return what + (f"; use {one_of('parallel.pipeline_schedule', schedules)}" if schedules else "")

        raise FixableConfigError(wording, [set_fix("parallel.pipeline_schedule", s) for s in PIPELINE_SCHEDULES])
    if cfg.optim.min_lr > cfg.optim.lr:
        raise ConfigError(f"optim.min_lr={cfg.optim.min_lr:g} is above optim.lr={cfg.optim.lr:g}; the LR decays "
                          f"from lr down to min_lr, so use --set optim.min_lr=N with N <= {cfg.optim.lr:g}")


def check_model_shape(model: ModelConfig, *, tensor_parallel: int) -> None:
    """PlanError when the model cannot be built, or split `tensor_parallel` ways (heads, FFN)."""
    if model.seq_length > model.max_position_embeddings:
        raise PlanError(f"model.seq_length={model.seq_length} is longer than model.max_position_embeddings="
                        f"{model.max_position_embeddings}; lower seq_length or raise max_position_embeddings")
    if model.hidden_size % model.num_attention_heads:
        raise PlanError(f"model.hidden_size={model.hidden_size} is not divisible by model.num_attention_heads="
                        f"{model.num_attention_heads}; pick a head count that divides the width")
    if model.position_embedding == "rope":
        try:
            rotary_dims(model.hidden_size // model.num_attention_heads, rotary_percent=model.rotary_percent)
        except ValueError as exc:
            raise PlanError(f"model.{exc}; pick rotary_percent so that it is (1.0 and 0.25 usually are)") from None
    groups = model.query_groups
    if groups < 1 or model.num_attention_heads % groups:
        counts = [g for g in range(1, model.num_attention_heads + 1) if model.num_attention_heads % g == 0]
        raise PlanError(f"model.num_query_groups={groups} does not divide model.num_attention_heads="
                        f"{model.num_attention_heads}; use one of {', '.join(map(str, counts))}")
    if model.rope_scaling != "none" and model.position_embedding != "rope":
        raise PlanError(f"model.rope_scaling={model.rope_scaling} scales rotary frequencies, but "
                        f"model.position_embedding={model.position_embedding}; set model.position_embedding=rope or "
                        f"model.rope_scaling=none")
    if model.rope_scaling == "llama3" and not model.rope_high_freq_factor > model.rope_low_freq_factor:
        raise PlanError(f"model.rope_high_freq_factor={model.rope_high_freq_factor} must be above "
                        f"model.rope_low_freq_factor={model.rope_low_freq_factor} (Llama 3.1: 4.0 and 1.0)")
    if model.num_attention_heads % tensor_parallel or model.ffn_size % tensor_parallel or groups % tensor_parallel:
        heads = model.num_attention_heads
        choices = [d for d in range(1, heads + 1)
                   if heads % d == 0 and model.ffn_size % d == 0 and groups % d == 0]
        what = (f"parallel.tensor={tensor_parallel} must divide model.num_attention_heads ({heads}) and the FFN size "
                f"({model.ffn_size})")
        if groups != heads:
            what = (f"parallel.tensor={tensor_parallel} must divide model.num_query_groups ({groups}: TP splits the "
                    f"key/value groups), model.num_attention_heads ({heads}) and the FFN size ({model.ffn_size})")

        def wording(kept: list[Fix]) -> str:
            sizes = values_of(kept, "parallel.tensor")
            return what + (f"; use {one_of('parallel.tensor', sizes)}" if sizes else "")

        raise FixablePlanError(wording, [set_fix("parallel.tensor", d) for d in choices])


SP_OFF = "--set parallel.sequence_parallel=false"
"""The way out of sequence parallelism, which the Llama and Qwen recipes turn on."""


def check_sequence_parallel(cfg: RunConfig, *, tensor_parallel: int) -> None:
    """PlanError when parallel.sequence_parallel is set without TP above 1, or the sequence does not split
    `tensor_parallel` ways."""
    if not cfg.parallel.sequence_parallel:
        return
    if tensor_parallel < 2:
        model = cfg.model
        sizes = [t for t in range(2, model.num_attention_heads + 1) if model.num_attention_heads % t == 0
                 and model.query_groups % t == 0 and model.ffn_size % t == 0 and model.seq_length % t == 0]

        off = set_fix("parallel.sequence_parallel", False)

        def wording(kept: list[Fix]) -> str:
            # Turning sequence parallelism off is a --set like the others (a recipe may set the key), printed
            # only where it plans.
            options = [f"--set parallel.tensor={t}" for t in values_of(kept, "parallel.tensor")[:1]]
            options += [SP_OFF] if off in kept else []
            return (f"parallel.sequence_parallel needs tensor parallelism above 1 (parallel.tensor is "
                    f"{tensor_parallel})" + (f"; use {' or '.join(options)}" if options else ""))

        raise FixablePlanError(wording, [*(set_fix("parallel.tensor", t) for t in sizes), off], toward=None)
    if cfg.model.seq_length % tensor_parallel:
        raise PlanError(f"parallel.sequence_parallel splits model.seq_length={cfg.model.seq_length} over "
                        f"parallel.tensor={tensor_parallel}, which does not divide it; pick a seq_length divisible "
                        f"by {tensor_parallel} or drop parallel.sequence_parallel")


def check_distributed_optimizer(cfg: RunConfig, *, backend: str) -> None:
    """PlanError when parallel.distributed_optimizer is asked of what it cannot follow: on XLA (torch_xla's
    ZeroRedundancyOptimizer, train/xla_zero.py) train.precision fp16, which XLA refuses anyway."""
    if cfg.parallel.distributed_optimizer and backend == "xla" and cfg.train.precision == "fp16":
        raise offer("parallel.distributed_optimizer on XLA keeps fp32 master weights for bf16 or fp32 weights, and "
                    "XLA has no fp16 path", [(set_fix("train.precision", "bf16"), "--set train.precision=bf16")])


def check_overlap_param_gather(cfg: RunConfig, *, pipeline_parallel: int) -> None:
    """PlanError when parallel.overlap_param_gather has no parameter all-gather to overlap (no distributed
    optimizer) or runs under pipelining (`pipeline_parallel` above 1), where the schedule runs each stage's forwards
    (compiled chunks under train.compile) and the wait in a forward pre-hook is not supported."""
    if not cfg.parallel.overlap_param_gather:
        return
    off = set_fix("parallel.overlap_param_gather", False)
    if not cfg.parallel.distributed_optimizer:
        raise offer("parallel.overlap_param_gather overlaps the distributed optimizer's parameter all-gather, but "
                    "parallel.distributed_optimizer is false", lead="; ",
                    options=[(set_fix("parallel.distributed_optimizer", True),
                              "--set parallel.distributed_optimizer=true"),
                             (off, "drop parallel.overlap_param_gather")])
    if pipeline_parallel > 1:
        what = (f"parallel.overlap_param_gather is not supported with pipeline parallelism (pipeline size "
                f"{pipeline_parallel}): the stages' forwards run inside the pipeline schedule")
        no_pipeline = set_fix("parallel.pipeline", 1)

        def wording(kept: list[Fix]) -> str:
            keys = [f.sets[0][0] + "=" + ("false" if f == off else "1") for f in (off, no_pipeline) if f in kept]
            return what + (f"; --set {' or '.join(keys)}" if keys else "")

        raise FixablePlanError(wording, [off, no_pipeline])

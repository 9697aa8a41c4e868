"""What one TP rank's checkpoint holds, in the reference Megatron's keys. Pure: dicts in, dicts out.

The keys follow the reference (neuron-xla.md 1.3): flat args, checkpoint_version 3.0, iteration, model,
optimizer, lr_scheduler and the RNG keys (random_rng_state, np_rng_state, torch_rng_state, cuda_rng_state).
Ours beside them: rng_state (one RNG entry per DP rank, Megatron HEAD's key), xla_rng_state, resolved_config,
resolved_plan, data_position and precision. Unlike the reference, consumed_train_samples is read back (its bug (a)).
Nothing here knows the trainer: the trainer's TrainState is turned into a Progress and RNG dicts by its
Checkpointer (train/checkpointing.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_hpc.errors import CheckpointError

CHECKPOINT_VERSION = 3.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Progress:
    """Where training stood when the checkpoint was written."""

    iteration: int
    """Optimizer steps taken (Megatron's iteration)."""
    consumed_samples: int
    """Training samples consumed across all DP ranks."""
    lr_steps: int
    """Optimizer steps whose update was applied (skipped fp16-overflow or non-finite steps excluded)."""


def build_state_dict(*, config: dict[str, Any], plan: dict[str, Any], model: dict[str, Any],
                     optimizer: dict[str, Any], progress: Progress, rng_per_dp_rank: list[dict[str, Any]],
                     grad_scaler: dict[str, Any] | None = None,
                     precision: dict[str, str] | None = None) -> dict[str, Any]:
    """One TP rank's checkpoint content; model tensors are state_dict() tensors, never Parameters.

    `config` and `plan` are the run's resolved JSON (config.json and plan.json). Megatron's
    lr_scheduler.num_steps counts samples, so it is stored as lr_steps * global batch size, with our
    own successful_steps beside it. rng_per_dp_rank holds Megatron's RNG keys, one dict per DP rank.
    `precision` records what the weights really hold ({"train_precision", "weights_hold"}): under XLA_USE_BF16 the
    files say float32 while the values are bf16.
    """
    m = config["model"]
    extra: dict[str, Any] = {} if grad_scaler is None else {"grad_scaler": grad_scaler}  # Megatron's, for fp16
    if precision is not None:
        extra["precision"] = precision
    return {
        **extra,
        "num_layers": m["num_layers"], "hidden_size": m["hidden_size"],
        "num_attention_heads": m["num_attention_heads"],
        "tensor_model_parallel_size": plan["tensor_parallel"],
        "pipeline_model_parallel_size": plan["pipeline_parallel"],
        "consumed_train_samples": progress.consumed_samples, "consumed_valid_samples": 0,
        "max_position_embeddings": m["max_position_embeddings"],
        "make_vocab_size_divisible_by": m["make_vocab_size_divisible_by"],
        "padded_vocab_size": plan["padded_vocab_size"],
        "tokenizer_type": config["data"]["tokenizer_type"],
        "checkpoint_version": CHECKPOINT_VERSION, "iteration": progress.iteration,
        "model": model,
        "optimizer": optimizer,
        # The LR is a pure function of the applied steps and the plan's schedule: their count suffices.
        "lr_scheduler": {"num_steps": progress.lr_steps * plan["global_batch_size"],
                         "successful_steps": progress.lr_steps, "train_iters": config["train"]["num_steps"],
                         "decay": plan["lr_decay"], "unit": plan["lr_schedule_unit"],
                         "optim": config["optim"]},
        **rng_per_dp_rank[0],
        "rng_state": rng_per_dp_rank,
        "resolved_config": config,
        "resolved_plan": plan,
        "data_position": {"step": progress.iteration, "consumed_samples": progress.consumed_samples,
                          "global_batch_size": plan["global_batch_size"], "seed": config["train"]["seed"]},
    }


def read_progress(state: dict[str, Any], *, where: object) -> Progress:
    """Iteration, consumed samples and applied LR steps of a loaded state dict."""
    try:
        iteration = int(state["iteration"])
        consumed = int(state["consumed_train_samples"])
        # Checkpoints from before the count was kept (and foreign ones) had no skipped steps recorded.
        lr_steps = int((state.get("lr_scheduler") or {}).get("successful_steps", iteration))
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{where} has no usable iteration or consumed_train_samples ({type(exc).__name__}: "
                              f"{exc}); it was not written by a Megatron-style trainer or is damaged") from None
    return Progress(iteration=iteration, consumed_samples=consumed, lr_steps=lr_steps)


def read_rng(state: dict[str, Any], *, dp_rank: int, where: object) -> dict[str, Any]:
    """The RNG keys of one DP rank (DP rank 0's when the checkpoint kept fewer, as the reference does)."""
    per_rank = state.get("rng_state")
    if isinstance(per_rank, list) and per_rank:
        return per_rank[dp_rank] if dp_rank < len(per_rank) else per_rank[0]
    if "torch_rng_state" in state:
        return state
    raise CheckpointError(f"{where} holds no RNG state (rng_state or torch_rng_state); it was not written by a "
                          "Megatron-style trainer or is damaged")


def saved_global_batch(state: dict[str, Any]) -> int | None:
    """The global batch size the data order was built for, when the checkpoint says."""
    position = state.get("data_position")
    return int(position["global_batch_size"]) if isinstance(position, dict) else None

"""Activation recomputation settings (Megatron's --recompute-granularity/-method/-num-layers). Pure.

- selective: only the attention core, softmax(QK^T)V, is recomputed in backward (Korthikanti et al. 2022): it
  holds the s^2-sized scores and probabilities yet costs little to recompute.
- full, uniform: a stage's layers are cut into groups of `recompute_num_layers`; each group is checkpointed as a
  unit, so only its input is kept and its layers are rerun together in backward.
- full, block: the first `recompute_num_layers` layers of each stage are checkpointed one by one; the rest keep
  every activation (spend leftover memory on less recomputation).

Megatron's transformer block walks uniform groups in steps of recompute_num_layers over the stage's layers, so we
require the number to divide every stage's layer count (a ragged last group would silently change the memory the
planner promised), and a block count of at most the stage's layers. `model.recompute: true`, the older boolean,
stays as an alias of full / uniform / 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_hpc.config.schema import ModelConfig
from megatron_hpc.errors import ConfigError, PlanError


@dataclass(frozen=True, kw_only=True, slots=True)
class Recompute:
    """The effective setting: granularity None (off), "selective" or "full"; method and count only for full."""

    granularity: str | None = None
    method: str | None = None
    num_layers: int = 0

    @property
    def selective(self) -> bool:
        return self.granularity == "selective"

    @property
    def full(self) -> bool:
        return self.granularity == "full"

    def label(self) -> str:
        """For `plan`: 'none', 'selective' or 'full, uniform groups of 2' / 'full, block of 3 layers'."""
        if self.granularity is None:
            return "none"
        if self.selective:
            return "selective"
        if self.method == "uniform":
            return f"full, uniform groups of {self.num_layers} layer{'s' if self.num_layers > 1 else ''}"
        return f"full, block of {self.num_layers} layer{'s' if self.num_layers > 1 else ''}"


FULL_UNIFORM_1 = Recompute(granularity="full", method="uniform", num_layers=1)
"""What `model.recompute: true` means (every layer checkpointed on its own)."""


def resolve_recompute(model: ModelConfig) -> Recompute:
    """The effective setting of `model`, or a one-line ConfigError when its recompute keys contradict each other."""
    granularity, method, count = model.recompute_granularity, model.recompute_method, model.recompute_num_layers
    if model.recompute:
        if granularity == "selective":
            raise ConfigError("model.recompute=true means full recomputation but model.recompute_granularity="
                              "'selective'; drop model.recompute (use --set model.recompute=false)")
        granularity = "full"
    if granularity != "full":
        for key, value in (("recompute_method", method), ("recompute_num_layers", count)):
            if value is not None:
                raise ConfigError(f"model.{key}={value!r} applies only to full recomputation; use --set "
                                  f"model.recompute_granularity=full or remove model.{key}")
        return Recompute(granularity=granularity)
    if count is not None and count < 1:
        raise ConfigError(f"model.recompute_num_layers={count} must be at least 1; use --set "
                          "model.recompute_num_layers=N with N >= 1")
    return Recompute(granularity="full", method=method or "uniform", num_layers=1 if count is None else count)


def check_recompute_stages(model: ModelConfig, stage_layers: Sequence[int]) -> None:
    """PlanError when recompute_num_layers does not fit the layers of every pipeline stage."""
    rc = resolve_recompute(model)
    if not rc.full:
        return
    n = rc.num_layers
    if rc.method == "uniform":
        bad = sorted({c for c in stage_layers if c % n})
        if bad:
            counts = sorted(set(stage_layers))
            divisors = [d for d in range(1, min(counts) + 1) if all(c % d == 0 for c in counts)]
            raise PlanError(f"model.recompute_num_layers={n} must divide the layers of every pipeline stage "
                            f"({', '.join(map(str, counts))}) for recompute_method=uniform; use --set "
                            f"model.recompute_num_layers=N with N in {{{', '.join(map(str, divisors))}}}")
    elif n > min(stage_layers):
        raise PlanError(f"model.recompute_num_layers={n} is more than the {min(stage_layers)} layers of a pipeline "
                        f"stage for recompute_method=block; use --set model.recompute_num_layers=N with N <= "
                        f"{min(stage_layers)}")


def recompute_groups(layers: Sequence[int], rc: Recompute) -> list[tuple[Sequence[int], bool]]:
    """A stage's layers cut into (layers, checkpointed) runs, in order: what stage_forward executes."""
    if not rc.full:
        return [(layers, False)]
    n = rc.num_layers
    if rc.method == "uniform":
        return [(layers[i:i + n], True) for i in range(0, len(layers), n)]
    head = [(layers[i:i + 1], True) for i in range(min(n, len(layers)))]
    return head + ([(layers[n:], False)] if len(layers) > n else [])

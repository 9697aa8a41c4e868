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
from megatron_hpc.errors import ConfigError
from megatron_hpc.plan.fixes import Fix, FixableConfigError, FixablePlanError, one_of, set_fix, values_of


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
            what = "model.recompute=true means full recomputation but model.recompute_granularity='selective'"
            raise FixableConfigError(lambda kept: f"{what}; drop model.recompute"
                                + (" (use --set model.recompute=false)" if kept else ""),
                                [set_fix("model.recompute", False)])
        granularity = "full"
    if granularity != "full":
        for key, value in (("recompute_method", method), ("recompute_num_layers", count)):
            if value is not None:
                raise _full_only(key, value)
        return Recompute(granularity=granularity)
    if count is not None and count < 1:
        raise ConfigError(f"model.recompute_num_layers={count} must be at least 1; use --set "
                          "model.recompute_num_layers=N with N >= 1")
    return Recompute(granularity="full", method=method or "uniform", num_layers=1 if count is None else count)


def _full_only(key: str, value: object) -> FixableConfigError:
    what = f"model.{key}={value!r} applies only to full recomputation"
    return FixableConfigError(lambda kept: f"{what}; use " + ("--set model.recompute_granularity=full or " if kept
                                                              else "") + f"remove model.{key}",
                              [set_fix("model.recompute_granularity", "full")])


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
            what = (f"model.recompute_num_layers={n} must divide the layers of every pipeline stage "
                    f"({', '.join(map(str, counts))}) for recompute_method=uniform")
            raise FixablePlanError(lambda kept: what + _layers_text(kept), [_layers(d) for d in divisors])
    elif n > min(stage_layers):
        what = (f"model.recompute_num_layers={n} is more than the {min(stage_layers)} layers of a pipeline stage for "
                f"recompute_method=block")
        raise FixablePlanError(lambda kept: what + _layers_text(kept, up_to=True),
                          [_layers(d) for d in range(1, min(stage_layers) + 1)])


def _layers(n: int) -> Fix:
    return set_fix("model.recompute_num_layers", n)


def _layers_text(kept: list[Fix], *, up_to: bool = False) -> str:
    """The recompute_num_layers that planned: `N <= k` when they are 1..k (block's rule), else `N in {...}`."""
    counts = [int(v) for v in values_of(kept, "model.recompute_num_layers")]
    if not counts:
        return ""
    if up_to and counts == list(range(1, len(counts) + 1)) and len(counts) > 1:
        return f"; use --set model.recompute_num_layers=N with N <= {counts[-1]}"
    return f"; use {one_of('model.recompute_num_layers', counts)}"


def recompute_groups(layers: Sequence[int], rc: Recompute) -> list[tuple[Sequence[int], bool]]:
    """A stage's layers cut into (layers, checkpointed) runs, in order: what stage_forward executes."""
    if not rc.full:
        return [(layers, False)]
    n = rc.num_layers
    if rc.method == "uniform":
        return [(layers[i:i + n], True) for i in range(0, len(layers), n)]
    head = [(layers[i:i + 1], True) for i in range(min(n, len(layers)))]
    return head + ([(layers[n:], False)] if len(layers) > n else [])

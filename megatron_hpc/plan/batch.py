"""Global batch arithmetic. Pure."""

from __future__ import annotations

from megatron_hpc.errors import PlanError


def num_micro_batches(*, global_batch: int, micro_batch: int, data_parallel: int) -> int:
    """global = micro x DP x micro-batches; refuse with the nearest valid global batches."""
    per_step = micro_batch * data_parallel
    if global_batch % per_step == 0 and global_batch > 0:
        return global_batch // per_step
    below = (global_batch // per_step) * per_step
    above = below + per_step
    options = [v for v in (below, above) if v > 0]
    raise PlanError(
        f"train.global_batch_size={global_batch} is not divisible by micro_batch_size x DP = "
        f"{micro_batch} x {data_parallel} = {per_step}; use --set train.global_batch_size="
        + " or ".join(str(v) for v in options)
    )

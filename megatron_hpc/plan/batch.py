"""Global batch arithmetic. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_hpc.plan.fixes import Fix, FixablePlanError, nearest, set_fix, values_of

NEAREST_TRIED = 4
"""Multiples tried on each side of a global batch that does not divide: the nearest can fail another check (a
micro-batch per pipeline stage, memory) where the next one plans."""


def num_micro_batches(*, global_batch: int, micro_batch: int, data_parallel: int) -> int:
    """global = micro x DP x micro-batches; refuse with the nearest valid global batches."""
    per_step = micro_batch * data_parallel
    if global_batch % per_step == 0 and global_batch > 0:
        return global_batch // per_step
    below = (global_batch // per_step) * per_step
    tried = [below - k * per_step for k in range(NEAREST_TRIED)] + \
        [below + k * per_step for k in range(1, NEAREST_TRIED + 1)]

    def wording(kept: list[Fix]) -> str:
        batches = nearest([int(v) for v in values_of(kept, "train.global_batch_size")], global_batch)
        use = f"; use --set train.global_batch_size={' or '.join(map(str, batches))}" if batches else ""
        return (f"train.global_batch_size={global_batch} is not divisible by micro_batch_size x DP = "
                f"{micro_batch} x {data_parallel} = {per_step}{use}")

    raise FixablePlanError(wording, [set_fix("train.global_batch_size", v) for v in tried if v > 0])


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchLayout:
    """How one global batch is split (the plan's numbers; Plan.batch): micro x DP x micro-batches.

    Sample order follows Megatron's MegatronPretrainingSampler: global batch k covers samples
    [k*GBS, (k+1)*GBS); its micro-batch m is the slice [m*mbs*dp, (m+1)*mbs*dp), of which DP rank r
    reads [r*mbs, (r+1)*mbs).
    """

    micro_batch_size: int
    global_batch_size: int
    num_micro_batches: int
    data_parallel: int

    def indices(self, step: int, *, micro: int, dp_rank: int) -> range:
        """Global sample indices that DP rank `dp_rank` reads in micro-batch `micro` of global batch `step`."""
        first = (step * self.global_batch_size + micro * self.micro_batch_size * self.data_parallel
                 + dp_rank * self.micro_batch_size)
        return range(first, first + self.micro_batch_size)

    def rank_indices(self, step: int, *, dp_rank: int) -> list[range]:
        """This DP rank's micro-batches of global batch `step`, in order."""
        return [self.indices(step, micro=m, dp_rank=dp_rank) for m in range(self.num_micro_batches)]


def num_valid_samples(*, train_iters: int, eval_interval: int, eval_iters: int, global_batch_size: int) -> int:
    """Megatron's valid sample count (get_train_valid_test_num_samples): one evaluation per interval plus the
    final one. The valid split's dataset is built for this count, which shapes its epochs and shuffle."""
    return (train_iters // eval_interval + 1) * eval_iters * global_batch_size


def num_test_samples(*, eval_iters: int, global_batch_size: int) -> int:
    """Megatron's test sample count: one evaluation, after training."""
    return eval_iters * global_batch_size

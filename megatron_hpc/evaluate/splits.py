"""The valid and test split samples Megatron evaluates, and their loss with a whole model.

Megatron builds each split's dataset for its own sample count (get_train_valid_test_num_samples, reference
2.1): valid (train_iters // eval_interval + 1) * eval_iters * global_batch_size, test eval_iters *
global_batch_size. That count shapes the split's epochs and shuffle, so it must be Megatron's for the samples to
be Megatron's. An evaluation then reads eval_iters global batches from the start of the split: the test split at
the end of training, and the valid split at its first evaluation (`megatron-hpc evaluate` reads the same
batches, so its valid loss of a run's first validation checkpoint is that validation's loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from megatron_hpc.config.schema import DataConfig, TrainConfig
from megatron_hpc.data.blending import build_split_dataset
from megatron_hpc.data.gpt_dataset import GPTIndexConfig, split_matrix
from megatron_hpc.errors import DataError
from megatron_hpc.evaluate.scoring import Scorer, sample_losses
from megatron_hpc.plan.batch import num_test_samples, num_valid_samples

EvalSplit = Literal["valid", "test"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SplitRequest:
    split: EvalSplit
    build_count: int
    """Samples the split's dataset is built for (Megatron's count for the run)."""
    num_samples: int
    """Samples evaluated: the split's first eval_iters global batches."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SplitResult:
    split: EvalSplit
    loss: float
    num_samples: int


def split_requests(train: TrainConfig, data: DataConfig, *, splits: tuple[EvalSplit, ...],
                   eval_iters: int) -> list[SplitRequest]:
    """What to read for each of `splits`, for a run trained with `train` and `data` (pure)."""
    if eval_iters < 1:
        raise DataError(f"--eval-iters {eval_iters} must be at least 1 (global batches per split)")
    gbs, requests = train.global_batch_size, []
    weights = split_matrix(data.split)
    for split in splits:
        if weights[("train", "valid", "test").index(split)] is None:
            raise DataError(f"data.split {data.split!r} gives the {split} split no weight; evaluate "
                            f"{'--split test' if split == 'valid' else '--split valid'} or a --task instead")
        read = eval_iters * gbs
        if split == "test":
            count = num_test_samples(eval_iters=eval_iters, global_batch_size=gbs)
        elif train.eval_interval > 0:
            count = num_valid_samples(train_iters=train.num_steps, eval_interval=train.eval_interval,
                                      eval_iters=eval_iters, global_batch_size=gbs)
        else:  # the run never validated: Megatron's count needs an interval, so build for what is read
            count = read
        requests.append(SplitRequest(split=split, build_count=count, num_samples=read))
    return requests


def split_samples(request: SplitRequest, data: DataConfig, *, seed: int, seq_length: int) -> torch.Tensor:
    """The (num_samples, seq_length + 1) token ids the request reads, in Megatron's order."""
    if not data.path:
        # A torch_dist conversion carries Megatron's training arguments but no data path of ours.
        why = "it trained on synthetic tokens" if data.source == "synthetic" else "a checkpoint converted from " \
            "another trainer records none"
        raise DataError(f"the run has no data.path ({why}); pass --data-path PREFIX to evaluate on a Megatron "
                        ".bin/.idx dataset, or use --task")
    config = GPTIndexConfig(seed=seed, seq_length=seq_length, split=data.split, cache_path=data.cache_path)
    dataset = build_split_dataset(data.path, split_name=request.split, num_samples=request.build_count,
                                  config=config)
    if len(dataset) < request.num_samples:
        raise DataError(f"the {request.split} split of {data.path} gives {len(dataset)} samples, "
                        f"{request.num_samples} are needed; this is a bug in the index build")
    return torch.from_numpy(np.stack([dataset.text(i) for i in range(request.num_samples)]))


def evaluate_split(model: Scorer, request: SplitRequest, data: DataConfig, *, seed: int, seq_length: int,
                   batch_size: int) -> SplitResult:
    """The mean lm loss over the request's samples (Megatron's: every sample has seq_length targets, so the mean
    over micro-batches and eval iterations is the mean over samples)."""
    samples = split_samples(request, data, seed=seed, seq_length=seq_length)
    losses = sample_losses(model, samples, batch_size=batch_size)
    return SplitResult(split=request.split, loss=float(losses.mean()), num_samples=request.num_samples)

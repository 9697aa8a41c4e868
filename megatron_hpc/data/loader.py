"""Per-rank batches from Megatron `.bin/.idx` data (data.source: indexed), and sample dumps for the CLI.

The trainer asks for train split samples num_steps * global_batch_size, as Megatron's
`get_train_valid_test_num_samples` does (shared/reference/megatron-and-launchers.md 2.1), so the index caches
are the ones a Megatron run with the same --train-iters, --global-batch-size, --seq-length, --seed, --split and
--data-path builds. Global sample ids are split over steps, micro-batches and DP ranks by the plan's BatchLayout
(Megatron's MegatronPretrainingSampler order).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from megatron_hpc.config.schema import DataConfig
from megatron_hpc.data.blending import BlendedDataset, build_split_dataset, parse_blend
from megatron_hpc.data.gpt_dataset import GPTDataset, GPTIndexConfig, SplitName
from megatron_hpc.data.indexed import IndexedDataset
from megatron_hpc.errors import DataError
from megatron_hpc.plan.batch import BatchLayout

_SCAN_CHUNK = 1 << 24
"""Tokens per chunk when scanning a .bin for its largest id."""


def max_token_id(prefix: str) -> int:
    """Largest token id in a dataset's .bin (-1 when it holds no tokens); one sequential pass."""
    dataset = IndexedDataset(prefix)
    tokens = dataset.get(0, 0, dataset.num_tokens) if len(dataset) else np.zeros(0, dtype=dataset.dtype)
    largest = -1
    for start in range(0, len(tokens), _SCAN_CHUNK):
        largest = max(largest, int(tokens[start:start + _SCAN_CHUNK].max()))
    return largest


def check_vocabulary(data_path: str, *, vocab_size: int) -> None:
    """DataError when some token id of the data does not fit an embedding of `vocab_size` rows."""
    for prefix in parse_blend(data_path).prefixes:
        if np.iinfo(IndexedDataset(prefix).dtype).max < vocab_size:
            continue  # every id this dtype can hold fits: no need to read the .bin
        largest = max_token_id(prefix)
        if largest >= vocab_size:
            raise DataError(f"{prefix}.bin holds token id {largest}, but model.vocab_size is {vocab_size}; the data "
                            f"was made with a larger tokenizer: set model.vocab_size above {largest} (the true "
                            f"vocabulary of that tokenizer) or re-tokenize the data")


@dataclass(frozen=True, kw_only=True, slots=True)
class IndexedBatches:
    """The train split of data.path, read by one DP rank."""

    dataset: GPTDataset | BlendedDataset
    layout: BatchLayout
    dp_rank: int

    def batch(self, indices: range | list[int]) -> torch.Tensor:
        """Samples stacked to (len(indices), seq_length + 1), int64: tokens are [:, :-1], labels [:, 1:]."""
        return torch.from_numpy(np.stack([self.dataset.text(i) for i in indices]))

    def micro_batches(self, step: int) -> list[torch.Tensor]:
        """This rank's micro-batches of optimizer step `step`, each (micro_batch_size, seq_length + 1)."""
        return [self.batch(ids) for ids in self.layout.rank_indices(step, dp_rank=self.dp_rank)]


def build_indexed_batches(data: DataConfig, *, seq_length: int, seed: int, num_steps: int, layout: BatchLayout,
                          dp_rank: int) -> IndexedBatches:
    """Build (or load from the cache) the train split indices for num_steps * global_batch_size samples."""
    if not data.path:
        raise DataError("data.source is indexed but data.path is not set; give a prefix (my-gpt2_text_document) "
                        "or a blend \"0.3 prefixA 0.7 prefixB\"")
    config = GPTIndexConfig(seed=seed, seq_length=seq_length, split=data.split, cache_path=data.cache_path)
    num_samples = num_steps * layout.global_batch_size
    dataset = build_split_dataset(data.path, split_name="train", num_samples=num_samples, config=config)
    if len(dataset) < num_samples:
        raise DataError(f"the train split of {data.path} gives {len(dataset)} samples, {num_samples} are needed "
                        f"({num_steps} steps x {layout.global_batch_size}); this is a bug in the index build")
    return IndexedBatches(dataset=dataset, layout=layout, dp_rank=dp_rank)


def gpt_samples(*, data_path: str, seq_length: int, seed: int, split: str, split_name: SplitName,
                num_samples: int | None, start: int, count: int,
                cache_path: str | None) -> list[dict[str, int | list[int]]]:
    """Samples [start, start + count) of one split, as the trainer sees them.

    Each is {"index", "tokens", "labels", "loss_mask"} with tokens = text[:-1] and labels = text[1:] of the
    seq_length + 1 ids Megatron's GPTDataset reads; padding (only in a short final sample) has token 0 and loss
    mask 0. `num_samples` is the sample count the indices are built for (the trainer uses num_steps *
    global_batch_size for train); None builds what megatron-core builds when no count is given: exactly one
    epoch of the split, (split tokens - 1) // seq_length samples (for a blend of plain prefixes: one epoch of
    each; a weighted blend needs a count). The indices come from, or go to, the same cache a run uses.
    """
    if start < 0 or count < 0:
        raise DataError(f"start and count must be >= 0, got {start} and {count}")
    config = GPTIndexConfig(seed=seed, seq_length=seq_length, split=split, cache_path=cache_path)
    dataset = build_split_dataset(data_path, split_name=split_name, num_samples=num_samples, config=config)
    if start + count > len(dataset):
        raise DataError(f"samples [{start}, {start + count}) requested, the {split_name} split has {len(dataset)}; "
                        f"lower start/count or raise the sample count")
    out = []
    for i in range(start, start + count):
        sample = dataset.sample(i)
        out.append({"index": i} | {key: value.tolist() for key, value in sample.items()})
    return out

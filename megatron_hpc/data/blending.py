"""Blends of several `.bin/.idx` prefixes ("0.3 A 0.7 B"), as megatron-core 0.16.1 blends them.

Parsing follows Megatron's `get_blend_from_list` (utils.py): either plain prefixes, or alternating
`weight prefix` pairs; weights are normalised. Per split, `build_split_dataset` then does what
`BlendedMegatronDatasetBuilder._build_blended_dataset_splits` does (shared/reference/megatron-and-launchers.md 2.5):

* one prefix and no weights: that prefix's GPTDataset, asked for the split's sample count;
* weights: dataset d builds ceil(ceil(n * w_d) * (1 + 0.005)) samples (the surplus), and the blend has
  sum_d ceil(n * w_d) samples picked by the deterministic greedy `build_blending_indices`;
* no weights: every dataset builds one epoch, weighted by its length, and the blend has
  min(n, total) samples (or exactly every sample, `build_exhaustive_blending_indices`, when n is None).

Megatron caches the blending indices only when --data-cache-path is set; they are cheap, so they are always
computed in memory here.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megatron_hpc.data import helpers
from megatron_hpc.data.gpt_dataset import GPTDataset, GPTIndexConfig, SplitName, build_gpt_dataset
from megatron_hpc.errors import DataError

MID_LEVEL_DATASET_SURPLUS = 0.005
"""Megatron's mid_level_dataset_surplus: extra samples each blended dataset builds beyond its share."""


@dataclass(frozen=True, slots=True)
class Blend:
    prefixes: tuple[str, ...]
    """Dataset prefixes (no .bin/.idx), ~ expanded."""
    weights: tuple[float, ...] | None
    """Weights as written (not normalised), or None for plain prefixes."""


def _as_float(token: str) -> float | None:
    try:
        return float(token)
    except ValueError:
        return None


def parse_blend(path: str) -> Blend:
    """"0.3 A 0.7 B" -> weighted blend; "A" or "A B" -> plain prefixes. Anything else is a DataError."""
    tokens = path.split()
    if not tokens:
        raise DataError("data.path is empty; give a prefix such as my-gpt2_text_document or a blend "
                        "\"0.3 prefixA 0.7 prefixB\"")
    numeric = [_as_float(t) is not None for t in tokens]
    if not any(numeric):
        return Blend(tuple(os.path.expanduser(t) for t in tokens), None)
    weighted_form = len(tokens) % 2 == 0 and all(numeric[0::2]) and not any(numeric[1::2])
    if not weighted_form:
        raise DataError(f"data.path {path!r} mixes weights and prefixes; write either plain prefixes "
                        f"(\"A B\") or weight-prefix pairs (\"0.3 A 0.7 B\")")
    weights = tuple(float(t) for t in tokens[0::2])
    bad = [w for w in weights if not math.isfinite(w) or w <= 0]
    if bad:
        raise DataError(f"data.path {path!r}: blend weights must be positive and finite, got {bad}; "
                        f"drop a dataset instead of giving it weight 0")
    return Blend(tuple(os.path.expanduser(t) for t in tokens[1::2]), weights)


def normalize(weights: Sequence[float]) -> list[float]:
    """Weights divided by their sum, in float64 (Megatron's utils.normalize; the exact floats matter)."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def size_per_dataset(normalized_weights: Sequence[float], target: int, *, surplus: float = 0.0) -> list[int]:
    """Samples each dataset contributes to a blend of `target` samples: ceil(ceil(target * w) * (1 + surplus))."""
    return [math.ceil(math.ceil(target * w) * (1 + surplus)) for w in normalized_weights]


class BlendedDataset:
    """Samples drawn from several GPTDatasets by Megatron's blending indices."""

    def __init__(self, datasets: Sequence[GPTDataset], *, weights: Sequence[float] | Sequence[int],
                 size: int | None):
        self.datasets = list(datasets)
        self.size = size
        if size is not None:
            self.weights: list[float] | list[int] = normalize(weights)
            self.dataset_index, self.dataset_sample_index = helpers.build_blending_indices(
                np.asarray(self.weights, dtype=np.float64), size)
        else:
            self.weights = [int(w) for w in weights]
            self.dataset_index, self.dataset_sample_index = helpers.build_exhaustive_blending_indices(
                np.asarray(self.weights, dtype=np.int64))
        drawn = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for d, (count, dataset) in enumerate(zip(drawn.tolist(), self.datasets)):
            if count > len(dataset):
                raise DataError(f"the {dataset.split_name} blend draws {count} samples from dataset {d} "
                                f"({dataset.dataset_path}), which has only {len(dataset)}; raise the weight of "
                                f"the others or use more data (Megatron: raise mid_level_dataset_surplus)")

    def __len__(self) -> int:
        return len(self.dataset_index)

    def _locate(self, index: int) -> tuple[GPTDataset, int]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for a blend of {len(self)} samples")
        return self.datasets[int(self.dataset_index[index])], int(self.dataset_sample_index[index])

    def text(self, index: int) -> np.ndarray:
        dataset, sample = self._locate(index)
        return dataset.text(sample)

    def sample(self, index: int) -> dict[str, np.ndarray]:
        dataset, sample = self._locate(index)
        return dataset.sample(sample)


def build_split_dataset(data_path: str, *, split_name: SplitName, num_samples: int | None,
                        config: GPTIndexConfig) -> GPTDataset | BlendedDataset:
    """The dataset Megatron's BlendedMegatronDatasetBuilder makes for one split of `data_path`."""
    blend = parse_blend(data_path)
    if len(blend.prefixes) == 1 and blend.weights is None:
        return build_gpt_dataset(blend.prefixes[0], split_name=split_name, num_samples=num_samples, config=config)
    if blend.weights is None:
        datasets = [build_gpt_dataset(p, split_name=split_name, num_samples=None, config=config)
                    for p in blend.prefixes]
        lengths = [len(d) for d in datasets]
        size = None if num_samples is None else min(num_samples, sum(lengths))
        return BlendedDataset(datasets, weights=lengths, size=size)
    if num_samples is None:
        raise DataError(f"the weighted blend {data_path!r} needs a sample count (Megatron refuses client weights "
                        f"without a size); give one, or list the prefixes without weights")
    weights = normalize(blend.weights)
    target = size_per_dataset(weights, num_samples)
    buffered = size_per_dataset(weights, num_samples, surplus=MID_LEVEL_DATASET_SURPLUS)
    datasets = [build_gpt_dataset(p, split_name=split_name, num_samples=n, config=config)
                for p, n in zip(blend.prefixes, buffered)]
    return BlendedDataset(datasets, weights=weights, size=sum(target))

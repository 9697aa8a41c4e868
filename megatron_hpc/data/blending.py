"""Blends of several `.bin/.idx` prefixes ("0.3 A 0.7 B"), as megatron-core 0.16.1 blends them.

Parsing follows Megatron's `get_blend_from_list` (utils.py): either plain prefixes, or alternating
`weight prefix` pairs; weights are normalised. Per split, `build_split_dataset` then does what
`BlendedMegatronDatasetBuilder._build_blended_dataset_splits` does (shared/reference/megatron-and-launchers.md 2.5):

* one prefix and no weights: that prefix's GPTDataset, asked for the split's sample count;
* weights: dataset d builds ceil(ceil(n * w_d) * (1 + 0.005)) samples (the surplus), and the blend has
  sum_d ceil(n * w_d) samples picked by the deterministic greedy `build_blending_indices`;
* no weights: every dataset builds one epoch, weighted by its length, and the blend has
  min(n, total) samples (or exactly every sample, `build_exhaustive_blending_indices`, when n is None).

Like megatron-core's BlendedDataset, the blending indices are cached only when a data cache path is set
(GPTIndexConfig.cache_path, Megatron's --data-cache-path): `{md5}-BlendedDataset-{split}-{description.txt|
dataset_index.npy|dataset_sample_index.npy}` in that directory, the md5 being that of the same description JSON
Megatron writes (class, the datasets' own descriptions, split, weights, size; shared/reference/
megatron-and-launchers.md 2.4), so caches Megatron built are reused and the other way round. Locking, temporary
files and rebuilding a cache that does not fit are index_cache.py's, as for GPTDataset.
"""

from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron_hpc.data import helpers, index_cache
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


BLEND_CACHE_FILES = (index_cache.DESCRIPTION, "dataset_index.npy", "dataset_sample_index.npy")


def blend_description(datasets: Sequence[GPTDataset], *, weights: Sequence[float] | Sequence[int],
                      size: int | None) -> str:
    """megatron-core's BlendedDataset unique_description: the JSON whose md5 names its cache files."""
    identifiers: OrderedDict[str, Any] = OrderedDict()
    identifiers["class"] = "BlendedDataset"
    identifiers["datasets"] = [d.unique_identifiers for d in datasets]
    identifiers["split"] = datasets[0].split_name
    identifiers["weights"] = list(weights)
    identifiers["size"] = size
    return json.dumps(identifiers, indent=4)


class BlendedDataset:
    """Samples drawn from several GPTDatasets by Megatron's blending indices, cached under `cache_path` if given."""

    def __init__(self, datasets: Sequence[GPTDataset], *, weights: Sequence[float] | Sequence[int],
                 size: int | None, cache_path: str | None = None):
        self.datasets = list(datasets)
        self.size = size
        if size is not None:
            self.weights: list[float] | list[int] = normalize(weights)
        else:
            self.weights = [int(w) for w in weights]
        self.split_name = self.datasets[0].split_name
        self.description = blend_description(self.datasets, weights=self.weights, size=size)
        self.cache_paths = None if cache_path is None else index_cache.cache_file_paths(
            cache_path, description=self.description, class_name="BlendedDataset", split_name=self.split_name,
            suffixes=BLEND_CACHE_FILES)
        """The cache files keyed by suffix, or None when there is no cache path (nothing is written)."""
        if self.cache_paths is None:
            arrays, self.built = self._build(), True
        else:
            arrays, self.built = index_cache.load_or_build(self.cache_paths, load=self._load_cached,
                                                           build=self._build_and_save, what="BlendedDataset")
        self.dataset_index, self.dataset_sample_index = arrays

    def build_indices(self) -> tuple[np.ndarray, np.ndarray]:
        """(dataset_index int16, dataset_sample_index int64), as megatron-core's helpers compute them."""
        if self.size is not None:
            return helpers.build_blending_indices(np.asarray(self.weights, dtype=np.float64), self.size)
        return helpers.build_exhaustive_blending_indices(np.asarray(self.weights, dtype=np.int64))

    def _check_draws(self, drawn: Sequence[int]) -> None:
        for d, (count, dataset) in enumerate(zip(drawn, self.datasets)):
            if count > len(dataset):
                raise DataError(f"the {dataset.split_name} blend draws {count} samples from dataset {d} "
                                f"({dataset.dataset_path}), which has only {len(dataset)}; raise the weight of "
                                f"the others or use more data (Megatron: raise mid_level_dataset_surplus)")

    def _build(self) -> tuple[np.ndarray, np.ndarray]:
        dataset_index, dataset_sample_index = self.build_indices()
        self._check_draws(np.bincount(dataset_index, minlength=len(self.datasets)).tolist())
        return dataset_index, dataset_sample_index

    def _build_and_save(self) -> tuple[np.ndarray, np.ndarray]:
        assert self.cache_paths is not None
        arrays = self._build()
        index_cache.write_arrays(self.cache_paths, description=self.description,
                                 arrays=dict(zip(BLEND_CACHE_FILES[1:], arrays)))
        return arrays

    def _load_cached(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The cached indices if both files load with the expected shapes and dtypes and draw each dataset's
        samples 0, 1, 2, ... (checked by counts and at the ends); else None."""
        assert self.cache_paths is not None
        length = self.size if self.size is not None else sum(self.weights)
        expected = {"dataset_index.npy": ((length,), (np.dtype(np.int16),)),
                    "dataset_sample_index.npy": ((length,), (np.dtype(np.int64),))}
        arrays = index_cache.read_arrays(self.cache_paths, description=self.description, expected=expected)
        if arrays is None:
            return None
        dataset_index, sample_index = arrays["dataset_index.npy"], arrays["dataset_sample_index.npy"]
        if length == 0:
            return dataset_index, sample_index
        try:
            drawn = np.bincount(dataset_index, minlength=len(self.datasets)).tolist()
        except ValueError:  # negative dataset ids
            return None
        if len(drawn) > len(self.datasets) or (self.size is None and drawn != self.weights):
            return None
        last = int(dataset_index[-1])
        if int(sample_index[0]) != 0 or int(sample_index[-1]) != drawn[last] - 1:
            return None
        if any(count > len(dataset) for count, dataset in zip(drawn, self.datasets)):
            return None  # a rebuild either fixes it or raises the oversampling error
        return dataset_index, sample_index

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
        return BlendedDataset(datasets, weights=lengths, size=size, cache_path=config.cache_path)
    if num_samples is None:
        raise DataError(f"the weighted blend {data_path!r} needs a sample count (Megatron refuses client weights "
                        f"without a size); give one, or list the prefixes without weights")
    weights = normalize(blend.weights)
    target = size_per_dataset(weights, num_samples)
    buffered = size_per_dataset(weights, num_samples, surplus=MID_LEVEL_DATASET_SURPLUS)
    datasets = [build_gpt_dataset(p, split_name=split_name, num_samples=n, config=config)
                for p, n in zip(blend.prefixes, buffered)]
    return BlendedDataset(datasets, weights=weights, size=sum(target), cache_path=config.cache_path)

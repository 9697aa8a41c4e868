"""Megatron's GPTDataset over a `.bin/.idx` pair: split ranges, epochs, the document/sample/shuffle indices,
their cache files, and sample retrieval.

Everything here reproduces megatron-core 0.16.1 (`megatron/core/datasets/gpt_dataset.py`, `megatron_dataset.py`,
`blended_megatron_dataset_config.py`, `utils.py`; shared/reference/megatron-and-launchers.md 2.1-2.4) bit for bit:
the same split bookends, the same RNG calls on one `numpy.random.RandomState(seed)` (document index, then
shuffle index), the same sample index, and cache files with the same names, description JSON and md5, so a cache
Megatron built is reused here and the other way round. tests/fixtures/megatron_core/ holds what megatron-core
itself produced.

Unlike Megatron (rank 0 builds, the others wait at a barrier), any process may build a missing cache: it takes
a file lock, writes under temporary names and renames (index_cache.py), so concurrent builders on one filesystem
produce one cache and nodes without a shared filesystem each build their own. A cache file that does not load or
does not have the shapes the configuration implies is rebuilt, not trusted.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from megatron_hpc.data import helpers, index_cache
from megatron_hpc.data.indexed import IndexedDataset
from megatron_hpc.errors import DataError

SplitName = Literal["train", "valid", "test"]
SPLITS: tuple[SplitName, ...] = ("train", "valid", "test")
PAD_TOKEN_ID = -1
"""Megatron's _PAD_TOKEN_ID: pads short samples; padded positions get token 0 and loss mask 0."""
NULL_TOKENIZER: Mapping[str, Any] = {"class": "megatron.core.tokenizers.text.libraries.null_tokenizer.NullTokenizer"}
"""unique_identifiers of megatron-core's NullTokenizer, the default `tokenizer` entry of the description."""
FINAL_EPOCH_THRESHOLD = 0.80
"""A final epoch that supplies fewer than this share of an epoch's samples is shuffled on its own."""
CACHE_FILES = (index_cache.DESCRIPTION, "document_index.npy", "sample_index.npy", "shuffle_index.npy")


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTIndexConfig:
    """The GPTDatasetConfig fields that shape the indices (and the cache key)."""

    seed: int
    """Megatron random_seed (--seed): seeds the one RandomState used for the document and shuffle indices."""
    seq_length: int
    """Tokens per sample seen by the model; each sample reads seq_length + 1 tokens."""
    split: str
    """The --split string exactly as given (it is part of the cache key), e.g. "969,30,1"."""
    cache_path: str | None = None
    """--data-cache-path; None means <prefix>/cache/GPTDataset_indices next to the data, as Megatron does."""
    tokenizer: Mapping[str, Any] = field(default_factory=lambda: dict(NULL_TOKENIZER))
    """The tokenizer's unique_identifiers as Megatron writes them into description.txt. They do not change the
    indices, only the md5: to reuse a cache a Megatron run built, pass the "tokenizer" object of its
    description.txt."""
    add_extra_token: bool = True
    """Read seq_length + 1 tokens per sample (Megatron's add_extra_token_to_sequence)."""
    drop_last_partial_validation_sequence: bool = True
    """Drop the last, partial sample of the valid split (otherwise it is padded and loss-masked)."""


def parse_split(split: str) -> list[float]:
    """"969,30,1" -> [0.969, 0.03, 0.001]: numbers in the string, padded with zeros to 3, summing to 1."""
    try:
        values = [float(x) for x in re.findall(r"[.0-9]+", split)]
    except ValueError as err:
        raise DataError(f"data.split {split!r} does not parse ({err}); use weights such as \"969,30,1\"") from None
    if not 1 <= len(values) <= len(SPLITS) or sum(values) <= 0:
        raise DataError(f"data.split {split!r} must give 1 to 3 non-negative weights with a positive sum, "
                        f"e.g. \"969,30,1\"")
    values += [0.0] * (len(SPLITS) - len(values))
    w = np.array(values, dtype=np.float64)
    return (w / w.sum()).tolist()


def split_matrix(split: str) -> list[tuple[float, float] | None]:
    """Bookends per split from the cumulative weights; an empty split is None. The first bookend starts at the
    int 0, exactly as Megatron builds it (it shows as `0` in the description JSON)."""
    ends: list[float] = [0]
    for weight in parse_split(split):
        ends.append(ends[-1] + weight)
    return [None if hi <= lo else (lo, hi) for lo, hi in itertools.pairwise(ends)]


def split_sequences(num_sequences: int, bookend: tuple[float, float]) -> np.ndarray:
    """The contiguous int32 range of sequence ids a split covers."""
    # round() of a float is already an int (banker's rounding, as in Megatron).
    begin = round(bookend[0] * float(num_sequences))
    end = round(bookend[1] * float(num_sequences))
    return np.arange(begin, end, dtype=np.int32)


def unique_identifiers(*, dataset_path: str, num_samples: int | None, split_name: SplitName,
                       config: GPTIndexConfig) -> OrderedDict[str, Any]:
    """Megatron's MegatronDataset.unique_identifiers, in its key order."""
    identifiers: OrderedDict[str, Any] = OrderedDict()
    identifiers["class"] = "GPTDataset"
    identifiers["dataset_path"] = dataset_path
    identifiers["num_samples"] = num_samples
    identifiers["index_split"] = split_name
    identifiers["random_seed"] = config.seed
    identifiers["sequence_length"] = config.seq_length
    identifiers["split"] = config.split
    identifiers["split_matrix"] = split_matrix(config.split)
    identifiers["tokenizer"] = dict(config.tokenizer)
    return identifiers


def description(*, dataset_path: str, num_samples: int | None, split_name: SplitName,
                config: GPTIndexConfig) -> str:
    """Megatron's unique_description: the JSON whose md5 names the cache files."""
    return json.dumps(unique_identifiers(dataset_path=dataset_path, num_samples=num_samples, split_name=split_name,
                                         config=config), indent=4)


def cache_dir(prefix: str, config: GPTIndexConfig) -> str:
    return config.cache_path or os.path.join(prefix, "cache", "GPTDataset_indices")


def cache_paths(directory: str, description_text: str, split_name: SplitName) -> dict[str, str]:
    """The four cache files, keyed by suffix: `{md5}-GPTDataset-{split}-{suffix}`."""
    return index_cache.cache_file_paths(directory, description=description_text, class_name="GPTDataset",
                                        split_name=split_name, suffixes=CACHE_FILES)


@dataclass(frozen=True, slots=True)
class EpochPlan:
    num_epochs: int
    separate_final_epoch: bool
    num_samples_sans_final_epoch: int
    """Samples before the final epoch; the shuffle index permutes them apart from the rest when separated."""


def plan_epochs(*, tokens_per_epoch: int, num_samples: int | None, seq_length: int, extra: int) -> EpochPlan:
    """Epochs needed for num_samples samples (one when None), and whether the final one is shuffled alone."""
    num_epochs = 1
    if num_samples is not None:
        needed = num_samples * seq_length + extra
        num_epochs = max(1, -(-needed // tokens_per_epoch))  # fewest epochs whose tokens reach `needed`
    if num_epochs == 1:
        return EpochPlan(1, False, 0)
    assert num_samples is not None
    sans_final = ((num_epochs - 1) * tokens_per_epoch - extra) // seq_length
    per_epoch = (tokens_per_epoch - extra) // seq_length
    separate = num_samples - sans_final < int(FINAL_EPOCH_THRESHOLD * per_epoch)
    return EpochPlan(num_epochs, separate, sans_final)


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, *,
                         separate_final_epoch: bool) -> np.ndarray:
    """Sequence ids repeated num_epochs times, shuffled (the final epoch on its own when separated), int32."""
    if separate_final_epoch and num_epochs > 1:
        first = build_document_index(documents, num_epochs - 1, rng, separate_final_epoch=False)
        last = build_document_index(documents, 1, rng, separate_final_epoch=False)
        return np.concatenate((first, last))
    index = np.tile(documents, num_epochs).astype(np.int32)
    rng.shuffle(index)
    return index


def build_shuffle_index(num_samples: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """Permutation of [0, num_samples) followed by one of [num_samples, total); uint32 unless total is huge."""
    dtype = np.int64 if total >= np.iinfo(np.uint32).max - 1 else np.uint32
    first = np.arange(0, num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total:
        return first
    rest = np.arange(num_samples, total, dtype=dtype)
    rng.shuffle(rest)
    return np.concatenate((first, rest))


class GPTDataset:
    """One split of one `.bin/.idx` prefix, sampled as Megatron's GPTDataset samples it."""

    def __init__(self, dataset: IndexedDataset, *, indices: np.ndarray, num_samples: int | None,
                 split_name: SplitName, config: GPTIndexConfig, dataset_path: str | None = None):
        self.dataset = dataset
        self.dataset_path = dataset.prefix if dataset_path is None else dataset_path
        self.indices = indices
        self.num_samples = num_samples
        self.split_name = split_name
        self.config = config
        self.extra = int(config.add_extra_token)
        self.unique_identifiers = unique_identifiers(dataset_path=self.dataset_path, num_samples=num_samples,
                                                     split_name=split_name, config=config)
        self.description = json.dumps(self.unique_identifiers, indent=4)
        self.cache_paths = cache_paths(cache_dir(dataset.prefix, config), self.description, split_name)
        self.tokens_per_epoch = int(np.sum(dataset.sequence_lengths[indices], dtype=np.int64))
        if self.tokens_per_epoch <= self.extra + 1:
            span = f"[{indices[0]}, {indices[-1] + 1})" if len(indices) else "no sequences"
            raise DataError(f"the {split_name} split of {self.dataset_path} ({span} of {len(dataset)} sequences) "
                            f"holds {self.tokens_per_epoch} tokens, too few for a sample; give it more weight in "
                            f"data.split (now {config.split!r}) or use more data")
        lengths = dataset.sequence_lengths
        self.max_sequence_length = int(lengths.max()) if len(lengths) else 0
        self.plan = plan_epochs(tokens_per_epoch=self.tokens_per_epoch, num_samples=num_samples,
                                seq_length=config.seq_length, extra=self.extra)
        self.built = False
        """Whether this object built the indices (False: loaded from the cache)."""
        self.document_index, self.sample_index, self.shuffle_index = self._load_or_build()

    @property
    def drop_last_partial_sequence(self) -> bool:
        return self.split_name != "valid" or self.config.drop_last_partial_validation_sequence

    def build_indices(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(document, sample, shuffle) indices, computed in Megatron's RNG call order."""
        rng = np.random.RandomState(self.config.seed)
        document_index = build_document_index(self.indices, self.plan.num_epochs, rng,
                                              separate_final_epoch=self.plan.separate_final_epoch)
        sample_index = helpers.build_sample_idx(
            np.asarray(self.dataset.sequence_lengths), document_index, seq_length=self.config.seq_length,
            num_epochs=self.plan.num_epochs, tokens_per_epoch=self.tokens_per_epoch,
            drop_last_partial_sequence=self.drop_last_partial_sequence, add_extra_token=bool(self.extra))
        total = sample_index.shape[0] - 1
        first = self.plan.num_samples_sans_final_epoch if self.plan.separate_final_epoch else total
        return document_index, sample_index, build_shuffle_index(first, total, rng)

    def _expected_shapes(self) -> dict[str, tuple[tuple[int, ...], tuple[np.dtype, ...]]]:
        total = helpers.num_samples_in_index(
            num_epochs=self.plan.num_epochs, tokens_per_epoch=self.tokens_per_epoch,
            seq_length=self.config.seq_length, drop_last_partial_sequence=self.drop_last_partial_sequence,
            add_extra_token=self.extra)
        docs = self.plan.num_epochs * len(self.indices)
        sample_dtype = helpers.sample_index_dtype(num_documents=docs, max_sequence_length=self.max_sequence_length)
        shuffle_dtype = np.dtype(np.int64 if total >= np.iinfo(np.uint32).max - 1 else np.uint32)
        return {"document_index.npy": ((docs,), (np.dtype(np.int32),)),
                "sample_index.npy": ((total + 1, 2), (sample_dtype,)),
                "shuffle_index.npy": ((total,), (shuffle_dtype,))}

    def _load_cached(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The cached indices if all four files exist, load, and fit this configuration; else None. A cache built
        under another tokenizer identity (a Megatron run's) serves too: the tokenizer does not change the indices."""
        expected = self._expected_shapes()
        arrays = index_cache.read_arrays(self.cache_paths, description=self.description, expected=expected)
        if arrays is None:
            other = index_cache.equivalent_cache(os.path.dirname(self.cache_paths[index_cache.DESCRIPTION]),
                                                 class_name="GPTDataset", split_name=self.split_name,
                                                 identifiers=self.unique_identifiers, ignore=("tokenizer",),
                                                 suffixes=CACHE_FILES)
            if other is not None:
                arrays = index_cache.read_arrays(other[0], description=other[1], expected=expected)
        if arrays is None:
            return None
        sample, docs, shuffle = arrays["sample_index.npy"], arrays["document_index.npy"], arrays["shuffle_index.npy"]
        ends_ok = (sample[0].tolist() == [0, 0] and 0 <= int(sample[-1, 0]) < len(docs)
                   and (len(shuffle) == 0 or 0 <= int(shuffle[0]) < len(shuffle)))
        return (docs, sample, shuffle) if ends_ok else None

    def _load_or_build(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        def build() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            arrays = self.build_indices()
            index_cache.write_arrays(self.cache_paths, description=self.description,
                                     arrays=dict(zip(CACHE_FILES[1:], arrays)))
            return arrays

        arrays, self.built = index_cache.load_or_build(self.cache_paths, load=self._load_cached, build=build,
                                                       what="GPTDataset")
        return arrays

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def text(self, index: int) -> np.ndarray:
        """The seq_length + 1 token ids (int64) of sample `index`; a short sample ends in PAD_TOKEN_ID."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for the {len(self)} samples of {self.dataset_path} "
                             f"({self.split_name})")
        position = int(self.shuffle_index[index])
        (first, first_offset), (last, last_offset) = self.sample_index[position].tolist(), \
            self.sample_index[position + 1].tolist()
        parts = []
        for doc in range(first, last + 1):
            offset = first_offset if doc == first else 0
            length = last_offset - offset + self.extra if doc == last else None
            parts.append(self.dataset.get(int(self.document_index[doc]), offset, length))
        want = self.config.seq_length + self.extra
        text = np.concatenate(parts).astype(np.int64)
        if len(text) < want:
            text = np.concatenate((text, np.full(want - len(text), PAD_TOKEN_ID, dtype=np.int64)))
        return text

    def sample(self, index: int) -> dict[str, np.ndarray]:
        """tokens, labels (int64) and loss_mask (0/1 int64) of sample `index`, as Megatron's __getitem__ gives
        them: padding is masked out of the loss and mapped to token id 0."""
        text = self.text(index)
        if self.extra:
            tokens, labels = text[:-1].copy(), text[1:].copy()
        else:
            tokens, labels = text.copy(), np.roll(text, -1)
            labels[-1] = PAD_TOKEN_ID
        loss_mask = (labels != PAD_TOKEN_ID).astype(np.int64)
        tokens[tokens == PAD_TOKEN_ID] = 0
        labels[labels == PAD_TOKEN_ID] = 0
        return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask}


def build_gpt_dataset(prefix: str, *, split_name: SplitName, num_samples: int | None,
                      config: GPTIndexConfig) -> GPTDataset:
    """The `split_name` split of one prefix, with Megatron's contiguous split ranges over sequences."""
    dataset = IndexedDataset(prefix)
    bookend = split_matrix(config.split)[SPLITS.index(split_name)]
    if bookend is None:
        raise DataError(f"data.split {config.split!r} gives the {split_name} split no weight; give it a "
                        f"positive weight to read it")
    return GPTDataset(dataset, indices=split_sequences(len(dataset), bookend), num_samples=num_samples,
                      split_name=split_name, config=config, dataset_path=prefix)

"""Blend parsing, per-dataset sizes, and blended samples against megatron-core 0.16.1 (fixtures)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from megatron_hpc.data.blending import (
    BlendedDataset,
    build_split_dataset,
    normalize,
    parse_blend,
    size_per_dataset,
)
from megatron_hpc.data.gpt_dataset import SPLITS, GPTIndexConfig
from megatron_hpc.errors import DataError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "megatron_core"
CASES = json.loads((FIXTURES / "expected.json").read_text())["cases"]
BLENDS = [(name, split) for name in ("blend_weighted", "blend_plain") for split in SPLITS]


def test_parse_weighted_and_plain() -> None:
    blend = parse_blend("0.3 A 0.7 B")
    assert blend.prefixes == ("A", "B") and blend.weights == (0.3, 0.7)
    assert parse_blend("A").weights is None and parse_blend("A B").prefixes == ("A", "B")
    assert parse_blend("30 ~/x").prefixes[0].endswith("/x") and not parse_blend("30 ~/x").prefixes[0].startswith("~")


@pytest.mark.parametrize("bad", ["", "0.3 A B", "A 0.3", "0.3 0.7", "0 A 1 B", "-1 A 2 B", "nan A 1 B",
                                 "inf A 1 B", "A 0.5 B 0.5"])
def test_bad_blends_raise(bad: str) -> None:
    with pytest.raises(DataError, match=r"data\.path"):
        parse_blend(bad)


def test_sizes_with_surplus() -> None:
    weights = normalize([3, 7])
    assert weights == [0.3, 0.7]
    assert size_per_dataset(weights, 60) == [18, 42]
    # ceil(ceil(60 * 0.3) * 1.005) = ceil(18.09) = 19
    assert size_per_dataset(weights, 60, surplus=0.005) == [19, 43]
    assert size_per_dataset(normalize([1, 1, 1]), 10) == [4, 4, 4]


@pytest.fixture
def corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    shutil.copytree(FIXTURES / "data", tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize(("name", "split"), BLENDS)
def test_blend_equals_megatron_core(corpus: Path, name: str, split: str) -> None:
    case, entry = CASES[name], CASES[name]["splits"][split]
    config = GPTIndexConfig(seed=case["seed"], seq_length=case["seq_length"], split=case["split"])
    dataset = build_split_dataset(case["data_path"], split_name=split,
                                  num_samples=case["sizes"][SPLITS.index(split)], config=config)
    assert isinstance(dataset, BlendedDataset)
    assert dataset.size == entry["size"] and dataset.weights == entry["weights"]
    assert dataset.dataset_index.tolist() == entry["dataset_index"]
    assert dataset.dataset_sample_index.tolist() == entry["dataset_sample_index"]
    for ours, theirs in zip(dataset.datasets, entry["datasets"]):
        assert ours.num_samples == theirs["num_samples"]
        assert ours.description == theirs["description"]
        assert ours.shuffle_index.tolist() == theirs["shuffle_index"]
    for key in ("tokens", "labels", "loss_mask"):
        assert [dataset.sample(i)[key].tolist() for i in range(len(dataset))] == entry["samples"][key]


def test_plain_blend_without_count_draws_every_sample(corpus: Path) -> None:
    config = GPTIndexConfig(seed=3, seq_length=16, split="8,1,1")
    dataset = build_split_dataset("data/corpus_a data/corpus_b", split_name="train", num_samples=None, config=config)
    assert dataset.size is None
    np.testing.assert_array_equal(np.bincount(dataset.dataset_index), [len(d) for d in dataset.datasets])
    with pytest.raises(DataError, match="needs a sample count"):
        build_split_dataset("1 data/corpus_a 2 data/corpus_b", split_name="train", num_samples=None, config=config)


def test_oversampled_blend_raises(corpus: Path) -> None:
    config = GPTIndexConfig(seed=3, seq_length=16, split="8,1,1")
    a = build_split_dataset("data/corpus_a", split_name="train", num_samples=None, config=config)
    with pytest.raises(DataError, match="draws"):
        BlendedDataset([a, a], weights=[0.9, 0.1], size=2 * len(a))

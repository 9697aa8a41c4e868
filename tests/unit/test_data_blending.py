"""Blend parsing, per-dataset sizes, blended samples and blend index caches against megatron-core 0.16.1."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import OrderedDict
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


# md5 in the names of the BlendedDataset cache files megatron-core 0.16.1 wrote for the fixture blends, with
# GPTDatasetConfig(path_to_cache=...) and otherwise the settings of tests/fixtures/make_megatron_core_expected.py
# (its BlendedDataset needs torch.distributed initialised to write a cache: gloo, world size 1).
MEGATRON_BLEND_MD5 = {
    ("blend_weighted", "train"): "5acb2f9bd583a1240faf7850f706c985",
    ("blend_weighted", "valid"): "f35c1e5556816a5aa88273ae17d66fd7",
    ("blend_weighted", "test"): "ab84316c47022dc0c7d5edec6b493f81",
    ("blend_plain", "train"): "c38c4ee01ad5c13df2734cf9f4d30e90",
    ("blend_plain", "valid"): "9fbe4820d9a18b86c370ec9b81423d82",
    ("blend_plain", "test"): "d185a51047e9456fc277378254a20cdb",
}


def _megatron_description(split: str, entry: dict) -> str:
    """The description megatron-core's BlendedDataset writes (shared/reference 2.4), built here from the values
    megatron-core produced for the fixture: class, its datasets' own descriptions, split, weights, size."""
    datasets = [json.loads(d["description"], object_pairs_hook=OrderedDict) for d in entry["datasets"]]
    return json.dumps(OrderedDict([("class", "BlendedDataset"), ("datasets", datasets), ("split", split),
                                   ("weights", entry["weights"]), ("size", entry["size"])]), indent=4)


def _build_blend(name: str, split: str, cache_path: str | None = "blend_cache") -> BlendedDataset:
    case = CASES[name]
    config = GPTIndexConfig(seed=case["seed"], seq_length=case["seq_length"], split=case["split"],
                            cache_path=cache_path)
    dataset = build_split_dataset(case["data_path"], split_name=split,
                                  num_samples=case["sizes"][SPLITS.index(split)], config=config)
    assert isinstance(dataset, BlendedDataset)
    return dataset


def _blend_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if "BlendedDataset" in p.name and not p.name.endswith(".lock"))


@pytest.mark.parametrize(("name", "split"), BLENDS)
def test_blend_cache_is_written_as_megatron_core_names_it(corpus: Path, name: str, split: str) -> None:
    entry = CASES[name]["splits"][split]
    dataset = _build_blend(name, split)
    assert dataset.built
    description = _megatron_description(split, entry)
    md5 = hashlib.md5(description.encode("utf-8")).hexdigest()
    assert md5 == MEGATRON_BLEND_MD5[(name, split)]
    base = f"{md5}-BlendedDataset-{split}-"
    assert _blend_files(corpus / "blend_cache") == [base + "dataset_index.npy", base + "dataset_sample_index.npy",
                                                   base + "description.txt"]
    assert (corpus / "blend_cache" / (base + "description.txt")).read_text() == description
    dataset_index = np.load(corpus / "blend_cache" / (base + "dataset_index.npy"))
    sample_index = np.load(corpus / "blend_cache" / (base + "dataset_sample_index.npy"))
    assert dataset_index.dtype == np.int16 and dataset_index.tolist() == entry["dataset_index"]
    assert sample_index.dtype == np.int64 and sample_index.tolist() == entry["dataset_sample_index"]


def test_blend_cache_is_read_on_the_second_build(corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = _build_blend("blend_weighted", "train")
    stamps = {p.name: p.stat().st_mtime_ns for p in (corpus / "blend_cache").iterdir()}

    def no_build(self: BlendedDataset) -> None:
        raise AssertionError("the blending indices were rebuilt instead of read from the cache")

    monkeypatch.setattr(BlendedDataset, "build_indices", no_build)
    second = _build_blend("blend_weighted", "train")
    assert not second.built and isinstance(second.dataset_index, np.memmap)
    np.testing.assert_array_equal(second.dataset_index, first.dataset_index)
    np.testing.assert_array_equal(second.dataset_sample_index, first.dataset_sample_index)
    assert {p.name: p.stat().st_mtime_ns for p in (corpus / "blend_cache").iterdir()} == stamps


@pytest.mark.parametrize(("name", "split"), [("blend_weighted", "train"), ("blend_plain", "valid")])
def test_blend_indices_are_the_same_with_and_without_cache(corpus: Path, name: str, split: str) -> None:
    cached, uncached = _build_blend(name, split), _build_blend(name, split, cache_path=None)
    assert cached.built and uncached.cache_paths is None
    for a, b in ((cached.dataset_index, uncached.dataset_index),
                 (cached.dataset_sample_index, uncached.dataset_sample_index)):
        assert a.dtype == b.dtype and a.tolist() == b.tolist()
    reread = _build_blend(name, split)
    assert not reread.built and reread.dataset_index.tolist() == uncached.dataset_index.tolist()
    assert [reread.sample(i)["tokens"].tolist() for i in range(len(reread))] == \
        [uncached.sample(i)["tokens"].tolist() for i in range(len(uncached))]


def test_no_cache_path_writes_no_blend_cache(corpus: Path) -> None:
    dataset = _build_blend("blend_weighted", "train", cache_path=None)
    assert dataset.built and dataset.cache_paths is None
    assert not [p for p in corpus.rglob("*") if "BlendedDataset" in p.name]


@pytest.mark.parametrize("damage", ["truncate", "garbage", "wrong_dtype", "wrong_length", "bad_dataset_id",
                                    "bad_sample_index", "description", "missing"])
def test_corrupt_blend_cache_is_rebuilt(corpus: Path, damage: str) -> None:
    entry = CASES["blend_weighted"]["splits"]["train"]
    paths = _build_blend("blend_weighted", "train").cache_paths
    assert paths is not None
    dataset_index, sample_index = paths["dataset_index.npy"], paths["dataset_sample_index.npy"]
    if damage == "truncate":
        data = Path(sample_index).read_bytes()
        Path(sample_index).write_bytes(data[: len(data) - 40])
    elif damage == "garbage":
        Path(dataset_index).write_bytes(b"\x93NUMPY garbage")
    elif damage == "wrong_dtype":
        np.save(dataset_index, np.asarray(entry["dataset_index"], dtype=np.int64))
    elif damage == "wrong_length":
        np.save(sample_index, np.asarray(entry["dataset_sample_index"][:-1], dtype=np.int64))
    elif damage == "bad_dataset_id":
        np.save(dataset_index, np.full(len(entry["dataset_index"]), 7, dtype=np.int16))
    elif damage == "bad_sample_index":
        np.save(sample_index, np.zeros(len(entry["dataset_sample_index"]), dtype=np.int64))
    elif damage == "description":
        Path(paths["description.txt"]).write_text("{}")
    else:
        os.unlink(dataset_index)
    rebuilt = _build_blend("blend_weighted", "train")
    assert rebuilt.built
    assert rebuilt.dataset_index.tolist() == entry["dataset_index"]
    assert rebuilt.dataset_sample_index.tolist() == entry["dataset_sample_index"]
    again = _build_blend("blend_weighted", "train")
    assert not again.built and again.dataset_sample_index.tolist() == entry["dataset_sample_index"]

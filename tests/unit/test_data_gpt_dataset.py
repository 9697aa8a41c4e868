"""GPTDataset indices, samples and cache files against what megatron-core 0.16.1 produced.

Expected values: tests/fixtures/megatron_core/expected.json and megatron_cache/, written by
tests/fixtures/make_megatron_core_expected.py running the real megatron-core (never by the code under test).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from megatron_hpc.data import helpers
from megatron_hpc.data.gpt_dataset import (
    SPLITS,
    GPTDataset,
    GPTIndexConfig,
    build_gpt_dataset,
    parse_split,
    split_matrix,
)
from megatron_hpc.errors import DataError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "megatron_core"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
CASES = EXPECTED["cases"]
SINGLE = [(name, split) for name, case in CASES.items() if "blend" not in name
          for split, entry in case["splits"].items() if entry and entry["length"] > 0]


@pytest.fixture
def corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the fixture corpora; the cwd is its parent, so "data/corpus_a" resolves as in the fixtures."""
    shutil.copytree(FIXTURES / "data", tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _config(case: dict, **overrides: object) -> GPTIndexConfig:
    return GPTIndexConfig(seed=case["seed"], seq_length=case["seq_length"], split=case["split"],
                          drop_last_partial_validation_sequence=case["drop_last_partial_validation_sequence"],
                          **overrides)


def _build(name: str, split: str, **overrides: object) -> GPTDataset:
    case = CASES[name]
    num_samples = case["sizes"][SPLITS.index(split)]
    return build_gpt_dataset(case["data_path"], split_name=split, num_samples=num_samples,
                             config=_config(case, **overrides))


def test_fixtures_cover_the_epoch_cases(corpus: Path) -> None:
    plans = {(name, split): _build(name, split).plan for name, split in SINGLE}
    assert any(p.num_epochs == 1 for p in plans.values())
    assert any(p.num_epochs > 1 and p.separate_final_epoch for p in plans.values())
    assert any(p.num_epochs > 1 and not p.separate_final_epoch for p in plans.values())
    assert {split for _, split in SINGLE} == set(SPLITS)


@pytest.mark.parametrize("native", [True, False], ids=["extension", "numpy"])
@pytest.mark.parametrize(("name", "split"), SINGLE)
def test_indices_and_samples_equal_megatron_core(corpus: Path, monkeypatch: pytest.MonkeyPatch, name: str,
                                                 split: str, native: bool) -> None:
    if not native:
        monkeypatch.setattr(helpers, "_native", None)
    entry = CASES[name]["splits"][split]
    want = entry["dataset"]
    dataset = _build(name, split)
    assert dataset.built
    assert dataset.description == want["description"]
    assert [os.path.basename(p) for p in dataset.cache_paths.values()] == want["cache_files"]
    assert dataset.tokens_per_epoch == want["num_tokens_per_epoch"]
    assert dataset.document_index.dtype == np.int32
    assert str(dataset.sample_index.dtype) == want["sample_index_dtype"]
    assert str(dataset.shuffle_index.dtype) == want["shuffle_index_dtype"]
    assert dataset.document_index.tolist() == want["document_index"]
    assert dataset.sample_index.tolist() == want["sample_index"]
    assert dataset.shuffle_index.tolist() == want["shuffle_index"]
    assert len(dataset) == entry["length"]
    samples = [dataset.sample(i) for i in range(len(dataset))]
    for key in ("tokens", "labels", "loss_mask"):
        assert [s[key].tolist() for s in samples] == entry["samples"][key], key


def test_padded_validation_sample_is_masked(corpus: Path) -> None:
    dataset = _build("valid_padded", "valid")
    last = dataset.sample(int(np.flatnonzero(dataset.shuffle_index == len(dataset) - 1)[0]))
    assert 0 < last["loss_mask"].sum() < len(last["loss_mask"])
    first_pad = int(np.flatnonzero(last["loss_mask"] == 0)[0])
    assert not last["loss_mask"][first_pad:].any()
    assert not last["labels"][first_pad:].any() and not last["tokens"][first_pad + 1:].any()


def test_cache_written_by_megatron_core_is_reused(corpus: Path) -> None:
    cache = corpus / "data" / "corpus_a" / "cache" / "GPTDataset_indices"  # Megatron's default location
    shutil.copytree(FIXTURES / "megatron_cache", cache)
    before = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    for split in SPLITS:
        dataset = _build("one_epoch", split)
        assert not dataset.built, split
        want = CASES["one_epoch"]["splits"][split]["dataset"]
        assert np.asarray(dataset.sample_index).tolist() == want["sample_index"]
        assert isinstance(dataset.shuffle_index, np.memmap)
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == before


def _retitled_megatron_cache(cache: Path, **changes: object) -> None:
    """The fixture cache as a Megatron run with other description values would have named it (md5 of its own
    description), e.g. one that passed --tokenizer-type GPT2BPETokenizer instead of the default NullTokenizer."""
    cache.mkdir(parents=True)
    for desc in sorted(FIXTURES.joinpath("megatron_cache").glob("*-description.txt")):
        identifiers = json.loads(desc.read_text(), object_pairs_hook=OrderedDict)
        identifiers.update(changes)
        text = json.dumps(identifiers, indent=4)
        digest = hashlib.md5(text.encode()).hexdigest()
        old = desc.name[: -len("description.txt")]
        new = f"{digest}-{old.split('-', 1)[1]}"
        (cache / f"{new}description.txt").write_text(text)
        for suffix in ("document_index.npy", "sample_index.npy", "shuffle_index.npy"):
            shutil.copy(desc.with_name(old + suffix), cache / (new + suffix))


def test_megatron_cache_of_another_tokenizer_is_reused(corpus: Path) -> None:
    cache = corpus / "data" / "corpus_a" / "cache" / "GPTDataset_indices"
    gpt2 = {"class": "_GPT2BPETokenizer", "tokenizer_path": ["gpt2-vocab.json", "gpt2-merges.txt"]}
    _retitled_megatron_cache(cache, tokenizer=gpt2)
    before = sorted(p.name for p in cache.iterdir())
    for split in SPLITS:
        dataset = _build("one_epoch", split)
        assert not dataset.built, split
        want = CASES["one_epoch"]["splits"][split]["dataset"]["sample_index"]
        assert np.asarray(dataset.sample_index).tolist() == want
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == before


def test_megatron_cache_of_another_seed_is_not_reused(corpus: Path) -> None:
    cache = corpus / "data" / "corpus_a" / "cache" / "GPTDataset_indices"
    _retitled_megatron_cache(cache, random_seed=CASES["one_epoch"]["seed"] + 1)
    assert _build("one_epoch", "train").built


def test_our_cache_is_what_megatron_core_writes(corpus: Path) -> None:
    _build("one_epoch", "train")
    ours = corpus / "data" / "corpus_a" / "cache" / "GPTDataset_indices"
    theirs = FIXTURES / "megatron_cache"
    names = sorted(p.name for p in ours.iterdir() if not p.name.endswith(".lock"))
    assert names == sorted(p.name for p in theirs.iterdir() if "-train-" in p.name)
    for name in names:
        if name.endswith(".npy"):
            a, b = np.load(ours / name), np.load(theirs / name)
            assert a.dtype == b.dtype and a.tolist() == b.tolist()
        else:
            assert (ours / name).read_text() == (theirs / name).read_text()


@pytest.mark.parametrize("damage", ["truncate", "garbage", "wrong_shape", "missing", "description"])
def test_corrupt_cache_is_rebuilt(corpus: Path, damage: str) -> None:
    first = _build("multi_epoch_separate", "train", cache_path="cache")
    paths = first.cache_paths
    if damage == "truncate":
        data = Path(paths["sample_index.npy"]).read_bytes()
        Path(paths["sample_index.npy"]).write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        Path(paths["shuffle_index.npy"]).write_bytes(b"not a numpy file")
    elif damage == "wrong_shape":
        np.save(paths["document_index.npy"], np.zeros(3, dtype=np.int32))
    elif damage == "missing":
        os.unlink(paths["shuffle_index.npy"])
    else:
        Path(paths["description.txt"]).write_text("{}")
    second = _build("multi_epoch_separate", "train", cache_path="cache")
    assert second.built
    want = CASES["multi_epoch_separate"]["splits"]["train"]["dataset"]
    assert second.shuffle_index.tolist() == want["shuffle_index"]
    third = _build("multi_epoch_separate", "train", cache_path="cache")
    assert not third.built and np.asarray(third.sample_index).tolist() == want["sample_index"]


def _build_in_process(root: str, barrier, results) -> None:
    os.chdir(root)
    helpers._native = None  # the slow path, so both processes are inside the build at the same time
    case = CASES["one_epoch"]
    config = _config(case, cache_path="shared_cache")
    barrier.wait()
    dataset = build_gpt_dataset(case["data_path"], split_name="train", num_samples=60_000, config=config)
    results.put((dataset.built, np.asarray(dataset.shuffle_index).tolist()[:50], len(dataset)))


def test_two_processes_build_one_cache(corpus: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_build_in_process, args=(str(corpus), barrier, results)) for _ in range(2)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert sorted(built for built, _, _ in outcomes) == [False, True]
    assert outcomes[0][1:] == outcomes[1][1:]
    files = sorted(p.name for p in (corpus / "shared_cache").iterdir())
    assert len([f for f in files if not f.endswith(".lock")]) == 4 and not any(".tmp." in f for f in files)
    reference = _build("one_epoch", "train", cache_path="shared_cache")
    reference_fresh = build_gpt_dataset("data/corpus_a", split_name="train", num_samples=60_000,
                                        config=_config(CASES["one_epoch"], cache_path="fresh"))
    assert reference.built  # a different num_samples: a different md5
    np.testing.assert_array_equal(reference_fresh.shuffle_index[:50], outcomes[0][1])


def test_split_parsing_matches_megatron() -> None:
    assert parse_split("969, 30, 1") == [0.969, 0.03, 0.001]
    assert parse_split("99,1") == [0.99, 0.01, 0.0]
    matrix = split_matrix("8,1,1")
    assert matrix[0] == (0, 0.8) and isinstance(matrix[0][0], int)
    assert split_matrix("1") == [(0, 1.0), None, None]
    for bad in ("", "a,b", "0,0,0", "1,1,1,1"):
        with pytest.raises(DataError, match=r"data\.split"):
            parse_split(bad)


def test_unusable_splits_raise(corpus: Path) -> None:
    with pytest.raises(DataError, match="no weight"):
        build_gpt_dataset("data/corpus_a", split_name="test", num_samples=4,
                          config=GPTIndexConfig(seed=1, seq_length=8, split="1,0,0"))
    # megatron-core returns an empty dataset here (and loops forever when given a sample count).
    assert CASES["no_num_samples"]["splits"]["test"]["length"] == 0
    with pytest.raises(DataError, match="too few"):
        _build("no_num_samples", "test")
    with pytest.raises(DataError, match="not found"):
        build_gpt_dataset("data/nope", split_name="train", num_samples=4,
                          config=GPTIndexConfig(seed=1, seq_length=8, split="1"))

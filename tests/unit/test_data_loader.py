"""The trainer's indexed batch source, gpt_samples for the CLI, and the vocabulary check."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_hpc.config.schema import (
    CompilePhaseConfig,
    DataConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    TrainConfig,
)
from megatron_hpc.data.indexed import IndexedDatasetWriter
from megatron_hpc.data.loader import build_indexed_batches, check_vocabulary, gpt_samples
from megatron_hpc.errors import DataError
from megatron_hpc.plan.batch import BatchLayout
from megatron_hpc.train.entry import plan_for_torchrun, run_training

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "megatron_core"
CASES = json.loads((FIXTURES / "expected.json").read_text())["cases"]


def _corpus(path: Path, *, vocab: int = 300, num_docs: int = 80) -> str:
    prefix = str(path / "corpus")
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as writer:
        for _ in range(num_docs):
            writer.add_document(rng.integers(0, vocab, size=int(rng.integers(1, 50))))
    return prefix


@pytest.mark.parametrize(("dp_size", "mbs", "gbs"), [(1, 2, 8), (2, 2, 8), (4, 1, 8), (2, 3, 12)])
def test_dp_slices_are_disjoint_and_cover_the_global_batch(tmp_path: Path, dp_size: int, mbs: int,
                                                           gbs: int) -> None:
    data = DataConfig(source="indexed", path=_corpus(tmp_path), split="90,5,5", cache_path=str(tmp_path / "cache"))
    layout = BatchLayout(micro_batch_size=mbs, global_batch_size=gbs, num_micro_batches=gbs // (mbs * dp_size),
                         data_parallel=dp_size)
    loaders = [build_indexed_batches(data, seq_length=16, seed=5, num_steps=3, layout=layout, dp_rank=r)
               for r in range(dp_size)]
    dataset = loaders[0].dataset
    assert dataset.num_samples == 3 * gbs  # Megatron: train_iters * global_batch_size
    for step in range(3):
        rows = []
        for loader in loaders:
            batches = loader.micro_batches(step)
            assert len(batches) == gbs // (mbs * dp_size)
            for batch in batches:
                assert batch.shape == (mbs, 17) and batch.dtype == torch.int64
                rows.extend(batch.tolist())
        want = [dataset.text(i).tolist() for i in range(step * gbs, (step + 1) * gbs)]
        assert sorted(rows) == sorted(want)  # the union is the global batch, each sample once
        assert len(rows) == gbs
    # Rank r, micro-batch m of step k reads ids k*GBS + m*mbs*dp + r*mbs + [0, mbs).
    first = loaders[-1].micro_batches(1)[0]
    start = gbs + (dp_size - 1) * mbs
    assert first.tolist() == [dataset.text(i).tolist() for i in range(start, start + mbs)]


def test_gpt_samples_equal_megatron_core(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copytree(FIXTURES / "data", tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    case = CASES["one_epoch"]
    got = gpt_samples(data_path=case["data_path"], seq_length=case["seq_length"], seed=case["seed"],
                      split=case["split"], split_name="valid", num_samples=case["sizes"][1], start=2, count=3,
                      cache_path=None)
    want = case["splits"]["valid"]["samples"]
    assert [g["index"] for g in got] == [2, 3, 4]
    for key in ("tokens", "labels", "loss_mask"):
        assert [g[key] for g in got] == want[key][2:5]
    # No count: one epoch of the split, as megatron-core builds it (num_samples None in its description).
    case = CASES["no_num_samples"]
    got = gpt_samples(data_path=case["data_path"], seq_length=case["seq_length"], seed=case["seed"],
                      split=case["split"], split_name="train", num_samples=None, start=0,
                      count=case["splits"]["train"]["length"], cache_path=str(tmp_path / "c"))
    assert [g["tokens"] for g in got] == case["splits"]["train"]["samples"]["tokens"]
    with pytest.raises(DataError, match="requested"):
        gpt_samples(data_path=case["data_path"], seq_length=8, seed=99, split=case["split"], split_name="train",
                    num_samples=None, start=0, count=10_000, cache_path=str(tmp_path / "c"))


def test_vocabulary_check(tmp_path: Path) -> None:
    prefix = _corpus(tmp_path, vocab=300)
    check_vocabulary(prefix, vocab_size=300)
    with pytest.raises(DataError, match=r"token id 29\d.*model.vocab_size is 200"):
        check_vocabulary(f"0.5 {prefix} 0.5 {prefix}", vocab_size=200)


def _run_config(data: DataConfig, *, vocab_size: int) -> RunConfig:
    return RunConfig(
        name="tiny-indexed",
        model=ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=16,
                          max_position_embeddings=16, vocab_size=vocab_size),
        train=TrainConfig(num_steps=2, micro_batch_size=2, global_batch_size=4, log_interval=1),
        optim=OptimConfig(lr=1e-3, min_lr=1e-4, lr_warmup_iters=1),
        compile=CompilePhaseConfig(num_steps=1),
        data=data,
    )


def test_trainer_reads_indexed_data_and_checks_the_vocabulary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    data = DataConfig(source="indexed", path=_corpus(tmp_path), split="90,5,5", cache_path=str(tmp_path / "cache"))
    assert run_training(plan_for_torchrun(_run_config(data, vocab_size=300)), run_dir=tmp_path / "run") == 0
    assert len(list((tmp_path / "cache").glob("*-GPTDataset-train-shuffle_index.npy"))) == 1
    with pytest.raises(DataError, match="vocab_size is 100"):
        run_training(plan_for_torchrun(_run_config(data, vocab_size=100)), run_dir=tmp_path / "run2")

"""Fixtures the unit tests share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_hpc.data.tokenizer import train_tokenizer
from megatron_hpc.parallel.context import ParallelContext
from megatron_hpc.plan.mesh import Mesh


@pytest.fixture
def ctx(tmp_path: Path) -> Iterator[ParallelContext]:
    """A one-rank gloo process group and its parallel context (TP 1), for building our GPT in the test's process."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.FileStore(str(tmp_path / "store"), 1))
    yield ParallelContext.build(Mesh(num_nodes=1, workers_per_node=1, tensor_parallel=1), rank=0)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with a tiny GPT-2 style byte-level BPE (vocab.json, merges.txt of 300 ids) trained here."""
    where = tmp_path_factory.mktemp("tok")
    (where / "text.txt").write_text("the quick brown fox jumps over the lazy dog; " * 50 + "pack my box " * 30)
    train_tokenizer([where / "text.txt"], vocab_size=300, output_dir=where)
    return where

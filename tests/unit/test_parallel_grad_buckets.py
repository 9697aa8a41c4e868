"""Gradient buckets: their order and sizes, and when the overlapped reducer is used."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_hpc.errors import ConfigError
from megatron_hpc.parallel.grads import bucket_numel, build_grad_reducer, plan_buckets


def _tensors(*sizes: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [torch.empty(n, dtype=dtype) for n in sizes]


def test_buckets_run_from_the_last_tensor_and_close_at_the_limit() -> None:
    # 30 + 5 fits in 35; 20 does not, so it opens the next bucket, which 10 joins.
    assert plan_buckets(_tensors(10, 20, 5, 30), max_numel=35) == [[3, 2], [1, 0]]


def test_a_tensor_over_the_limit_gets_its_own_bucket() -> None:
    assert plan_buckets(_tensors(4, 100, 4), max_numel=10) == [[2], [1], [0]]


def test_a_dtype_change_closes_the_bucket() -> None:
    tensors = _tensors(4, 4) + _tensors(4, dtype=torch.bfloat16)
    assert plan_buckets(tensors, max_numel=100) == [[2], [1, 0]]


def test_bucket_size_in_mib_of_fp32() -> None:
    assert bucket_numel(128.0) == 32 * 1024 * 1024
    assert bucket_numel(1.0, dtype=torch.bfloat16) == 512 * 1024
    with pytest.raises(ConfigError, match="grad_bucket_mb"):
        bucket_numel(0.0)


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[dist.ProcessGroup]:
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.FileStore(str(tmp_path / "store"), 1))
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_no_overlapped_reducer_without_data_parallel_peers(one_rank: dist.ProcessGroup) -> None:
    params = list(torch.nn.Linear(4, 4).parameters())
    assert build_grad_reducer(params, group=one_rank, overlap=True, bucket_mb=1.0, device_kind="cpu") is None

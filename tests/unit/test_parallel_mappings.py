"""The mapping docstrings: well-formed, paired, and (at world size 1) identity in both directions.

Their behaviour over two ranks is checked against the same docstrings in
tests/multiprocess/test_parallel_layers_mp.py.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_hpc.parallel import mappings

NAMES = ("copy_to_tp_region", "reduce_from_tp_region", "scatter_to_tp_region", "gather_from_tp_region")
PARTNER = {"copy_to_tp_region": "reduce_from_tp_region", "scatter_to_tp_region": "gather_from_tp_region"}


def _spec(name: str) -> dict[str, str]:
    doc = inspect.getdoc(getattr(mappings, name))
    assert doc is not None and "\n" not in doc, f"{name}: one-line docstring"
    return dict(part.strip().split(": ") for part in doc.split("|"))


@pytest.mark.parametrize("name", NAMES)
def test_docstring_is_well_formed(name: str) -> None:
    spec = _spec(name)
    assert list(spec) == ["fwd", "bwd", "dim"]
    ops = {"identity", "all-reduce", "split", "all-gather"}
    assert spec["fwd"] in ops and spec["bwd"] in ops and spec["dim"] == "last"


def test_docstrings_state_the_megatron_pairs() -> None:
    specs = {n: _spec(n) for n in NAMES}
    assert (specs["copy_to_tp_region"]["fwd"], specs["copy_to_tp_region"]["bwd"]) == ("identity", "all-reduce")
    assert (specs["scatter_to_tp_region"]["fwd"], specs["scatter_to_tp_region"]["bwd"]) == ("split", "all-gather")
    for a, b in PARTNER.items():  # each pair is the other's adjoint
        assert (specs[a]["fwd"], specs[a]["bwd"]) == (specs[b]["bwd"], specs[b]["fwd"])


def test_group_is_required() -> None:
    for name in NAMES:
        param = inspect.signature(getattr(mappings, name)).parameters["group"]
        assert param.default is inspect.Parameter.empty


@pytest.fixture
def solo_group(tmp_path: Path) -> Iterator[dist.ProcessGroup]:
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.FileStore(str(tmp_path / "store"), 1))
    yield dist.new_group([0])
    dist.destroy_process_group()


@pytest.mark.parametrize("name", NAMES)
def test_world_of_one_is_identity(name: str, solo_group: dist.ProcessGroup) -> None:
    x = torch.randn(3, 4, requires_grad=True)
    y = getattr(mappings, name)(x, solo_group)
    grad = torch.randn(3, 4)
    y.backward(grad)
    assert torch.equal(y, x) and torch.equal(x.grad, grad)

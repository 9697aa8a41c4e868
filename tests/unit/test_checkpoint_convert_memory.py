"""`ckpt convert`'s memory levers (issue 16): the import and the reshard let go of each weight once its new copy is
made, and what they write is what the whole-model path (whole_model_reshard.py, kept whole) writes."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_checkpoint_import import reference_checkpoint
from whole_model_reshard import reshard

from megatron_hpc.checkpoint.conversion import pp_layout, read_whole, stream
from megatron_hpc.checkpoint.foreign import import_foreign, read_foreign


def _models(root: Path) -> list[list[dict[str, torch.Tensor]]]:
    return [[s["model"] for s in row] for row in read_whole(root).grid]


def test_the_import_consumes_the_source_weights(tmp_path: Path) -> None:
    reference_checkpoint(tmp_path / "ref", tp=2, pp=2, xser_files=True)
    src = read_foreign(tmp_path / "ref" / "iter_0000030")
    imported = import_foreign(src)
    assert all("model" not in state for row in src.grid for state in row)
    assert all("optimizer" in state for row in src.grid for state in row)  # the rest is still read
    full = pp_layout.merge_grid([[s["model"] for s in row] for row in imported.whole.grid])
    assert full["wte.weight"].dtype == torch.float32 and full["wte.weight"].device.type == "cpu"


def test_a_streamed_reshard_in_memory_writes_the_same_and_leaves_shapes_behind(tmp_path: Path) -> None:
    """stream.in_memory's release: every source weight ends as a meta tensor of its shape, and the output equals the
    whole-model reference's from a copy it leaves untouched."""
    reference_checkpoint(tmp_path / "ref", tp=2, pp=2, xser_files=False)
    kept = import_foreign(read_foreign(tmp_path / "ref" / "iter_0000030")).whole
    released = import_foreign(read_foreign(tmp_path / "ref" / "iter_0000030")).whole
    shapes = [[{n: (w.shape, w.dtype) for n, w in s["model"].items()} for s in row] for row in released.grid]
    a = reshard(kept, tp=1, pp=2, out=tmp_path / "kept")
    b = stream.reshard(stream.in_memory(released), tp=1, pp=2, out=tmp_path / "released")
    assert (a.optimizer, b.optimizer) == ("resharded", "resharded")
    for row_a, row_b in zip(_models(tmp_path / "kept"), _models(tmp_path / "released"), strict=True):
        for ma, mb in zip(row_a, row_b, strict=True):
            assert list(ma) == list(mb)
            assert all(torch.equal(ma[n], mb[n]) for n in ma)
    assert all(w.device.type == "cpu" for row in kept.grid for s in row for w in s["model"].values())
    left = [[{n: (w.shape, w.dtype) for n, w in s["model"].items()} for s in row] for row in released.grid]
    assert left == shapes
    assert all(w.device.type == "meta" for row in released.grid for s in row for w in s["model"].values())

"""stream.reshard (issue 16): the same checkpoint as the plain merge-then-split reference (whole_model_reshard.py, the
whole-model path), tensor for tensor, while holding about one output rank at a time."""

from __future__ import annotations

import gc
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_checkpoint_import import reference_checkpoint
from whole_model_reshard import reshard

from megatron_hpc.checkpoint.conversion import read_lazy, read_whole, stream
from megatron_hpc.checkpoint.conversion import whole as whole_module
from megatron_hpc.checkpoint.foreign import import_foreign, read_foreign

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "convert_cpu.py"


def assert_same_tree(a: Any, b: Any, where: str = "") -> None:
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            assert_same_tree(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def assert_same_checkpoint(old: Path, new: Path) -> None:
    a, b = read_whole(old), read_whole(new)
    ma, mb = a.found.manifest, b.found.manifest
    assert (ma.iteration, ma.format, ma.tensor_parallel, ma.pipeline_parallel, ma.virtual_pipeline) == \
        (mb.iteration, mb.format, mb.tensor_parallel, mb.pipeline_parallel, mb.virtual_pipeline)
    assert sorted(ma.files) == sorted(mb.files)
    assert (old / "latest_checkpointed_iteration.txt").read_text() == \
        (new / "latest_checkpointed_iteration.txt").read_text()
    for row_a, row_b in zip(a.grid, b.grid, strict=True):
        for sa, sb in zip(row_a, row_b, strict=True):
            assert_same_tree(sa, sb)


def _old_and_new(folder: Path, out: Path, *, tp: int, pp: int, optimizer: str = "resharded") -> None:
    old = import_foreign(read_foreign(folder), vocab_size=50).whole
    a = reshard(old, tp=tp, pp=pp, out=out / f"old-{tp}-{pp}", fmt="xser", release=True)
    new = import_foreign(read_foreign(folder, mmap=True), vocab_size=50, lazy=True)
    assert new.source is not None
    assert all(w.device.type == "meta" for row in new.whole.grid for s in row for w in s["model"].values())
    b = stream.reshard(new.source, tp=tp, pp=pp, out=out / f"new-{tp}-{pp}", fmt="xser")
    assert (a.optimizer, b.optimizer, a.note) == (optimizer, optimizer, b.note)
    assert_same_checkpoint(out / f"old-{tp}-{pp}", out / f"new-{tp}-{pp}")


def test_streamed_convert_of_a_torch_file_checkpoint_equals_the_whole_model_path(tmp_path: Path) -> None:
    reference_checkpoint(tmp_path / "ref", tp=2, pp=2, xser_files=False)
    _old_and_new(tmp_path / "ref" / "iter_0000030", tmp_path, tp=4, pp=1)


def test_streamed_convert_equals_the_whole_model_path(tmp_path: Path) -> None:
    """Reference tp 2 x pp 2 (xser, bf16, fp32 masters, Adam) with a 50-token vocabulary: to tp 1 (padding trimmed
    from 64 to 56 rows) and tp 4 x pp 2; then our own tp 1 checkpoint to tp 4 x pp 2 (padding grown back to 64 rows
    by repeating the last token's row) with two virtual chunks."""
    reference_checkpoint(tmp_path / "ref", tp=2, pp=2, xser_files=True)
    folder = tmp_path / "ref" / "iter_0000030"
    for tp, pp in ((1, 1), (4, 2)):
        _old_and_new(folder, tmp_path, tp=tp, pp=pp)

    assert read_whole(tmp_path / "new-1-1").first["model"]["wte.weight"].shape[0] == 56

    ours = tmp_path / "new-1-1"
    reshard(read_whole(ours), tp=4, pp=2, virtual=2, out=tmp_path / "old-ours", fmt="torch", release=True)
    stream.reshard(stream.in_memory(read_whole(ours)), tp=4, pp=2, virtual=2, out=tmp_path / "new-ours", fmt="torch")
    assert_same_checkpoint(tmp_path / "old-ours", tmp_path / "new-ours")
    # ckpt reshard's source (read a tensor at a time), its 8 output ranks written by 3 forked workers in runs of
    # 2, 3 and 3: the same checkpoint, each worker releasing only its own copy of what it read
    lazy, _ = read_lazy(ours, budget=1)
    stream.reshard(lazy, tp=4, pp=2, virtual=2, out=tmp_path / "forked-ours", fmt="torch", workers=3)
    assert_same_checkpoint(tmp_path / "old-ours", tmp_path / "forked-ours")
    grown = torch.cat([s["model"]["wte.weight"] for s in read_whole(tmp_path / "new-ours").grid[0]])
    assert grown.shape[0] == 64 and torch.equal(grown[56:], grown[49:50].expand(8, -1))


def test_a_bf16_weights_only_checkpoint_streams_in_bf16_like_the_whole_model_path(tmp_path: Path) -> None:
    """No fp32 masters: the weights stay bf16 through the TP merge, the pipeline split (the tied copy of the
    embeddings on the last stage compared and dropped) and the vocabulary's re-padding, as in the reference."""
    reference_checkpoint(tmp_path / "ref", tp=2, pp=2, xser_files=True, optimizer=False)
    for tp, pp in ((1, 1), (4, 2)):
        _old_and_new(tmp_path / "ref" / "iter_0000030", tmp_path, tp=tp, pp=pp, optimizer="dropped")
    for tp, pp in ((1, 1), (4, 2)):
        grid = read_whole(tmp_path / f"new-{tp}-{pp}").grid
        assert {w.dtype for row in grid for s in row for w in s["model"].values()} == {torch.bfloat16}
    assert read_whole(tmp_path / "new-1-1").first["model"]["wte.weight"].shape[0] == 56


def test_streamed_convert_refuses_like_the_whole_model_path(tmp_path: Path) -> None:
    reference_checkpoint(tmp_path / "ref", tp=2, pp=1, xser_files=True)
    folder = tmp_path / "ref" / "iter_0000030"
    source = import_foreign(read_foreign(folder, mmap=True), lazy=True).source
    assert source is not None
    with pytest.raises(Exception) as old:
        reshard(import_foreign(read_foreign(folder)).whole, tp=3, out=tmp_path / "old")
    with pytest.raises(type(old.value)) as new:
        stream.reshard(source, tp=3, out=tmp_path / "new")
    assert str(new.value) == str(old.value) and "--tp 3" in str(new.value)
    assert not (tmp_path / "new").exists()


# ---------------------------------------------------------------------------------------------- the memory bound

def _file_mappings() -> list[tuple[int, int]]:
    """Address ranges of this process's file-backed mappings (/proc/self/maps: an inode and a path)."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[4] != "0" and fields[5].startswith("/"):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            out.append((lo, hi))
    return out


def _anonymous_tensor_bytes() -> int:
    """Bytes of the CPU tensor storages alive in this process that are not mapped files: what the tensors hold in
    memory of their own (a mapped source shard is the page cache's, and leaves RSS when let go)."""
    gc.collect()
    mapped = _file_mappings()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if type(obj) is torch.Tensor and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            ptr = storage.data_ptr()
            if ptr and not any(lo <= ptr < hi for lo, hi in mapped):
                seen[ptr] = storage.nbytes()
    return sum(seen.values())


def _state_bytes(state: dict[str, Any]) -> int:
    from megatron_hpc.checkpoint.store import iter_tensors

    return sum(t.untyped_storage().nbytes() for _, t in iter_tensors(state))


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("convert_cpu_for_stream", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The benchmark's reference checkpoint, small: 2 layers, hidden 64, tp 4, xser, weights only."""
    bench = _bench()
    root = tmp_path_factory.mktemp("bench") / "ref"
    bench.write_source(root, bench.Shape(layers=2, hidden=64, heads=4, vocab=1000, seq=64), tp=4, fmt="xser",
                       optimizer=False)
    return root / "iter_0000100"


def _peak_while_writing(monkeypatch: pytest.MonkeyPatch, module: Any, run: Any) -> tuple[int, list[int]]:
    """(largest growth of anonymous tensor bytes over the start, measured as each output rank is handed to the
    writer, when all of its tensors exist; each written rank's own tensor bytes)."""
    real = module.write_rank_folder
    start = _anonymous_tensor_bytes()
    peaks: list[int] = []
    ranks: list[int] = []

    def measured(state: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        peaks.append(_anonymous_tensor_bytes() - start)
        ranks.append(_state_bytes(state))
        real(state, *args, **kwargs)

    monkeypatch.setattr(module, "write_rank_folder", measured)
    run()
    monkeypatch.setattr(module, "write_rank_folder", real)
    return max(peaks), ranks


def test_the_stream_holds_one_output_rank_the_whole_model_path_all(tmp_path: Path, bench_source: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """tp 4 -> 2: the streamed convert holds one output rank's tensors (plus what a state always carries: RNG
    states, a few KiB), the whole-model path both ranks at once; the same measure judges both."""
    def streamed() -> None:
        imported = import_foreign(read_foreign(bench_source, mmap=True), lazy=True)
        assert imported.source is not None
        stream.reshard(imported.source, tp=2, out=tmp_path / "new", fmt="xser")

    def whole_model() -> None:
        reshard(import_foreign(read_foreign(bench_source)).whole, tp=2, out=tmp_path / "old", fmt="xser",
                release=True)

    new_peak, new_ranks = _peak_while_writing(monkeypatch, stream, streamed)
    old_peak, old_ranks = _peak_while_writing(monkeypatch, whole_module, whole_model)
    one_rank = max(new_ranks)
    assert new_ranks == old_ranks and one_rank > 150_000  # ~0.17 MB of bf16 (the source's dtype) per output rank
    slack = 32 << 10
    assert new_peak <= one_rank + slack, (new_peak, one_rank)
    assert old_peak > one_rank + slack, (old_peak, one_rank)  # the measure tells the two paths apart
    assert_same_checkpoint(tmp_path / "old", tmp_path / "new")

"""`ckpt convert` of a checkpoint of ours reads it a tensor at a time (conversion/lazy.py) for every --to: what it
writes equals, file for file and tensor for tensor, what the whole read (read_whole, then the same writers) wrote, on
GPT and Llama-shaped checkpoints of ours at TP 2 x PP 2 in both file formats, and the reader's own count of the bytes
it held at once stays within one tensor at a budget of 1 byte."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_checkpoint_import import reference_checkpoint
from test_checkpoint_stream import assert_same_checkpoint, assert_same_tree
from test_checkpoint_torch_dist_export import FIXTURES, dcp_tensors

from megatron_hpc.checkpoint.conversion import read_lazy, read_whole, stream
from megatron_hpc.checkpoint.conversion.whole import write_whole
from megatron_hpc.checkpoint.foreign import export_hf, export_torch_dist, import_foreign, read_foreign
from megatron_hpc.cli.main import main


def _convert(src: Path, out: Path, *args: str) -> None:
    assert main(["ckpt", "convert", str(src), "--out", str(out), *args]) == 0


@pytest.fixture(scope="module")
def ours(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Checkpoints of ours at TP 2 x PP 2 with Adam's state: GPT (from the reference's bf16 run with fp32 masters)
    and Llama-shaped (megatron-core's RMSNorm / SwiGLU / GQA / untied fixture), each as xser and as torch files."""
    root = tmp_path_factory.mktemp("own")
    reference_checkpoint(root / "ref", tp=2, pp=2, xser_files=True)
    out = {"legacy": root / "ref" / "iter_0000030"}
    for fmt in ("xser", "torch"):
        out[f"gpt-{fmt}"] = root / f"gpt-{fmt}"
        _convert(root / "ref" / "iter_0000030", out[f"gpt-{fmt}"], "--to", fmt, "--vocab-size", "50")
        out[f"llama-{fmt}"] = root / f"llama-{fmt}"
        _convert(FIXTURES / "llama_tp2_distopt", out[f"llama-{fmt}"], "--to", fmt, "--tp", "2", "--pp", "2")
    return out


CASES = ["gpt-xser", "gpt-torch", "llama-xser", "llama-torch"]


@pytest.mark.parametrize("case", [*CASES, "legacy"])
def test_the_hf_export_streams_equal_to_the_whole_read(case: str, ours: dict[str, Path], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Ours, and the reference's legacy TP 2 x PP 2 folder (mapped, as --to torch|xser already read it)."""
    src = ours[case]
    whole = read_whole(src) if case != "legacy" else import_foreign(read_foreign(src), vocab_size=50).whole
    export_hf(whole, tmp_path / "whole", max_shard_bytes=20_000)
    _convert(src, tmp_path / "streamed", "--to", "hf", "--shard-size-gb", "0.00002", "--read-budget-gib", "1e-9",
             *(["--vocab-size", "50"] if case == "legacy" else []))
    # A mapped legacy folder holds no budget: said, not silently ignored.
    assert ("--read-budget-gib does not apply" in capsys.readouterr().err) == (case == "legacy")
    names = sorted(p.name for p in (tmp_path / "whole").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "streamed").iterdir())
    assert len([n for n in names if n.endswith(".safetensors")]) >= 3  # shards, with their index
    from safetensors.torch import load_file

    for name in names:
        a, b = tmp_path / "whole" / name, tmp_path / "streamed" / name
        if name.endswith(".safetensors"):
            assert_same_tree(load_file(a), load_file(b), name)
        else:
            assert json.loads(a.read_text()) == json.loads(b.read_text()), name


@pytest.mark.parametrize("case", ["gpt-torch", "llama-xser"])
def test_the_torch_dist_export_streams_equal_to_the_whole_read(case: str, ours: dict[str, Path],
                                                               tmp_path: Path) -> None:
    src = ours[case]
    export_torch_dist(read_whole(src), tmp_path / "whole", tp=1, pp=2)
    _convert(src, tmp_path / "streamed", "--to", "torch_dist", "--tp", "1", "--pp", "2", "--read-budget-gib", "1e-9")
    folder = next((tmp_path / "whole").glob("iter_*")).name
    a, b = dcp_tensors(tmp_path / "whole" / folder), dcp_tensors(tmp_path / "streamed" / folder)
    assert sorted(a) == sorted(b)
    # The reference's GPT records no LR schedule, so its export holds the weights only; the Llama's carries Adam.
    assert any(k.startswith("optimizer.state.exp_avg.") for k in a) == case.startswith("llama")
    for key in a:
        assert torch.equal(a[key], b[key]), key
    common = [torch.load(d / folder / "common.pt", weights_only=False) for d in (tmp_path / "whole",
                                                                                tmp_path / "streamed")]
    assert vars(common[0].pop("args")) == vars(common[1].pop("args"))
    assert_same_tree(common[0], common[1])


@pytest.mark.parametrize("case,sizes", [("gpt-xser", ("--to", "torch", "--tp", "1", "--pp", "1")),
                                        ("llama-torch", ("--to", "xser", "--tp", "1")),
                                        ("gpt-torch", ("--to", "xser")), ("llama-xser", ("--to", "torch"))])
def test_reshards_and_format_changes_stream_equal_to_the_whole_read(case: str, sizes: tuple[str, ...],
                                                                    ours: dict[str, Path], tmp_path: Path) -> None:
    src = ours[case]
    whole = read_whole(src)
    to = sizes[1]
    tp = int(sizes[sizes.index("--tp") + 1]) if "--tp" in sizes else whole.tensor_parallel
    pp = int(sizes[sizes.index("--pp") + 1]) if "--pp" in sizes else whole.pipeline_parallel
    if (tp, pp) == (whole.tensor_parallel, whole.pipeline_parallel):
        write_whole(tmp_path / "whole", whole.iteration, whole.grid, fmt=to, layout=whole.layout)
    else:
        stream.reshard(stream.in_memory(whole), tp=tp, pp=pp, out=tmp_path / "whole", fmt=to)
    _convert(src, tmp_path / "streamed", *sizes, "--read-budget-gib", "1e-9")
    assert_same_checkpoint(tmp_path / "whole", tmp_path / "streamed")


@pytest.mark.parametrize("case", ["gpt-xser", "llama-torch"])
def test_the_reader_holds_one_tensor_at_a_budget_of_one_byte(case: str, ours: dict[str, Path],
                                                             tmp_path: Path) -> None:
    """The reader's own count of the source bytes held at once: one tensor (the largest) at a budget of 1 byte,
    through the Hugging Face export of the merged TP 2 x PP 2 source; with a budget above the checkpoint, every
    tensor read stays held until its last use, far more (so the measure can fail)."""
    peaks = {}
    for budget in (1, 1 << 40):
        source, reader = read_lazy(ours[case], budget=budget)
        largest = max(w.numel() * w.element_size() for row in source.whole.grid for s in row
                      for w in s["model"].values())
        one = stream.merged(source)
        export_hf(one.whole, tmp_path / f"hf-{budget}", source=one, max_shard_bytes=20_000)
        peaks[budget] = reader.peak_bytes
        assert not reader.loads, "every tensor was released"
    assert 0 < peaks[1] <= largest
    assert peaks[1 << 40] > 3 * largest


def _mapped_from(folder: Path) -> list[tuple[int, int]]:
    """The address ranges of this process mapped from files under `folder` (/proc/self/maps)."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(str(folder.resolve())):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            out.append((lo, hi))
    return out


def test_a_torch_file_is_read_not_mapped_into_what_is_fetched(ours: dict[str, Path]) -> None:
    """torch.load(mmap=True) maps the rank file for its structure; a fetched tensor must be read into its own memory,
    not be a view of that mapping (whose pages would count in RSS until the file's last tensor went)."""
    source, _ = read_lazy(ours["llama-torch"], budget=1 << 40)
    name = "h.0.attn.qkv.weight"
    mapped = _mapped_from(ours["llama-torch"])
    assert mapped, "the rank files are mapped for their structure"
    got = source.weight(0, 0, name)
    assert not any(lo <= got.data_ptr() < hi for lo, hi in mapped)
    assert torch.equal(got, read_whole(ours["llama-torch"]).grid[0][0]["model"][name])


def test_reshard_reads_within_its_read_budget(ours: dict[str, Path], tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """`ckpt reshard --read-budget-gib` reaches the reader (its own count of the bytes held stays within the
    largest tensor at 1e-9 GiB, far above it at the default), writes what the whole read does, and 0 is refused in
    one line before anything is written."""
    import megatron_hpc.checkpoint.conversion as conversion

    readers = []

    def counted(*args: object, **kwargs: object) -> object:
        found = read_lazy(*args, **kwargs)
        readers.append(found[1])
        return found

    monkeypatch.setattr(conversion, "read_lazy", counted)
    src = ours["llama-xser"]
    whole = read_whole(src)
    largest = max(w.numel() * w.element_size() for row in whole.grid for s in row for w in s["model"].values())
    stream.reshard(stream.in_memory(whole), tp=1, pp=1, out=tmp_path / "whole")
    peaks = []
    for name, budget in (("small", ["--read-budget-gib", "1e-9"]), ("default", [])):
        out = tmp_path / name
        assert main(["ckpt", "reshard", str(src), "--tp", "1", "--pp", "1", "--out", str(out), *budget]) == 0
        peaks.append(readers[-1].peak_bytes)
        assert_same_checkpoint(tmp_path / "whole", out)
    assert 0 < peaks[0] <= largest < 3 * largest < peaks[1]
    capsys.readouterr()
    assert main(["ckpt", "reshard", str(src), "--tp", "1", "--out", str(tmp_path / "no"),
                 "--read-budget-gib", "0"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["megatron-hpc: error: --read-budget-gib 0.0 must be above 0; drop it for the default 1, or give "
                   "less on a machine short of memory (each part past it is read once per output rank)"]
    assert not (tmp_path / "no").exists()

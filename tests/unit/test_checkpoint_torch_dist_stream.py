"""`ckpt convert` of a torch_dist checkpoint reads it a part at a time (torch_dist_stream.py): what it holds of the
source at once stays within its budget plus one unit (a layer of every stacked key, or one other key with its
moments), well under the checkpoint, and what it writes equals the whole read's output tensor for tensor. The source
is real megatron-core's (tests/fixtures/megatron_core_torch_dist): plain Adam with fp32 masters (gpt_tp2), the
distributed optimizer saved fully reshardable with SwiGLU (llama_tp2_distopt), and in its default dp_reshardable
flat buffers at DP 2, at PP 2 with a tied embedding, and a Llama at TP 2 x PP 2 x DP 2 (gpt_dp2_distopt,
gpt_pp2_distopt, llama_tp2_pp2_dp2_distopt)."""

from __future__ import annotations

import json
import math
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from megatron_hpc.checkpoint.conversion import read_whole, stream
from megatron_hpc.checkpoint.conversion.optim_layout import by_name
from megatron_hpc.checkpoint.foreign import export_torch_dist, import_torch_dist
from megatron_hpc.checkpoint.foreign.torch_dist_files import open_folder, read

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "megatron_core_torch_dist"
ITER = "iter_0000003"
DP_RESHARDABLE = ("gpt_dp2_distopt", "gpt_pp2_distopt", "llama_tp2_pp2_dp2_distopt")
"""The fixtures whose distributed optimizer saved megatron-core's default flat buffers."""


def _bytes(record: object) -> int:
    size = record.size  # type: ignore[attr-defined]
    return size.numel() * torch.empty(0, dtype=record.properties.dtype).element_size()  # type: ignore[attr-defined]


def _bounds(folder: Path) -> tuple[int, int]:
    """(every tensor's bytes, the largest unit's at most: one layer of all stacked keys, or the largest other key
    with its optimizer keys), from the index alone."""
    src = open_folder(folder)
    layers = src.common["args"].num_layers
    records = {k: src.keys[k] for k in src.tensor_keys()}
    per_layer = sum(_bytes(r) // layers for k, r in records.items() if "decoder.layers." in k)
    single = max(sum(_bytes(r) for k, r in records.items() if k.endswith(key))
                 for key in records if "decoder.layers." not in key)
    return sum(_bytes(r) for r in records.values()), max(per_layer, single)


def _tensors(out: Path) -> dict[str, torch.Tensor]:
    whole = read_whole(out)
    found = {}
    for p, row in enumerate(whole.grid):
        for t, state in enumerate(row):
            for name, w in state["model"].items():
                found[f"{p}.{t}.{name}"] = w
            for name, moments in by_name(state["model"], state["optimizer"]).items():
                found.update({f"{p}.{t}.{name}.{k}": v for k, v in moments.items() if torch.is_tensor(v)})
    return found


@pytest.mark.parametrize("case", ["gpt_tp2", "llama_tp2_distopt"])
def test_a_small_budget_holds_one_unit_and_writes_what_the_whole_read_writes(case: str, tmp_path: Path) -> None:
    folder = FIXTURES / case / ITER
    total, unit = _bounds(folder)
    whole = import_torch_dist(folder)
    assert whole.reader is None
    stream.reshard(stream.in_memory(whole.imported.whole), tp=2, out=tmp_path / "whole", fmt="torch")

    streamed = import_torch_dist(folder, stream_budget=1)
    reader = streamed.reader
    assert reader is not None and reader.peak_bytes == 0  # nothing read before reshard asks
    assert all(w.is_meta for w in streamed.imported.whole.first["model"].values())
    stream.reshard(streamed.imported.source, tp=2, out=tmp_path / "streamed", fmt="torch")
    assert 0 < reader.peak_bytes <= unit < total / 2
    assert reader.held_bytes == 0  # every unit let go once its last output rank was written
    units = 2 + int(open_folder(folder).common["args"].num_layers)  # layers, word embeddings, final norm (+ more)
    assert reader.unit_reads >= 2 * units  # nothing kept past the budget: each output rank reads its units again

    expected, got = _tensors(tmp_path / "whole"), _tensors(tmp_path / "streamed")
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def test_a_budget_above_the_checkpoint_reads_each_unit_once(tmp_path: Path) -> None:
    folder = FIXTURES / "gpt_tp2" / ITER
    total, _ = _bounds(folder)
    once = import_torch_dist(folder, stream_budget=total)
    stream.reshard(once.imported.source, tp=2, out=tmp_path / "once", fmt="xser")
    small = import_torch_dist(folder, stream_budget=1)
    stream.reshard(small.imported.source, tp=2, out=tmp_path / "small", fmt="xser")
    assert once.reader is not None and small.reader is not None
    assert small.reader.unit_reads == 2 * once.reader.unit_reads
    assert small.reader.peak_bytes < once.reader.peak_bytes <= total


def _bucket_bound(folder: Path, *, states: int = 3) -> int:
    """Bytes a dp_reshardable unit holds at most, from the index: the largest unit's fp32 states (param, exp_avg,
    exp_avg_sq; param alone weights only) assembled, the same again as the boxes of the flat buffers they come from,
    and the 64-element alignment gaps those boxes span (16 parameters a layer at most, a box per TP rank and state)."""
    src = open_folder(folder)
    layers, tp = src.common["args"].num_layers, src.common["args"].tensor_model_parallel_size
    model = {k: src.keys[k].size.numel() for k in src.tensor_keys() if not k.startswith("optimizer.")}
    per_layer = sum(n // layers for k, n in model.items() if "decoder.layers." in k)
    single = max(n for k, n in model.items() if "decoder.layers." not in k)
    return states * (2 * 4 * max(per_layer, single) + tp * 16 * 64 * 4)


def _convert_both(folder: Path, tmp_path: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], object]:
    """(the whole read's output, the streamed one's, the streamed reader), both written at TP 2."""
    whole = import_torch_dist(folder)
    assert whole.reader is None and not whole.imported.notes
    stream.reshard(stream.in_memory(whole.imported.whole), tp=2, out=tmp_path / "whole", fmt="torch")
    streamed = import_torch_dist(folder, stream_budget=1)
    reader = streamed.reader
    assert reader is not None and reader.peak_bytes == 0 and not streamed.imported.notes
    assert all(w.is_meta for w in streamed.imported.whole.first["model"].values())
    stream.reshard(streamed.imported.source, tp=2, out=tmp_path / "streamed", fmt="torch")
    return _tensors(tmp_path / "whole"), _tensors(tmp_path / "streamed"), reader


@pytest.mark.parametrize("case", DP_RESHARDABLE)
def test_the_distributed_optimizers_bucket_space_streams_a_layer_at_a_time(case: str, tmp_path: Path) -> None:
    """dp_reshardable's flat buffers are read as one box per bucket and state a layer, each parameter put together
    from them: weights (the fp32 masters) and both moments equal the whole read's; gpt_pp2_distopt's tied embedding
    is the last stage's copy as there."""
    folder = FIXTURES / case / ITER
    total, _ = _bounds(folder)
    expected, got, reader = _convert_both(folder, tmp_path)
    assert 0 < reader.peak_bytes <= _bucket_bound(folder) < total  # type: ignore[attr-defined]
    assert reader.held_bytes == 0  # type: ignore[attr-defined]
    assert sorted(got) == sorted(expected) and any(k.endswith(".exp_avg_sq") for k in got)
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def test_a_module_order_that_only_fits_the_sizes_is_passed_over(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Every order fills gpt_dp2_distopt's bucket length, so sizes alone cannot choose: the sample (the first layer,
    at the end of the bucket) must turn down the wrong orders tried first."""
    from megatron_hpc.checkpoint.foreign import torch_dist_buckets, torch_dist_optim

    folder = FIXTURES / "gpt_dp2_distopt" / ITER
    orders = torch_dist_optim.LAYER_ORDERS
    wrong = tuple(reversed(orders[0]))
    src = open_folder(folder)
    model = {k: torch.empty(tuple(src.keys[k].size), device="meta") for k in src.tensor_keys()
             if not k.startswith("optimizer.")}
    params = torch_dist_optim.rank_params(model, wrong, range(2), first=True, last=True, pp=1)
    sizes = [model[k].numel() if i is None else model[k][0].numel() for k, i in params]
    length = src.keys[next(k for k in src.tensor_keys() if k.endswith("bucket_idx_0.param"))].size[0]
    assert torch_dist_optim.layout(sizes, [length], 64) is not None
    monkeypatch.setattr(torch_dist_optim, "LAYER_ORDERS", (wrong, *reversed(orders)))
    expected, got, _ = _convert_both(folder, tmp_path)
    assert torch_dist_buckets.optim.LAYER_ORDERS[0] == wrong
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


def test_the_adamw_group_template_is_what_torch_adamw_saves() -> None:
    """The converter reads AdamW's group settings from its signature (making one imports torch._dynamo)."""
    from megatron_hpc.checkpoint.foreign.importer import adamw_defaults

    made = torch.optim.AdamW([torch.zeros(1)]).state_dict()["param_groups"][0]
    assert adamw_defaults() == {k: v for k, v in made.items() if k != "params"}


@pytest.mark.parametrize(("flags", "said"), [
    (["--to", "torch", "--read-budget-gib", "0"], "--read-budget-gib 0.0 must be above 0; drop it for the default 1"),
    (["--to", "hf", "--shard-size-gb", "0"], "--shard-size-gb 0.0 sets the file size of --to hf and must be above 0"),
    (["--to", "torch", "--shard-size-gb", "1"], "--shard-size-gb 1.0 sets the file size of --to hf"),
])
def test_a_bad_budget_or_shard_size_is_refused_before_anything_is_written(
        flags: list[str], said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_hpc.cli.main import main

    code = main(["ckpt", "convert", str(FIXTURES / "gpt_tp2"), *flags, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and said in err[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["gpt_tp2", "llama_tp2_distopt", "gpt_pp2_distopt", "llama_tp2_pp2_dp2_distopt"])
def test_the_hf_export_streams_in_shards_equal_to_the_whole_reads(case: str, tmp_path: Path) -> None:
    """`--to hf` reads the source a unit at a time and writes save_pretrained's shards one at a time: the same
    files, index and tensors as the export of the whole read, holding at most one unit of the source (for
    dp_reshardable, gpt_pp2_distopt, the weights are the fp32 masters put together from the flat buffers)."""
    import transformers
    from safetensors.torch import load_file

    from megatron_hpc.checkpoint.foreign import export_hf

    folder = FIXTURES / case / ITER
    total, unit = _bounds(folder)
    if case in DP_RESHARDABLE:  # the flat buffers' spans
        unit = _bucket_bound(folder, states=1)
    whole = import_torch_dist(folder).imported.whole
    shard = sum(w.numel() * 4 for w in whole.first["model"].values()) // 3  # fp32 out: three shards or more
    export_hf(whole, tmp_path / "whole", max_shard_bytes=shard)

    streamed = import_torch_dist(folder, stream_budget=1, weights_only=True)
    reader = streamed.reader
    assert reader is not None and all(w.is_meta for w in streamed.imported.whole.first["model"].values())
    written = export_hf(streamed.imported.whole, tmp_path / "streamed", source=streamed.imported.source,
                        max_shard_bytes=shard)
    assert 0 < reader.peak_bytes <= unit < total / 2 and reader.held_bytes == 0

    assert written.name == "model.safetensors.index.json"
    files = sorted(p.name for p in (tmp_path / "whole").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "streamed").iterdir())
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) >= 3 and all((tmp_path / "streamed" / f).stat().st_size < shard + 4096 for f in shards)
    for name in ("config.json", written.name):
        assert (tmp_path / "streamed" / name).read_text() == (tmp_path / "whole" / name).read_text()
    index = json.loads(written.read_text())
    for f in shards:
        want, got = load_file(tmp_path / "whole" / f), load_file(tmp_path / "streamed" / f)
        assert list(got) == list(want) and all(index["weight_map"][k] == f for k in got)
        for key, value in want.items():
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), (f, key)

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "streamed").eval()
    want = json.loads((FIXTURES / case / "expected.json").read_text())
    with torch.no_grad():
        logits = hf(torch.tensor(want["tokens"])).logits[0]
    expected = torch.tensor(want["logits"])
    torch.testing.assert_close(logits, expected[..., :logits.shape[-1]], rtol=0, atol=1e-4)


def test_the_shard_plan_is_save_pretraineds() -> None:
    """hf_shards.plan_shards fills and names files as huggingface_hub's splitter, which save_pretrained calls: a
    tensor past the limit alone, a new file where the next tensor would pass it, one file without a number."""
    from huggingface_hub import split_torch_state_dict_into_shards

    from megatron_hpc.checkpoint.foreign.hf_shards import plan_shards

    sd = {f"t{i}": torch.zeros(n) for i, n in enumerate([10, 300, 50, 50, 900, 20, 20, 100])}
    for max_bytes in (100, 400, 1000, 10**6):
        theirs = split_torch_state_dict_into_shards(sd, filename_pattern="model{suffix}.safetensors",
                                                    max_shard_size=max_bytes)
        ours = plan_shards({k: (t.numel() * 4, t.numel()) for k, t in sd.items()}, max_bytes=max_bytes,
                           stem="model", suffix=".safetensors")
        assert dict(ours.files) == theirs.filename_to_tensors, max_bytes
        assert ours.total_size == theirs.metadata["total_size"]


def _written(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, object], dict[str, list[tuple[int, ...]]]]:
    """(tensors, objects, each tensor key's chunk offsets) of a written torch_dist folder, read by our reader."""
    src = open_folder(folder)
    tensors, objects = read(src, list(src.keys))
    chunks = {k: sorted(tuple(c.offsets) for c in src.keys[k].chunks) for k in src.tensor_keys()}
    return tensors, objects, chunks


@pytest.mark.parametrize(("case", "distributed"), [("gpt_tp2", False), ("llama_tp2_distopt", True),
                                                   ("gpt_dp2_distopt", True), ("gpt_pp2_distopt", False),
                                                   ("llama_tp2_pp2_dp2_distopt", True)])
def test_to_torch_dist_streams_and_writes_what_the_whole_read_writes(case: str, distributed: bool,
                                                                    tmp_path: Path) -> None:
    """`--to torch_dist` from a torch_dist source reads and writes a part at a time (one layer of every stacked key,
    or one other key, with Adam's state), each part read once, and writes the whole read's tensors, objects and
    common.pt; each stacked key is one chunk per layer, as megatron-core saved the source."""
    folder = FIXTURES / case / ITER
    total, unit = _bounds(folder)
    ceiling = total / 2
    if case in DP_RESHARDABLE:  # a layer's spans of the flat buffers and
        unit, ceiling = _bucket_bound(folder), total  # what they make, over half of these 2 layers
    whole = import_torch_dist(folder)
    export_torch_dist(whole.imported.whole, tmp_path / "whole", tp=2, pp=1, distributed=distributed)
    streamed = import_torch_dist(folder, stream_budget=1)
    reader = streamed.reader
    assert reader is not None and streamed.imported.source is not None
    export_torch_dist(streamed.imported.whole, tmp_path / "streamed", tp=2, pp=1, distributed=distributed,
                      source=streamed.imported.source)
    assert 0 < reader.peak_bytes <= unit < ceiling
    assert reader.held_bytes == 0
    layers = int(open_folder(folder).common["args"].num_layers)
    assert layers + 2 <= reader.unit_reads <= layers + 5  # each part once: the layers, embeddings, norms, output

    expected, got = _written(tmp_path / "whole" / ITER), _written(tmp_path / "streamed" / ITER)
    assert sorted(got[0]) == sorted(expected[0]) and got[2] == expected[2] and got[1] == expected[1]
    for key, value in expected[0].items():
        assert got[0][key].dtype == value.dtype and torch.equal(got[0][key], value), key
    source_chunks = {k: sorted(tuple(c.offsets) for c in open_folder(folder).keys[k].chunks)
                     for k in open_folder(folder).tensor_keys() if k.startswith("decoder.layers.")}
    assert all(got[2][k] == [(i,) + (0,) * (len(v[0]) - 1) for i in range(layers)] for k, v in source_chunks.items())
    ours, theirs = (torch.load(tmp_path / d / ITER / "common.pt", weights_only=False) for d in ("streamed", "whole"))
    assert vars(ours.pop("args")) == vars(theirs.pop("args"))
    assert repr(ours) == repr(theirs)


def _rewritten(case: str, dest: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of `case` whose iteration folder is written again by torch.distributed.checkpoint's own writer (one
    process, one file, nested objects kept whole as megatron-core's planner keeps them) after `change` edits its
    tensors in place; common.pt and metadata.json are copied as they are."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    shutil.copytree(FIXTURES / case, dest)
    folder = dest / ITER
    src = open_folder(folder)
    tensors, objects = read(src, list(src.keys))
    change(tensors)
    for old in [*folder.glob("*.distcp"), folder / ".metadata"]:
        old.unlink()
    with warnings.catch_warnings():  # one process on purpose: no_dist says so, torch warns anyway
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({**tensors, **objects}, storage_writer=dcp.FileSystemWriter(folder),
                 planner=DefaultSavePlanner(flatten_state_dict=False), no_dist=True)
    return dest


def test_a_tied_embeddings_state_is_the_last_stages_copy(tmp_path: Path) -> None:
    """gpt_pp2_distopt holds a copy of the shared word embedding in each stage's buckets (megatron-core keeps them
    equal); with the last stage's copy of both moments doubled, the whole and the streamed read both take it, the
    rule torch_dist_buckets.py documents, and nothing else moves."""
    folder = FIXTURES / "gpt_pp2_distopt" / ITER
    embedding = open_folder(folder).keys["embedding.word_embeddings.weight"].size.numel()
    last = "optimizer.distributed.dp_group_idx_1.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0."

    def double(tensors: dict[str, torch.Tensor]) -> None:
        for what in ("exp_avg", "exp_avg_sq"):
            assert tensors[last + what].numel() == embedding  # the last stage's copy, alone in its bucket
            tensors[last + what].mul_(2)

    changed = _rewritten("gpt_pp2_distopt", tmp_path / "changed", double) / ITER
    pristine = import_torch_dist(folder)
    stream.reshard(stream.in_memory(pristine.imported.whole), tp=2, out=tmp_path / "pristine", fmt="torch")
    want = _tensors(tmp_path / "pristine")
    doubled = [k for k in want if ".wte." in k and k.endswith((".exp_avg", ".exp_avg_sq"))]
    assert len(doubled) == 4  # two TP ranks' vocabulary halves, two moments
    whole, streamed, _ = _convert_both(changed, tmp_path)
    for got in (whole, streamed):
        assert sorted(got) == sorted(want)
        for key, value in want.items():
            assert torch.equal(got[key], value * 2 if key in doubled else value), key


def test_a_damaged_master_in_a_stages_last_layer_is_seen_by_the_streamed_read(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The streamed read confirms the layout on each stage's first and last layers: a changed fp32 master in stage
    0's last layer (layer 1 of llama_tp2_pp2_dp2_distopt, TP rank 1's linear_fc2) is named in one line, as the
    whole read names it, and the damaged masters and moments are not written (the weights come from the saved
    weights). With the first layer alone sampled, the damaged master became the written weight."""
    from megatron_hpc.checkpoint.foreign.torch_dist_buckets import bucket_space
    from megatron_hpc.cli.main import main

    case = "llama_tp2_pp2_dp2_distopt"
    src = open_folder(FIXTURES / case / ITER)
    model = {k: torch.empty(tuple(src.keys[k].size), device="meta") for k in src.tensor_keys()
             if not k.startswith("optimizer.")}
    space = bucket_space(src, model, tp=2, pp=2, swiglu=True, num_layers=4)
    piece = space.flats[("decoder.layers.mlp.linear_fc2.weight", 1, "param")].pieces[1]
    assert "dp_group_idx_1." in piece.flat  # stage 0, TP rank 1

    def damage(tensors: dict[str, torch.Tensor]) -> None:
        tensors[piece.flat][piece.start:piece.start + math.prod(piece.shape)] += 1.0

    damaged = _rewritten(case, tmp_path / "damaged", damage)
    said = ("the dp_reshardable buffers of model-parallel rank 1 (buckets [10496]) do not lay out as megatron-core's "
            "grad buffer over the model's parameters (the fp32 master of decoder.layers.mlp.linear_fc2.weight in "
            "layer 1 is not its weight there); save with --dist-ckpt-optim-fully-reshardable")
    assert any(said in note for note in import_torch_dist(damaged / ITER).imported.notes)  # the whole read
    outs, noted = {}, {}
    for name, folder in (("damaged", damaged), ("pristine", FIXTURES / case)):
        outs[name] = tmp_path / f"{name}_out"
        code = main(["ckpt", "convert", str(folder), "--to", "torch", "--tp", "1", "--pp", "1", "--json",
                     "--out", str(outs[name])])
        out, err = capsys.readouterr()
        assert code == 0, err
        noted[name] = (json.loads(out)["optimizer"], [line for line in err.splitlines() if "dp_reshardable" in line])
    assert noted["pristine"] == ("resharded", [])
    assert noted["damaged"][0] == "dropped" and len(noted["damaged"][1]) == 1 and said in noted["damaged"][1][0]
    ours, theirs = read_whole(outs["damaged"]).first, read_whole(outs["pristine"]).first
    assert "optimizer" not in ours or not ours["optimizer"].get("state")
    for key, value in theirs["model"].items():
        assert torch.equal(ours["model"][key], value), key

"""torch_dist checkpoints written by the real megatron-core 0.16.1 (tests/fixtures/make_megatron_core_torch_dist.py,
run by hand; its expected.json holds what megatron-core computed): GPT at TP 2, GPT at PP 2, GPT with the
distributed optimizer at DP 2 (dp_reshardable buckets), GPT at PP 2 with tied embeddings and the distributed optimizer
(dp_reshardable, each stage's copy of the shared embedding in a bucket of its own), GPT at PP 2 with 2 virtual chunks
per stage (the interleaved schedule, 2 micro-batches a step), and a Llama-shaped model (RMSNorm, SwiGLU, 4 heads in 2
query groups, no biases, untied output, RoPE) at TP 2 with the distributed optimizer saved fully reshardable, and
the same Llama shape (4 layers) at TP 2 x PP 2 x DP 2 in dp_reshardable buckets (each rank's TP pieces).
`ckpt inspect` and `ckpt convert` read them through torch.distributed.checkpoint; our GPT from the converted
checkpoint gives megatron-core's logits, Adam's state comes through, and our trainer resumed from it takes the step
megatron-core took next (LR, gradient norm, loss)."""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch
from mcore_names import ours_names

from megatron_hpc.checkpoint.conversion import read_whole
from megatron_hpc.checkpoint.conversion.optim_layout import by_name
from megatron_hpc.checkpoint.foreign import torch_dist_optim
from megatron_hpc.cli.main import main
from megatron_hpc.config.loader import from_dict
from megatron_hpc.config.schema import CheckpointConfig, DataConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig
from megatron_hpc.data.indexed import IndexedDatasetWriter
from megatron_hpc.model.gpt import GPT
from megatron_hpc.parallel.context import ParallelContext
from megatron_hpc.parallel.device import DeviceInfo
from megatron_hpc.run_folder import IterationRecord
from megatron_hpc.train.entry import plan_for_torchrun
from megatron_hpc.train.loop import train

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "megatron_core_torch_dist"
CASES = ("gpt_tp2", "gpt_pp2", "gpt_dp2_distopt", "llama_tp2_distopt", "gpt_pp2_distopt", "gpt_pp2_vp2",
         "llama_tp2_pp2_dp2_distopt")
ITER = "iter_0000003"
BF16 = "llama_bf16_tp2"
"""The Llama shape at TP 2 trained with --bf16 and plain Adam (Float16OptimizerWithFloat16Params: fp32 masters, its
state dict nested under 'optimizer'). Not in CASES: our fp32 forward of its masters meets megatron-core's bf16 one
only to bf16 precision, and so does a continuation."""


def _expected(case: str) -> dict[str, Any]:
    return json.loads((FIXTURES / case / "expected.json").read_text())


def _cli(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each fixture converted to our xser layout at TP 1 x PP 1 (what the in-process trainer loads)."""
    out = {}
    for case in (*CASES, BF16):
        dest = tmp_path_factory.mktemp(case) / "ours"
        assert main(["ckpt", "convert", str(FIXTURES / case), "--to", "xser", "--tp", "1", "--pp", "1",
                     "--out", str(dest)]) == 0
        out[case] = dest
    return out


@pytest.mark.parametrize("case", (*CASES, BF16))
def test_inspect_reads_what_megatron_core_wrote(case: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _cli(capsys, "ckpt", "inspect", FIXTURES / case, "--json")
    assert code == 0, err
    got = json.loads(out)
    want = _expected(case)
    assert (got["family"], got["format"], got["iteration"], got["checkpoint_version"]) == (
        "megatron-core", "torch_dist", 3, 3.0)
    assert (got["tensor_parallel"], got["pipeline_parallel"], got["data_parallel"]) == (
        want["tensor_parallel"], want["pipeline_parallel"], want["data_parallel"])
    assert got["virtual_pipeline"] == (2 if case == "gpt_pp2_vp2" else None)
    names = {r["name"] for r in got["tensors"]}
    assert "decoder.layers.self_attention.linear_qkv.weight" in names


def _logits(case: str, converted: dict[str, Path], ctx: ParallelContext) -> tuple[torch.Tensor, torch.Tensor]:
    """Our GPT's logits from `case` converted (its resolved model config), and megatron-core's on the same tokens."""
    state = read_whole(converted[case]).first
    cfg = from_dict(ModelConfig, state["resolved_config"]["model"], where="model")
    model = GPT(cfg, ctx=ctx, padded_vocab=state["model"]["wte.weight"].shape[0], seed=1)
    model.load_state_dict(state["model"])
    want = _expected(case)
    with torch.no_grad():
        logits = model.eval()(torch.tensor(want["tokens"]))[0]
    return logits, torch.tensor(want["logits"])


@pytest.mark.parametrize("case", CASES)
def test_converted_model_gives_megatron_cores_logits(case: str, converted: dict[str, Path],
                                                     ctx: ParallelContext) -> None:
    logits, want = _logits(case, converted, ctx)
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-4)


def test_bf16_masters_give_megatron_cores_bf16_logits(converted: dict[str, Path], ctx: ParallelContext) -> None:
    """The converted weights are the fp32 masters; megatron-core's forward ran in bf16 (about 3 significant digits:
    2.5e-3 apart at most here, where bf16 weights read instead of the masters, or a dropped RoPE base, are further)."""
    logits, want = _logits(BF16, converted, ctx)
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-2)


def _summary(tensors: list[torch.Tensor]) -> dict[str, float]:
    out = {"sum": 0.0, "abs_sum": 0.0, "sq_sum": 0.0}
    for t in tensors:
        t = t.double()
        out["sum"] += t.sum().item()
        out["abs_sum"] += t.abs().sum().item()
        out["sq_sum"] += (t * t).sum().item()
    return out


@pytest.mark.parametrize("case", (*CASES, BF16))
def test_adam_state_carries_over_as_megatron_core_kept_it(case: str, converted: dict[str, Path]) -> None:
    """Every parameter's fp32 master and both moments, summed over the whole tensor as megatron-core summed them
    over its TP and DP shards, and the step count. With bf16 and plain Adam the state was dropped before ('its param
    groups are missing': they are nested one level down there)."""
    state = read_whole(converted[case]).first
    model = state["model"]
    moments = by_name(model, state["optimizer"])
    want = _expected(case)["moments"]
    assert sorted(moments) == sorted(n for name in want for n in ours_names(name, model))
    for name, summary in want.items():
        ours = ours_names(name, model)
        assert sum(model[n].numel() for n in ours) == summary["numel"], name
        got = {"param": [model[n] for n in ours], "exp_avg": [moments[n]["exp_avg"] for n in ours],
               "exp_avg_sq": [moments[n]["exp_avg_sq"] for n in ours]}
        for key, tensors in got.items():
            for how, value in _summary(tensors).items():
                assert value == pytest.approx(summary[f"{key}:{how}"], rel=1e-5, abs=1e-12), (name, key, how)
        assert all(float(moments[n]["step"]) == 3.0 for n in ours)


def _fixed_tokens(tmp_path: Path, tokens: list[int]) -> str:
    """A corpus whose every sample is megatron-core's (tokens, labels) (see test_checkpoint_megatron_core_real.py)."""
    prefix = tmp_path / "fixed"
    writer = IndexedDatasetWriter(prefix, dtype=numpy.uint16)
    for _ in range(4):
        writer.add_document(tokens)
    writer.finalize()
    return str(prefix)


def _resume(converted: Path, *, want: dict[str, Any], data: str, saves: Path,
            ctx: ParallelContext) -> dict[int, IterationRecord]:
    """Our trainer's own run (train/loop.py) from the converted checkpoint to iteration 5 on the fixed tokens, with
    the fixture's optimizer settings and global batch (DP 2 there: the same tokens on both ranks, so a global batch
    of 2 identical samples here)."""
    model = from_dict(ModelConfig, read_whole(converted).first["resolved_config"]["model"], where="model")
    gbs = want["global_batch_size"]
    cfg = RunConfig(
        name="continuation",
        model=dataclasses.replace(model, hidden_dropout=0.0, attention_dropout=0.0),
        train=TrainConfig(num_steps=5, micro_batch_size=1, global_batch_size=gbs, log_interval=1, tensorboard=False,
                          eval_test=False),
        optim=OptimConfig(**want["optimizer"]),
        data=DataConfig(source="indexed", path=data, split="1,0,0", cache_path=str(saves / "index-cache")),
        checkpoint=CheckpointConfig(load=str(converted), save=str(saves)))
    device = DeviceInfo(kind="cpu", device=torch.device("cpu"), backend="gloo")
    out = io.StringIO()
    summary = train(plan_for_torchrun(cfg, environ={}), ctx, device=device, phase="run", out=out)
    assert f"loaded checkpoint {converted}" in out.getvalue(), out.getvalue()
    assert "optimizer afresh" not in out.getvalue(), out.getvalue()
    return {r.iteration: r for r in summary.records}


@pytest.mark.parametrize("case", CASES)
def test_training_continues_where_megatron_core_would_have(case: str, converted: dict[str, Path], tmp_path: Path,
                                                           ctx: ParallelContext) -> None:
    """Our trainer restored from the converted checkpoint takes megatron-core's iteration 4: its LR (the scheduler
    position), its gradient norm (megatron-core clipped it: above clip_grad 1), its loss (the saved weights), and the
    loss after it equal to 1e-5, which needs both moments, the step count and the LR position to have come through
    (test_checkpoint_megatron_core_real.py shows each of them alone moves it 500 times further)."""
    want = _expected(case)
    records = _resume(converted[case], want=want, data=_fixed_tokens(tmp_path, want["tokens"][0]),
                      saves=tmp_path / "resumed", ctx=ctx)
    assert sorted(records) == [4, 5]
    assert records[4].applied_lr == pytest.approx(want["next_lr"], rel=1e-12)
    assert records[4].grad_norm == pytest.approx(want["next_grad_norm"], rel=1e-5)
    assert records[4].lm_loss == pytest.approx(want["next_step_loss"], rel=1e-5)
    assert records[5].lm_loss == pytest.approx(want["next_loss"], rel=1e-5)


def test_the_dp_reshardable_layout_is_megatron_cores_grad_buffer() -> None:
    """Worked by hand from param_and_grad_buffer.py: reverse order, 64-aligned starts from each bucket's start, a
    bucket closes where its recorded unpadded length ends."""
    assert torch_dist_optim.layout([3, 70, 5], [195], 64) == [(0, 192), (0, 64), (0, 0)]
    assert torch_dist_optim.layout([3, 70, 5], [134, 3], 64) == [(1, 0), (0, 64), (0, 0)]
    assert torch_dist_optim.layout([3, 70, 5], [78], 1) == [(0, 75), (0, 5), (0, 0)]
    assert torch_dist_optim.layout([3, 70, 5], [200], 64) is None  # the lengths must come out exactly


def test_a_dp_reshardable_buffer_out_of_place_is_not_taken(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """With no module order that puts every fp32 master on its weight, the moments are dropped with a note instead
    of being assigned to the wrong parameters."""
    monkeypatch.setattr(torch_dist_optim, "LAYER_ORDERS", (tuple(reversed(torch_dist_optim.LAYER_ORDERS[0])),))
    code, out, err = _cli(capsys, "ckpt", "convert", FIXTURES / "gpt_dp2_distopt", "--to", "torch", "--json",
                          "--out", tmp_path / "out")
    assert code == 0, err
    assert json.loads(out)["optimizer"] == "dropped"
    assert "do not lay out as megatron-core's grad buffer" in err


def _copy(case: str, tmp_path: Path) -> Path:
    dest = tmp_path / case
    shutil.copytree(FIXTURES / case, dest)
    return dest


def _one_line_error(capsys: pytest.CaptureFixture[str], src: Path, out: Path) -> str:
    code, _, err = _cli(capsys, "ckpt", "convert", src, "--to", "torch", "--out", out)
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert not out.exists()
    return lines[0]


def test_a_missing_distcp_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _copy("gpt_tp2", tmp_path)
    (src / ITER / "__1_0.distcp").unlink()
    line = _one_line_error(capsys, src, tmp_path / "out")
    assert "has no __1_0.distcp" in line and "1 of its 4 .distcp data files missing" in line
    assert "copy the missing files" in line


def test_an_unknown_metadata_json_version_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _copy("gpt_tp2", tmp_path)
    config = src / ITER / "metadata.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "sharded_backend_version": 2}))
    line = _one_line_error(capsys, src, tmp_path / "out")
    assert "'sharded_backend_version': 2" in line and "--ckpt-format torch" in line


def test_a_folder_without_common_pt_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _copy("gpt_tp2", tmp_path)
    (src / ITER / "common.pt").unlink()
    line = _one_line_error(capsys, src, tmp_path / "out")
    assert "has no common.pt" in line and "copy common.pt" in line


def _damage(case: str, tmp_path: Path, how: str) -> Path:
    """A copy of `case` with one .distcp file cut to `how` ('empty', 'half') or, for 'zeroed', the bytes of one
    tensor chunk overwritten with zeros (the file keeps its size: only reading that chunk finds it)."""
    src = _copy(case, tmp_path)
    folder = src / ITER
    if how == "zeroed":
        from torch.distributed.checkpoint import FileSystemReader  # torch's own index reader, trusted fixture

        index = FileSystemReader(str(folder)).read_metadata().storage_data
        info = next(i for k, i in index.items() if k.fqn == "decoder.layers.mlp.linear_fc1.weight")
        with (folder / info.relative_path).open("r+b") as fh:
            fh.seek(info.offset)
            fh.write(b"\0" * info.length)
    else:
        data = folder / "__1_0.distcp"
        with data.open("r+b") as fh:
            fh.truncate(0 if how == "empty" else data.stat().st_size // 2)
    return src


@pytest.mark.parametrize("how", ["empty", "half"])
def test_a_truncated_distcp_file_is_refused_before_anything_is_read(how: str, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The index's byte ranges tell a file cut short: inspect refuses it too, and convert before writing (torch's
    reader raised CheckpointException, a BaseException, which escaped as a traceback and left the --out folder)."""
    src = _damage("gpt_tp2", tmp_path, how)
    line = _one_line_error(capsys, src, tmp_path / "out")
    assert "__1_0.distcp has" in line and "the file is truncated" in line and "copy the checkpoint again" in line
    code, out, err = _cli(capsys, "ckpt", "inspect", src)
    assert code == 1 and err.strip().splitlines() == [line] and not out


@pytest.mark.parametrize("to", ["torch", "xser", "hf", "torch_dist"])
def test_damaged_distcp_data_is_one_line_and_leaves_nothing(to: str, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Found only when the chunk is read, mid-convert: one line (no tokenizer note before it with --to hf), and
    neither the --out folder nor any file in it is left behind."""
    src = _damage("gpt_tp2", tmp_path, "zeroed")
    out = tmp_path / "out"
    code, _, err = _cli(capsys, "ckpt", "convert", src, "--to", to, "--out", out)
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "could not read" in lines[0] and "a .distcp file is damaged" in lines[0]
    assert not out.exists()


@pytest.mark.parametrize("case", CASES)
def test_inspect_verify_reads_every_chunk_megatron_core_saved(case: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _cli(capsys, "ckpt", "inspect", FIXTURES / case, "--verify", "--json")
    assert code == 0, err
    assert json.loads(out)["verified"] is True


def test_inspect_verify_finds_a_damaged_chunk(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--verify ("reads all data") was silently ignored for torch_dist: rc 0 on a zeroed tensor chunk."""
    src = _damage("gpt_tp2", tmp_path, "zeroed")
    code, out, err = _cli(capsys, "ckpt", "inspect", src)
    assert code == 0 and "verified" not in out  # the index alone is whole
    code, out, err = _cli(capsys, "ckpt", "inspect", src, "--verify")
    assert code == 1 and not out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "a .distcp file is damaged" in lines[0], err


@pytest.mark.parametrize(("case", "advice"), [("gpt_tp2", "add GPT-2 vocab.json and merges.txt"),
                                              ("llama_tp2_distopt", "add the model's tokenizer files")])
def test_the_missing_tokenizer_note_fits_the_exported_architecture(case: str, advice: str, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The fixtures' runs had no tokenizer (NullTokenizer): GPT-2's vocab files were advised for a Llama export too."""
    code, _, err = _cli(capsys, "ckpt", "convert", FIXTURES / case, "--to", "hf", "--out", tmp_path / "hf")
    assert code == 0, err
    notes = [line for line in err.splitlines() if "no tokenizer files written" in line]
    assert len(notes) == 1 and advice in notes[0], err


def test_an_hf_export_does_not_warn_about_what_a_resumed_run_lacks(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A model-only save (--no-save-optim --no-save-rng, here common.pt without its optimizer): `--to torch` warns
    that a resumed run starts Adam afresh; `--to hf` never carries Adam or RNG state, and warned about it anyway."""
    src = _copy("gpt_tp2", tmp_path)
    common = src / ITER / "common.pt"
    state = torch.load(common, weights_only=False)
    state.pop("optimizer")
    torch.save(state, common)
    code, _, err = _cli(capsys, "ckpt", "convert", src, "--to", "torch", "--out", tmp_path / "ours")
    assert code == 0 and "a resumed run starts Adam's moments at zero" in err, err
    code, _, err = _cli(capsys, "ckpt", "convert", src, "--to", "hf", "--out", tmp_path / "hf")
    assert code == 0, err
    assert "resumed run" not in err and "warning" not in err, err


def _tensors(value: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor under `value` (nested dicts and lists) by its path."""
    if torch.is_tensor(value):
        return {prefix: value}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list | tuple) else ()
    out: dict[str, torch.Tensor] = {}
    for key, item in items:
        out.update(_tensors(item, f"{prefix}/{key}"))
    return out


@pytest.mark.parametrize("workers", [2, 3])
def test_workers_write_what_one_process_writes(workers: int, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """--workers N forks N processes that each write a run of the output ranks (3 over 4 ranks: uneven runs). Every
    rank's weights and Adam state equal the one-process convert's, tensor for tensor, and the manifest names them."""
    from megatron_hpc.checkpoint.conversion import locate
    from megatron_hpc.checkpoint.store import read_shard

    src = FIXTURES / "llama_tp2_pp2_dp2_distopt"
    outs = {n: tmp_path / f"w{n}" for n in (1, workers)}
    for n, out in outs.items():
        code, _, err = _cli(capsys, "ckpt", "convert", src, "--to", "torch", "--tp", 2, "--pp", 2, "--out", out,
                            "--workers", n)
        assert code == 0, err
    one, many = (locate(outs[n]) for n in (1, workers))
    for pp_rank in range(2):
        for tp_rank in range(2):
            want = read_shard(one, tp_rank=tp_rank, pp_rank=pp_rank)
            got = read_shard(many, tp_rank=tp_rank, pp_rank=pp_rank)
            for part in ("model", "optimizer"):
                want_t, got_t = _tensors(want[part]), _tensors(got[part])
                assert want_t.keys() == got_t.keys() and want_t
                for key, tensor in want_t.items():
                    assert torch.equal(got_t[key], tensor), (pp_rank, tp_rank, key)


def test_a_failing_worker_is_one_line_and_leaves_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A chunk found damaged inside a forked worker: its message comes back as the command's one line, the other
    worker's ranks and the --out folder are removed, as without workers."""
    src = _damage("gpt_tp2", tmp_path, "zeroed")
    out = tmp_path / "out"
    code, _, err = _cli(capsys, "ckpt", "convert", src, "--to", "torch", "--tp", 2, "--out", out, "--workers", 2)
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "could not read" in lines[0] and "a .distcp file is damaged" in lines[0]
    assert not out.exists()


def test_workers_below_one_are_refused_before_anything_is_read(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    for command in (["convert", FIXTURES / "gpt_tp2", "--to", "torch", "--out", out],
                    ["reshard", FIXTURES / "gpt_tp2", "--tp", 1, "--out", out]):
        code, _, err = _cli(capsys, "ckpt", *command, "--workers", 0)
        assert code == 1
        assert err.strip().splitlines() == ["megatron-hpc: error: --workers 0 must be 1 or more; drop it to write "
                                            "one output rank at a time, or give up to the number of idle cores"]
        assert not out.exists()

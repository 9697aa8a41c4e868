"""Checkpoints written by the real megatron-core 0.16.1 (tests/fixtures/make_megatron_core_checkpoint.py, run by
hand; its expected.json holds what megatron-core computed): GPT at TP 1 and 2, with Adam and the distributed optimizer,
and a Llama-shaped model (RMSNorm, SwiGLU, 4 heads in 2 query groups, no biases, untied output, RoPE of base 500000)
at TP 2 with the distributed optimizer. `ckpt inspect` and `ckpt convert` read them, our GPT from the converted
checkpoint gives megatron-core's logits, Adam's state comes through, from distrib_optim.pt when the run used the
distributed optimizer, and our trainer resumed from the converted checkpoint takes the step megatron-core would have
taken next."""

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
from megatron_hpc.checkpoint.foreign import distrib_optim
from megatron_hpc.checkpoint.foreign.megatron_family import read_rank
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

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "megatron_core_ckpt"
CASES = ("tp1_distopt", "tp1_distopt_buckets", "tp2_adam", "tp2_distopt", "llama_tp2_distopt")
RANK_DIR = "iter_0000003/mp_rank_00"


def _expected(case: str) -> dict[str, Any]:
    return json.loads((FIXTURES / case / "expected.json").read_text())


def _cli(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for case in CASES:
        dest = tmp_path_factory.mktemp(case) / "ours"
        assert main(["ckpt", "convert", str(FIXTURES / case), "--to", "torch", "--tp", "1", "--out", str(dest)]) == 0
        out[case] = dest
    return out


@pytest.mark.parametrize("case", CASES)
def test_inspect_reads_what_megatron_core_wrote(case: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _cli(capsys, "ckpt", "inspect", FIXTURES / case, "--json")
    assert code == 0, err
    got = json.loads(out)
    want = _expected(case)
    assert (got["family"], got["iteration"], got["checkpoint_version"]) == ("megatron-core", 3, 3.0)
    assert (got["tensor_parallel"], got["pipeline_parallel"]) == (want["tensor_parallel"], 1)


@pytest.mark.parametrize("case", CASES)
def test_converted_model_gives_megatron_cores_logits(case: str, converted: dict[str, Path],
                                                     ctx: ParallelContext) -> None:
    whole = read_whole(converted[case])
    state = whole.first
    cfg = from_dict(ModelConfig, state["resolved_config"]["model"], where="model")
    model = GPT(cfg, ctx=ctx, padded_vocab=state["model"]["wte.weight"].shape[0], seed=1)
    model.load_state_dict(state["model"])
    want = _expected(case)
    with torch.no_grad():
        logits = model.eval()(torch.tensor(want["tokens"]))[0]
    torch.testing.assert_close(logits, torch.tensor(want["logits"]), rtol=0, atol=1e-4)


def _summary(tensors: list[torch.Tensor]) -> dict[str, float]:
    out = {"sum": 0.0, "abs_sum": 0.0, "sq_sum": 0.0}
    for t in tensors:
        t = t.double()
        out["sum"] += t.sum().item()
        out["abs_sum"] += t.abs().sum().item()
        out["sq_sum"] += (t * t).sum().item()
    return out


@pytest.mark.parametrize("case", CASES)
def test_adam_state_carries_over_as_megatron_core_kept_it(case: str, converted: dict[str, Path]) -> None:
    state = read_whole(converted[case]).first
    model = state["model"]
    moments = by_name(model, state["optimizer"])
    per_rank = _expected(case)["moments_by_tp_rank"]
    assert sorted(moments) == sorted(n for name in per_rank[0] for n in ours_names(name, model))
    for name in per_rank[0]:
        ours = ours_names(name, model)
        numel = sum(model[n].numel() for n in ours)
        # A TP-split weight's summaries add up over the shards; a replicated one is rank 0's.
        ranks = per_rank if sum(r[name]["numel"] for r in per_rank) == numel else per_rank[:1]
        assert sum(r[name]["numel"] for r in ranks) == numel, name
        got = {"param": [model[n] for n in ours], "exp_avg": [moments[n]["exp_avg"] for n in ours],
               "exp_avg_sq": [moments[n]["exp_avg_sq"] for n in ours]}
        for key, tensors in got.items():
            for how, value in _summary(tensors).items():
                want = sum(r[name][f"{key}:{how}"] for r in ranks)
                assert value == pytest.approx(want, rel=1e-5, abs=1e-12), (name, key, how)
        assert all(float(moments[n]["step"]) == 3.0 for n in ours)


def test_the_bucketed_fixture_lays_parameters_out_otherwise() -> None:
    """The multi-bucket case tests the bucket rule: its layout differs from the single bucket's."""
    model = read_rank(FIXTURES / "tp1_distopt_buckets" / RANK_DIR / "model_optim_rng.pt")
    params = {n: t.shape for n, t in model["model"].items() if isinstance(t, torch.Tensor)}
    chunk = distrib_optim.Chunk(params=params)
    one, _ = distrib_optim.offsets(chunk, align=64, bucket_size=None)
    many, _ = distrib_optim.offsets(chunk, align=64, bucket_size=model["args"].ddp_bucket_size)
    assert one != many


def test_the_flat_layout_follows_megatron_cores_padding_rules() -> None:
    """Worked by hand from param_and_grad_buffer.py: reverse order, 64-aligned starts counted from each bucket's
    start, bucket end padding cut off, a shared embedding alone in its bucket."""
    shapes = {"a": torch.Size([3]), "b": torch.Size([7, 10]), "c": torch.Size([5])}
    assert distrib_optim.offsets(distrib_optim.Chunk(params=shapes), align=64, bucket_size=None) == (
        {"c": 0, "b": 64, "a": 192}, 195)
    assert distrib_optim.offsets(distrib_optim.Chunk(params=shapes), align=1, bucket_size=None) == (
        {"c": 0, "b": 5, "a": 75}, 78)
    # Bucket of >= 60 elements: c and b fill the first (64 + 70 = 134 kept), a starts the second at 0.
    assert distrib_optim.offsets(distrib_optim.Chunk(params=shapes), align=64, bucket_size=60) == (
        {"c": 0, "b": 64, "a": 134}, 137)
    alone = distrib_optim.Chunk(params={"emb": torch.Size([10]), "x": torch.Size([5])}, own_bucket=frozenset({"emb"}))
    assert distrib_optim.offsets(alone, align=64, bucket_size=None) == ({"x": 0, "emb": 64}, 74)


def _fixed_tokens(tmp_path: Path, tokens: list[int]) -> str:
    """An indexed corpus whose every training sample is megatron-core's (tokens, labels): documents of exactly the
    fixture's tokens back to back, so the stream repeats with the sequence's period and each sample of seq + 1
    tokens (Megatron's samples overlap by one) is the tokens plus the first again, whose shift is megatron-core's
    labels (torch.roll(tokens, -1)) whichever documents and samples the shuffles pick."""
    prefix = tmp_path / "fixed"
    writer = IndexedDatasetWriter(prefix, dtype=numpy.uint16)
    for _ in range(4):
        writer.add_document(tokens)
    writer.finalize()
    return str(prefix)


def _resume(converted: Path, *, want: dict[str, Any], data: str, saves: Path, ctx: ParallelContext,
            load_optim: bool = True) -> dict[int, IterationRecord]:
    """Our trainer's own run (train/loop.py) from the converted checkpoint to iteration 5 on the fixed tokens, with
    the fixture's model and optimizer settings; its logged iterations by number. Iteration 4 is megatron-core's
    continuation; iteration 5's loss is the loss on the same tokens after it."""
    model = from_dict(ModelConfig, read_whole(converted).first["resolved_config"]["model"], where="model")
    cfg = RunConfig(
        name="continuation",
        model=dataclasses.replace(model, hidden_dropout=0.0, attention_dropout=0.0),  # as the fixture's run
        train=TrainConfig(num_steps=5, micro_batch_size=1, global_batch_size=1, log_interval=1, tensorboard=False,
                          eval_test=False),
        optim=OptimConfig(**want["optimizer"]),
        data=DataConfig(source="indexed", path=data, split="1,0,0", cache_path=str(saves / "index-cache")),
        checkpoint=CheckpointConfig(load=str(converted), save=str(saves), load_optim=load_optim))
    device = DeviceInfo(kind="cpu", device=torch.device("cpu"), backend="gloo")
    out = io.StringIO()
    summary = train(plan_for_torchrun(cfg, environ={}), ctx, device=device, phase="run", out=out)
    assert f"loaded checkpoint {converted}" in out.getvalue(), out.getvalue()
    assert ("optimizer afresh" in out.getvalue()) != load_optim, out.getvalue()
    return {r.iteration: r for r in summary.records}


@pytest.mark.parametrize("case", CASES)
def test_training_continues_where_megatron_core_would_have(case: str, tmp_path: Path, ctx: ParallelContext) -> None:
    """The checkpoint converted to xser (the trainer's default format) and restored by our trainer's own loop
    (Checkpointer.restore, its AdamW, LR schedule and train_step) takes megatron-core's iteration 4: the loss on the
    same tokens after that one step matches the one megatron-core computed after its own iteration 4 (the generator
    took it after saving).

    One Adam step's update is lr(position) * m_hat / (sqrt(v_hat) + eps) with m_hat = m / (1 - beta1^step) and
    v_hat = v / (1 - beta2^step), plus the weight decay of the decayed group; past the warmup the cosine LR changes
    at every step. The update, and so the next loss, depend on the first and second moments, the step count (the
    bias corrections) and the LR position (the applied steps), besides the weights. Matching megatron-core's next
    loss to 1e-5 therefore shows all four came through the conversion and the restore. The same run with
    checkpoint.load_optim=false (moments zero, step count 0: the first step's update is lr * sign(g)) lands
    measurably elsewhere (3% here), so the check can fail; the next test moves the LR position or the step count
    alone. Iteration 4's loss itself (before the update) is megatron-core's loss of the saved weights, and its LR
    the one megatron-core's scheduler gave iteration 4. Megatron-core clipped that step's gradient (norm 1.5 >
    clip_grad 1), and ours finds the same norm, so the clipping is matched too.
    """
    want = _expected(case)
    ours = tmp_path / "ours"
    assert main(["ckpt", "convert", str(FIXTURES / case), "--to", "xser", "--tp", "1", "--out", str(ours)]) == 0
    data = _fixed_tokens(tmp_path, want["tokens"][0])
    records = _resume(ours, want=want, data=data, saves=tmp_path / "resumed", ctx=ctx)
    assert sorted(records) == [4, 5]  # started at the checkpoint's iteration 3
    assert records[4].applied_lr == pytest.approx(want["next_lr"], rel=1e-12)
    assert records[4].grad_norm == pytest.approx(want["next_grad_norm"], rel=1e-5)  # above clip_grad: clipped
    assert records[4].lm_loss == pytest.approx(want["next_step_loss"], rel=1e-5)
    assert records[5].lm_loss == pytest.approx(want["next_loss"], rel=1e-5)

    fresh = _resume(ours, want=want, data=data, saves=tmp_path / "fresh", ctx=ctx, load_optim=False)
    assert fresh[4].lm_loss == pytest.approx(want["next_step_loss"], rel=1e-5)  # the same weights
    assert abs(fresh[5].lm_loss - want["next_loss"]) > 1e-3 * want["next_loss"], fresh[5].lm_loss


def _lr_position_two(state: dict[str, Any]) -> None:
    state["opt_param_scheduler"]["num_steps"] = 2  # as if one of the three updates had been skipped


def _adam_step_two(state: dict[str, Any]) -> None:
    for moments in state["optimizer"]["state"].values():
        moments["step"] = torch.tensor(2.0)


@pytest.mark.parametrize("tamper", [_lr_position_two, _adam_step_two])
def test_the_continuation_check_sees_the_lr_position_and_the_step_count(
        tamper: Any, tmp_path: Path, ctx: ParallelContext) -> None:
    """Each of the two alone, one off in the source's files, moves the next loss well past the tolerance above
    (by 0.6% and 0.5%: 500 times the 1e-5 the match holds to)."""
    src = _copy("tp2_adam", tmp_path)
    for rank in ("mp_rank_00", "mp_rank_01"):
        path = src / "iter_0000003" / rank / "model_optim_rng.pt"
        state = read_rank(path)
        tamper(state)
        torch.save(state, path)
    dest = tmp_path / "ours"
    assert main(["ckpt", "convert", str(src), "--to", "xser", "--tp", "1", "--out", str(dest)]) == 0
    want = _expected("tp2_adam")
    records = _resume(dest, want=want, data=_fixed_tokens(tmp_path, want["tokens"][0]), saves=tmp_path / "resumed",
                      ctx=ctx)
    assert records[4].lm_loss == pytest.approx(want["next_step_loss"], rel=1e-5)  # the same weights
    assert abs(records[5].lm_loss - want["next_loss"]) > 1e-3 * want["next_loss"], records[5].lm_loss


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


def test_a_missing_distrib_optim_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _copy("tp1_distopt", tmp_path)
    (src / RANK_DIR / "distrib_optim.pt").unlink()
    line = _one_line_error(capsys, src, tmp_path / "out")
    assert f"{RANK_DIR}/distrib_optim.pt is missing" in line and "distributed optimizer" in line


def test_a_distrib_optim_file_of_another_size_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _copy("tp1_distopt", tmp_path)
    path = src / RANK_DIR / "distrib_optim.pt"
    state = torch.load(path, weights_only=True)
    (buf,) = state[0].values()
    for key in distrib_optim.KEYS:
        buf[key] = buf[key][:-64].clone()
    buf["numel_unpadded"] -= 64
    torch.save(state, path)
    line = _one_line_error(capsys, src, tmp_path / "out")
    assert str(path) in line and "optimizer elements" in line and "another model" in line


def test_the_pre_2024_distrib_optim_layout_names_megatrons_fix(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    src = _copy("tp1_distopt", tmp_path)
    path = src / RANK_DIR / "distrib_optim.pt"
    state = torch.load(path, weights_only=True)
    del state["buckets_coalesced"]
    torch.save(state, path)
    line = _one_line_error(capsys, src, tmp_path / "out")
    assert str(path) in line and "--ckpt-convert-update-legacy-dist-opt-format" in line


def test_the_llama_exports_to_transformers_with_megatron_cores_logits(tmp_path: Path) -> None:
    """`--to hf` reads the shards whole (not mapped one output rank at a time): transformers' model from the export
    of megatron-core's Llama-shaped checkpoint gives the logits megatron-core computed."""
    import transformers

    assert main(["ckpt", "convert", str(FIXTURES / "llama_tp2_distopt"), "--to", "hf", "--out",
                 str(tmp_path / "hf")]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    want = _expected("llama_tp2_distopt")
    with torch.no_grad():
        logits = model(torch.tensor(want["tokens"])).logits[0]
    torch.testing.assert_close(logits, torch.tensor(want["logits"]), rtol=0, atol=1e-4)

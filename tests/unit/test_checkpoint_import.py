"""Checkpoints of the Neuron reference, Megatron-LM and megatron-core: read safely, inspected, converted to ours at any
TP x PP with the weights, Adam moments and progress exact; bad input refused in one line with nothing written."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
import megatron_writers as mw

from megatron_hpc.checkpoint.conversion import read_whole
from megatron_hpc.checkpoint.conversion.optim_layout import by_name
from megatron_hpc.checkpoint.store import find_checkpoint, read_progress, safe_load
from megatron_hpc.cli.main import main
from megatron_hpc.errors import CheckpointError

LAYERS, HIDDEN, HEADS, FFN, VOCAB, POS = 4, 16, 4, 32, 64, 16


def _full(seed: int = 0, **kw: Any) -> dict[str, torch.Tensor]:
    return mw.full_model(seed, layers=LAYERS, hidden=HIDDEN, ffn=FFN, vocab=VOCAB, positions=POS, **kw)


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def _convert(capsys: pytest.CaptureFixture[str], src: Path, out: Path, *extra: str) -> dict[str, Any]:
    code, stdout, err = _cli(capsys, "ckpt", "convert", src, "--to", "torch", "--out", out, "--json", *extra)
    assert code == 0, err
    return json.loads(stdout)


def _only_state(out: Path) -> dict[str, Any]:
    whole = read_whole(out)
    assert (whole.tensor_parallel, whole.pipeline_parallel) == (1, 1)
    return whole.first


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == torch.float32, name
        assert torch.equal(got[name], want[name].float()), name


# ---------------------------------------------------------------------------------------------- what may be unpickled

class _SystemPickler(pickle._Pickler):
    """Writes os.system as the global `os system` (the stock pickler names the module posix)."""

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if obj is os.system:
            self.write(pickle.GLOBAL + b"os\nsystem\n")
            return
        super().save_global(obj, name)


class _Attack:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def _malicious(path: Path, marker: Path) -> None:
    module = types.ModuleType("attack_pickle")
    module.Pickler = _SystemPickler  # type: ignore[attr-defined]
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"iteration": 1, "model": {"x": _Attack(marker)}}, path, pickle_module=module)


def test_megatron_objects_load_under_numpy_1_and_2_names(tmp_path: Path) -> None:
    state = {"args": mw.megatron_args(num_layers=2), "np_rng_state": np.random.get_state(),
             "scalar": np.float64(0.25), "count": np.int64(7), "ids": np.arange(4, dtype=np.int32)}
    for numpy1 in (False, True):
        path = tmp_path / f"numpy1-{numpy1}.pt"
        mw.save_torch(state, path, numpy1=numpy1)
        assert (b"numpy.core.multiarray" in path.read_bytes()) == numpy1
        loaded = safe_load(path, what=path)
        assert loaded["args"].num_layers == 2 and loaded["args"].params_dtype == torch.float16
        assert loaded["np_rng_state"][0] == "MT19937"
        assert np.array_equal(loaded["np_rng_state"][1], state["np_rng_state"][1])
        assert loaded["np_rng_state"][1].dtype == np.uint32
        assert loaded["scalar"] == 0.25 and loaded["count"] == 7 and loaded["ids"].tolist() == [0, 1, 2, 3]


def test_megatron_enums_in_args_come_back_inert(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import enum

    class AttnBackend(enum.Enum):
        flash = 1
        auto = 5

    names = ("megatron", "megatron.core", "megatron.core.transformer", "megatron.core.transformer.enums")
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    AttnBackend.__module__ = "megatron.core.transformer.enums"
    AttnBackend.__qualname__ = "AttnBackend"
    sys.modules["megatron.core.transformer.enums"].AttnBackend = AttnBackend  # type: ignore[attr-defined]
    path = tmp_path / "args.pt"
    torch.save({"args": mw.megatron_args(attention_backend=AttnBackend.auto, num_layers=3)}, path)
    for name in names:  # reading must not import it: it is gone
        monkeypatch.delitem(sys.modules, name)
    args = safe_load(path, what=path)["args"]
    assert args.num_layers == 3
    assert type(args.attention_backend).__name__ == "AttnBackend" and args.attention_backend.args == (5,)
    assert not isinstance(args.attention_backend, enum.Enum)


def test_a_malicious_pickle_is_refused_naming_the_global(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "ran"
    probe = tmp_path / "probe.pt"
    _malicious(probe, marker)
    torch.load(probe, weights_only=False)  # the payload works when loaded without restriction
    assert marker.exists()
    marker.unlink()

    main_file = tmp_path / "ckpt" / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    _malicious(main_file, marker)
    mw.write_tracker(tmp_path / "ckpt", 1)
    for args in (("ckpt", "inspect", main_file), ("ckpt", "inspect", tmp_path / "ckpt"),
                 ("ckpt", "convert", tmp_path / "ckpt", "--to", "xser", "--out", tmp_path / "out")):
        code, _, err = _cli(capsys, *args)
        assert code == 1
        assert err.count("\n") == 1, err
        assert f"{main_file} asks for os.system, which a checkpoint may not contain" in err
        assert "weights_only" not in err and "delete" not in err
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------- the three families

def reference_checkpoint(root: Path, *, tp: int, pp: int, xser_files: bool, optimizer: bool = True) -> dict[str, Any]:
    """A bf16 run of the reference at tp x pp, iteration 30 with a global batch of 4: the model in bf16, fp32 masters,
    Adam's moments, the LR scheduler at 28 applied steps (two were skipped), RNG states. Without `optimizer`: the
    model alone in bf16 (--no-save-optim)."""
    full, m1, m2 = _full(1), _full(2, scale=0.1), _full(3, scale=0.01, positive=True)
    for p in range(pp):
        for t in range(tp):
            shards = [mw.tp_shard(x, tp, t) for x in (full, m1, m2)]
            layers = mw.stage_layers(layers=LAYERS, pp=pp, vp=1, pp_rank=p, chunk=0)
            nested = [mw.legacy_model(s, layers=layers, first=p == 0, last=p == pp - 1, version=3.0,
                                      heads=HEADS // tp) for s in shards]
            params = list(mw.flat(nested[0]).items())
            opt = mw.optimizer_state(params, list(mw.flat(nested[1]).values()), list(mw.flat(nested[2]).values()),
                                     step=28.0, masters=True)
            model16 = _to_bf16(nested[0])
            state = {"num_layers": LAYERS, "hidden_size": HIDDEN, "num_attention_heads": HEADS,
                     "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                     "consumed_train_samples": 120, "consumed_valid_samples": 0, "max_position_embeddings": POS,
                     "make_vocab_size_divisible_by": 8, "padded_vocab_size": VOCAB,
                     "tokenizer_type": "GPT2BPETokenizer", "checkpoint_version": 3.0, "iteration": 30,
                     "model": model16, "optimizer": opt,
                     "lr_scheduler": {"max_lr": 1e-4, "warmup_steps": 8, "num_steps": 28 * 4, "decay_style": "cosine",
                                      "decay_steps": 400, "min_lr": 1e-5},
                     **mw.rng_states(7, as_lists=xser_files)}
            if not optimizer:
                del state["optimizer"]
            name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
            main_file = root / "iter_0000030" / name / "model_optim_rng.pt"
            if xser_files:
                mw.save_reference_xser(state, main_file)
            else:
                mw.save_torch(state, main_file)
    mw.write_tracker(root, 30)
    return {"full": full, "m1": m1, "m2": m2}


def _to_bf16(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _to_bf16(v) for k, v in tree.items()}
    return tree.to(torch.bfloat16)


@pytest.mark.parametrize("xser_files", [True, False], ids=["xser", "torch"])
def test_reference_checkpoint_converts_exactly(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              xser_files: bool) -> None:
    want = reference_checkpoint(tmp_path / "ref", tp=2, pp=2, xser_files=xser_files)
    code, stdout, err = _cli(capsys, "ckpt", "inspect", tmp_path / "ref", "--json")
    assert code == 0, err
    seen = json.loads(stdout)
    assert (seen["family"], seen["iteration"], seen["tensor_parallel"], seen["pipeline_parallel"], seen["format"]) == \
        ("neuron-reference", 30, 2, 2, "xser" if xser_files else "torch")
    assert any(r["name"] == "model.language_model.embedding.word_embeddings.weight" and r["shape"] == [VOCAB // 2, 16]
               for r in seen["tensors"])

    report = _convert(capsys, tmp_path / "ref", tmp_path / "ours", "--tp", "1", "--pp", "1")
    assert (report["family"], report["from_tp"], report["from_pp"], report["optimizer"]) == \
        ("neuron-reference", 2, 2, "resharded")
    state = _only_state(tmp_path / "ours")
    _assert_same(state["model"], want["full"])  # the fp32 masters, not the bf16 copies
    moments = by_name(state["model"], state["optimizer"])
    _assert_same({n: m["exp_avg"] for n, m in moments.items()}, want["m1"])
    _assert_same({n: m["exp_avg_sq"] for n, m in moments.items()}, want["m2"])
    assert {float(m["step"]) for m in moments.values()} == {28.0}
    progress = read_progress(state, where="converted")
    assert (progress.iteration, progress.consumed_samples, progress.lr_steps) == (30, 120, 28)
    assert state["grad_scaler"] == {"scale": 1024.0, "growth_tracker": 3, "hysteresis_tracker": 2}
    rng = mw.rng_states(7, as_lists=True)
    assert state["random_rng_state"] == [rng["random_rng_state"][0], list(rng["random_rng_state"][1]),
                                         rng["random_rng_state"][2]]
    assert state["np_rng_state"][1] == [int(k) for k in rng["np_rng_state"][1]]
    assert torch.equal(state["torch_rng_state"], rng["torch_rng_state"])
    assert state["resolved_config"]["model"]["vocab_size"] == VOCAB  # padded only: all rows kept
    assert state["converted_from"]["family"] == "neuron-reference"


@pytest.mark.parametrize("version", [0, 1.0, 3.0])
def test_megatron_lm_legacy_versions_convert_exactly(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    version: float) -> None:
    """checkpoint_version 0 stored QKV rows [3, heads, hd] under `transformer` and `attention`, 1.0 [heads, hd, 3];
    both per TP shard. Saved with numpy 1 (numpy.core names), an args Namespace, an untied output layer."""
    tp, old = 2, version == 0
    full, m1, m2 = _full(4, untied=True), _full(5, untied=True), _full(6, untied=True, positive=True)
    root = tmp_path / "mlm"
    for t in range(tp):
        shards = [mw.tp_shard(x, tp, t) for x in (full, m1, m2)]
        nested = [mw.legacy_model(s, layers=list(range(LAYERS)), first=True, last=True, version=version,
                                  heads=HEADS // tp, old_names=old) for s in shards]
        params = list(mw.flat(nested[0]).items())
        parallel = {"model_parallel_size": tp} if version < 3 else {"tensor_model_parallel_size": tp,
                                                                     "pipeline_model_parallel_size": 1}
        args = mw.megatron_args(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, seq_length=POS,
                                max_position_embeddings=POS, padded_vocab_size=VOCAB, make_vocab_size_divisible_by=8,
                                consumed_train_samples=64, global_batch_size=8,
                                untie_embeddings_and_output_weights=True, **parallel)
        state = {"args": args, "checkpoint_version": version, "iteration": 8, "model": nested[0],
                 "optimizer": mw.optimizer_state(params, list(mw.flat(nested[1]).values()),
                                                 list(mw.flat(nested[2]).values()), step=8.0),
                 "opt_param_scheduler": {"num_steps": 64, "max_lr": 1e-4},
                 "rng_state": [mw.rng_states(3, as_lists=False)]}
        mw.save_torch(state, root / "iter_0000008" / f"mp_rank_{t:02d}" / "model_optim_rng.pt", numpy1=True)
    mw.write_tracker(root, 8)
    report = _convert(capsys, root, tmp_path / "ours", "--tp", "1", "--vocab-size", "60")
    assert report["family"] == "megatron-lm"
    state = _only_state(tmp_path / "ours")
    _assert_same(state["model"], full)
    moments = by_name(state["model"], state["optimizer"])
    _assert_same({n: m["exp_avg"] for n, m in moments.items()}, m1)
    assert state["resolved_config"]["model"]["vocab_size"] == 60
    assert state["resolved_config"]["model"]["tie_embeddings"] is False
    assert read_progress(state, where="converted").lr_steps == 8


def _llama_full(seed: int, *, groups: int, positive: bool = False) -> dict[str, torch.Tensor]:
    """A Llama-shaped model in our names: RMSNorm (weights only), QKV of `groups` key/value heads with a bias
    (Qwen2's --add-qkv-bias), SwiGLU gate and up, no other biases, untied output layer."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        t = torch.randn(*shape, generator=g)
        return t.abs() if positive else t

    qkv = (HEADS + 2 * groups) * (HIDDEN // HEADS)
    out = {"wte.weight": r(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        out.update({f"h.{i}.ln_1.weight": r(HIDDEN), f"h.{i}.attn.qkv.weight": r(qkv, HIDDEN),
                    f"h.{i}.attn.qkv.bias": r(qkv), f"h.{i}.attn.proj.weight": r(HIDDEN, HIDDEN),
                    f"h.{i}.ln_2.weight": r(HIDDEN), f"h.{i}.mlp.gate.weight": r(FFN, HIDDEN),
                    f"h.{i}.mlp.fc.weight": r(FFN, HIDDEN), f"h.{i}.mlp.proj.weight": r(HIDDEN, FFN)})
    return {**out, "ln_f.weight": r(HIDDEN), "lm_head.weight": r(VOCAB, HIDDEN)}


def _llama_legacy_shard(full: dict[str, torch.Tensor], tp: int, t: int) -> dict[str, torch.Tensor]:
    """TP rank t's weights as Megatron-LM's legacy model (September 2023 norm names) names and holds them, flat:
    whole query groups of QKV, and dense_h_to_4h the rank's gate rows then its up rows ([gate_t; up_t]: its swiglu
    chunks the rank's output in two)."""
    enc = "language_model.encoder."
    out = {"language_model.embedding.word_embeddings.weight": full["wte.weight"].chunk(tp)[t]}
    for i in range(LAYERS):
        pre, h = f"{enc}layers.{i}.", f"h.{i}."
        out.update({
            pre + "input_norm.weight": full[h + "ln_1.weight"],
            pre + "self_attention.query_key_value.weight": full[h + "attn.qkv.weight"].chunk(tp)[t],
            pre + "self_attention.query_key_value.bias": full[h + "attn.qkv.bias"].chunk(tp)[t],
            pre + "self_attention.dense.weight": full[h + "attn.proj.weight"].chunk(tp, 1)[t],
            pre + "post_attention_norm.weight": full[h + "ln_2.weight"],
            pre + "mlp.dense_h_to_4h.weight": torch.cat([full[h + "mlp.gate.weight"].chunk(tp)[t],
                                                          full[h + "mlp.fc.weight"].chunk(tp)[t]]),
            pre + "mlp.dense_4h_to_h.weight": full[h + "mlp.proj.weight"].chunk(tp, 1)[t]})
    out.update({enc + "final_norm.weight": full["ln_f.weight"],
                "language_model.output_layer.weight": full["lm_head.weight"].chunk(tp)[t]})
    return {k: v.clone() for k, v in out.items()}


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in flat.items():
        *parents, leaf = name.split(".")
        node = out
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return out


def _llama_legacy(root: Path, *, tp: int, groups: int = 2,
                  context: int | None = POS) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A Megatron-LM legacy Llama checkpoint at `tp` with plain Adam: (the weights, exp_avg) in our names. `context`
    None leaves seq_length and max_position_embeddings out of its args."""
    full, m1, m2 = _llama_full(11, groups=groups), _llama_full(12, groups=groups), _llama_full(13, groups=groups,
                                                                                            positive=True)
    for t in range(tp):
        shards = [_llama_legacy_shard(x, tp, t) for x in (full, m1, m2)]
        args = mw.megatron_args(
            num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, kv_channels=HIDDEN // HEADS,
            group_query_attention=True, num_query_groups=groups, seq_length=context, max_position_embeddings=context,
            padded_vocab_size=VOCAB, make_vocab_size_divisible_by=8, tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=1, consumed_train_samples=16, global_batch_size=8,
            normalization="RMSNorm", norm_epsilon=1e-6, swiglu=True, add_bias_linear=False, add_qkv_bias=True,
            position_embedding_type="rope", rotary_base=500000, use_rope_scaling=True, rope_scaling_factor=32.0,
            untie_embeddings_and_output_weights=True)
        state = {"args": args, "checkpoint_version": 3.0, "iteration": 2, "model": _nest(shards[0]),
                 "optimizer": mw.optimizer_state(list(shards[0].items()), list(shards[1].values()),
                                                 list(shards[2].values()), step=2.0),
                 "opt_param_scheduler": {"num_steps": 16}}
        mw.save_torch(state, root / "iter_0000002" / f"mp_rank_{t:02d}" / "model_optim_rng.pt")
    mw.write_tracker(root, 2)
    return full, m1


@pytest.mark.parametrize("tp", [1, 2])
def test_a_megatron_lm_llama_converts_exactly(tmp_path: Path, capsys: pytest.CaptureFixture[str], tp: int) -> None:
    """RMSNorm, SwiGLU (each TP rank's fused [gate; up] rows cut into our gate and fc), grouped-query attention, no
    linear biases but a QKV bias, untied output layer, RoPE of base 500000 with Llama 3.1's scaling: the weights and
    moments land on our names exactly, and the model config says all of it."""
    full, m1 = _llama_legacy(tmp_path / "mlm", tp=tp)
    _convert(capsys, tmp_path / "mlm", tmp_path / "ours", "--tp", "1")
    state = _only_state(tmp_path / "ours")
    _assert_same(state["model"], full)
    _assert_same({n: m["exp_avg"] for n, m in by_name(state["model"], state["optimizer"]).items()}, m1)
    cfg = state["resolved_config"]["model"]
    assert {k: cfg[k] for k in ("normalization", "swiglu", "num_query_groups", "add_bias_linear", "add_qkv_bias",
                                "tie_embeddings", "position_embedding", "rotary_base", "rope_scaling",
                                "rope_scaling_factor", "layernorm_epsilon", "ffn_hidden_size")} == {
        "normalization": "rmsnorm", "swiglu": True, "num_query_groups": 2, "add_bias_linear": False,
        "add_qkv_bias": True, "tie_embeddings": False, "position_embedding": "rope", "rotary_base": 500000.0,
        "rope_scaling": "llama3", "rope_scaling_factor": 32.0, "layernorm_epsilon": 1e-6, "ffn_hidden_size": FFN}


def test_a_rotary_megatron_lm_checkpoint_without_its_context_length_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A rotary model has no position table: with neither max_position_embeddings nor seq_length in its args there is
    no context length to give the model, which is one line naming both, not a TypeError."""
    _llama_legacy(tmp_path / "mlm", tp=1, context=None)
    code, _, err = _cli(capsys, "ckpt", "convert", tmp_path / "mlm", "--to", "torch", "--out", tmp_path / "ours")
    assert code == 1
    assert "neither max_position_embeddings nor seq_length" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "ours").exists()


def _core_chunks(shard: dict[str, torch.Tensor], *, pp_rank: int, pp: int, vp: int, te: bool) -> list[dict[str, Any]]:
    """One TP shard's virtual chunks on pipeline rank `pp_rank`, as megatron-core nests them (model0, model1, ...)."""
    return [mw.core_model(shard, layers=mw.stage_layers(layers=LAYERS, pp=pp, vp=vp, pp_rank=pp_rank, chunk=v),
                          first=pp_rank == 0 and v == 0, last=pp_rank == pp - 1 and v == vp - 1, pp=pp, te=te)
            for v in range(vp)]


@pytest.mark.parametrize("te", [False, True], ids=["local-spec", "transformer-engine"])
def test_megatron_core_with_virtual_stages_converts_exactly(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           te: bool) -> None:
    """tp 2 x pp 2 with two virtual chunks per stage (model0, model1, one layer each), tied embeddings (the last
    stage's output_layer is the copy); optimizer groups start with LayerNorms on stages without the embedding."""
    tp, pp, vp = 2, 2, 2
    full, m1, m2 = _full(7), _full(8), _full(9, positive=True)
    root = tmp_path / "mcore"
    for p in range(pp):
        for t in range(tp):
            shards = [mw.tp_shard(x, tp, t) for x in (full, m1, m2)]
            chunks = [_core_chunks(s, pp_rank=p, pp=pp, vp=vp, te=te) for s in shards]
            params = [(n, w) for c in chunks[0] for n, w in c.items() if isinstance(w, torch.Tensor)]
            m = [[w for c in chunks[i] for n, w in c.items() if isinstance(w, torch.Tensor)] for i in (1, 2)]
            args = mw.megatron_args(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, seq_length=POS,
                                    max_position_embeddings=POS, padded_vocab_size=VOCAB,
                                    make_vocab_size_divisible_by=8, tensor_model_parallel_size=tp,
                                    pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
                                    consumed_train_samples=40, global_batch_size=8, num_query_groups=None,
                                    group_query_attention=False, swiglu=False, normalization="LayerNorm")
            state = {"args": args, "checkpoint_version": 3.0, "iteration": 5,
                     **{f"model{v}": chunks[0][v] for v in range(vp)},
                     "optimizer": mw.optimizer_state(params, *m, step=5.0, vectors_first=p > 0),
                     "opt_param_scheduler": {"num_steps": 40}, "rng_state": [mw.rng_states(5, as_lists=False)]}
            mw.save_torch(state, root / "iter_0000005" / f"mp_rank_{t:02d}_{p:03d}" / "model_optim_rng.pt")
    mw.write_tracker(root, 5)
    code, stdout, _ = _cli(capsys, "ckpt", "inspect", root / "iter_0000005", "--json")
    assert code == 0 and json.loads(stdout)["family"] == "megatron-core"
    assert json.loads(stdout)["virtual_pipeline"] == 2
    _convert(capsys, root / "iter_0000005", tmp_path / "ours", "--tp", "1", "--pp", "1")
    state = _only_state(tmp_path / "ours")
    _assert_same(state["model"], full)
    moments = by_name(state["model"], state["optimizer"])
    _assert_same({n: m["exp_avg"] for n, m in moments.items()}, m1)
    _assert_same({n: m["exp_avg_sq"] for n, m in moments.items()}, m2)


def test_distributed_optimizer_state_of_a_pipelined_run_converts_exactly(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """tp 2 x pp 2 x 2 virtual chunks with --use-distributed-optimizer: each rank's distrib_optim.pt (several
    buckets, the tied embedding's copies alone in theirs) gives back the masters and moments of every parameter."""
    tp, pp, vp, bucket, vocab = 2, 2, 2, 1000, 60  # 30 x 16 embedding rows per shard: not a multiple of 64
    full, m1, m2 = (mw.full_model(seed, layers=LAYERS, hidden=HIDDEN, ffn=FFN, vocab=vocab, positions=POS,
                                  positive=seed == 19) for seed in (17, 18, 19))
    root = tmp_path / "mcore"
    for p in range(pp):
        for t in range(tp):
            shards = [mw.tp_shard(x, tp, t) for x in (full, m1, m2)]
            chunks = [_core_chunks(s, pp_rank=p, pp=pp, vp=vp, te=False) for s in shards]
            args = mw.megatron_args(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, seq_length=POS,
                                    max_position_embeddings=POS, padded_vocab_size=vocab,
                                    make_vocab_size_divisible_by=2, tensor_model_parallel_size=tp,
                                    pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
                                    use_distributed_optimizer=True, overlap_grad_reduce=True, ddp_bucket_size=bucket)
            folder = root / "iter_0000005" / f"mp_rank_{t:02d}_{p:03d}"
            state = {"args": args, "checkpoint_version": 3.0, "iteration": 5,
                     **{f"model{v}": chunks[0][v] for v in range(vp)},
                     "optimizer": mw.distrib_optim_settings(step=5.0), "opt_param_scheduler": {"num_steps": 40}}
            mw.save_torch(state, folder / "model_optim_rng.pt")
            per_chunk = [[(n, w, chunks[1][v][n], chunks[2][v][n]) for n, w in chunks[0][v].items()]
                         for v in range(vp)]
            alone = ("embedding.word_embeddings.weight", "output_layer.weight")
            mw.save_torch(mw.distrib_optim_state(per_chunk, bucket_size=bucket, alone=alone),
                          folder / "distrib_optim.pt")
    mw.write_tracker(root, 5)
    out = _convert(capsys, root, tmp_path / "ours", "--tp", "1", "--pp", "1")
    assert not [n for n in out["notes"] if "optimizer" in n]
    state = _only_state(tmp_path / "ours")
    _assert_same(state["model"], full)
    moments = by_name(state["model"], state["optimizer"])
    _assert_same({n: m["exp_avg"] for n, m in moments.items()}, m1)
    _assert_same({n: m["exp_avg_sq"] for n, m in moments.items()}, m2)
    assert {float(m["step"]) for m in moments.values()} == {5.0}


def test_convert_to_other_sizes_splits_as_megatron(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Reference tp 2 x pp 2 to tp 4 (the pipeline kept): each shard is Megatron's split of the whole model."""
    want = reference_checkpoint(tmp_path / "ref", tp=2, pp=2, xser_files=False)
    code, out, err = _cli(capsys, "ckpt", "convert", tmp_path / "ref", "--to", "torch", tmp_path / "ours", "--tp", "4")
    assert code == 0, err
    assert f"continue from it with checkpoint.load={tmp_path / 'ours'} parallel.tensor=4 parallel.pipeline=2" in out
    whole = read_whole(tmp_path / "ours")
    assert (whole.tensor_parallel, whole.pipeline_parallel, whole.found.manifest.format) == (4, 2, "torch")
    for p, row in enumerate(whole.grid):
        layers = set(mw.stage_layers(layers=LAYERS, pp=2, vp=1, pp_rank=p, chunk=0))
        for t, s in enumerate(row):
            shard = mw.tp_shard(want["full"], 4, t)
            mine = {n: w for n, w in shard.items() if (n.startswith("h.") and int(n.split(".")[1]) in layers)
                    or (p == 0 and n in ("wte.weight", "wpe.weight"))
                    or (p == 1 and n in ("ln_f.weight", "ln_f.bias", "wte.weight"))}
            _assert_same(s["model"], mine)


# ---------------------------------------------------------------------------------------------- bad input

def _mlm_tp2(root: Path, *, iterations: tuple[int, int] = (3, 3), bump: bool = False, **args: Any) -> None:
    full = _full(10)
    for t in range(2):
        shard = mw.tp_shard(full, 2, t)
        if bump and t == 1:
            shard["h.2.ln_2.weight"] = shard["h.2.ln_2.weight"] + 0.5
        model = mw.legacy_model(shard, layers=list(range(LAYERS)), first=True, last=True, version=3.0, heads=2)
        namespace = mw.megatron_args(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                                     tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
                                     max_position_embeddings=POS, padded_vocab_size=VOCAB, **args)
        state = {"args": namespace, "checkpoint_version": 3.0, "iteration": iterations[t], "model": model}
        mw.save_torch(state, root / "iter_0000003" / f"mp_rank_{t:02d}" / "model_optim_rng.pt")
    mw.write_tracker(root, 3)


@pytest.mark.parametrize("case", ["copies-differ", "iterations-differ", "missing-shard", "missing-tensor-file",
                                  "experts", "tp-splits-a-group"])
def test_bad_checkpoints_fail_in_one_line_and_write_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            case: str) -> None:
    root = tmp_path / "src"
    if case == "missing-tensor-file":
        reference_checkpoint(root, tp=2, pp=1, xser_files=True)
        victim = root / "iter_0000030" / "mp_rank_01" / "model_optim_rng.pt.tensors" / "tensor_3.pt"
        victim.unlink()
        expect = f"{victim} is missing"
    elif case == "tp-splits-a-group":
        _llama_legacy(root, tp=2, groups=1)  # one key/value head (MQA) cannot be split over 2 TP ranks
        expect = r"records 1 query groups for 4 heads, which tp 2 does not divide: Megatron splits whole groups"
    else:
        _mlm_tp2(root, iterations=(3, 4) if case == "iterations-differ" else (3, 3), bump=case == "copies-differ",
                 **({"num_experts": 4} if case == "experts" else {}))
        expect = {"copies-differ": "TP shards of .* disagree: h.2.ln_2.weight, a copy every TP rank holds, differs",
                  "iterations-differ": "shards of .* disagree: .*mp_rank_01.* has iteration 4",
                  "missing-shard": r"has no mp_rank_01/model_optim_rng.pt .*tp 2 x pp 1 grid",
                  "experts": r"was trained with num_experts=4 \(mixture-of-experts layers\), which our GPT does not "
                             "have"}[case]
        if case == "missing-shard":
            shutil.rmtree(root / "iter_0000003" / "mp_rank_01")
            (root / "iter_0000003" / "mp_rank_02").mkdir()  # tp 0 and 2 present: 1 is the hole
            shutil.copy(root / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt",
                        root / "iter_0000003" / "mp_rank_02")
            expect = r"has no mp_rank_01/model_optim_rng.pt .*tp 3 x pp 1 grid"
    code, _, err = _cli(capsys, "ckpt", "convert", root, "--to", "xser", "--out", tmp_path / "out")
    assert code == 1
    assert err.count("\n") == 1, err
    assert re.search(expect, err), err
    assert "delete" not in err
    assert not (tmp_path / "out").exists()


def test_the_trainer_names_the_convert_command_for_a_foreign_checkpoint(tmp_path: Path) -> None:
    _mlm_tp2(tmp_path / "mlm")
    with pytest.raises(CheckpointError) as info:
        find_checkpoint(tmp_path / "mlm")
    message = str(info.value)
    assert f"megatron-hpc ckpt convert {tmp_path / 'mlm'} --to xser --out DIR" in message
    assert "delete" not in message
    assert (tmp_path / "mlm" / "latest_checkpointed_iteration.txt").exists()


def test_convert_still_takes_the_output_folder_as_a_positional(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    _mlm_tp2(tmp_path / "mlm")
    src = tmp_path / "mlm"
    for args in ((src, "--to", "torch", tmp_path / "a"), (src, tmp_path / "b", "--to", "torch"),
                 (src, "--to", "torch", "--out", tmp_path / "c")):
        code, _, err = _cli(capsys, "ckpt", "convert", *args)
        assert code == 0, err
    assert [p.name for p in sorted(tmp_path.iterdir())] == ["a", "b", "c", "mlm"]
    code, _, err = _cli(capsys, "ckpt", "convert", src, tmp_path / "d", "--to", "torch", "--out", tmp_path / "e")
    assert code == 1 and "say once where to write" in err
    assert not (tmp_path / "d").exists() and not (tmp_path / "e").exists()

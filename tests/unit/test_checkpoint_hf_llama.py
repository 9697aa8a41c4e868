"""`ckpt convert` of Hugging Face Llama and Qwen2 folders both ways: tiny random LlamaForCausalLM /
Qwen2ForCausalLM of the real `transformers` (grouped-query attention with G < heads and G = 1, SwiGLU, RMSNorm,
Llama 3.1's RoPE scaling, Qwen2's QKV bias), saved by save_pretrained in shards with their index, become our
checkpoint; our GPT then computes transformers' logits, greedy generation gives its tokens, and the export loads back
in transformers with the same tensors."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest
import tokenizers
import torch
import torch.distributed as dist
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from hf_models import LLAMA_SEQ, VOCAB, hf_llama_model, hf_logits, save, save_llama
from test_checkpoint_hf_import import convert, our_logits

from megatron_hpc.checkpoint.conversion import read_whole
from megatron_hpc.checkpoint.foreign.hf_llama import model_config_from_hf
from megatron_hpc.cli.main import main

SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8}
CASES = {  # name -> (architecture, key/value heads, rope scaling)
    "llama_gqa": ("llama", 2, SCALING),
    "llama_mqa": ("llama", 1, None),
    "qwen2": ("qwen2", 2, None),
}


def hf_llama(kind: str, groups: int, scaling: dict | None, *, tied: bool = False) -> transformers.PreTrainedModel:
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=groups, intermediate_size=48, max_position_embeddings=32, rms_norm_eps=1e-6,
                  tie_word_embeddings=tied, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    if kind == "llama":
        config = transformers.LlamaConfig(**common, rope_theta=500.0, rope_scaling=scaling)
        cls = transformers.LlamaForCausalLM
    else:
        config = transformers.Qwen2Config(**common, rope_theta=1000.0)
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a swapped or dropped one shows
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.1 if name.endswith("bias") or "norm" in name else 0.2)
                    + (1.0 if "norm" in name else 0.0))
    return model


@pytest.mark.parametrize("case", sorted(CASES))
def test_imported_llama_and_qwen_give_transformers_logits_and_export_back(
        case: str, tmp_path: Path, tokenizer: Path, ctx, capsys: pytest.CaptureFixture[str]) -> None:
    kind, groups, scaling = CASES[case]
    theirs = hf_llama(kind, groups, scaling)
    folder = save(theirs, tmp_path / "hf", "shards")
    assert len(list(folder.glob("model-*.safetensors"))) > 1  # read through model.safetensors.index.json
    assert convert(str(folder), "--to", "torch", "--out", str(tmp_path / "ours"), "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["architecture"] == type(theirs).__name__
    model = read_whole(tmp_path / "ours").first["resolved_config"]["model"]
    assert (model["num_query_groups"], model["add_qkv_bias"]) == (groups, kind == "qwen2")
    want = hf_logits(theirs)
    torch.testing.assert_close(our_logits(tmp_path / "ours", ctx), want, rtol=0, atol=1e-4)
    if scaling is not None:  # the scaling is what makes it match (positions past 8 / low_freq_factor)
        assert (our_logits(tmp_path / "ours", ctx, rope_scaling="none") - want).abs().max() > 1e-3
    assert convert(str(tmp_path / "ours"), "--to", "hf", "--out", str(tmp_path / "back")) == 0
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["architectures"] == [type(theirs).__name__]
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    torch.testing.assert_close(hf_logits(again), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_tp2_pp2_conversion_gives_back_the_same_tensors(tied: bool, tmp_path: Path) -> None:
    theirs = hf_llama("qwen2", 2, None, tied=tied)
    folder = save(theirs, tmp_path / "hf", "safetensors")
    assert convert(str(folder), "--to", "xser", "--tp", "2", "--pp", "2", "--out", str(tmp_path / "ours")) == 0
    whole = read_whole(tmp_path / "ours")
    assert (whole.tensor_parallel, whole.pipeline_parallel) == (2, 2)
    # TP 2 splits the two key/value groups: rank r holds group r's queries, key and value rows, and its gate rows
    # beside the same up rows.
    rank0 = whole.grid[0][0]["model"]
    q, k = theirs.model.layers[0].self_attn.q_proj.weight, theirs.model.layers[0].self_attn.k_proj.weight
    torch.testing.assert_close(rank0["h.0.attn.qkv.weight"][:16], q[:16], rtol=0, atol=0)
    torch.testing.assert_close(rank0["h.0.attn.qkv.weight"][16:24], k[:8], rtol=0, atol=0)
    torch.testing.assert_close(rank0["h.0.mlp.gate.weight"], theirs.model.layers[0].mlp.gate_proj.weight[:24])
    assert convert(str(tmp_path / "ours"), "--to", "hf", "--out", str(tmp_path / "back")) == 0
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    for name, tensor in theirs.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


def test_generate_continues_like_transformers(tmp_path: Path, tokenizer: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    theirs = hf_llama("llama", 2, SCALING)
    folder = save(theirs, tmp_path / "hf", "safetensors")
    # As Llama 3 and Qwen ship it: tokenizer.json (with tokenizer_config.json), no vocab.json / merges.txt.
    _fast_tokenizer(tokenizer).save_pretrained(folder)
    for name in ("vocab.json", "merges.txt"):
        (folder / name).unlink(missing_ok=True)
    ids = torch.tensor([tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")).encode("the quick").ids])
    assert ids.shape[1] > 0
    want = theirs.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=VOCAB - 1)[0, ids.shape[1]:].tolist()
    assert convert(str(folder), "--to", "xser", "--out", str(tmp_path / "ours")) == 0
    capsys.readouterr()
    try:
        assert main(["generate", str(tmp_path / "ours"), "--prompt", "the quick", "--max-new-tokens", "8",
                     "--ignore-eos", "--json"]) == 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    result = json.loads(capsys.readouterr().out)["results"][0]
    assert result["prompt_ids"] == ids[0].tolist() and result["tokens"] == want


class _fast_tokenizer:  # noqa: N801  (reads as the function it stands for)
    """The test's byte-level BPE, saved as the tokenizer.json of the `tokenizers` library."""

    def __init__(self, folder: Path) -> None:
        self.bpe = tokenizers.ByteLevelBPETokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"))

    def save_pretrained(self, folder: Path) -> None:
        self.bpe.save(str(folder / "tokenizer.json"))


def test_transformers_4_and_5_configs_read_alike() -> None:
    five = hf_llama("llama", 2, SCALING).config.to_dict()
    assert "rope_parameters" in five
    four = {k: v for k, v in five.items() if k != "rope_parameters"}
    four.update(rope_theta=500.0, rope_scaling={"type": "llama3", **{k: v for k, v in SCALING.items()
                                                                      if k != "rope_type"}})
    assert model_config_from_hf(four) == model_config_from_hf(five)
    assert model_config_from_hf(five)["rope_scaling"] == "llama3"
    assert model_config_from_hf(five)["rotary_base"] == 500.0


def _refused(folder: Path, out: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> str:
    assert convert(str(folder), "--to", "xser", "--out", str(out), *extra) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("megatron-hpc: error: "), err
    assert not out.exists()
    return err


def _edited(tmp_path: Path, name: str, **config: object) -> Path:
    folder = save(hf_llama("llama", 2, None), tmp_path / name, "safetensors")
    data = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**data, **config}))
    return folder


def test_what_we_cannot_express_is_refused_in_one_line(tmp_path: Path, tokenizer: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    supported = "supported: GPT2LMHeadModel, GPTNeoXForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM"
    for arch, lacks in (("MixtralForCausalLM", "mixture-of-experts MLPs"),
                        ("Qwen2MoeForCausalLM", "mixture-of-experts"), ("Gemma2ForCausalLM", "soft-capping")):
        err = _refused(_edited(tmp_path, arch, architectures=[arch]), out, capsys)
        assert f"{arch} (" in err and lacks in err and supported in err
    # transformers' MistralConfig gives a window of 4096 where config.json names none; only null is full attention
    for name, window in (("mistral_default", {}), ("mistral_4096", {"sliding_window": 4096})):
        err = _refused(_edited(tmp_path, name, architectures=["MistralForCausalLM"], max_position_embeddings=8192,
                               **window), out, capsys)
        assert "sliding-window attention in every layer (a 4096-token window)" in err and supported in err
    err = _refused(_edited(tmp_path, "yarn", rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                              "rope_theta": 500.0}), out, capsys)
    assert "rope_type 'yarn'" in err and "llama3" in err
    assert "mlp_bias" in _refused(_edited(tmp_path, "mlpb", mlp_bias=True), out, capsys)
    assert "attention_bias" in _refused(_edited(tmp_path, "attb", attention_bias=True), out, capsys)
    err = _refused(_edited(tmp_path, "window", architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                           use_sliding_window=True, sliding_window=16, max_window_layers=1), out, capsys)
    assert "sliding-window attention in 1 of its 2 layers (a 16-token window)" in err
    assert "do not divide" in _refused(_edited(tmp_path, "groups", num_key_value_heads=3), out, capsys)
    err = _refused(_edited(tmp_path, "tp4"), out, capsys, "--tp", "4")
    assert "2 key/value groups" in err and "use --tp in [1, 2]" in err
    small = _edited(tmp_path, "small", vocab_size=64)  # fewer rows than the tokenizer has tokens
    _fast_tokenizer(tokenizer).save_pretrained(small)
    assert "tokens but config.json's vocab_size is 64" in _refused(small, out, capsys)


def test_a_mistral_without_its_window_imports_and_exports_as_mistral(tmp_path: Path, ctx) -> None:
    theirs = hf_llama_model("MistralForCausalLM", vocab=VOCAB, seed=2)  # sliding_window null, as Mistral 7B v0.3
    folder = save_llama(theirs, tmp_path / "hf", tokenizer=False)
    assert convert(str(folder), "--to", "torch", "--out", str(tmp_path / "ours")) == 0
    want = hf_logits(theirs)
    torch.testing.assert_close(our_logits(tmp_path / "ours", ctx), want, rtol=0, atol=1e-5)
    assert convert(str(tmp_path / "ours"), "--to", "hf", "--out", str(tmp_path / "back")) == 0
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(again).__name__ == "MistralForCausalLM" and again.config.sliding_window is None
    torch.testing.assert_close(hf_logits(again), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("window", [{"max_window_layers": 2, "sliding_window": 4},
                                    {"max_window_layers": 0, "sliding_window": LLAMA_SEQ}],
                         ids=["on-no-layer", "as-long-as-the-positions"])
def test_a_qwen2_whose_sliding_window_changes_nothing_imports_with_transformers_logits(
        window: dict[str, int], tmp_path: Path, ctx) -> None:
    """use_sliding_window true, but transformers slides only layers from max_window_layers on (none of 2 here), and a
    window of max_position_embeddings tokens masks nothing: both compute full attention, so both import. The control
    (a 4-token window on every layer) shows transformers' logits move when the window does apply."""
    theirs = hf_llama_model("Qwen2ForCausalLM", vocab=VOCAB, seed=3, use_sliding_window=True, **window)
    sliding = hf_llama_model("Qwen2ForCausalLM", vocab=VOCAB, seed=3, use_sliding_window=True, max_window_layers=0,
                             sliding_window=4)
    assert (hf_logits(sliding) - hf_logits(theirs)).abs().max() > 1e-2
    folder = save_llama(theirs, tmp_path / "hf", tokenizer=False)
    assert json.loads((folder / "config.json").read_text())["use_sliding_window"] is True
    assert convert(str(folder), "--to", "torch", "--out", str(tmp_path / "ours")) == 0
    torch.testing.assert_close(our_logits(tmp_path / "ours", ctx), hf_logits(theirs), rtol=0, atol=1e-5)


BAD_CONFIGS = {  # name: (config.json changes, what the one line says)
    "linear_v4": ({"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type 'linear'"),
    "dynamic": ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "rope_type 'dynamic'"),
    "longrope": ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
                 "rope_type 'longrope'"),
    "llama3_no_factor": ({"rope_parameters": {"rope_type": "llama3", "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0}}, "llama3 rope scaling has no usable 'factor'"),
    "partial_rotary": ({"partial_rotary_factor": 0.5}, "rotates 0.5 of each head"),
    "head_dim": ({"head_dim": 16}, "head_dim 16 x 4 heads is not its hidden_size 32"),
    "no_hidden_size": ({"hidden_size": None}, "has no usable hidden_size"),
    "qwen2_layer_types": ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                           "layer_types": ["full_attention", "sliding_attention"]},
                          "sliding-window attention in 1 of its 2 layers"),
}


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_configs_we_cannot_run_are_refused_in_one_line(name: str, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    changes, needle = BAD_CONFIGS[name]
    assert needle in _refused(_edited(tmp_path, name, **changes), tmp_path / "out", capsys)


def test_llama3_scaling_without_an_original_context_takes_max_positions_as_transformers_does() -> None:
    config = hf_llama("llama", 2, SCALING).config.to_dict()
    del config["rope_parameters"]["original_max_position_embeddings"]
    assert model_config_from_hf(config)["rope_original_max_position"] == config["max_position_embeddings"] == 32


def test_a_qwen2_folder_tokenizes_with_its_tokenizer_json(tmp_path: Path, tokenizer: Path) -> None:
    # Qwen2 folders ship a GPT-2 style vocab.json and merges.txt beside tokenizer.json; GPT-2's BPE would split the
    # text by GPT-2's rules instead of the model's, so the tokenizer.json is the one named.
    folder = save(hf_llama("qwen2", 2, None), tmp_path / "hf", "safetensors", tokenizer)
    _fast_tokenizer(tokenizer).save_pretrained(folder)
    assert convert(str(folder), "--to", "xser", "--out", str(tmp_path / "ours")) == 0
    data = read_whole(tmp_path / "ours").first["resolved_config"]["data"]
    assert data == {"tokenizer_type": "HuggingFaceTokenizer",
                    "tokenizer_model": str((tmp_path / "ours" / "tokenizer").absolute())}


@pytest.mark.parametrize("recipe", ["llama3_8b", "qwen2.5_7b"])
def test_the_printed_line_of_a_tp1_import_plans_after_a_llama_recipe(
        recipe: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/checkpoints.md: paste the printed --set line after `submit --recipe llama3_8b` or any recipe. An MQA
    model imports at TP 1 only, and those recipes set parallel.sequence_parallel, which needs TP above 1."""
    folder = save(hf_llama("llama", 1, None), tmp_path / "hf", "shards")
    assert convert(str(folder), "--to", "xser", "--out", str(tmp_path / "ours")) == 0
    printed = shlex.split(capsys.readouterr().out.strip().split("fine-tune from it with ", 1)[1])
    assert "parallel.tensor=1" in printed[1::2]
    code = main(["plan", "--recipe", recipe, "--platform", "cpu", *printed, "--set", "data.source=synthetic",
                 "--set", "train.global_batch_size=8", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    plan = json.loads(out.out)
    assert (plan["tensor_parallel"], plan["model"]["num_query_groups"]) == (1, 1)


def test_generate_stops_where_the_imported_generation_config_stops(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Llama 3.1 Instruct's generation_config.json stops at three ids, its tokenizer's eos_token is one: greedy
    `generate` of the import stops where transformers' generate of the folder does, not only at the eos_token."""
    from megatron_hpc.generate.loading import generation_stops

    theirs = hf_llama_model(seed=11)
    folder = save_llama(theirs, tmp_path / "hf")
    prompt = torch.tensor([[5, 17, 33, 9]])
    free = theirs.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 4:]
    free = free.tolist()
    # A generated token that is neither the tokenizer's eos (2) nor seen before it: the model stops there.
    at = next(k for k in range(2, len(free)) if free[k] not in free[:k] and free[k] != 2)
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, free[at]]}))
    want = transformers.AutoModelForCausalLM.from_pretrained(folder).generate(prompt, max_new_tokens=12,
                                                                             do_sample=False, pad_token_id=0)
    want = want[0, 4:].tolist()
    assert want == free[:at + 1]
    assert convert(str(folder), "--to", "xser", "--out", str(tmp_path / "ours")) == 0
    resolved = read_whole(tmp_path / "ours").first["resolved_config"]
    assert generation_stops(resolved) == [2, free[at]]
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "ours"), "--prompt-ids", "5,17,33,9", "--max-new-tokens", "12",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["tokens"] == want


def test_a_folder_of_hf_weights_without_config_json_is_named_as_such(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    folder = save(hf_llama("llama", 2, None), tmp_path / "hf", "shards")
    (folder / "config.json").unlink()
    assert convert(str(folder), "--to", "xser", "--out", str(tmp_path / "ours")) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds Hugging Face weights (model-00001-of-" in err[0], err
    assert "copy the model's config.json beside them" in err[0] and not (tmp_path / "ours").exists()


def test_the_printed_checkpoint_load_is_absolute_for_a_relative_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The line is pasted wherever the user submits from; its tokenizer path was absolute, its checkpoint.load not."""
    folder = save(hf_llama("llama", 2, None), tmp_path / "hf", "shards")
    monkeypatch.chdir(tmp_path)
    assert convert("hf", "--to", "xser", "--out", "ours") == 0
    printed = shlex.split(capsys.readouterr().out.strip().split("fine-tune from it with ", 1)[1])[1::2]
    assert f"checkpoint.load={tmp_path / 'ours'}" in printed and folder.exists()

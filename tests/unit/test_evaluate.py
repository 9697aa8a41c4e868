"""`megatron-hpc evaluate` on a tiny checkpoint trained here on indexed data: split losses against a direct
computation on the samples Megatron's counts select, the test split logged at the end of training, WikiText
windowed perplexity and LAMBADA accuracy against per-target / per-example reference loops, bad input in one
line."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_hpc.cli.main import main
from megatron_hpc.config.schema import (
    CheckpointConfig,
    DataConfig,
    LaunchConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    TrainConfig,
)
from megatron_hpc.data.blending import build_split_dataset
from megatron_hpc.data.gpt_dataset import GPTIndexConfig
from megatron_hpc.data.indexed import IndexedDatasetWriter
from megatron_hpc.data.tokenizer import GPT2BPETokenizer
from megatron_hpc.evaluate.detokenize import wikitext_detokenize
from megatron_hpc.evaluate.tasks import lm_windows
from megatron_hpc.generate.loading import load_for_generation
from megatron_hpc.train.entry import plan_for_torchrun, run_training

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "preprocess"
SEQ, STEPS, INTERVAL, EVAL_ITERS, GBS, SEED = 16, 4, 2, 2, 4, 1234
SPLIT = "80,10,10"
WIKI = ("= Valkyria Chronicles = \n \n The game 's story , set in 1935 @-@ 36 , follows a squad ( the Nameless ) . "
        "It was made by Sega and Media.Vision ; it sold 1 @,@ 000 @,@ 000 copies ! \n Reviews were \" mixed \" "
        "at first , and the 2 @.@ 5 update fixed it . = = Plot = = \n The war is between the Empire and the "
        "Federation ; the player 's squad fights on the border . \n")


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
    yield
    if dist.is_initialized():  # load_for_generation's one-rank world
        dist.destroy_process_group()


def _cfg(tmp: Path, data: DataConfig, **train: object) -> RunConfig:
    return RunConfig(
        name="tiny",
        model=ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=SEQ,
                          max_position_embeddings=SEQ, vocab_size=400, make_vocab_size_divisible_by=64,
                          init_method_std=0.2),
        train=TrainConfig(**{"num_steps": STEPS, "micro_batch_size": 2, "global_batch_size": GBS, "log_interval": 2,
                             "eval_interval": INTERVAL, "eval_iters": EVAL_ITERS, "seed": SEED, "tensorboard": False,
                             **train}),
        optim=OptimConfig(lr=3e-3, lr_warmup_iters=1),
        data=data,
        checkpoint=CheckpointConfig(save=str(tmp / "ckpt")),
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-step run on 200 random documents with the fixture's GPT-2 tokenizer; returns its folder."""
    tmp = tmp_path_factory.mktemp("evalrun")
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(str(tmp / "corpus"), dtype=np.uint16) as writer:
        for _ in range(200):
            writer.add_document(rng.integers(0, 400, size=int(rng.integers(5, 60))))
    data = DataConfig(source="indexed", path=str(tmp / "corpus"), split=SPLIT, cache_path=str(tmp / "cache"),
                      vocab_file=str(FIXTURE / "vocab.json"), merge_file=str(FIXTURE / "merges.txt"))
    assert run_training(plan_for_torchrun(_cfg(tmp, data)), run_dir=tmp / "run") == 0
    return tmp


def _evaluate(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["evaluate", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def _reference_split_loss(model: torch.nn.Module, run: Path, split: str, *, build_count: int) -> float:
    """Mean token loss of the split's first EVAL_ITERS * GBS samples, one sample at a time."""
    config = GPTIndexConfig(seed=SEED, seq_length=SEQ, split=SPLIT, cache_path=str(run / "cache"))
    dataset = build_split_dataset(str(run / "corpus"), split_name=split, num_samples=build_count, config=config)
    losses = []
    with torch.no_grad():
        for i in range(EVAL_ITERS * GBS):
            tokens = torch.from_numpy(dataset.text(i)).long()
            losses.append(F.cross_entropy(model(tokens[None, :-1])[0], tokens[1:]).item())
    return sum(losses) / len(losses)


def test_split_losses_equal_a_direct_computation(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _evaluate(capsys, str(run / "ckpt"), "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["iteration"] == STEPS and set(report["splits"]) == {"valid", "test"}
    model = load_for_generation(run / "ckpt", keep_padded_vocab=True).model
    # Megatron's counts (reference 2.1), by hand: valid (4 // 2 + 1) * 2 * 4, test 2 * 4
    valid = _reference_split_loss(model, run, "valid", build_count=24)
    test = _reference_split_loss(model, run, "test", build_count=8)
    assert report["splits"]["valid"]["loss"] == pytest.approx(valid, abs=1e-5)
    assert report["splits"]["test"]["loss"] == pytest.approx(test, abs=1e-5)
    assert abs(valid - test) > 1e-3  # different samples
    for split in ("valid", "test"):
        r = report["splits"][split]
        assert r["samples"] == EVAL_ITERS * GBS and r["ppl"] == pytest.approx(math.exp(r["loss"]))
    # the run evaluated the same test samples after its last step, in the training loop
    rows = [json.loads(x) for x in (run / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if r["phase"] == "test"]
    assert [r["iteration"] for r in logged] == [STEPS]
    assert logged[0]["lm_loss"] == pytest.approx(test, abs=1e-5)
    assert [r["iteration"] for r in rows if r["phase"] == "valid"] == [2, 4]
    # --eval-iters and --split: one split, fewer samples, Megatron's count for one batch
    code, out, err = _evaluate(capsys, str(run / "ckpt"), "--split", "test", "--eval-iters", "1", "--json")
    one = json.loads(out)["splits"]
    assert code == 0 and set(one) == {"test"} and one["test"]["samples"] == GBS, err
    text_code, text, _ = _evaluate(capsys, str(run / "ckpt"))
    assert text_code == 0 and f"lm loss value: {test:.4E}"[:-4] in text


def test_training_prints_the_test_block_and_the_switch_turns_it_off(run: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    data = DataConfig(source="indexed", path=str(run / "corpus"), split=SPLIT, cache_path=str(run / "cache"))
    assert run_training(plan_for_torchrun(_cfg(tmp_path, data, num_steps=2, eval_interval=0, tensorboard=True)),
                        run_dir=tmp_path / "on") == 0
    out = capsys.readouterr().out.splitlines()
    rows = [json.loads(x) for x in (tmp_path / "on" / "metrics.jsonl").read_text().splitlines()]
    test = [r for r in rows if r["phase"] == "test"]
    assert len(test) == 1 and test[0]["iteration"] == 2
    line = f" validation loss at iteration 2 on test set | lm loss value: {test[0]['lm_loss']:.6E} |"
    at = [i for i, x in enumerate(out) if x.startswith(line)]
    assert len(at) == 1 and set(out[at[0] - 1]) == {"-"}
    acc = EventAccumulator(str(tmp_path / "on" / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("lm loss test")] == [(2, pytest.approx(test[0]["lm_loss"]))]
    assert acc.Scalars("lm loss test ppl")[0].value == pytest.approx(math.exp(test[0]["lm_loss"]), rel=1e-6)
    assert "lm loss validation" not in acc.Tags()["scalars"]  # validation is off; the test loss has its own tags
    shutil.rmtree(tmp_path / "ckpt")
    assert run_training(plan_for_torchrun(_cfg(tmp_path, data, num_steps=2, eval_interval=0, eval_test=False)),
                        run_dir=tmp_path / "off") == 0
    assert "on test set" not in capsys.readouterr().out
    assert all(json.loads(x)["phase"] == "run" for x in (tmp_path / "off" / "metrics.jsonl").read_text().splitlines())


def test_wikitext_detokenizer_rules() -> None:
    # expected output written by hand from Megatron's rules
    raw = "= = Plot = = \n The game 's story , set in 1935 @-@ 36 ( the Nameless ) said \" yes \" ; 1 @,@ 000 . \n"
    assert wikitext_detokenize(raw) == ("== Plot ==\nThe game's story, set in 1935-36 (the Nameless) said \"yes\"; "
                                        "1,000.\n")


def _reference_wikitext(model: torch.nn.Module, tokens: list[int], stride: int) -> float:
    """Loss sum with one forward pass per target: target p (1-based) is predicted from the window that first
    holds it as a new token, window i starting at i * stride (window 0 holds targets 1..SEQ)."""
    total = 0.0
    with torch.no_grad():
        for p in range(1, len(tokens)):
            i = 0 if p <= SEQ else -(-(p - SEQ) // stride)
            start = i * stride
            logits = model(torch.tensor([tokens[start:p]]))[0, -1]
            total += F.cross_entropy(logits[None], torch.tensor([tokens[p]])).item()
    return total


def test_wikitext_perplexity_equals_a_per_target_computation(run: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "wiki.test.tokens"
    path.write_text(WIKI, encoding="utf-8")
    tok = GPT2BPETokenizer(FIXTURE / "vocab.json", FIXTURE / "merges.txt")
    tokens = tok.encode(wikitext_detokenize(WIKI))
    words = len(WIKI.strip().split(" "))
    assert len(tokens) > 3 * SEQ
    model = load_for_generation(run / "ckpt", keep_padded_vocab=True).model
    results = {}
    for stride in (SEQ, 5):
        extra = [] if stride == SEQ else ["--overlapping-eval", str(stride)]
        code, out, err = _evaluate(capsys, str(run / "ckpt"), "--task", "wikitext", "--file", str(path), "--json",
                                   *extra)
        assert code == 0, err
        report = json.loads(out)
        assert report["splits"] == {}  # a task alone evaluates no split
        wiki = report["tasks"]["wikitext"]
        total = _reference_wikitext(model, tokens, stride)
        assert wiki["tokens"] == len(tokens) and wiki["words"] == words and wiki["stride"] == stride
        assert wiki["token_ppl"] == pytest.approx(math.exp(total / (len(tokens) - 1)), rel=1e-5)
        assert wiki["word_loss"] == pytest.approx(total / (words - 1), rel=1e-6)
        # Megatron caps the exponent at 20 (this tokenizer splits a word into several tokens)
        assert wiki["word_ppl"] == pytest.approx(math.exp(min(20.0, total / (words - 1))), rel=1e-5)
        results[stride] = wiki["token_ppl"]
    assert results[SEQ] != pytest.approx(results[5], rel=1e-4)  # more context changes the figure


def test_windows_score_every_target_once() -> None:
    for n, stride in ((50, 16), (50, 5), (17, 16), (2, 3), (40, 1)):
        seen = []
        for w in lm_windows(n, seq_length=SEQ, stride=min(stride, SEQ)):
            seen += range(w.start + 1 + w.first_scored, w.stop)
        assert seen == list(range(1, n)), (n, stride)


def _lambada_texts(model: torch.nn.Module, tok: GPT2BPETokenizer) -> list[str]:
    """Short lines, plus lines ending in the model's own greedy next token (so some examples are right)."""
    prefixes = ["the cat sat on the", "I am sure it", "we see what", "It is a test", "class Stack: self.items",
                "return a +", "It's a test; we"]
    texts = [p + " end" for p in prefixes]
    for p in prefixes:
        ids = tok.encode(p)
        with torch.no_grad():
            nxt = int(model(torch.tensor([ids]))[0, -1, :400].argmax())
        text = tok.decode([*ids, nxt])
        if tok.encode(text) == [*ids, nxt] and len(text.split()) > 1:
            texts.append(text)
    return texts


def _reference_cloze(model: torch.nn.Module, tok: GPT2BPETokenizer, text: str, *, strict: bool) -> bool:
    if strict:
        last = text.split()[-1]
        context, target = tok.encode(text[:text.rfind(last)].strip()), tok.encode(" " + last)
    else:
        ids = tok.encode(text)
        context, target = ids[:-1], ids[-1:]
    ids = context + target
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]]))[0]
    return all(int(logits[len(context) - 1 + k].argmax()) == t for k, t in enumerate(target))


def test_lambada_accuracy_equals_a_per_example_computation(run: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    tok = GPT2BPETokenizer(FIXTURE / "vocab.json", FIXTURE / "merges.txt")
    model = load_for_generation(run / "ckpt", keep_padded_vocab=True).model
    texts = _lambada_texts(model, tok)
    path = tmp_path / "lambada.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts) + "\n", encoding="utf-8")
    for strict in (False, True):
        expected = [_reference_cloze(model, tok, t, strict=strict) for t in texts]
        code, out, err = _evaluate(capsys, str(run / "ckpt"), "--task", "lambada", "--file", str(path), "--json",
                                   *(["--strict-lambada"] if strict else []))
        assert code == 0, err
        lam = json.loads(out)["tasks"]["lambada"]
        assert lam == {"accuracy": sum(expected) / len(texts), "correct": sum(expected), "total": len(texts),
                       "strict": strict}
        if not strict:
            assert 0 < sum(expected) < len(texts)  # both outcomes occur, so the count can be wrong


def test_bad_input_is_one_line(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = str(run / "ckpt")
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"text": "one two three"}\n{"txt": "oops"}\n', encoding="utf-8")
    not_json = tmp_path / "notjson.jsonl"
    not_json.write_text('{"text": "one two three"}\nplain words here\n', encoding="utf-8")
    wiki_as_json = tmp_path / "wiki.jsonl"
    wiki_as_json.write_text('{"text": "one two three"}\n', encoding="utf-8")
    good = tmp_path / "wiki.test.tokens"
    good.write_text(WIKI, encoding="utf-8")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("first line\ncaf\u00e9\n".encode("latin-1"))
    synthetic = tmp_path / "synthetic"
    spec = plan_for_torchrun(_cfg(synthetic, DataConfig(source="synthetic"), num_steps=1, eval_interval=0))
    assert run_training(spec, run_dir=synthetic / "run") == 0
    capsys.readouterr()
    cases = [  # (arguments, words of the one-line error)
        ([ckpt, "--task", "lambada", "--file", str(bad_jsonl)], f"{bad_jsonl} line 2: no non-empty \"text\""),
        ([ckpt, "--task", "lambada", "--file", str(not_json)], f"{not_json} line 2: not JSON"),
        ([ckpt, "--task", "wikitext", "--file", str(wiki_as_json)], "line 1: starts with a JSON object"),
        ([ckpt, "--task", "wikitext", "--file", str(latin1)], "line 2: byte 0xe9 is not UTF-8"),
        ([ckpt, "--task", "wikitext", "--file", str(tmp_path / "gone.txt")], "gone.txt does not exist"),
        ([ckpt, "--task", "wikitext"], "pass --task and --file together"),
        ([ckpt, "--task", "wikitext", "--file", str(good), "--overlapping-eval", "17"], "must be in [1, 16]"),
        ([ckpt, "--eval-iters", "0"], "--eval-iters 0 must be at least 1"),
        ([str(synthetic / "ckpt"), "--task", "lambada", "--file", str(bad_jsonl)],
         "pass --vocab-file and --merge-file"),
        ([str(synthetic / "ckpt")], "pass --data-path PREFIX"),
    ]
    for args, words in cases:
        code, _, err = _evaluate(capsys, *args)
        assert code == 1 and words in err, (args, err)
        assert len(err.strip().splitlines()) == 1, err


def test_a_converted_torch_dist_checkpoint_without_data_path_is_not_called_synthetic(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """megatron-core's training arguments come through a torch_dist conversion, a data path of ours does not: the
    refusal names --data-path and does not say the run trained on synthetic tokens (it did not)."""
    src = Path(__file__).resolve().parents[1] / "fixtures" / "megatron_core_torch_dist" / "gpt_tp2"
    assert main(["ckpt", "convert", str(src), "--to", "torch", "--tp", "1", "--out", str(tmp_path / "ck")]) == 0
    capsys.readouterr()
    code, _, err = _evaluate(capsys, str(tmp_path / "ck"), "--split", "test")
    assert code == 1 and "pass --data-path PREFIX" in err and "converted from another trainer" in err, err
    assert "synthetic" not in err and len(err.strip().splitlines()) == 1, err


def test_platform_is_the_runs_or_the_asked_one(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The run's launch.platform decides, falling back to the CPU with a note when this machine lacks its device;
    a --platform this machine cannot run is one line, before the load."""
    from megatron_hpc.generate.loading import choose_device
    from megatron_hpc.parallel.device import xla_available

    if xla_available() or torch.cuda.is_available():
        pytest.skip("checks the fallback on a machine with neither torch_xla nor a GPU (the main tier's)")
    chosen = choose_device(None, {"launch": {"platform": "trn1"}})
    assert (chosen.info.kind, chosen.platform) == ("cpu", "cpu")
    assert "the run's platform trn1 cannot run here" in chosen.note and "--platform" in chosen.note
    cpu = choose_device(None, {"launch": {"platform": "cpu"}})
    assert (cpu.info.kind, cpu.note) == ("cpu", "")
    for platform, words in (("trn1", "--platform trn1: backend xla needs torch_xla"),
                            ("p5", "--platform p5: backend nccl needs a CUDA GPU")):
        for extra in (["evaluate"], ["generate", "--prompt-ids", "1,2"]):
            code = main([extra[0], str(run / "ckpt"), *extra[1:], "--platform", platform])
            err = capsys.readouterr().err
            assert code == 1 and words in err and len(err.strip().splitlines()) == 1, (extra, err)


def test_the_runs_platform_is_the_one_it_was_planned_on(run: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """`submit --platform cpu` of a recipe whose launch.platform is trn1 (llama3_8b's) ran on the CPU: evaluate and
    generate take that platform from the checkpoint's plan, with no note that trn1 cannot run here (the resolved
    config keeps the recipe's trn1; read alone, it sent a p5 run of such a recipe to the CPU on a GPU node)."""
    from megatron_hpc.parallel.device import xla_available

    if xla_available():
        pytest.skip("checks a trn1 config on a machine without torch_xla")
    data = DataConfig(source="indexed", path=str(run / "corpus"), split=SPLIT, cache_path=str(tmp_path / "cache"),
                      vocab_file=str(FIXTURE / "vocab.json"), merge_file=str(FIXTURE / "merges.txt"))
    cfg = dataclasses.replace(_cfg(tmp_path, data, num_steps=1, eval_interval=1, eval_iters=1),
                              launch=LaunchConfig(platform="trn1"))
    spec = plan_for_torchrun(cfg, platform="cpu")
    assert (spec.config.launch.platform, spec.plan.platform) == ("trn1", "cpu")
    assert run_training(spec, run_dir=tmp_path / "run") == 0
    capsys.readouterr()
    code, out, err = _evaluate(capsys, str(tmp_path / "ckpt"), "--split", "test", "--eval-iters", "1", "--json")
    assert code == 0 and json.loads(out)["device"] == "cpu", err
    assert "cannot run here" not in err, err
    assert main(["generate", str(tmp_path / "ckpt"), "--prompt-ids", "1,2", "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert "cannot run here" not in err, err

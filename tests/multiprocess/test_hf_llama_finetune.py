"""The fine-tune path of a Hugging Face Llama as a user runs it: a tiny LlamaForCausalLM that has learned a corpus,
with its tokenizer.json; `data preprocess` of the corpus with that tokenizer; `ckpt convert` to TP 2; `submit
--cluster local` of a fine-tune with the settings the conversion printed (two real torchrun ranks); then `evaluate`
and `generate` of the run's checkpoint, and `ckpt convert --to hf` back, which transformers loads and continues
greedily with our tokens."""

from __future__ import annotations

import json
import math
import os
import random
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import tokenizers
import torch
import transformers

pytestmark = pytest.mark.multiprocess

VOCAB, SEQ = 320, 32
WORDS = ["the", "a", "red", "blue", "green", "cat", "dog", "fox", "bird", "sees", "eats", "likes", "jumps", "over",
         "under", "near", "big", "small"]


def _corpus(path: Path) -> list[str]:
    rng = random.Random(5)
    docs = [" ".join(f"the {rng.choice(WORDS[2:5])} {rng.choice(WORDS[5:9])} {rng.choice(WORDS[9:13])} the "
                     f"{rng.choice(WORDS[15:17])} {rng.choice(WORDS[5:9])}." for _ in range(6)) for _ in range(120)]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return docs


def _taught_llama(tok: tokenizers.Tokenizer, docs: list[str]) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=SEQ,
                                      rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = [i for d in docs for i in tok.encode(d).ids]
    rows = torch.tensor(ids[: len(ids) // SEQ * SEQ]).view(-1, SEQ)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(60):
        batch = rows[(8 * step) % (len(rows) - 8):][:8]
        loss = model(batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def test_an_hf_llama_imports_at_tp2_fine_tunes_evaluates_generates_and_exports(tmp_path: Path,
                                                                                cli_in_process) -> None:
    docs = _corpus(tmp_path / "corpus.jsonl")
    tok_dir = tmp_path / "tokenizer"
    tok_dir.mkdir()
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(docs, vocab_size=300, min_frequency=1, special_tokens=["<|endoftext|>"])
    bpe.save(str(tok_dir / "tokenizer.json"))
    tok = tokenizers.Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    hf = tmp_path / "hf"
    _taught_llama(tok, docs).save_pretrained(hf)
    (hf / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())

    made = cli_in_process("data", "preprocess", "--input", str(tmp_path / "corpus.jsonl"), "--output-prefix",
                          str(tmp_path / "corpus"), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                          str(tok_dir))
    assert made.returncode == 0, made.stderr
    converted = cli_in_process("ckpt", "convert", str(hf), "--to", "xser", "--tp", "2", "--out", str(tmp_path / "ours"))
    assert converted.returncode == 0, converted.stderr
    # The line as printed, pasted after `submit --recipe tiny` (it names the tokenizer copied beside the checkpoint)
    printed = shlex.split(converted.stdout.strip().split("fine-tune from it with ", 1)[1])
    sets = printed[1::2]
    assert set(printed[::2]) == {"--set"} and "checkpoint.finetune=true" in sets and "parallel.tensor=2" in sets
    assert "model.num_query_groups=2" in sets and "data.tokenizer_type=HuggingFaceTokenizer" in sets

    run = tmp_path / "run"
    sets += [f"data.path={tmp_path / 'corpus_text_document'}", "data.split=80,10,10",
             "launch.workers_per_node=2", "train.num_steps=2", "train.micro_batch_size=4",
             "train.global_batch_size=4", "train.log_interval=1", "train.eval_iters=1", "train.tensorboard=false",
             "optim.lr=1e-4", "optim.lr_warmup_iters=0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    submit = subprocess.run([sys.executable, "-m", "megatron_hpc", "submit", "--recipe", "tiny", "--cluster", "local",
                             "--out", str(run), *[a for s in sets for a in ("--set", s)]],
                            capture_output=True, text=True, env=env, timeout=600)
    assert submit.returncode == 0, (submit.stdout + submit.stderr)[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["lm_loss"] for r in records if r["phase"] == "run"]
    # A fresh model starts near log(320) = 5.8; the imported one already knows the corpus.
    assert len(losses) == 2 and losses[0] < math.log(VOCAB) - 2.0, losses
    (tested,) = [r["lm_loss"] for r in records if r["phase"] == "test"]

    evaluated = cli_in_process("evaluate", str(run / "checkpoints"), "--split", "test", "--json")
    assert evaluated.returncode == 0, evaluated.stderr
    assert json.loads(evaluated.stdout)["splits"]["test"]["loss"] == pytest.approx(tested, rel=2e-5)

    generated = cli_in_process("generate", str(run / "checkpoints"), "--prompt", "the red cat", "--max-new-tokens",
                               "8", "--ignore-eos", "--json")
    assert generated.returncode == 0, generated.stderr
    result = json.loads(generated.stdout)["results"][0]
    assert result["prompt_ids"] == tok.encode("the red cat").ids and len(result["tokens"]) == 8

    exported = cli_in_process("ckpt", "convert", str(run / "checkpoints"), "--to", "hf", "--out",
                              str(tmp_path / "back"))
    assert exported.returncode == 0, exported.stderr
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back).__name__ == "LlamaForCausalLM"
    assert (tmp_path / "back" / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()
    prompt = torch.tensor([result["prompt_ids"]])
    want = back.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)[0, prompt.shape[1]:].tolist()
    assert result["tokens"] == want

"""`megatron-hpc generate` on a checkpoint trained at TP=2: the same greedy tokens as `transformers`' generate on
the `ckpt convert --to hf` export of it, text prompts through a supplied tokenizer, bad input in one line.

The commands run in this process (`cli_in_process`: the CLI's main(), no new interpreter to import torch again),
except one refusal, run as a real `python -m megatron_hpc` for its exit status and whole stderr, and the torchrun
runs, whose processes are the point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mp_workers
import pytest
import torch

pytestmark = pytest.mark.multiprocess

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "preprocess"
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [1, 2], [300, 301, 302]]


def cli_subprocess(*args: str) -> subprocess.CompletedProcess[str]:
    """The real `python -m megatron_hpc ARGS`."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return subprocess.run([sys.executable, "-m", "megatron_hpc", *args], capture_output=True, text=True, env=env)


def test_greedy_equals_transformers_generate_on_the_hf_export(tp2_checkpoint, tmp_path, cli_in_process):
    import transformers  # the real library (the `test` extra installs it)

    assert cli_in_process("ckpt", "convert", str(tp2_checkpoint), "--to", "hf", str(tmp_path / "hf")).returncode == 0
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.activation_function == "gelu"  # exact (erf) GeLU, as our MLP
    eos = hf.config.eos_token_id
    args = ["generate", str(tp2_checkpoint), "--max-new-tokens", "16", "--stop-token", str(eos), "--json"]
    for p in PROMPTS:
        args += ["--prompt-ids", ",".join(map(str, p))]
    proc = cli_in_process(*args)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["tensor_parallel"] == 2 and len(report["results"]) == len(PROMPTS)
    for prompt, row in zip(PROMPTS, report["results"]):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=16, do_sample=False, eos_token_id=eos, pad_token_id=eos)
            theirs = out[0, len(prompt):].tolist()
            logits = hf(out[:, :-1]).logits[0, len(prompt) - 1:].log_softmax(-1)
        assert row["tokens"] == theirs
        expected = logits.gather(-1, torch.tensor(theirs).unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(torch.tensor(row["logprobs"]), expected, rtol=0, atol=1e-4)


def test_text_prompts_and_bad_input(tp2_checkpoint, cli_in_process):
    ckpt = str(tp2_checkpoint)
    # synthetic run: no tokenizer; refused after the load, by the real command (its exit status, all its stderr)
    proc = cli_subprocess("generate", ckpt, "--prompt", "hello")
    assert proc.returncode == 1 and "pass --vocab-file and --merge-file" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    cases = [  # (arguments, words of the one-line error)
        (["--prompt-ids", ",".join(["1"] * 40)], "prompt 0 is 40 tokens, 8 more than the model's context of 32"),
        (["--prompt-ids", "1,2", "--top-p", "0"], "top_p must be in (0, 1]"),
        (["--prompt-ids", "1,2", "--top-p", "1.5"], "top_p must be in (0, 1]"),
        (["--prompt-ids", "1,x"], "not comma-separated integers"),
        (["--prompt-ids", "1", "--vocab-file", str(FIXTURE / "vocab.json")], "pass both"),
    ]
    for extra, words in cases:
        proc = cli_in_process("generate", ckpt, *extra)
        assert proc.returncode == 1 and words in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    from megatron_hpc.data.tokenizer import GPT2BPETokenizer

    tok = GPT2BPETokenizer(FIXTURE / "vocab.json", FIXTURE / "merges.txt")
    proc = cli_in_process("generate", ckpt, "--prompt", "The quick brown", "--prompt", "fox", "--max-new-tokens", "5",
                "--temperature", "0.8", "--top-k", "20", "--seed", "3", "--vocab-file", str(FIXTURE / "vocab.json"),
                "--merge-file", str(FIXTURE / "merges.txt"), "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["results"]
    assert [r["prompt_ids"] for r in rows] == [tok.encode("The quick brown"), tok.encode("fox")]
    for r in rows:
        assert r["text"] == tok.decode(r["tokens"]) and 1 <= len(r["tokens"]) <= 5
        assert all(lp <= 0 for lp in r["logprobs"])
    again = cli_in_process("generate", ckpt, "--prompt", "The quick brown", "--prompt", "fox", "--max-new-tokens", "5",
                 "--temperature", "0.8", "--top-k", "20", "--seed", "3", "--vocab-file", str(FIXTURE / "vocab.json"),
                 "--merge-file", str(FIXTURE / "merges.txt"), "--json")
    assert json.loads(again.stdout)["results"] == rows  # seeded
    plain = cli_in_process("generate", ckpt, "--prompt", "fox", "--max-new-tokens", "3", "--vocab-file",
                 str(FIXTURE / "vocab.json"), "--merge-file", str(FIXTURE / "merges.txt"))
    assert plain.returncode == 0 and plain.stdout.startswith("fox"), plain.stderr


def _torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    # --standalone: torchrun's rendezvous store binds a port of the kernel's choosing at once (a port found free and
    # passed as --master_port stays unbound until the store binds it: another process group could take it)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           "-m", "megatron_hpc", *args],
                          capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "1"})


def test_torchrun_tp2_generates_what_tp1_generates(tp2_checkpoint, cli_in_process):
    """`torchrun --nproc_per_node 2 ... generate` runs the TP 2 checkpoint at TP 2 (two gloo ranks, each its heads
    and vocabulary shard): the greedy tokens and log-probs of the merged TP 1 run, printed once."""
    args = ["generate", str(tp2_checkpoint), "--max-new-tokens", "6", "--json"]
    for p in PROMPTS:
        args += ["--prompt-ids", ",".join(map(str, p))]
    one = cli_in_process(*args)
    two = _torchrun(2, *args)
    assert one.returncode == 0 and two.returncode == 0, one.stderr[-2000:] + two.stderr[-2000:]
    ref, got = json.loads(one.stdout)["results"], json.loads(two.stdout)["results"]  # rank 1 printed nothing
    assert [r["prompt_ids"] for r in got] == PROMPTS
    assert [r["tokens"] for r in got] == [r["tokens"] for r in ref]
    assert [r["finish_reason"] for r in got] == [r["finish_reason"] for r in ref]
    for a, b in zip(ref, got):
        torch.testing.assert_close(torch.tensor(b["logprobs"]), torch.tensor(a["logprobs"]), rtol=0, atol=1e-4)
    assert len({tuple(r["tokens"]) for r in ref}) > 1  # the prompts lead to different continuations
    bad = _torchrun(3, "generate", str(tp2_checkpoint), "--prompt-ids", "1,2")
    assert bad.returncode != 0
    assert "tp 3, which does not divide its 4 attention heads" in bad.stderr, bad.stderr[-2000:]
    assert "torchrun --nproc_per_node=2 (the checkpoint's tp)" in bad.stderr


def test_llama_at_tp2_generates_and_evaluates_what_tp1_does(generate_checkpoints, tmp_path, cli_in_process):
    """The Qwen-style Llama of conftest's generate_checkpoints at its own TP 2 (two real gloo ranks running the CLI as
    torchrun would, each loading only its shard: one key/value group, its gate and up rows) against the merged TP 1
    run in this process: the same greedy tokens, log-probs, split loss and zero-shot perplexity."""
    from test_evaluate_test_split import LAMBADA, write_random_corpus

    ckpt = str(generate_checkpoints["llama"])
    write_random_corpus(tmp_path / "corpus", seed=4, documents=150)
    (tmp_path / "wiki.txt").write_text(" ".join(LAMBADA * 6) + " \n")
    generate = ["generate", ckpt, "--max-new-tokens", "8", "--json"]
    for p in PROMPTS:
        generate += ["--prompt-ids", ",".join(map(str, p))]
    evaluate = ["evaluate", ckpt, "--json", "--split", "valid", "--data-path", str(tmp_path / "corpus"),
                "--eval-iters", "2", "--task", "wikitext", "--file", str(tmp_path / "wiki.txt"), "--overlapping-eval",
                "8", "--vocab-file", str(FIXTURE / "vocab.json"), "--merge-file", str(FIXTURE / "merges.txt")]
    ranks = mp_workers.spawn(mp_workers.cli_runs, world=2, out_dir=tmp_path / "tp2", num_ports=2,
                             args=([generate, evaluate],))
    for code, _, err in ranks[0] + ranks[1]:
        assert code == 0, err[-2000:]
    assert ranks[1][0][1] == ranks[1][1][1] == ""  # rank 0 alone prints
    gen2, ev2 = (json.loads(out) for _, out, _ in ranks[0])
    merged = [cli_in_process(*args) for args in (generate, evaluate)]
    assert all(proc.returncode == 0 for proc in merged), [proc.stderr[-2000:] for proc in merged]
    gen1, ev1 = (json.loads(proc.stdout) for proc in merged)
    assert gen2["tensor_parallel"] == ev2["tensor_parallel"] == 2
    assert [r["tokens"] for r in gen2["results"]] == [r["tokens"] for r in gen1["results"]]
    assert len({tuple(r["tokens"]) for r in gen1["results"]}) > 1  # the prompts lead to different continuations
    for a, b in zip(gen1["results"], gen2["results"]):
        torch.testing.assert_close(torch.tensor(b["logprobs"]), torch.tensor(a["logprobs"]), rtol=0, atol=1e-4)
    valid1, valid2 = ev1["splits"]["valid"], ev2["splits"]["valid"]
    assert valid1["samples"] == valid2["samples"] > 0
    assert valid2["loss"] == pytest.approx(valid1["loss"], rel=1e-6)
    wiki1, wiki2 = ev1["tasks"]["wikitext"], ev2["tasks"]["wikitext"]
    assert (wiki1["tokens"], wiki1["words"]) == (wiki2["tokens"], wiki2["words"]) and wiki1["tokens"] > 32
    assert wiki2["token_ppl"] == pytest.approx(wiki1["token_ppl"], rel=1e-5)

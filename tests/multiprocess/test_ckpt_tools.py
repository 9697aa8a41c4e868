"""`ckpt reshard` and `ckpt convert` on a checkpoint the trainer wrote at TP=2 in real gloo processes.

The logits are the reference everywhere: the TP=2 model (two processes, gathered over the vocabulary),
the TP=1 model loaded from the resharded checkpoint, and the real `transformers` GPT2LMHeadModel loaded
from the exported folder must agree on the real vocabulary within 1e-4 (float32).

The `ckpt` commands run in this process (`cli_in_process`, the CLI's main(), under the usual umask) but for one
refusal, run as a real `python -m megatron_hpc` for its exit status and whole stderr.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mp_workers
import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.multiprocess

VOCAB = 500
MODEL = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.seq_length=32",
         "model.max_position_embeddings=32", f"model.vocab_size={VOCAB}", "model.make_vocab_size_divisible_by=64"]
TOKENS = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(7))


@pytest.fixture
def run_cli(cli_in_process):
    """`run_cli(*args)`: the CLI under the usual umask (022), so files it creates are 0644 unless it narrows them
    itself; it must succeed."""
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        proc = cli_in_process(*args, umask=0o022)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc

    return run


def _train(ckpt: Path, sets: list[str], *, tp: int) -> None:
    """`train --recipe tiny --set ...` for 3 steps at TP `tp` in `tp` real gloo processes (forkserver workers through
    the path the command takes: load_recipe, plan_for_torchrun, run_training)."""
    from megatron_hpc.config.loader import load_recipe

    cfg = load_recipe("tiny", [*sets, f"parallel.tensor={tp}", "train.num_steps=3", "train.micro_batch_size=4",
                               "train.global_batch_size=4", "train.tensorboard=false", f"checkpoint.save={ckpt}"])
    mp_workers.spawn(mp_workers.train_runs, world=tp, out_dir=ckpt.parent / f"{ckpt.name}-out",
                     args=([cfg], str(ckpt.parent / f"{ckpt.name}-runs")))


def model_logits(rank: int, world: int, ports: list[int], ckpt: str, tokens: torch.Tensor) -> torch.Tensor | None:
    """Logits of our GPT loaded from `ckpt` at TP=world, gathered to full vocabulary on rank 0."""
    from megatron_hpc.checkpoint.conversion import locate
    from megatron_hpc.checkpoint.store import read_shard
    from megatron_hpc.config.loader import load_recipe
    from megatron_hpc.model.gpt import GPT
    from megatron_hpc.parallel.context import ParallelContext
    from megatron_hpc.plan.mesh import Mesh

    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{ports[0]}")
    cfg = load_recipe("tiny", MODEL)
    ctx = ParallelContext.build(Mesh(num_nodes=1, workers_per_node=world, tensor_parallel=world), rank=rank)
    state = read_shard(locate(Path(ckpt)), tp_rank=rank)
    model = GPT(cfg.model, ctx=ctx, padded_vocab=state["padded_vocab_size"], seed=1)
    model.load_state_dict(state["model"])
    model.eval()
    with torch.no_grad():
        local = model(tokens)
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous())
    dist.destroy_process_group()
    return torch.cat(parts, dim=-1)[..., :VOCAB] if rank == 0 else None


@pytest.fixture(scope="module")
def tp2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ckpt = tmp_path_factory.mktemp("tools") / "tp2"
    _train(ckpt, [*MODEL, "data.source=synthetic"], tp=2)
    return ckpt


def test_reshard_tp2_to_tp1_and_back_keeps_the_logits(tp2_checkpoint, tmp_path, run_cli):
    ref = mp_workers.spawn(model_logits, world=2, out_dir=tmp_path / "ref", args=(str(tp2_checkpoint), TOKENS))[0]
    report = json.loads(run_cli("ckpt", "reshard", str(tp2_checkpoint), "--tp", "1", "--out", str(tmp_path / "tp1"),
                                "--json").stdout)
    assert (report["from_tp"], report["to_tp"], report["iteration"], report["optimizer"]) == (2, 1, 3, "resharded")
    one = mp_workers.spawn(model_logits, world=1, out_dir=tmp_path / "one", args=(str(tmp_path / "tp1"), TOKENS))[0]
    torch.testing.assert_close(one, ref, rtol=0, atol=1e-4)
    run_cli("ckpt", "reshard", str(tmp_path / "tp1"), "--tp", "2", "--out", str(tmp_path / "back"))
    back = mp_workers.spawn(model_logits, world=2, out_dir=tmp_path / "bk", args=(str(tmp_path / "back"), TOKENS))[0]
    torch.testing.assert_close(back, ref, rtol=0, atol=1e-4)
    # the trainer resumes from the resharded checkpoint at TP=1, optimizer included
    from megatron_hpc.config.loader import load_recipe
    from megatron_hpc.train.entry import plan_for_torchrun, run_training

    cfg = load_recipe("tiny", [*MODEL, "data.source=synthetic", "train.num_steps=4", "train.micro_batch_size=4",
                               "train.global_batch_size=4", "train.tensorboard=false",
                               f"checkpoint.load={tmp_path / 'tp1'}", f"checkpoint.save={tmp_path / 'tp1-more'}"])
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(var, None)
    assert run_training(plan_for_torchrun(cfg), run_dir=tmp_path / "resumed") == 0
    assert (tmp_path / "tp1-more" / "latest_checkpointed_iteration.txt").read_text() == "4"


def test_hf_export_matches_our_logits_in_transformers(tp2_checkpoint, tmp_path, run_cli):
    import transformers  # the real library (the `test` extra installs it)
    ref = mp_workers.spawn(model_logits, world=2, out_dir=tmp_path / "ref", args=(str(tp2_checkpoint), TOKENS))[0]
    proc = run_cli("ckpt", "convert", str(tp2_checkpoint), "--to", "hf", str(tmp_path / "hf"), "--json")
    report = json.loads(proc.stdout)
    assert (report["to"], report["tensor_parallel"], report["iteration"]) == ("hf", 2, 3)
    # synthetic tokens: no tokenizer to export, said in one line
    notes = [line for line in proc.stderr.splitlines() if "tokenizer" in line]
    assert len(notes) == 1 and "no tokenizer files written: the run trained on synthetic tokens" in notes[0]
    assert report["tokenizer"] is None and not (tmp_path / "hf" / "vocab.json").exists()
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "hf").iterdir()} == {
        "config.json": "0o644", "model.safetensors": "0o644"}  # others can load it
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    hf.eval()
    with torch.no_grad():
        theirs = hf(TOKENS).logits
    assert theirs.shape == (2, 32, VOCAB)
    torch.testing.assert_close(theirs, ref, rtol=0, atol=1e-4)


def test_hf_export_of_a_run_on_demo_data_carries_its_tokenizer(demo_data, tmp_path, run_cli):
    """A run trained on `data demo` output: AutoTokenizer loads the exported folder and gives the ids the
    training data holds (the .bin file written by our preprocessing), <|endoftext|> included."""
    import transformers

    from megatron_hpc.data.indexed import IndexedDataset

    sets = [s for s in demo_data if s != "--set"]
    prefix, vocab_file, merge_file = (s.split("=", 1)[1] for s in sets)
    _train(tmp_path / "ckpt", [*sets, "data.source=indexed", "model.num_layers=1", "model.hidden_size=64",
                               "model.seq_length=32", "model.max_position_embeddings=32"], tp=1)
    out = tmp_path / "hf"
    proc = run_cli("ckpt", "convert", str(tmp_path / "ckpt"), "--to", "hf", str(out), "--json")
    assert "no tokenizer" not in proc.stderr
    names = {"config.json", "model.safetensors", "vocab.json", "merges.txt", "tokenizer_config.json",
             "special_tokens_map.json"}
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == dict.fromkeys(names, "0o644")
    assert (out / "vocab.json").read_bytes() == Path(vocab_file).read_bytes()
    assert (out / "merges.txt").read_bytes() == Path(merge_file).read_bytes()

    tok = transformers.AutoTokenizer.from_pretrained(out)
    vocab = json.loads(Path(vocab_file).read_text(encoding="utf-8"))
    eod = vocab["<|endoftext|>"]
    assert (tok.eos_token_id, tok.bos_token_id, len(tok)) == (eod, eod, len(vocab))
    hf = transformers.GPT2LMHeadModel.from_pretrained(out)
    assert hf.config.eos_token_id == eod and hf.config.vocab_size >= len(vocab)
    corpus = Path(vocab_file).with_name("stdlib.jsonl")
    with corpus.open(encoding="utf-8") as f:
        texts = [json.loads(next(f))["text"] for _ in range(3)]
    data = IndexedDataset(prefix)
    for i, text in enumerate(texts):
        stored = data[i].tolist()  # preprocessing appended EOD to each document
        assert stored[-1] == eod
        assert tok(text + "<|endoftext|>")["input_ids"] == stored
        assert tok.decode(stored) == text + "<|endoftext|>"


def test_convert_xser_to_torch_and_back_is_identical(tp2_checkpoint, tmp_path, run_cli):
    from megatron_hpc.checkpoint.conversion import read_whole
    from megatron_hpc.checkpoint.store import iter_tensors

    run_cli("ckpt", "convert", str(tp2_checkpoint), "--to", "torch", str(tmp_path / "torch"))
    run_cli("ckpt", "convert", str(tmp_path / "torch"), "--to", "xser", str(tmp_path / "xser"))
    original, as_torch, again = (read_whole(p) for p in (tp2_checkpoint, tmp_path / "torch", tmp_path / "xser"))
    assert (as_torch.found.manifest.format, again.found.manifest.format) == ("torch", "xser")
    for rank in range(2):
        want = dict(iter_tensors(original.grid[0][rank]))
        for other in (as_torch, again):
            got = dict(iter_tensors(other.grid[0][rank]))
            assert want.keys() == got.keys()
            for name, tensor in want.items():
                assert torch.equal(tensor, got[name]), name


def test_bad_input_is_refused_in_one_line(tp2_checkpoint, tmp_path, cli_in_process):
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    for i, (args, expected) in enumerate((
        (["reshard", str(tp2_checkpoint), "--tp", "3", "--out", str(tmp_path / "x")], "--tp in [1, 2, 4]"),
        (["reshard", str(tmp_path / "missing"), "--tp", "1"], "does not exist"),
        (["convert", str(tmp_path), "--to", "hf", str(tmp_path / "hf")], "no complete checkpoint"),
    )):
        if i == 0:  # the real command: its exit status and all it printed
            proc = subprocess.run([sys.executable, "-m", "megatron_hpc", "ckpt", *args], capture_output=True,
                                  text=True, env=env)
        else:
            proc = cli_in_process("ckpt", *args)
        assert proc.returncode == 1 and expected in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()

"""A checkpoint saved at TP 2 x PP 2 and resharded with the CLI loads at other sizes and trains on as if nothing
changed: the first step after it has the same loss on the same batch (the weights came over), and the next steps
the same losses and grad norms (Adam's moments came over too). And a run that would load it without a reshard is
refused before queueing, with the command that fixes it."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import mp_workers
import pytest
import torch

from megatron_hpc.cli.main import main
from megatron_hpc.config.loader import load_recipe
from megatron_hpc.config.schema import RunConfig

pytestmark = pytest.mark.multiprocess

RTOL = 1e-5
SIZES = {"tp2pp2": (2, 2), "tp1pp4": (1, 4), "tp1pp1": (1, 1)}
SMALL = ["model.hidden_size=64", "model.seq_length=32", "model.max_position_embeddings=32", "model.vocab_size=500"]


def _config(mesh: str, *, num_steps: int, load: str | None = None) -> RunConfig:
    tp, pp = SIZES[mesh]
    # The tiny recipe's 4 layers (one per stage at PP 4) at a quarter of its width on synthetic tokens: what moves
    # between sizes is the same, at a 25th of the compute. Micro-batches of 2 give 4 per step, enough for 4 stages.
    cfg = load_recipe("tiny", [*SMALL, f"parallel.tensor={tp}", f"parallel.pipeline={pp}", "train.micro_batch_size=2",
                               f"train.num_steps={num_steps}", "train.log_interval=1", "optim.lr_decay_iters=20",
                               "data.source=synthetic", "checkpoint.save_interval=10"])
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, load=load))


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_hpc", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reshard")
    first = root / "first"
    plan1 = [(4, _config("tp2pp2", num_steps=20), "straight"), (4, _config("tp2pp2", num_steps=10), "part1")]
    mp_workers.spawn(mp_workers.sized_runs, world=4, out_dir=first, num_ports=len(plan1), args=(plan1, str(first)))
    saved = first / "part1" / "checkpoints"
    resharded = {}
    for mesh in ("tp1pp4", "tp1pp1"):
        tp, pp = SIZES[mesh]
        resharded[mesh] = root / f"ckpt_{mesh}"
        # in this process (the CLI's main(): no interpreter to start); a failure's message is in the captured stderr
        assert main(["ckpt", "reshard", str(saved), "--tp", str(tp), "--pp", str(pp), "--out",
                     str(resharded[mesh])]) == 0
    second = root / "second"
    plan2 = [(4, _config("tp1pp4", num_steps=20, load=str(resharded["tp1pp4"])), "part2_tp1pp4"),
             (1, _config("tp1pp1", num_steps=20, load=str(resharded["tp1pp1"])), "part2_tp1pp1")]
    mp_workers.spawn(mp_workers.sized_runs, world=4, out_dir=second, num_ports=len(plan2), args=(plan2, str(second)))
    return {"straight": first / "straight", "part1": first / "part1", "saved": saved,
            "tp1pp4": second / "part2_tp1pp4", "tp1pp1": second / "part2_tp1pp1"}


@pytest.mark.parametrize("mesh", ["tp1pp4", "tp1pp1"])
def test_resharded_checkpoint_trains_on_at_new_sizes(runs: dict[str, Path], mesh: str) -> None:
    straight = _metrics(runs["straight"])[10:]
    resumed = _metrics(runs[mesh])
    assert [r["iteration"] for r in resumed] == list(range(11, 21))
    # Iteration 11 is the loss of the checkpoint's weights on the same batch (and the gradient they give); the
    # steps after it show Adam's moments came over too.
    for key in ("lm_loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor([r[key] for r in resumed], dtype=torch.float64),
                                   torch.tensor([r[key] for r in straight], dtype=torch.float64),
                                   rtol=RTOL, atol=0.0, msg=lambda m, key=key: f"{key}: {m}")
    assert [r["lr"] for r in resumed] == [r["lr"] for r in straight]


def test_inspect_reports_the_pipeline(runs: dict[str, Path], cli_in_process) -> None:
    done = cli_in_process("ckpt", "inspect", str(runs["saved"]), "--json")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert (info["pipeline_parallel"], info["tensor_parallel"]) == (2, 2)


def test_loading_at_other_sizes_is_refused_before_queueing(runs: dict[str, Path], tmp_path: Path) -> None:
    done = _cli("submit", "--recipe", "tiny", "--cluster", "local", "--dry-run", "--out", str(tmp_path / "run"),
                *[a for item in SMALL for a in ("--set", item)],
                "--set", "parallel.pipeline=1", "--set", "data.source=synthetic",
                "--set", f"checkpoint.load={runs['saved']}")
    assert done.returncode != 0
    message = done.stderr.strip().splitlines()[-1]
    assert "tp 2 x pp 2" in message and "ckpt reshard" in message and "--pp 1" in message, message
    assert not (tmp_path / "run").exists()  # nothing written, nothing queued

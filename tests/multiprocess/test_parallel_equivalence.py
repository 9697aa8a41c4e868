"""TP, DP and micro-batching change nothing numerically: each is checked against one process. So for a tiny Llama at
TP 2 (grouped-query attention with TP splitting the groups, SwiGLU, RMSNorm, no linear biases; Qwen's QKV bias is
checked at TP 2 with sequence parallelism in test_sequence_parallel); and the proof has teeth: a TP split that breaks
the groups or pairs the SwiGLU halves wrongly fails it."""

from __future__ import annotations

import json
from pathlib import Path

import mp_workers
import pytest
import torch

from megatron_hpc.config.schema import RunConfig

pytestmark = pytest.mark.multiprocess

RTOL = 1e-5


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _llama() -> RunConfig:
    """At TP 2, the shape of conftest's llama_reference (4 layers)."""
    return mp_workers.llama(mp_workers.pipeline_config(tp=2))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """Ten real training runs of 20 steps over three spawns (world 1, 2 and 4); two of them GPT-NeoX, three Llama
    at TP 2 (two with a broken TP split)."""
    root = tmp_path_factory.mktemp("runs")
    plan = {
        1: {"dense": (mp_workers.tiny_config(), ""), "one_micro": (mp_workers.tiny_config(micro_batch_size=8), ""),
            "dense_neox": (mp_workers.neox(mp_workers.tiny_config()), "")},
        2: {"tp2": (mp_workers.tiny_config(tp=2), ""), "dp2": (mp_workers.tiny_config(tp=1), ""),
            "tp2_neox": (mp_workers.neox(mp_workers.tiny_config(tp=2)), ""),
            "tp2_llama": (_llama(), ""),
            "tp2_llama_ungrouped_qkv": (_llama(), "ungrouped_qkv"),
            "tp2_llama_swapped_gate": (_llama(), "swapped_gate")},
        4: {"tp2dp2": (mp_workers.tiny_config(tp=2), "")},
    }
    out: dict[str, list[dict]] = {}
    for world, entries in plan.items():
        run_root = root / f"world{world}"
        mp_workers.spawn(mp_workers.fault_runs, world=world, out_dir=run_root, num_ports=len(entries),
                         args=([cfg for cfg, _ in entries.values()], [fault for _, fault in entries.values()],
                               str(run_root)))
        for i, name in enumerate(entries):
            out[name] = _metrics(run_root / f"run{i}")
    return out


def _assert_same(got: list[dict], want: list[dict], key: str) -> None:
    assert [r["iteration"] for r in got] == list(range(1, 21))
    torch.testing.assert_close(torch.tensor([r[key] for r in got], dtype=torch.float64),
                               torch.tensor([r[key] for r in want], dtype=torch.float64), rtol=RTOL, atol=0.0)


def test_reference_run_learns(runs: dict[str, list[dict]]) -> None:
    losses = [r["lm_loss"] for r in runs["dense"]]
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("name", ["tp2", "dp2", "tp2dp2", "one_micro"])
def test_losses_match_single_process(runs: dict[str, list[dict]], name: str) -> None:
    _assert_same(runs[name], runs["dense"], "lm_loss")


@pytest.mark.parametrize("name", ["tp2", "dp2", "tp2dp2"])
def test_grad_norm_matches_single_process(runs: dict[str, list[dict]], name: str) -> None:
    # With TP the replicated LayerNorms, biases and positions must be counted once.
    _assert_same(runs[name], runs["dense"], "grad_norm")


@pytest.mark.parametrize("key", ["lm_loss", "grad_norm"])
def test_neox_at_tp2_matches_single_process(runs: dict[str, list[dict]], key: str) -> None:
    # Parallel residual: each branch ends in its own row-parallel all-reduce before the two are added.
    _assert_same(runs["tp2_neox"], runs["dense_neox"], key)
    assert runs["dense_neox"][-1]["lm_loss"] < 0.8 * runs["dense_neox"][0]["lm_loss"]
    assert runs["dense_neox"][-1]["lm_loss"] != runs["dense"][-1]["lm_loss"]  # another model, really


def test_samples_and_lr_identical(runs: dict[str, list[dict]]) -> None:
    for name in ("tp2", "dp2", "tp2dp2", "one_micro"):
        assert [r["consumed_samples"] for r in runs[name]] == [8 * i for i in range(1, 21)]
        assert [r["lr"] for r in runs[name]] == [r["lr"] for r in runs["dense"]]


def test_llama_and_qwen_references_learn(llama_reference: dict[str, list[dict]]) -> None:
    llama, qwen = llama_reference["llama"], llama_reference["qwen"]
    assert llama[-1]["lm_loss"] < 0.8 * llama[0]["lm_loss"]
    # The QKV bias starts at zero (the first forward is Llama's) and then trains: another model.
    assert qwen[0]["lm_loss"] == llama[0]["lm_loss"] and qwen[-1]["lm_loss"] != llama[-1]["lm_loss"]


@pytest.mark.parametrize("key", ["lm_loss", "grad_norm"])
def test_llama_at_tp2_matches_single_process(runs: dict[str, list[dict]], llama_reference: dict[str, list[dict]],
                                             key: str) -> None:
    # Each TP rank holds one of the two key/value groups with its two queries, and the matching gate and up rows;
    # the RMSNorm weights are replicated and counted once in the grad norm.
    _assert_same(runs["tp2_llama"], llama_reference["llama"], key)


@pytest.mark.parametrize("fault", ["ungrouped_qkv", "swapped_gate"])
def test_a_tp_split_that_ignores_groups_or_swiglu_pairs_fails_the_proof(
        runs: dict[str, list[dict]], llama_reference: dict[str, list[dict]], fault: str) -> None:
    # The faulty sharder is the identity at TP 1 (so the model it cuts up is the reference's) and wrong at TP 2.
    full = torch.randn(128, 64, generator=torch.Generator().manual_seed(0))
    key = "h.0.attn.qkv" if fault == "ungrouped_qkv" else "h.0.mlp.gate"
    assert torch.equal(mp_workers.faulty_shard(fault, full, key=key, tp=1, rank=0), full)
    assert not torch.equal(mp_workers.faulty_shard(fault, full, key=key, tp=2, rank=0), full.chunk(2)[0])
    got = runs[f"tp2_llama_{fault}"]
    # The same comparison the intact split passes must fail; the forward is wrong from the first step on.
    with pytest.raises(AssertionError):
        _assert_same(got, llama_reference["llama"], "lm_loss")
    assert got[0]["lm_loss"] != pytest.approx(llama_reference["llama"][0]["lm_loss"], rel=RTOL)

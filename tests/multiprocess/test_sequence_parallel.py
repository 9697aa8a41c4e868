"""Sequence parallelism (parallel.sequence_parallel) changes nothing numerically: real gloo processes against one,
GPT, GPT-NeoX and a tiny Qwen (RMSNorm, SwiGLU, grouped-query attention with a QKV bias)."""

from __future__ import annotations

import json
from pathlib import Path

import mp_workers
import pytest
import torch

pytestmark = pytest.mark.multiprocess

RTOL = 1e-5


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """Real 20-step runs: dense references in one process, SP at TP=2 (and one with the TP grad all-reduce of
    the replicated params removed), SP at TP=2 x DP=2 and at TP=2 x PP=2 (rotary, 4 layers; and GPT-NeoX's parallel
    residual, untied, with full recomputation); and SP at TP=2 for the Qwen of conftest's llama_reference."""
    root = tmp_path_factory.mktemp("sp")
    sp = mp_workers.sequence_parallel
    plan = {
        1: {"dense": (mp_workers.tiny_config(), ""),
            "dense_pp_ref": (mp_workers.pipeline_config(rope=True), ""),
            "dense_pp_neox": (mp_workers.neox(mp_workers.pipeline_config(), recompute=True), "")},
        2: {"sp_tp2": (sp(mp_workers.tiny_config(tp=2)), ""),
            "sp_tp2_no_allreduce": (sp(mp_workers.tiny_config(tp=2)), "no_sp_grad_allreduce"),
            "sp_tp2_qwen": (sp(mp_workers.llama(mp_workers.pipeline_config(tp=2), qkv_bias=True)), "")},
        4: {"sp_tp2dp2": (sp(mp_workers.tiny_config(tp=2)), ""),
            "sp_tp2pp2": (sp(mp_workers.pipeline_config(tp=2, pp=2, rope=True)), ""),
            "sp_tp2pp2_neox": (sp(mp_workers.neox(mp_workers.pipeline_config(tp=2, pp=2), recompute=True)), "")},
    }
    out: dict[str, list[dict]] = {}
    for world, entries in plan.items():
        run_root = root / f"world{world}"
        configs = [cfg for cfg, _ in entries.values()]
        faults = [fault for _, fault in entries.values()]
        mp_workers.spawn(mp_workers.fault_runs, world=world, out_dir=run_root, num_ports=len(configs),
                         args=(configs, faults, str(run_root)))
        for i, name in enumerate(entries):
            out[name] = _metrics(run_root / f"run{i}")
    return out


def _series(rows: list[dict], key: str) -> torch.Tensor:
    assert [r["iteration"] for r in rows] == list(range(1, 21))
    return torch.tensor([r[key] for r in rows], dtype=torch.float64)


@pytest.mark.parametrize("name,ref", [("sp_tp2", "dense"), ("sp_tp2dp2", "dense"), ("sp_tp2pp2", "dense_pp_ref"),
                                      ("sp_tp2pp2_neox", "dense_pp_neox")])
@pytest.mark.parametrize("key", ["lm_loss", "grad_norm"])
def test_sequence_parallel_matches_single_process(runs: dict[str, list[dict]], name: str, ref: str,
                                                  key: str) -> None:
    torch.testing.assert_close(_series(runs[name], key), _series(runs[ref], key), rtol=RTOL, atol=0.0)


@pytest.mark.parametrize("key", ["lm_loss", "grad_norm"])
def test_sequence_parallel_qwen_matches_single_process(runs: dict[str, list[dict]],
                                                       llama_reference: dict[str, list[dict]], key: str) -> None:
    # The RMSNorm weights see one sequence shard per rank (tagged, their grads all-reduced over TP); the QKV bias
    # is column-parallel, a shard of its own per rank, and needs no such reduction.
    torch.testing.assert_close(_series(runs["sp_tp2_qwen"], key), _series(llama_reference["qwen"], key), rtol=RTOL,
                               atol=0.0)


def test_missing_layernorm_grad_allreduce_is_caught(runs: dict[str, list[dict]]) -> None:
    # Without the TP all-reduce each rank steps its LayerNorms with half the gradient: the runs drift apart.
    broken, dense = _series(runs["sp_tp2_no_allreduce"], "lm_loss"), _series(runs["dense"], "lm_loss")
    assert not torch.allclose(broken, dense, rtol=RTOL, atol=0.0)
    grad_broken, grad_dense = _series(runs["sp_tp2_no_allreduce"], "grad_norm"), _series(runs["dense"], "grad_norm")
    assert not torch.allclose(grad_broken, grad_dense, rtol=RTOL, atol=0.0)


def test_sequence_mappings_do_what_their_docstrings_say(tmp_path: Path) -> None:
    for res in mp_workers.spawn(mp_workers.mappings, world=2, out_dir=tmp_path,
                                args=(mp_workers.SEQUENCE_MAPPINGS,)):
        for name, got in res.items():
            assert got["spec"]["dim"] == "sequence", name
            torch.testing.assert_close(*got["fwd"], msg=f"{name} forward")
            torch.testing.assert_close(*got["bwd"], msg=f"{name} backward")

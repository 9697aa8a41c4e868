"""Tensor-parallel building blocks against dense torch, over two real gloo processes."""

from __future__ import annotations

from pathlib import Path

import mp_workers
import pytest
import torch

pytestmark = pytest.mark.multiprocess


def test_tp2_model_matches_tp1(tmp_path: Path) -> None:
    results = mp_workers.spawn(mp_workers.tp_layers, world=2, out_dir=tmp_path)
    for rank, res in enumerate(results):
        assert res["padded"][0] == res["padded"][1]
        for name, (full, ref) in res["weights"].items():
            # Initialisation is TP-invariant: the gathered shards ARE the dense weights, bit for bit.
            assert torch.equal(full, ref), f"rank {rank}: initial {name} differs"
        torch.testing.assert_close(res["logits"][0], res["logits"][1], rtol=1e-5, atol=1e-6)
        assert res["loss"][0] == pytest.approx(res["loss"][1], rel=1e-6)
        for name, (full, ref) in res["grads"].items():
            torch.testing.assert_close(full, ref, rtol=1e-4, atol=1e-7, msg=f"rank {rank}: grad of {name}")


def test_vocab_parallel_cross_entropy_matches_torch(tmp_path: Path) -> None:
    for res in mp_workers.spawn(mp_workers.cross_entropy, world=2, out_dir=tmp_path):
        torch.testing.assert_close(*res["loss"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(*res["grad"], rtol=1e-6, atol=1e-7)


def test_mappings_do_what_their_docstrings_say(tmp_path: Path) -> None:
    for res in mp_workers.spawn(mp_workers.mappings, world=2, out_dir=tmp_path):
        for name, checks in res.items():
            for phase in ("fwd", "bwd"):
                got, want = checks[phase]
                assert got.shape == want.shape, f"{name} {phase} ({checks['spec'][phase]}): shape"
                torch.testing.assert_close(got, want, msg=f"{name} {phase} ({checks['spec'][phase]})")

"""The DP all-reduce overlapped with backward: same numbers as after backward, and really overlapped."""

from __future__ import annotations

import grad_overlap_workers
import mp_workers
import pytest
import torch

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return mp_workers.spawn(grad_overlap_workers.overlap_checks, world=2, out_dir=tmp_path_factory.mktemp("overlap"))


def test_overlapped_reduce_gives_the_plain_gradients_bit_for_bit(results: list[dict]) -> None:
    results = [res["matches"] for res in results]
    for rank, res in enumerate(results):
        assert res["buckets"] > 2, "the test model must span several buckets"
        # Every bucket was started in each of the three steps, none left behind.
        assert res["started"] == [res["buckets"]] * 3
        for step, (overlapped, plain) in enumerate(zip(*res["grads"])):
            for name in plain:
                assert torch.equal(overlapped[name], plain[name]), f"rank {rank} step {step}: grad of {name}"
        for name, weight in res["weights"][1].items():
            assert torch.equal(res["weights"][0][name], weight), f"rank {rank}: weight {name} after 3 steps"
    # The DP average leaves both replicas with the same gradients (each rank saw different tokens).
    for name, grad in results[0]["grads"][0][-1].items():
        assert torch.equal(grad, results[1]["grads"][0][-1][name]), f"replicas differ in the grad of {name}"


def test_a_bucket_is_all_reduced_before_backward_reaches_the_first_layer(results: list[dict]) -> None:
    for res in (r["order"] for r in results):
        overlapped, plain = res["overlap"], res["plain"]
        reached = overlapped.index("backward reached h.0")
        assert "dp all-reduce (async)" in overlapped[:reached], overlapped
        # The rest of the buckets are launched after it; all of them async.
        assert set(overlapped) == {"dp all-reduce (async)", "backward reached h.0"}, overlapped
        # Without the reducer every DP all-reduce comes after backward.
        reached = plain.index("backward reached h.0")
        assert plain[:reached] == [] and "dp all-reduce" in plain[reached:], plain


def test_overlap_is_used_with_dp_peers_off_xla_when_asked(results: list[dict]) -> None:
    for res in results:
        assert res["chosen"] == {"cpu overlap=True": "OverlappedGradReducer", "xla overlap=True": "NoneType",
                                 "cpu overlap=False": "NoneType"}

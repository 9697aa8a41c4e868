"""benchmarks/plan_fits.py: its rows are make_plan's, its marks follow the numbers, and the memory features only
ever move the planner's choice earlier in its search order.

The expected plans come from make_plan on overrides written out here, not from the script's SETTINGS.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from megatron_hpc.config.loader import load_recipe
from megatron_hpc.config.platforms import get_platform
from megatron_hpc.errors import MegatronHpcError
from megatron_hpc.plan.planner import make_plan
from megatron_hpc.plan.sizing import TP_BEFORE_PIPELINING

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "plan_fits.py"

FREE_AND_OFF = ["parallel.tensor=0", "parallel.pipeline=0", "parallel.choose_layout=fits", "model.recompute=false"]
BY_HAND = {
    "off": [],
    "selective": ["model.recompute_granularity=selective"],
    "SP": ["parallel.sequence_parallel=true"],
    "dist-opt": ["parallel.distributed_optimizer=true"],
    "full": ["model.recompute=true"],
    "sel+SP+DO": ["model.recompute_granularity=selective", "parallel.sequence_parallel=true",
                  "parallel.distributed_optimizer=true"],
    "full+SP+DO": ["model.recompute=true", "parallel.sequence_parallel=true", "parallel.distributed_optimizer=true"],
}


def _bench():
    spec = importlib.util.spec_from_file_location("plan_fits", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _plan(recipe, nodes, platform, extra):
    return make_plan(load_recipe(recipe, FREE_AND_OFF + extra), num_nodes=nodes, platform=get_platform(platform))


def _plans(recipe, nodes, platform, extra):
    try:
        _plan(recipe, nodes, platform, extra)
    except MegatronHpcError:
        return False
    return True


def test_the_gpt3_175b_row_on_p5_is_make_plans():
    bench = _bench()
    row = bench.build_row("gpt3_175b", get_platform("p5"), max_nodes=32)
    assert row.nodes == 16 and set(row.cells) == set(BY_HAND)
    for name, extra in BY_HAND.items():
        want, got = _plan("gpt3_175b", 16, "p5", extra), row.cells[name].plan
        assert got is not None, name
        assert (got.tensor_parallel, got.pipeline_parallel, got.data_parallel) == \
            (want.tensor_parallel, want.pipeline_parallel, want.data_parallel), name
        assert got.memory_breakdown_gib == want.memory_breakdown_gib, name
        # the smallest node count: plans there, and not at half of it
        assert row.smallest[name] is not None, name
        low = row.smallest[name].num_nodes
        assert _plans("gpt3_175b", low, "p5", extra), name
        assert low == 1 or not _plans("gpt3_175b", low // 2, "p5", extra), name
    assert row.cells["SP"].model_parallel < row.cells["off"].model_parallel  # what the mark is there for
    assert bench.format_cell(row.cells["SP"], row.cells["off"]).split()[0].endswith("*")


def test_xla_platforms_have_no_distributed_optimizer_column_because_it_changes_the_precision_there():
    bench = _bench()
    trn1 = get_platform("trn1")
    names = [s.name for s in bench.settings_for(trn1)]
    assert "dist-opt" not in names and "sel+SP+DO" in names
    for setting in bench.settings_for(trn1):
        assert bench.DISTOPT not in bench.setting_overrides(setting, trn1)
    assert bench.column_name(bench.SETTINGS[-1], trn1) == "full+SP"
    assert _plan("gpt3_6.7b", 16, "trn1", ["parallel.distributed_optimizer=true"]).distributed_optimizer


def _search_key(plan):
    """Where a mesh comes in the planner's search (plan/sizing.py choose_sizes): TP up to 8 before wider TP, then
    the smallest PP, then the smallest TP."""
    return (plan.tensor_parallel > TP_BEFORE_PIPELINING, plan.pipeline_parallel, plan.tensor_parallel)


@pytest.mark.parametrize("platform", ["p5", "trn1", "trn2"])
def test_a_feature_never_moves_the_choice_later_or_raises_the_estimate_at_the_same_mesh(platform):
    """Not "a feature never raises TP x PP": the search takes the smallest PP first, so a feature that lets TP 8 x
    PP 1 fit may trade TP 1 x PP 2 for it. What must hold is that each mesh needs no more memory with the feature,
    so the first mesh that fits comes no later in the search."""
    bench = _bench()
    plat = get_platform(platform)
    off_setting, *features = bench.settings_for(plat)
    for recipe, nodes in bench.NOMINAL_NODES.items():
        off = bench.plan_cell(recipe, off_setting, plat, nodes=nodes).plan
        for setting in features:
            cell = bench.plan_cell(recipe, setting, plat, nodes=nodes)
            if off is None or cell.plan is None or off.idle_workers_per_node or cell.plan.idle_workers_per_node:
                continue
            if off.tensor_parallel == 1 and bench.SP in setting.overrides:
                # sequence parallelism needs TP: the planner's search starts at TP 2 for it
                assert cell.plan.tensor_parallel >= 2, (recipe, setting.name)
                continue
            assert _search_key(cell.plan) <= _search_key(off), (recipe, setting.name)
            mesh = [f"parallel.tensor={off.tensor_parallel}", f"parallel.pipeline={off.pipeline_parallel}"]
            pinned = load_recipe(recipe, [*bench.setting_overrides(setting, plat), *mesh])
            same_mesh = make_plan(pinned, num_nodes=nodes, platform=plat)
            assert same_mesh.memory_per_worker_gib <= off.memory_per_worker_gib, (recipe, setting.name)


def test_refusals_are_named_by_their_cause():
    bench = _bench()
    p5, trn1 = get_platform("p5"), get_platform("trn1")
    sp = next(s for s in bench.SETTINGS if s.name == "SP")
    off = bench.SETTINGS[0]
    # With TP left to the planner, SP is planned from TP 2 (it was refused at TP 1 before the planner knew).
    assert bench.plan_cell("gpt3_1.7b", sp, p5, nodes=4).plan.tensor_parallel == 2
    assert bench.plan_cell("gpt3_175b", off, trn1, nodes=16).refusal == "memory"
    # 192 p5 nodes (the paper's 1536 GPUs): DP 24 does not divide the recipe's global batch of 1024
    assert bench.plan_cell("gpt3_145.6b", off, p5, nodes=192).refusal == "batch"
    assert bench.format_cell(bench.Cell(None, "memory"), bench.Cell(None, "memory")) == "- (memory)"


@pytest.mark.parametrize(("value", "base", "want"), [(4, 8, "*"), (8, 8, ""), (16, 8, "^"), (2, None, "+"),
                                                     (None, 8, "")])
def test_marks_follow_the_numbers(value, base, want):
    assert _bench().mark(value, base) == want


def test_the_smallest_node_search_stops_at_max_nodes():
    bench = _bench()
    off = bench.SETTINGS[0]
    # gpt3_175b without recomputation does not fit a trn1 worker at any mesh; with SP it plans from 16 nodes
    assert bench.smallest_plan("gpt3_175b", off, get_platform("trn1"), max_nodes=64) is None
    sp = next(s for s in bench.SETTINGS if s.name == "SP")
    assert bench.smallest_plan("gpt3_175b", sp, get_platform("trn1"), max_nodes=8) is None
    found = bench.smallest_plan("gpt3_175b", sp, get_platform("trn1"), max_nodes=16)
    assert found.num_nodes == 16
    assert bench.format_nodes(found, None) == f"16+ ({found.tensor_parallel}x{found.pipeline_parallel}!)"


def test_meshes_that_submit_refuses_on_xla_are_flagged():
    bench = _bench()
    trn2, off = get_platform("trn2"), bench.SETTINGS[0]
    full = next(s for s in bench.SETTINGS if s.name == "full")
    pipelined = bench.plan_cell("neox_20b", off, trn2, nodes=4)  # TP 8 x PP 2 without recomputation
    flat = bench.plan_cell("neox_20b", full, trn2, nodes=4)
    assert pipelined.plan.pipeline_parallel > 1 and flat.plan.pipeline_parallel == 1
    assert bench.format_cell(pipelined, pipelined).split()[0].endswith("!")
    assert "!" not in bench.format_cell(flat, pipelined)
    p5_pipelined = bench.plan_cell("gpt3_175b", off, get_platform("p5"), nodes=16)
    assert p5_pipelined.plan.pipeline_parallel > 1 and "!" not in bench.format_cell(p5_pipelined, p5_pipelined)

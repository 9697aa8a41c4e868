"""Refusals whose fix works (issue 26): every `--set` / `--nodes` / `--platform` a refusal prints is fed back to the
same command, in-process through `megatron-hpc plan` (`submit --dry-run` for submit's own refusal), and must plan.
When no fix plans, the refusal says "none fits at this size" and names a node count, which must plan too.

The suggestions are read from the printed line with a parser written here (the grammar the refusals use), not
from the planner's own list, so a value that is printed but was never tried fails this test.
"""

from __future__ import annotations

import re

import pytest

from megatron_hpc.cli.main import main
from megatron_hpc.config.loader import load_recipe
from megatron_hpc.config.platforms import get_platform
from megatron_hpc.errors import MegatronHpcError
from megatron_hpc.plan.fixes import FixableError
from megatron_hpc.plan.planner import make_plan

_FLAG = re.compile(
    r"--(?P<flag>nodes(?= \d)|platform) (?P<arg>[\w.]+)(?=[\s,;)]|$)"
    r"|--set (?P<key>[\w.]+)=(?:N with N in \{(?P<choices>[^}]*)\}(?P<auto> \(0 lets the planner choose\))?"
    r"|N with N <= (?P<up_to>\d+)"
    r"|(?P<value>[^\s,;()]+)(?P<more>(?: or (?:[\w.]+=[^\s,;()]+|\d+)(?=[\s,;)]|$))*))")


def suggestions(message: str) -> list[list[str]]:
    """Every alternative the message offers, as command-line arguments. Flags separated by a single space are one
    alternative (`--set a=1 --set b=2`); `N with N in {..}`, `N with N <= k` and `v or w` are one per value."""
    alternatives: list[list[str]] = []
    end = -1
    for match in _FLAG.finditer(message):
        if match["flag"]:
            args = [[f"--{match['flag']}", match["arg"]]]
        elif match["choices"] is not None or match["up_to"] is not None:
            values = (match["choices"].split(", ") if match["choices"] is not None
                      else [str(n) for n in range(1, int(match["up_to"]) + 1)])
            values += ["0"] if match["auto"] else []
            args = [["--set", f"{match['key']}={v}"] for v in values]
        else:
            args = [["--set", f"{match['key']}={match['value']}"]]
            for more in re.findall(r" or ([\w.]+=[^\s,;()]+|\d+)", match["more"] or ""):
                args.append(["--set", more if "=" in more else f"{match['key']}={more}"])
        if len(args) == 1 and alternatives and match.start() == end + 1 and message[end] == " ":
            alternatives[-1] += args[0]  # --set a=1 --set b=2: one fix
        else:
            alternatives += args
        end = match.end()
    return alternatives


def test_the_parser_reads_the_refusals_grammar():
    assert suggestions("use --set a.b=N with N in {1, 3} (0 lets the planner choose), or --nodes 16") == [
        ["--set", "a.b=1"], ["--set", "a.b=3"], ["--set", "a.b=0"], ["--nodes", "16"]]
    assert suggestions("use --set t.g=960 or 1024; --set x.y=false or p.q=1 or drop p.r") == [
        ["--set", "t.g=960"], ["--set", "t.g=1024"], ["--set", "x.y=false"], ["--set", "p.q=1"]]
    assert suggestions("use --set p.t=0 --set p.p=0 (the planner then picks TP 8 x PP 2) or --set m.r=true") == [
        ["--set", "p.t=0", "--set", "p.p=0"], ["--set", "m.r=true"]]
    assert suggestions("use --set m.n=N with N <= 3; none (use --nodes 6 --set m.r=true)") == [
        ["--set", "m.n=1"], ["--set", "m.n=2"], ["--set", "m.n=3"], ["--nodes", "6", "--set", "m.r=true"]]
    assert suggestions("use --nodes a multiple of 16 (--nodes 16 plans); these rules allow p.t=N with N in {1}") == [
        ["--nodes", "16"]]


# (recipe, nodes, platform, overrides, what the refusal is about); each is refused, and names fixes that plan.
REFUSALS = {
    "memory, pinned TP on trn1": ("gpt3_6.7b", 1, "trn1", ["parallel.tensor=1"], "needs about"),
    "memory, pinned TP x PP on p5": ("gpt3_6.7b", 2, "p5", ["parallel.tensor=1", "parallel.pipeline=1",
                                                             "parallel.distributed_optimizer=true"], "81.9 GiB"),
    "memory, none fits at 3 p5 nodes": ("gpt3_175b", 3, "p5", ["parallel.pipeline=0"], "none fits at this size"),
    "memory, PP 1 pinned on trn2": ("gpt3_310.1b", 64, "trn2", ["parallel.pipeline=1"], "no TP x PP works"),
    "mesh does not divide the nodes (the issue's example)": ("gpt3_175b", 3, "p5", [], "does not divide the 24"),
    "mesh does not divide, PP fixes": ("gpt3_175b", 8, "p5", [], "does not divide the 64"),
    "mesh does not divide, 48 layers": ("gpt3_6.7b", 16, "p5", ["parallel.tensor=8", "parallel.pipeline=3",
                                                               "model.num_layers=48"], "use --nodes a multiple of 3"),
    "global batch does not divide": ("gpt3_6.7b", 16, "trn1", ["train.global_batch_size=1000"], "960 or 1024"),
    "global batch: the nearest multiples starve the stages": (
        "gpt3_6.7b", 16, "p5", ["parallel.tensor=8", "parallel.pipeline=4", "train.global_batch_size=6"],
        "is not divisible by micro_batch_size x DP"),
    "layers do not split into the stages": ("gpt3_6.7b", 16, "p5", ["parallel.pipeline=5"], "split evenly into 5"),
    "layers do not split into virtual stages": ("gpt3_6.7b", 16, "p5", ["parallel.pipeline=4",
                                                                       "parallel.virtual_pipeline=3"], "into 12"),
    "fewer micro-batches than stages": ("gpt3_6.7b", 16, "p5", ["parallel.tensor=8", "parallel.pipeline=4",
                                                               "train.global_batch_size=8"], "fewer than the 4"),
    "fewer micro-batches than the recipe's pinned stages (gpt3_175b at 512 trn1 nodes)": (
        "gpt3_175b", 512, "trn1", [], "(the planner then picks TP 16 x PP 32)"),
    "virtual stages without a pipeline": ("gpt3_6.7b", 16, "p5", ["parallel.pipeline=1",
                                                                 "parallel.virtual_pipeline=2"], "needs parallel."),
    "interleaved micro-batches": ("gpt3_6.7b", 16, "p5", ["parallel.tensor=8", "parallel.pipeline=2",
                                                         "parallel.virtual_pipeline=2", "train.global_batch_size=24"],
                                  "the interleaved schedule needs"),
    "TP not a runtime degree": ("gpt3_6.7b", 16, "trn1", ["parallel.tensor=3"], "parallel.tensor=3 is invalid"),
    "TP above the cpu platform's workers (a checkpoint imported at TP 2)": (
        "tiny", 1, "cpu", ["parallel.tensor=2"], ", or --set launch.workers_per_node=2 (keeps TP 2)"),
    "TP vs heads": ("tiny", 1, "cpu", ["launch.workers_per_node=4", "parallel.tensor=3"],
                    "must divide the 4 attention heads"),
    "sequence parallel without TP": ("gpt3_6.7b", 1, "trn1", ["parallel.sequence_parallel=true",
                                                              "parallel.tensor=1"], "needs tensor parallelism"),
    "sequence parallel with one key/value group": ("llama3_8b", 16, "p5", ["model.num_query_groups=1"],
                                                    "sequence_parallel needs TP above 1"),
    "sequence parallel at TP 1 with one key/value group": (
        "llama3_8b", 16, "p5", ["model.num_query_groups=1", "parallel.tensor=1"], "needs tensor parallelism"),
    "overlap_param_gather without the distributed optimizer": (
        "tiny", 1, "cpu", ["parallel.overlap_param_gather=true", "launch.workers_per_node=2"], "is false"),
    "overlap_param_gather under pipelining": (
        "gpt3_6.7b", 2, "p5", ["parallel.tensor=1", "parallel.pipeline=2", "parallel.distributed_optimizer=true",
                               "model.recompute=true", "parallel.overlap_param_gather=true"], "not supported"),
    "distributed optimizer in fp16 on XLA": ("gpt3_6.7b", 16, "trn1", ["parallel.distributed_optimizer=true",
                                                                       "train.precision=fp16"], "no fp16 path"),
    "recompute and selective": ("tiny", 1, "cpu", ["model.recompute=true", "model.recompute_granularity=selective"],
                                "drop model.recompute"),
    "recompute_method without full": ("tiny", 1, "cpu", ["model.recompute_method=block"], "applies only to full"),
    "uniform groups do not divide the stage": ("tiny", 1, "cpu", ["model.recompute_granularity=full",
                                                                  "model.recompute_num_layers=3"], "must divide"),
    "block beyond the stage": ("tiny", 1, "cpu", ["model.recompute_granularity=full", "model.recompute_method=block",
                                                  "model.recompute_num_layers=5"], "more than the 4 layers"),
    "unknown pipeline schedule": ("tiny", 1, "cpu", ["parallel.pipeline_schedule=gpipe"], "is not a schedule"),
    "global batch too small for the user's workers": ("gpt3_1.7b", 512, "trn1", ["launch.workers_per_node=32"],
                                                      "is too small for 16384 workers"),
}


def _args(recipe: str, nodes: int, platform: str, overrides: list[str]) -> list[str]:
    sets = [a for s in ["data.source=synthetic", *overrides] for a in ("--set", s)]
    return ["--recipe", recipe, "--nodes", str(nodes), "--platform", platform, *sets]


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_every_fix_a_refusal_prints_plans_when_fed_back(case, capsys):
    recipe, nodes, platform, overrides, about = REFUSALS[case]
    assert main(["plan", *_args(recipe, nodes, platform, overrides)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and about in err, err
    fixes = suggestions(err)
    assert fixes, err  # a refusal of this kind always names a way out: a fix, or the node count that plans
    for fix in fixes:
        assert main(["plan", *_args(recipe, nodes, platform, overrides), *fix]) == 0, (fix, err)
        capsys.readouterr()
    # the planner tried exactly what it printed: every printed fix is one it kept
    with pytest.raises(MegatronHpcError) as info:
        make_plan(load_recipe(recipe, ["data.source=synthetic", *overrides]), num_nodes=nodes,
                  platform=get_platform(platform))
    assert isinstance(info.value, FixableError) and str(info.value) in err
    if "none fits at this size" not in err:
        kept = [f.text().split() for f in info.value.fixes]
        assert all(fix in kept for fix in fixes), (fixes, kept)


def test_the_issues_example_names_the_nodes_and_no_pipeline_that_fails_on_memory():
    # gpt3_175b pins TP 8 x PP 16; on 3 p5 nodes PP 1 or 3 divide the workers but need 371 and 128 GiB per GPU.
    with pytest.raises(MegatronHpcError) as info:
        make_plan(load_recipe("gpt3_175b"), num_nodes=3, platform=get_platform("p5"))
    message = str(info.value)
    assert "use --nodes a multiple of 16 (--nodes 16 plans)" in message
    assert "parallel.pipeline" not in message
    for pipeline in (1, 3, 0):  # what the refusal used to offer: each fails
        with pytest.raises(MegatronHpcError):
            make_plan(load_recipe("gpt3_175b", [f"parallel.pipeline={pipeline}"]), num_nodes=3,
                      platform=get_platform("p5"))


def test_with_no_fix_that_plans_the_refusal_names_the_smallest_node_count_that_does():
    with pytest.raises(MegatronHpcError) as info:
        make_plan(load_recipe("gpt3_175b", ["parallel.pipeline=0"]), num_nodes=3, platform=get_platform("p5"))
    message = str(info.value)
    assert "none fits at this size (3 x p5); the smallest node count that plans it is " in message
    smallest = int(re.search(r"plans it is (\d+) \(use --nodes \1\)", message)[1])
    cfg = load_recipe("gpt3_175b", ["parallel.pipeline=0"])
    make_plan(cfg, num_nodes=smallest, platform=get_platform("p5"))
    for fewer in range(1, smallest):
        with pytest.raises(MegatronHpcError):
            make_plan(cfg, num_nodes=fewer, platform=get_platform("p5"))


def test_submits_own_refusal_names_fixes_that_submit(tmp_path, capsys):
    # gpt3_39.1b plans PP 4 on trn1; XLA cannot run a pipeline, so submit refuses and names TP alone or p5.
    args = _args("gpt3_39.1b", 16, "trn1", [])
    assert main(["submit", *args, "--dry-run", "--out", str(tmp_path / "refused")]) == 1
    err = capsys.readouterr().err.strip()
    assert "does not run on XLA" in err and "(the planner then picks TP 32 x PP 1)" in err
    fixes = suggestions(err)
    assert fixes == [["--set", "parallel.pipeline=1"], ["--platform", "p5"]]
    for i, fix in enumerate(fixes):
        assert main(["submit", *args, *fix, "--dry-run", "--out", str(tmp_path / str(i))]) == 0, fix
        capsys.readouterr()


def test_a_refusal_travels_between_processes_as_its_plain_type():
    import pickle

    with pytest.raises(MegatronHpcError) as info:
        make_plan(load_recipe("gpt3_175b"), num_nodes=3, platform=get_platform("p5"))
    copy = pickle.loads(pickle.dumps(info.value))
    assert type(copy).__name__ == "PlanError" and str(copy) == str(info.value)


def test_with_no_way_out_at_any_size_the_refusal_says_so():
    # 6 workers per node give DP 6 or 3 at the TP sizes tiny's 4 heads allow, too many replicas for its global batch
    # of 8 in micro-batches of 4 at any node count: no fix is printed (the batch is the next thing to change).
    cfg = load_recipe("tiny", ["launch.workers_per_node=6", "parallel.tensor=6"])
    with pytest.raises(MegatronHpcError) as info:
        make_plan(cfg, num_nodes=1, platform=get_platform("cpu"))
    searched = re.search(r"; none fits at this size \(1 x cpu\), nor at any node count up to (\d+)$", str(info.value))
    assert searched and int(searched[1]) >= 50, str(info.value)  # the search is bounded by its number of plans
    assert suggestions(str(info.value)) == []
    for tensor in (1, 2, 0):
        with pytest.raises(MegatronHpcError, match="global_batch_size=8"):
            make_plan(load_recipe("tiny", ["launch.workers_per_node=6", f"parallel.tensor={tensor}"]), num_nodes=1,
                      platform=get_platform("cpu"))

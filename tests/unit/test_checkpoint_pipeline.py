"""Pipeline-parallel checkpoints in one process: Megatron's mp_rank_XX_YYY layout, which weights each stage holds,
`ckpt reshard` to any TP x PP and back (weights and Adam's moments exact), mismatched loads refused, inspect.

The source is the trainer's real content: our GPT (build_model at TP=1 in a world of one) after one AdamW step,
packed by build_state_dict with the planner's resolved plan and config.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from megatron_hpc.checkpoint.conversion import optim_layout, pp_layout, read_whole, stream, tp_layout
from megatron_hpc.checkpoint.conversion.whole import write_whole
from megatron_hpc.checkpoint.store import (
    PipelineLayout,
    Progress,
    RankInfo,
    build_state_dict,
    check_before_queue,
    load_checkpoint,
    paths,
    read_manifest,
)
from megatron_hpc.cli.main import main
from megatron_hpc.config.schema import ModelConfig, OptimConfig, RunConfig, TrainConfig
from megatron_hpc.errors import CheckpointError
from megatron_hpc.parallel.context import ParallelContext
from megatron_hpc.plan.mesh import Mesh
from megatron_hpc.train.entry import plan_for_torchrun
from megatron_hpc.train.loop import build_model
from megatron_hpc.train.optim import build_adamw

VOCAB = 300  # padded to 320 at TP 1, 384 at TP 2, 512 at TP 4: every reshard re-pads


def _config(**model: Any) -> RunConfig:
    return RunConfig(name="tiny", model=ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4,
                                                    seq_length=16, max_position_embeddings=16, vocab_size=VOCAB,
                                                    make_vocab_size_divisible_by=64, **model),
                     train=TrainConfig(num_steps=10, micro_batch_size=2, global_batch_size=2),
                     optim=OptimConfig(lr=1e-2))


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ParallelContext]:
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    yield ParallelContext.build(Mesh(num_nodes=1, workers_per_node=1), rank=0)
    dist.destroy_process_group()


def _trained_state(ctx: ParallelContext, cfg: RunConfig) -> dict[str, Any]:
    """One TP=1 x PP=1 rank's checkpoint content after one real AdamW step."""
    spec = plan_for_torchrun(cfg, environ={})
    model = build_model(cfg.model, ctx, padded_vocab=spec.plan.padded_vocab_size, seed=3, device=torch.device("cpu"))
    optimizer = build_adamw(model, optim=cfg.optim)
    ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))
    logits = model(ids[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1)[:, :VOCAB], ids[:, 1:].flatten()).backward()
    optimizer.step()
    return build_state_dict(config=dataclasses.asdict(cfg), plan=spec.plan.to_json(),
                            model=dict(model.state_dict()), optimizer=optimizer.state_dict(),
                            progress=Progress(iteration=1, consumed_samples=2, lr_steps=1),
                            rng_per_dp_rank=[{"torch_rng_state": torch.get_rng_state()}])


@pytest.fixture(scope="module")
def source(ctx: ParallelContext, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    state = _trained_state(ctx, _config())
    root = tmp_path_factory.mktemp("src") / "ckpt"
    write_whole(root, 1, [[state]], fmt="xser")
    return root, read_whole(root).first  # as the file holds it (xser keeps tuples as lists)


def _layers(model: dict[str, torch.Tensor]) -> list[int]:
    return sorted({layer for layer in map(pp_layout.layer_of, model) if layer is not None})


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def _assert_same_optimizer(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for index, moments in want["state"].items():
        assert moments.keys() == got["state"][index].keys()
        for key, value in moments.items():
            assert torch.equal(got["state"][index][key], value), (index, key)


# ---------------------------------------------------------------------------------------------- layout

def test_megatron_rank_folder_names() -> None:
    assert paths.rank_dirname(3) == "mp_rank_03"
    assert paths.rank_dirname(3, 0, pp_size=1) == "mp_rank_03"
    assert paths.rank_dirname(3, 0, pp_size=2) == "mp_rank_03_000"  # every stage gets the suffix under PP
    assert paths.rank_dirname(1, 12, pp_size=16) == "mp_rank_01_012"
    assert paths.main_file(Path("/c/iter_0000007"), 0, 3, pp_size=4) == Path(
        "/c/iter_0000007/mp_rank_00_003/model_optim_rng.pt")


@pytest.mark.parametrize(("nodes", "per_node", "tp", "pp", "io"), [
    (1, 8, 2, 2, 2), (1, 4, 1, 2, 1), (2, 8, 2, 4, 1), (4, 8, 8, 4, 4), (2, 16, 2, 2, 3), (1, 8, 4, 1, 4)])
def test_pipeline_writers_are_staggered_by_their_index_on_the_node(nodes, per_node, tp, pp, io) -> None:
    """Each (tp, pp) pair's DP-rank-0 writer gets a phase; no phase has more than io_workers_per_node writers of a
    node; every rank counts the same phases, no more than the busiest node needs."""
    mesh = Mesh(num_nodes=nodes, workers_per_node=per_node, tensor_parallel=tp, pipeline_parallel=pp)
    infos = [RankInfo(rank=r, world_size=mesh.world_size, tp_size=tp, dp_size=mesh.data_parallel, pp_size=pp,
                      ranks_per_node=per_node, **{f"{d}_rank": c for d, c in mesh.coords(r).items()})
             for r in range(mesh.world_size)]
    writers = [i for i in infos if i.is_writer]
    assert sorted((i.tp_rank, i.pp_rank) for i in writers) == sorted((t, p) for t in range(tp) for p in range(pp))
    phases = {i.num_write_phases(io) for i in infos}
    assert len(phases) == 1
    count = phases.pop()
    busiest = max(sum(1 for w in writers if w.rank // per_node == n) for n in range(nodes))
    assert count == -(-busiest // io)
    for node in range(nodes):
        mine = [w.write_phase(io) for w in writers if w.rank // per_node == node]
        assert all(0 <= p < count for p in mine)
        assert all(mine.count(p) <= io for p in set(mine))


def test_manifest_without_pipeline_reads_as_one(tmp_path: Path) -> None:
    (tmp_path / paths.MANIFEST).write_text(json.dumps({
        "manifest_version": 2, "iteration": 5, "format": "xser", "tensor_parallel": 2, "data_parallel": 1,
        "world_size": 2, "files": {}}))
    m = read_manifest(tmp_path)
    assert (m.tensor_parallel, m.pipeline_parallel, m.virtual_pipeline) == (2, 1, 1)
    assert PipelineLayout.of_manifest(m) == PipelineLayout()


def test_stage_contents_follow_the_contract(source: tuple[Path, dict[str, Any]]) -> None:
    full = source[1]["model"]
    even = pp_layout.split_stages(full, layout=PipelineLayout(pipeline=2), num_layers=4)
    assert _layers(even[0]) == [0, 1] and _layers(even[1]) == [2, 3]
    assert {"wte.weight", "wpe.weight"} <= even[0].keys() and "ln_f.weight" not in even[0]
    # tied embeddings: the last stage holds its own wte.weight (Megatron's word_embeddings_for_head)
    assert {"wte.weight", "ln_f.weight", "ln_f.bias"} <= even[1].keys() and "wpe.weight" not in even[1]
    assert torch.equal(even[1]["wte.weight"], full["wte.weight"])
    virtual = pp_layout.split_stages(full, layout=PipelineLayout(pipeline=2, virtual=2), num_layers=4)
    assert _layers(virtual[0]) == [0, 2] and _layers(virtual[1]) == [1, 3]  # stage s on rank s % p
    uneven = pp_layout.split_stages(full, layout=PipelineLayout(pipeline=2, first_stage_layers=1), num_layers=4)
    assert _layers(uneven[0]) == [0] and _layers(uneven[1]) == [1, 2, 3]
    # merging is the union; a wrong copy of the tied embeddings is caught
    _assert_same(pp_layout.merge_stages(virtual, num_layers=4), full)
    bad = [dict(s) for s in even]
    bad[1]["wte.weight"] = bad[1]["wte.weight"] + 1e-3
    with pytest.raises(CheckpointError, match="tied word embeddings of pipeline ranks 0 and 1 differ"):
        pp_layout.merge_stages(bad)
    with pytest.raises(CheckpointError, match=r"missing \[2, 3\]"):
        pp_layout.merge_stages(even[:1], num_layers=4)


def test_untied_head_lives_on_the_last_stage_only(ctx: ParallelContext) -> None:
    full = _trained_state(ctx, _config(tie_embeddings=False, position_embedding="rope"))["model"]
    stages = pp_layout.split_stages(full, layout=PipelineLayout(pipeline=4), num_layers=4)
    assert [n for n in stages[0] if pp_layout.layer_of(n) is None] == ["wte.weight"]  # rope: no wpe
    assert [n for n in stages[3] if pp_layout.layer_of(n) is None] == ["ln_f.weight", "ln_f.bias", "lm_head.weight"]
    assert all(pp_layout.layer_of(n) == 1 for n in stages[1]) and all(pp_layout.layer_of(n) == 2 for n in stages[2])
    _assert_same(pp_layout.merge_stages(stages, num_layers=4), full)


# ---------------------------------------------------------------------------------------------- reshard

def test_reshard_to_tp2_pp2_and_back_is_exact(source: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    root, original = source
    result = stream.reshard(stream.in_memory(read_whole(root)), tp=2, pp=2, out=tmp_path / "tp2pp2")
    assert (result.from_tp, result.to_tp, result.from_pp, result.to_pp, result.optimizer) == (1, 2, 1, 2, "resharded")
    folder = tmp_path / "tp2pp2" / "iter_0000001"
    assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    m = read_manifest(folder)
    assert (m.tensor_parallel, m.pipeline_parallel, m.world_size) == (2, 2, 4)
    mid = read_whole(tmp_path / "tp2pp2")
    for row in mid.grid:
        for state in row:
            assert state["resolved_config"]["parallel"]["tensor"] == 2
            assert state["resolved_config"]["parallel"]["pipeline"] == 2
            assert (state["resolved_plan"]["tensor_parallel"], state["resolved_plan"]["pipeline_parallel"]) == (2, 2)
            assert (state["tensor_model_parallel_size"], state["pipeline_model_parallel_size"]) == (2, 2)
            assert state["padded_vocab_size"] == 384
    # each rank holds its stage's weights, split over TP, and their Adam moments split the same way
    stage1_tp1 = mid.grid[1][1]
    full = original["model"]
    for name, tensor in stage1_tp1["model"].items():
        assert pp_layout.layer_of(name) in (2, 3, None) and name not in ("wpe.weight",)
        want = full[name]
        if name == "wte.weight":
            want = tp_layout.repad_vocab(want, vocab_size=VOCAB, padded=384)
        assert torch.equal(tensor, tp_layout.split(name, want, 2)[1]), name
    want_moments = optim_layout.by_name(full, original["optimizer"])
    got_moments = optim_layout.by_name(stage1_tp1["model"], stage1_tp1["optimizer"])
    assert got_moments.keys() == stage1_tp1["model"].keys()
    assert torch.equal(got_moments["h.3.attn.proj.weight"]["exp_avg_sq"],
                       tp_layout.split("h.3.attn.proj.weight", want_moments["h.3.attn.proj.weight"]["exp_avg_sq"],
                                       2)[1])
    # and back to TP 1 x PP 1: every weight, every moment, the same groups
    back = stream.reshard(stream.in_memory(mid), tp=1, pp=1, out=tmp_path / "back")
    assert (back.from_tp, back.from_pp, back.optimizer) == (2, 2, "resharded")
    again = read_whole(tmp_path / "back")
    assert (again.tensor_parallel, again.pipeline_parallel) == (1, 1)
    assert [p.name for p in (tmp_path / "back" / "iter_0000001").iterdir() if p.is_dir()] == ["mp_rank_00"]
    _assert_same(again.first["model"], original["model"])
    _assert_same_optimizer(again.first["optimizer"], original["optimizer"])


def test_reshard_chain_through_other_sizes(source: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """TP1 PP1 -> TP2 PP4 -> TP1 PP2 (virtual 2) -> TP4 PP2 (uneven) -> TP1 PP1 gives the original back."""
    root, original = source
    steps = [dict(tp=2, pp=4), dict(tp=1, pp=2, virtual=2), dict(tp=4, pp=2, first_stage_layers=3), dict(tp=1, pp=1)]
    src = root
    for i, sizes in enumerate(steps):
        out = tmp_path / f"step{i}"
        assert stream.reshard(stream.in_memory(read_whole(src)), out=out, **sizes).optimizer == "resharded"
        whole = read_whole(out)
        assert (whole.tensor_parallel, whole.pipeline_parallel) == (sizes["tp"], sizes["pp"])
        layout = whole.layout
        assert (layout.virtual, layout.first_stage_layers) == (sizes.get("virtual", 1),
                                                               sizes.get("first_stage_layers", 0))
        parallel = whole.first["resolved_config"]["parallel"]
        assert (parallel["virtual_pipeline"], parallel["pipeline_first_stage_layers"]) == (
            layout.virtual, layout.first_stage_layers)
        src = out
    final = read_whole(src)
    _assert_same(final.first["model"], original["model"])
    _assert_same_optimizer(final.first["optimizer"], original["optimizer"])


def test_resharded_checkpoint_loads_into_the_trainers_model_and_optimizer(
        source: tuple[Path, dict[str, Any]], ctx: ParallelContext, tmp_path: Path) -> None:
    """What Checkpointer.restore does, on a TP 1 x PP 1 checkpoint that went through TP 2 x PP 2."""
    root, original = source
    stream.reshard(stream.in_memory(read_whole(root)), tp=2, pp=2, out=tmp_path / "mid")
    stream.reshard(stream.in_memory(read_whole(tmp_path / "mid")), tp=1, pp=1, out=tmp_path / "back")
    _, state = load_checkpoint(tmp_path / "back", ranks=RankInfo())
    cfg = _config()
    model = build_model(cfg.model, ctx, padded_vocab=state["padded_vocab_size"], seed=99, device=torch.device("cpu"))
    optimizer = build_adamw(model, optim=cfg.optim)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(optim_layout.for_model(state["optimizer"], saved_model=state["model"],
                                                     live_model=model.state_dict()))
    _assert_same(dict(model.state_dict()), original["model"])
    _assert_same_optimizer(optimizer.state_dict(), original["optimizer"])


def test_optimizer_follows_names_into_a_model_listing_them_otherwise(source: tuple[Path, dict[str, Any]]) -> None:
    """A stage module may list the tied embedding copy after the head; restore renumbers the moments by name."""
    _, original = source
    stage = pp_layout.split_stages(original["model"], layout=PipelineLayout(pipeline=2), num_layers=4)[1]
    moments = optim_layout.by_name(original["model"], original["optimizer"])
    groups = optim_layout.group_template(original["optimizer"], original["model"])
    saved_opt = optim_layout.indexed({n: moments[n] for n in stage}, model=stage, groups=groups)
    live = {n: stage[n] for n in [*[k for k in stage if k != "wte.weight"], "wte.weight"]}
    renumbered = optim_layout.for_model(saved_opt, saved_model=stage, live_model=live)
    assert renumbered is not saved_opt
    assert optim_layout.by_name(live, renumbered).keys() == live.keys()
    for name, m in optim_layout.by_name(live, renumbered).items():
        assert torch.equal(m["exp_avg"], moments[name]["exp_avg"]), name
    # the positions really moved: wte.weight was the first matrix, now it is the last
    assert torch.equal(renumbered["state"][0]["exp_avg"], moments["h.2.attn.qkv.weight"]["exp_avg"])
    assert optim_layout.for_model(saved_opt, saved_model=stage, live_model=stage) is saved_opt


# ---------------------------------------------------------------------------------------------- refusals

def test_loading_at_another_pipeline_size_is_refused_with_the_fix(source: tuple[Path, dict[str, Any]],
                                                                 tmp_path: Path) -> None:
    root, _ = source
    stream.reshard(stream.in_memory(read_whole(root)), tp=1, pp=4, out=tmp_path / "pp4")
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path / "pp4", ranks=RankInfo(pp_size=2))
    message = str(err.value)
    assert "\n" not in message
    assert "saved at tp 1 x pp 4 but this run has tp 1 x pp 2" in message
    assert (f"`megatron-hpc ckpt reshard {tmp_path / 'pp4' / 'iter_0000001'} --tp 1 --pp 2 --out "
            f"{tmp_path / 'pp4-tp1-pp2'}`") in message
    # the same check before queueing, from the tracker and manifest alone
    with pytest.raises(CheckpointError, match="--tp 1 --pp 2 --out"):
        check_before_queue(tmp_path / "pp4", tensor_parallel=1, layout=PipelineLayout(pipeline=2))
    check_before_queue(tmp_path / "pp4", tensor_parallel=1, layout=PipelineLayout(pipeline=4))
    check_before_queue(tmp_path / "nothing-there", tensor_parallel=1, layout=PipelineLayout(pipeline=2))
    # same pipeline size, other virtual stages: the files hold other layers, refused too
    with pytest.raises(CheckpointError, match="--tp 1 --pp 4 --virtual-pipeline 2 --out"):
        load_checkpoint(tmp_path / "pp4", ranks=RankInfo(pp_size=4), layout=PipelineLayout(pipeline=4, virtual=2))
    # and the command it prints works: the resharded checkpoint loads at pp 2
    assert main(["ckpt", "reshard", str(tmp_path / "pp4" / "iter_0000001"), "--tp", "1", "--pp", "2"]) == 0
    found, state = load_checkpoint(tmp_path / "pp4-tp1-pp2", ranks=RankInfo(pp_size=2, pp_rank=1))
    assert found.manifest.pipeline_parallel == 2
    assert _layers(state["model"]) == [2, 3]


def test_each_rank_reads_its_own_file(source: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    root, original = source
    stream.reshard(stream.in_memory(read_whole(root)), tp=2, pp=2, out=tmp_path / "grid")
    for pp_rank in range(2):
        for tp_rank in range(2):
            _, state = load_checkpoint(tmp_path / "grid", ranks=RankInfo(tp_size=2, tp_rank=tp_rank, pp_size=2,
                                                                          pp_rank=pp_rank))
            layers = _layers(state["model"])
            assert layers == [2 * pp_rank, 2 * pp_rank + 1]
            qkv = f"h.{layers[0]}.attn.qkv.weight"
            assert torch.equal(state["model"][qkv], tp_layout.split(qkv, original["model"][qkv], 2)[tp_rank])


def test_reshard_bad_sizes_are_refused(source: tuple[Path, dict[str, Any]], tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    root, _ = source
    for args, expected in ((["--pp", "3"], "do not split as pp 3"), (["--pp", "2", "--virtual-pipeline", "4"],
                                                                     "do not split as pp 2 x virtual 4"),
                           (["--tp", "3"], "--tp in [1, 2, 4]"), ([], "--tp N and/or --pp M")):
        assert main(["ckpt", "reshard", str(root), *args, "--out", str(tmp_path / "x")]) == 1
        err = capsys.readouterr().err
        assert expected in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------------------------------------- CLI

def test_reshard_and_inspect_cli(source: tuple[Path, dict[str, Any]], tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    root, _ = source
    out = tmp_path / "cli"
    assert main(["ckpt", "reshard", str(root), "--tp", "2", "--pp", "2", "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["from_tp"], report["to_tp"], report["from_pp"], report["to_pp"], report["optimizer"]) == (
        1, 2, 1, 2, "resharded")
    assert main(["ckpt", "inspect", str(out), "--json", "--verify"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["tensor_parallel"], summary["pipeline_parallel"], summary["virtual_pipeline"]) == (2, 2, 1)
    assert {(r["tp_rank"], r["pp_rank"]) for r in summary["tensors"]} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert {r["name"] for r in summary["tensors"] if r["pp_rank"] == 1 and r["name"].startswith("model.h.")} == {
        r["name"] for r in summary["tensors"] if r["name"].startswith("model.h.2.") or r["name"].startswith(
            "model.h.3.")}
    assert main(["ckpt", "inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "mesh        tp 2 pp 2 dp 1 world 4" in text and "[tp 1 pp 1] model.h.3.ln_1.weight" in text
    # --pp alone keeps the TP size; the default output folder says the new sizes
    assert main(["ckpt", "reshard", str(out), "--pp", "1"]) == 0
    assert "from tp 2 x pp 2 to tp 2 x pp 1" in capsys.readouterr().out
    assert read_whole(tmp_path / "cli-tp2").pipeline_parallel == 1
    assert main(["ckpt", "inspect", str(root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pipeline_parallel"] == 1

"""submit's compile-skip decision against a real shared cache folder (dry runs): the one line it prints, what
counts as "the cache holds this fingerprint", and the node script a skipped submit writes."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_hpc.compile_cache import fingerprint

from megatron_hpc.cli.main import main
from megatron_hpc.run_folder import FINGERPRINT_FILE

# On CPU a compile phase exists only with torch.compile (without it there is nothing to compile).
SETS = ["--set", "data.source=synthetic", "--set", "train.compile=true"]


def dry_run(capsys, out: Path, *extra: str, as_json: bool = True) -> dict | str:
    capsys.readouterr()
    args = ["submit", "--recipe", "tiny", "--cluster", "local", "--dry-run", "--out", str(out), *SETS, *extra]
    assert main([*args, "--json"] if as_json else args) == 0
    text = capsys.readouterr().out
    return json.loads(text) if as_json else text


def record(cache_root: Path, run_dir: Path, job_id: str = "4242") -> None:
    """What the node script does on node 0 after a compile phase that succeeded and published."""
    fp = json.loads((run_dir / FINGERPRINT_FILE).read_text())
    fingerprint.record(cache_root, fp, run_dir=str(run_dir), job_id=job_id)


def test_a_cold_cache_keeps_the_compile_phase(tmp_path, capsys, own_compile_cache):
    first = dry_run(capsys, tmp_path / "first")
    assert first["compile_skipped"] is False and len(first["fingerprint"]) == 64
    assert (tmp_path / "first" / "compile.sbatch").exists()
    assert "afterok" in (tmp_path / "first" / "run.sbatch").read_text()
    assert not (own_compile_cache / fingerprint.MARKER_DIR).exists()  # a dry run records nothing


def test_the_skip_is_said_in_one_line_naming_cache_fingerprint_run_and_the_way_out(tmp_path, capsys, own_compile_cache):
    first = dry_run(capsys, tmp_path / "first")
    record(own_compile_cache, tmp_path / "first")

    text = dry_run(capsys, tmp_path / "second", as_json=False)
    (line,) = [ln for ln in text.splitlines() if "skipped" in ln]
    assert line == (f"compile phase skipped: the shared cache at {own_compile_cache} already holds fingerprint "
                    f"{first['fingerprint'][:12]} (compiled by run {tmp_path / 'first'}); --recompile forces it")
    assert "run.sbatch" in text and "compile.sbatch" not in text
    assert not (tmp_path / "second" / "compile.sbatch").exists()
    submit_sh = (tmp_path / "second" / "submit.sh").read_text()
    assert "run.sbatch" in submit_sh and "compile.sbatch" not in submit_sh and "dependency" not in submit_sh


def test_only_the_marker_in_this_runs_shared_cache_counts(tmp_path, capsys, own_compile_cache, monkeypatch):
    dry_run(capsys, tmp_path / "first")
    elsewhere = tmp_path / "another-cache"
    record(elsewhere, tmp_path / "first")
    assert dry_run(capsys, tmp_path / "second")["compile_skipped"] is False
    monkeypatch.setenv("MEGATRON_HPC_CACHE_DIR", str(elsewhere))
    assert dry_run(capsys, tmp_path / "third")["compile_skipped"] is True


def test_a_damaged_marker_does_not_skip(tmp_path, capsys, own_compile_cache):
    first = dry_run(capsys, tmp_path / "first")
    marker = fingerprint.marker_path(own_compile_cache, first["fingerprint"])
    marker.parent.mkdir(parents=True)
    marker.write_text('{"sha256": "' + first["fingerprint"][:20])  # cut short, as by a full disk
    assert dry_run(capsys, tmp_path / "second")["compile_skipped"] is False


def test_a_graph_change_recompiles_and_recompile_forces_it(tmp_path, capsys, own_compile_cache):
    first = dry_run(capsys, tmp_path / "first")
    record(own_compile_cache, tmp_path / "first")
    same_graphs = dry_run(capsys, tmp_path / "lr", "--set", "optim.lr=3e-4", "--set", "train.num_steps=7")
    assert same_graphs["compile_skipped"] is True and same_graphs["fingerprint"] == first["fingerprint"]
    for i, change in enumerate(["train.micro_batch_size=2", "model.num_layers=2", "train.precision=bf16"]):
        changed = dry_run(capsys, tmp_path / f"c{i}", "--set", change)
        assert changed["compile_skipped"] is False and changed["fingerprint"] != first["fingerprint"], change
    forced = dry_run(capsys, tmp_path / "forced", "--recompile")
    assert forced["compile_skipped"] is False and (tmp_path / "forced" / "compile.sbatch").exists()


def test_a_skipped_submit_still_syncs_the_shared_cache_before_the_run(tmp_path, capsys, own_compile_cache):
    dry_run(capsys, tmp_path / "first")
    record(own_compile_cache, tmp_path / "first")
    second = dry_run(capsys, tmp_path / "second")
    assert second["compile_skipped"] is True
    node = (tmp_path / "second" / "node.sh").read_text()
    assert f"SHARED_CACHE={own_compile_cache}\n" in node
    assert 'cache_transfer sync "$SHARED_CACHE" "$LOCAL_CACHE"' in node
    assert 'export TORCHINDUCTOR_CACHE_DIR="$LOCAL_CACHE/inductor"' in node


def test_a_disabled_compile_phase_is_not_reported_as_skipped(tmp_path, capsys, own_compile_cache):
    first = dry_run(capsys, tmp_path / "first")
    record(own_compile_cache, tmp_path / "first")
    off = dry_run(capsys, tmp_path / "off", "--set", "compile.enabled=false")
    assert off["compile_skipped"] is False and off["compile_left_out"] == "compile.enabled is false"
    assert not (tmp_path / "off" / "compile.sbatch").exists()
    assert off["fingerprint"] == first["fingerprint"]  # whether a compile phase runs does not change the graphs


def test_a_run_that_compiles_nothing_is_left_out_not_skipped(tmp_path, capsys, own_compile_cache):
    first = dry_run(capsys, tmp_path / "first", "--set", "train.compile=false")
    record(own_compile_cache, tmp_path / "first")  # even a marker for these very graphs
    again = dry_run(capsys, tmp_path / "again", "--set", "train.compile=false")
    assert again["fingerprint"] == first["fingerprint"]
    assert again["compile_skipped"] is False and again["compile_left_out"].startswith("nothing to compile")
    assert not (tmp_path / "again" / "compile.sbatch").exists()

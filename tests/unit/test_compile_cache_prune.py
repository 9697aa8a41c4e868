"""Pruning, clearing failures, verify and publish/sync on stand-in cache trees (tests/fixtures/fake_neuron_cache.py).

Each tree holds a sentinel file and symlinks that point outside the root; they must survive byte for byte.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from pathlib import Path

import pytest

from megatron_hpc.cli.main import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
import fake_neuron_cache as fake

DAY = 86400.0


@pytest.fixture
def tree(tmp_path):
    """root with 3 complete entries idle 30/20/10 days, a failed and a locked one; data outside the root."""
    root, outside = tmp_path / "cache", tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.bin").write_bytes(b"outside data" * 1000)
    now = time.time()
    keys = {}
    for i, (state, idle_days) in enumerate([("complete", 30), ("complete", 20), ("complete", 10),
                                            ("failed", 40), ("locked", 50)]):
        name = fake.module_name(i)
        fake.write_entry(root, version=fake.VERSION, name=name, files=fake.entry_files(state, seed=i, neff_size=10_000),
                         mtime=now - idle_days * DAY)
        keys[(state, idle_days)] = f"neuronxcc-{fake.VERSION}/{name}"
    version_dir = root / f"neuronxcc-{fake.VERSION}"
    # a symlinked "entry" and a symlink inside an entry, both leading outside; plus a sentinel in the root
    (version_dir / f"MODULE_{'f' * 20}+{fake.FLAGS_HASH}").symlink_to(outside, target_is_directory=True)
    old_entry = root / keys[("complete", 30)]
    (old_entry / "extra-link").symlink_to(outside / "precious.bin")
    (root / "SENTINEL").write_text("keep me")
    for p in [old_entry / "extra-link", old_entry]:
        os.utime(p, (now - 30 * DAY, now - 30 * DAY), follow_symlinks=False)
    return root, outside, keys


def _outside_intact(root: Path, outside: Path) -> None:
    assert (outside / "precious.bin").read_bytes() == b"outside data" * 1000
    assert (root / "SENTINEL").read_text() == "keep me"
    link = root / f"neuronxcc-{fake.VERSION}" / f"MODULE_{'f' * 20}+{fake.FLAGS_HASH}"
    assert link.is_symlink() and os.readlink(link) == str(outside)


def _keys(root: Path) -> set[str]:
    return {f"{p.parent.name}/{p.name}" for p in root.glob("neuronxcc-*/MODULE_*") if not p.is_symlink()}


def test_prune_older_than_removes_idle_entries_but_never_locked_or_outside(tree, capsys):
    root, outside, keys = tree
    assert main(["cache", "prune", "--root", str(root), "--older-than", "15d", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["removed"]) == {keys[("complete", 30)], keys[("complete", 20)], keys[("failed", 40)]}
    assert out["kept_locked"] == [keys[("locked", 50)]]
    assert _keys(root) == {keys[("complete", 10)], keys[("locked", 50)]}
    _outside_intact(root, outside)


def test_prune_max_size_removes_least_recently_used_first(tree, capsys):
    root, outside, keys = tree
    sizes = {k: sum(p.lstat().st_size for p in (root / k).iterdir()) for k in keys.values()}
    locked, newest = keys[("locked", 50)], keys[("complete", 10)]
    budget = sizes[locked] + sizes[newest]  # room for exactly the newest entry next to the locked one
    assert main(["cache", "prune", "--root", str(root), "--max-size", str(budget), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # oldest first: failed (40 d), then complete 30 d, then 20 d; the locked one is kept but counted
    assert out["removed"] == [keys[("failed", 40)], keys[("complete", 30)], keys[("complete", 20)]]
    assert out["bytes_left"] == budget
    assert _keys(root) == {newest, locked}
    _outside_intact(root, outside)


def test_prune_dry_run_removes_nothing(tree, capsys):
    root = tree[0]
    before = _keys(root)
    assert main(["cache", "prune", "--root", str(root), "--max-size", "0", "--dry-run"]) == 0
    assert "would remove" in capsys.readouterr().out
    assert _keys(root) == before


def test_clear_failed_and_verify(tree, capsys):
    root, outside, keys = tree
    version_dir = root / f"neuronxcc-{fake.VERSION}"
    leftover = version_dir / ".MODULE_abc+d41d8cd9.tmp.other-host.123.beef"
    leftover.mkdir()
    (leftover / "model.neff").write_bytes(b"partial")
    os.utime(leftover, (time.time() - 2 * 3600,) * 2)
    fresh = version_dir / ".MODULE_abd+d41d8cd9.tmp.other-host.124.beef"
    fresh.mkdir()
    assert main(["cache", "verify", "--root", str(root), "--json"]) == 1  # failed entry, symlinks
    out = json.loads(capsys.readouterr().out)
    assert out["leftovers_removed"] == [str(leftover)]
    assert not leftover.exists() and fresh.exists()  # a young temp may belong to a live publisher elsewhere
    whats = {p["what"].split(":")[0] for p in out["problems"]}
    assert "cached compile failure" in whats and "symlink inside the cache (never followed)" in whats
    assert main(["cache", "clear-failed", "--root", str(root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["removed"] == [keys[("failed", 40)]]
    assert keys[("failed", 40)] not in _keys(root)
    _outside_intact(root, outside)


def test_publish_then_sync_copies_only_complete_entries(tree, tmp_path, capsys):
    local, outside, keys = tree
    shared, other_local = tmp_path / "shared", tmp_path / "node2"
    # the 30-day entry holds a symlink to outside data: refused (exit 1), never followed; the others go
    assert main(["cache", "publish", "--from", str(local), "--to", str(shared), "--group-writable", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    complete = {k for (state, days), k in keys.items() if state == "complete" and days != 30}
    assert set(out["copied"]) == complete
    assert list(out["refused"]) == [keys[("complete", 30)]]
    assert "not a regular file" in out["refused"][keys[("complete", 30)]]
    assert set(out["not_complete"]) == {keys[("failed", 40)], keys[("locked", 50)]}
    assert _keys(shared) == complete
    for key in complete:
        src = {p.name: p.read_bytes() for p in (local / key).iterdir() if p.is_file() and not p.is_symlink()}
        assert {p.name: p.read_bytes() for p in (shared / key).iterdir()} == src
        mode = (shared / key).stat().st_mode
        assert mode & stat.S_IWGRP and mode & stat.S_ISGID
        assert (shared / key / "model.neff").stat().st_mode & stat.S_IWGRP
    assert not list(shared.glob("neuronxcc-*/.*"))  # no temp dirs left
    # without the link the entry goes too; the rest is already there
    (local / keys[("complete", 30)] / "extra-link").unlink()
    assert main(["cache", "publish", "--from", str(local), "--to", str(shared), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["copied"] == [keys[("complete", 30)]] and set(out["already_there"]) == complete
    complete.add(keys[("complete", 30)])
    assert main(["cache", "sync", "--from", str(shared), "--to", str(other_local), "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)["copied"]) == complete
    assert _keys(other_local) == complete
    assert (outside / "precious.bin").read_bytes() == b"outside data" * 1000


@pytest.mark.parametrize(("argv", "message"), [
    (["prune"], "needs --older-than"),
    (["publish", "--from", "/nonexistent/x", "--to", "/tmp/y"], "not a directory"),
])
def test_errors_say_what_to_do(argv, message, tmp_path, capsys):
    if argv[0] == "prune":
        argv = [*argv, "--root", str(tmp_path)]
    assert main(["cache", *argv]) == 1
    assert message in capsys.readouterr().err


def test_bad_duration_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["cache", "prune", "--older-than", "7 days"])
    assert exc.value.code == 2

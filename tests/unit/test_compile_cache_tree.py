"""compile_cache/tree.py and layouts.py in one process: what a tree publish copies, skips and refuses, and how
the launcher layout splits a cache root. Concurrency and kills: tests/multiprocess/test_compile_tree_publish.py."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from megatron_hpc.compile_cache import layouts, tree

from megatron_hpc.cli.main import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
import fake_neuron_cache as fake


def _write(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def _files(root: Path) -> dict[str, bytes]:
    return {str(Path(d, n).relative_to(root)): Path(d, n).read_bytes() for d, _, names in os.walk(root) for n in names}


SHAREABLE = {"ab/cab.py": b"code", "ab/cab.so": b"\x7fELF...", "fxgraph/xy/fkey/h1": b"graph",
             "aotautograd/akey/h2": b"split", "kernels/k1/kernel.so": b"k", "kernels/k1/__grp__kernel.json": b"{}"}
NEVER = {"locks/cab.lock": b"", "ab/.123.456.tmp": b"half", "kernels/tmp.pid_9_x/kernel.so": b"half",
         ".hidden/file": b"x"}


def test_publish_copies_the_files_and_skips_locks_and_temps(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    _write(src, {**SHAREABLE, **NEVER})
    report = tree.transfer(src, dst)
    assert sorted(report.copied) == sorted(SHAREABLE)
    assert report.bytes_copied == sum(len(v) for v in SHAREABLE.values())
    assert _files(dst) == SHAREABLE

    again = tree.transfer(src, dst)
    assert again.copied == [] and sorted(again.already_there) == sorted(SHAREABLE)


def test_an_existing_file_is_never_replaced(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    _write(src, {"ab/cab.py": b"new bytes"})
    _write(dst, {"ab/cab.py": b"what a reader may have open"})
    report = tree.transfer(src, dst)
    assert report.already_there == ["ab/cab.py"]
    assert (dst / "ab" / "cab.py").read_bytes() == b"what a reader may have open"


def test_group_files_come_after_the_files_of_their_folder(tmp_path):
    _write(tmp_path, {"k/__grp__a.json": b"", "k/a.so": b"", "k/z.json": b"", "k/__grp__b.json": b""})
    (folder,) = [f for f in tree.walk(tmp_path).folders if f.rel == "k"]
    assert folder.files == ["a.so", "z.json", "__grp__a.json", "__grp__b.json"]


def test_leftover_of_a_dead_publisher_is_swept_and_a_live_ones_is_kept(tmp_path):
    dead_pid = 2 ** 22 + 12345  # above the default pid_max: no such process
    dead = tmp_path / "ab" / f".cab.py.tmp.{os.uname().nodename}.{dead_pid}.abcd1234"
    live = tmp_path / "ab" / f".cab.so.tmp.{os.uname().nodename}.{os.getpid()}.abcd1234"
    _write(tmp_path, {"ab/cab.py": b"x", f"ab/{dead.name}": b"half", f"ab/{live.name}": b"half"})
    assert tree.clean_leftovers(tmp_path) == [dead]
    assert not dead.exists() and live.exists() and (tmp_path / "ab" / "cab.py").exists()


def test_launcher_layout_shares_neuron_and_inductor_but_not_triton_or_fingerprints(tmp_path, capsys):
    src, dst = tmp_path / "local", tmp_path / "shared"
    name = fake.module_name(1)
    fake.write_entry(src / "neuron", version=fake.VERSION, name=name, files=fake.entry_files("complete", seed=1))
    fake.write_entry(src / "neuron", version=fake.VERSION, name=fake.module_name(2),
                     files=fake.entry_files("failed", seed=2))
    _write(src / "inductor", {"ab/cab.py": b"code"})
    _write(src / "triton", {"KEY/kernel.so": b"k", "KEY/__grp__kernel.json": b'{"child_paths": {}}'})
    _write(src / "megatron-hpc" / "fingerprints", {"abc.json": b"{}"})

    capsys.readouterr()
    assert main(["cache", "publish", "--layout", "launcher", "--from", str(src), "--to", str(dst), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"neuron", "inductor"}
    assert report["neuron"]["copied"] == [f"neuronxcc-{fake.VERSION}/{name}"]
    assert len(report["neuron"]["not_complete"]) == 1
    assert report["inductor"]["copied"] == ["ab/cab.py"]
    assert sorted(p.name for p in dst.iterdir()) == ["inductor", "neuron"]


def test_launcher_sync_from_a_cache_nobody_published_to_copies_nothing(tmp_path, capsys):
    assert layouts.transfer(tmp_path / "never-written", tmp_path / "local", layout="launcher") == {}
    assert main(["cache", "sync", "--layout", "launcher", "--from", str(tmp_path / "never-written"),
                 "--to", str(tmp_path / "local")]) == 0
    assert "nothing to copy" in capsys.readouterr().out


def test_quiet_transfers_say_only_what_they_copied(tmp_path, capsys):
    """What the node script runs before and after each phase: silent when there was nothing to do."""
    src, dst = tmp_path / "local", tmp_path / "shared"
    _write(src / "inductor", {"ab/cab.py": b"code"})
    args = ["cache", "publish", "--quiet", "--layout", "launcher", "--from", str(src), "--to", str(dst)]
    capsys.readouterr()
    assert main(args) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("inductor: 1 copied (") and line.endswith(" 0 refused")
    assert main(args) == 0  # everything already there
    assert capsys.readouterr().out == ""
    assert main(["cache", "sync", "--quiet", "--layout", "launcher", "--from", str(tmp_path / "never-written"),
                 "--to", str(tmp_path / "x")]) == 0
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("action", ["verify", "ls", "stats"])
def test_a_tree_needs_a_root_and_a_launcher_root_defaults_to_the_shared_cache(action, capsys, own_compile_cache):
    assert main(["cache", action, "--layout", "tree"]) == 1
    assert "needs --root" in capsys.readouterr().err
    _write(own_compile_cache / "inductor", {"ab/cab.py": b"code"})
    assert main(["cache", action, "--layout", "launcher", "--json"]) == 0
    captured = capsys.readouterr()
    assert f"cache root {own_compile_cache} (the shared compile cache of submit)" in captured.err
    out = json.loads(captured.out)
    if action == "ls":
        assert [row["key"] for row in out] == ["inductor/ab/cab.py"]
    else:
        assert out["entries"] == 1

"""`cache ls | stats | verify | prune --layout tree|launcher` on a TorchInductor-shaped cache built by hand.

The shape is the one torch 2.13's Inductor wrote here for a small compiled function with
TORCHINDUCTOR_CACHE_DIR, FX graph and AOTAutograd caches on (a real compile takes about 20 s on this machine, too
slow for a unit test): bucket folders `<2 chars>/c<hash>.py|.cpp|.so|.main.cpp|.main.so`,
`fxgraph/<2>/f<key>/<hash>`, `aotautograd/a<key>/<hash>`, `locks/c<hash>.lock`; plus a Triton kernel folder as
Inductor keeps it (`triton/<device>/<hash>/` with the kernel's files and `__grp__<name>.json` naming them).
Temp files, a temp folder, symlinks that lead outside the root and a sentinel outside it must survive every command.
Expected entries, sizes and orders come from the tree built here, never from the code under test.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from megatron_hpc.compile_cache import fingerprint, tree

from megatron_hpc.cli.main import main
from megatron_hpc.errors import CompileCacheError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
import fake_neuron_cache as fake

DAY = 86400.0
KERNEL = "triton/0/TK3QJ5ZLGA7Q"
# rel path -> (size, idle days); each file is one entry, except the Triton folder (one entry, idle = newest file)
FILES = {
    "cg/ccgqnl5xzf5vlq752w5m3ownv3mpgsbifedv5j4g5nk4a425npdh.main.cpp": (2_000, 40),
    "cg/ccgqnl5xzf5vlq752w5m3ownv3mpgsbifedv5j4g5nk4a425npdh.main.so": (30_000, 40),
    "th/cthddkr6tqpvvx2keoyfjfaz3e5tmldioaoosvrbpzssty5wzlrd.cpp": (1_500, 25),
    "th/cthddkr6tqpvvx2keoyfjfaz3e5tmldioaoosvrbpzssty5wzlrd.so": (20_000, 25),
    "yw/cywfd4tyekbc6dkqh4derdk65fgzypia4dbfozpcahrbzhfdg3jm.py": (4_000, 2),
    "fxgraph/ju/fjufxvizzj74i4l22ehtz2p3ru4b65jom3ztixchvkfap3bflxz6/xxxu4wtliphddi2f4qjgsqd3su7pq4mjekd7nckd6":
        (9_000, 30),
    "fxgraph/mb/fmbz735ri43hlcmaxl2jmivtqray7j3qyh62tbe4c66gu7ketqjm/ozvezt5cnfjnkcty74tefydrxw2ly3roefflolsb":
        (8_000, 1),
    "aotautograd/aq6oybukk6xti25bqzehtmlhytwmvgmzxwdh5isdcmyrg74cblv5/25b6va2256ee5bm7zpy6rnsn5dkf3lcs2qilhayz":
        (6_000, 10),
    f"{KERNEL}/triton_poi_fused_relu_0.cubin": (12_000, 20),
    f"{KERNEL}/triton_poi_fused_relu_0.ptx": (5_000, 20),
    f"{KERNEL}/triton_poi_fused_relu_0.json": (700, 20),
}
NEVER = ["locks/ccgqnl5xzf5vlq752w5m3ownv3mpgsbifedv5j4g5nk4a425npdh.lock", "yw/.tmp8h2k_x1z",
         "triton/0/tmp.pid_77_4c2/triton_poi_fused_relu_0.cubin"]


def _entries() -> dict[str, tuple[int, float]]:
    """The expected entries: key -> (bytes, idle days)."""
    out = {rel: v for rel, v in FILES.items() if not rel.startswith(KERNEL)}
    kernel = [v for rel, v in FILES.items() if rel.startswith(KERNEL)]
    group = len(_group_bytes())
    out[f"{KERNEL}/"] = (sum(size for size, _ in kernel) + group, min(days for _, days in kernel))
    return out


def _group_bytes() -> bytes:
    names = [rel.rsplit("/", 1)[1] for rel in FILES if rel.startswith(KERNEL)]
    return json.dumps({"child_paths": {n: f"/home/u/.triton/cache/TK3QJ5ZLGA7Q/{n}" for n in names}}).encode()


def _set_age(path: Path, days: float, now: float) -> None:
    os.utime(path, (now - days * DAY, now - days * DAY), follow_symlinks=False)


@pytest.fixture
def inductor(tmp_path):
    """(root, outside): the tree above, with symlinks into `outside` and a sentinel beside the root."""
    root, outside = tmp_path / "inductor", tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.so").write_bytes(b"outside data" * 100)
    now = time.time()
    for rel, (size, days) in FILES.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size))
        _set_age(path, days, now)
    (root / KERNEL / "__grp__triton_poi_fused_relu_0.json").write_bytes(_group_bytes())
    _set_age(root / KERNEL / "__grp__triton_poi_fused_relu_0.json", 20, now)
    for rel in NEVER:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x")
        _set_age(root / rel, 100, now)
    (root / "cg" / "link.so").symlink_to(outside / "precious.so")
    (root / "zz").symlink_to(outside, target_is_directory=True)
    (tmp_path / "SENTINEL").write_text("keep me")
    return root, outside


def _intact(root: Path, outside: Path) -> None:
    assert (outside / "precious.so").read_bytes() == b"outside data" * 100
    assert sorted(p.name for p in outside.iterdir()) == ["precious.so"]
    assert (root.parent / "SENTINEL").read_text() == "keep me"
    assert (root / "cg" / "link.so").is_symlink() and (root / "zz").is_symlink()
    for rel in NEVER:
        assert (root / rel).read_bytes() == b"x", rel


def _cli_json(capsys, *argv: str) -> object:
    capsys.readouterr()
    code = main(["cache", *argv, "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


def test_ls_lists_files_and_the_triton_folder_as_entries(inductor, capsys):
    root, outside = inductor
    rows = _cli_json(capsys, "ls", "--layout", "tree", "--root", str(root))
    expected = _entries()
    assert [r["key"] for r in rows] == sorted(expected)
    now = time.time()
    for row in rows:
        size, days = expected[row["key"]]
        assert row["bytes"] == size and row["state"] == "complete", row["key"]
        assert abs((now - row["last_used"]) / DAY - days) < 0.01, row["key"]
    (kernel,) = [r for r in rows if r["key"] == f"{KERNEL}/"]
    assert kernel["files"][0] == f"{KERNEL}/__grp__triton_poi_fused_relu_0.json" and len(kernel["files"]) == 4
    _intact(root, outside)


def test_stats_counts_entries_per_top_level_folder(inductor, capsys):
    root, _ = inductor
    s = _cli_json(capsys, "stats", "--layout", "tree", "--root", str(root))
    expected = _entries()
    assert s["layout"] == "tree" and s["entries"] == len(expected)
    assert s["bytes"] == sum(size for size, _ in expected.values())
    buckets = [k for k in expected if len(k.split("/")[0]) == 2]
    assert s["folders"] == {
        "??": {"entries": len(buckets), "bytes": sum(expected[k][0] for k in buckets)},
        "aotautograd": {"entries": 1, "bytes": 6_000},
        "fxgraph": {"entries": 2, "bytes": 17_000},
        "triton": {"entries": 1, "bytes": expected[f"{KERNEL}/"][0]},
    }
    assert main(["cache", "stats", "--layout", "tree", "--root", str(root)]) == 0
    text = capsys.readouterr().out.splitlines()
    (line,) = [t for t in text if t.startswith("??/")]  # the text says what the "??" folders are
    assert line.endswith("(Inductor's generated code, in its two-character hash folders)")
    assert line.split()[1] == str(len(buckets))


def test_prune_older_than_removes_idle_entries_whole_and_nothing_else(inductor, capsys):
    root, outside = inductor
    out = _cli_json(capsys, "prune", "--layout", "tree", "--root", str(root), "--older-than", "15d")
    idle = {k for k, (_, days) in _entries().items() if days > 15}
    assert set(out["removed"]) == idle and len(out["removed"]) == len(idle)
    assert out["bytes_freed"] == sum(_entries()[k][0] for k in idle)
    for rel in FILES:
        gone = rel in idle or rel.startswith(KERNEL)
        assert (root / rel).exists() != gone, rel
    assert not (root / KERNEL / "__grp__triton_poi_fused_relu_0.json").exists()
    assert out["leftovers_removed"] == []  # the temps are not a publisher's: left to Inductor and Triton
    _intact(root, outside)


def test_prune_max_size_removes_least_recently_used_first(inductor, capsys):
    root, outside = inductor
    expected = _entries()
    by_age = sorted(expected, key=lambda k: -expected[k][1])  # most idle first
    keep = by_age[-3:]
    budget = sum(expected[k][0] for k in keep)
    out = _cli_json(capsys, "prune", "--layout", "tree", "--root", str(root), "--max-size", str(budget))
    assert out["removed"][:2] == by_age[:2]  # the two 40-day files, then the rest by idle time
    assert set(out["removed"]) == set(by_age[:-3]) and out["bytes_left"] == budget
    assert {e.key for e in tree.scan(root)} == set(keep)
    _intact(root, outside)


def test_prune_dry_run_removes_nothing(inductor, capsys):
    root, outside = inductor
    before = sorted(str(p) for p in root.rglob("*"))
    out = _cli_json(capsys, "prune", "--layout", "tree", "--root", str(root), "--max-size", "0", "--dry-run")
    assert set(out["removed"]) == set(_entries()) and out["bytes_left"] == 0
    assert sorted(str(p) for p in root.rglob("*")) == before
    _intact(root, outside)


def test_verify_reports_symlinks_and_a_group_naming_a_missing_file(inductor, capsys):
    root, _ = inductor
    (root / KERNEL / "triton_poi_fused_relu_0.ptx").unlink()
    capsys.readouterr()
    assert main(["cache", "verify", "--layout", "tree", "--root", str(root), "--json"]) == 1
    problems = {p["path"]: p["what"] for p in json.loads(capsys.readouterr().out)["problems"]}
    assert problems == {
        str(root / "cg" / "link.so"): "not a regular file or directory",
        str(root / "zz"): "not a regular file or directory",
        str(root / KERNEL / "__grp__triton_poi_fused_relu_0.json"):
            "group names files its folder lacks: triton_poi_fused_relu_0.ptx",
    }


def test_removal_never_goes_through_a_symlink_swapped_in_after_the_scan(inductor):
    root, outside = inductor
    (entry,) = [e for e in tree.scan(root) if e.key.startswith("th/") and e.key.endswith(".so")]
    moved = root.parent / "th-moved"
    (root / "th").rename(moved)
    (root / "th").symlink_to(outside, target_is_directory=True)
    (outside / entry.key.split("/")[1]).write_bytes(b"not the cache's")
    with pytest.raises(CompileCacheError, match="symlink"):
        tree.remove_entry(entry, root=root)
    assert (outside / entry.key.split("/")[1]).read_bytes() == b"not the cache's"


def test_empty_folders_go_only_when_they_stayed_empty(tmp_path):
    now = time.time()
    for rel, days in (("fxgraph/ab/fold", 2), ("fxgraph/cd/ffresh", 0)):
        (tmp_path / rel).mkdir(parents=True)
        _set_age(tmp_path / rel, days, now)
    removed = tree.remove_empty_folders(tmp_path, older_than=3600)
    assert removed == [tmp_path / "fxgraph" / "ab" / "fold"]
    assert (tmp_path / "fxgraph" / "cd" / "ffresh").is_dir() and (tmp_path / "fxgraph" / "ab").is_dir()


def test_launcher_root_prunes_neuron_and_inductor_together_and_drops_fingerprints(tmp_path, capsys):
    root, now = tmp_path / "shared", time.time()
    old_neff = fake.module_name(1)
    fake.write_entry(root / "neuron", version=fake.VERSION, name=old_neff, mtime=now - 50 * DAY,
                     files=fake.entry_files("complete", seed=1, neff_size=10_000))
    fake.write_entry(root / "neuron", version=fake.VERSION, name=fake.module_name(2), mtime=now - 1 * DAY,
                     files=fake.entry_files("complete", seed=2, neff_size=10_000))
    for rel, days in (("inductor/ab/cab.py", 60), ("inductor/cd/ccd.py", 5)):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"code" * 100)
        _set_age(root / rel, days, now)
    fp = {"sha256": "ab" * 32, "inputs": {}, "cache_root": str(root)}
    fingerprint.record(root, fp, run_dir="/runs/x", job_id="7")

    rows = _cli_json(capsys, "ls", "--layout", "launcher", "--root", str(root))
    assert [r["key"] for r in rows] == sorted([f"neuron/neuronxcc-{fake.VERSION}/{old_neff}",
                                               f"neuron/neuronxcc-{fake.VERSION}/{fake.module_name(2)}",
                                               "inductor/ab/cab.py", "inductor/cd/ccd.py"])
    s = _cli_json(capsys, "stats", "--layout", "launcher", "--root", str(root))
    assert (s["entries"], s["fingerprints"]) == (4, 1)
    assert s["parts"]["neuron"]["counts"]["complete"] == 2 and s["parts"]["inductor"]["entries"] == 2

    dry = _cli_json(capsys, "prune", "--layout", "launcher", "--root", str(root), "--older-than", "30d",
                    "--dry-run")
    assert dry["fingerprints_removed"] == ["ab" * 32] and fingerprint.find(root, "ab" * 32) is not None
    out = _cli_json(capsys, "prune", "--layout", "launcher", "--root", str(root), "--older-than", "30d")
    assert out["removed"] == ["inductor/ab/cab.py", f"neuron/neuronxcc-{fake.VERSION}/{old_neff}"]  # LRU first
    assert out["fingerprints_removed"] == ["ab" * 32] and fingerprint.find(root, "ab" * 32) is None
    assert not (root / "inductor" / "ab" / "cab.py").exists() and (root / "inductor" / "cd" / "ccd.py").exists()
    assert [r["key"] for r in _cli_json(capsys, "ls", "--layout", "launcher", "--root", str(root))] == [
        "inductor/cd/ccd.py", f"neuron/neuronxcc-{fake.VERSION}/{fake.module_name(2)}"]


def test_pruning_one_folder_of_a_launcher_root_drops_the_roots_fingerprints(tmp_path, capsys):
    root, now = tmp_path / "shared", time.time()
    fake.write_entry(root / "neuron", version=fake.VERSION, name=fake.module_name(1), mtime=now - 50 * DAY,
                     files=fake.entry_files("complete", seed=1, neff_size=10_000))
    fingerprint.record(root, {"sha256": "cd" * 32, "inputs": {}, "cache_root": str(root)}, run_dir="/r", job_id="8")
    kept = _cli_json(capsys, "prune", "--layout", "neuron", "--root", str(root / "neuron"), "--older-than", "60d")
    assert kept["removed"] == [] and fingerprint.find(root, "cd" * 32) is not None  # nothing pruned: kept
    out = _cli_json(capsys, "prune", "--layout", "neuron", "--root", str(root / "neuron"), "--older-than", "30d")
    assert len(out["removed"]) == 1 and out["fingerprints_removed"] == ["cd" * 32]
    assert fingerprint.find(root, "cd" * 32) is None  # a later submit compiles again instead of trusting it


def test_a_neuron_view_of_another_layout_says_which_layout_to_use(inductor, tmp_path, capsys):
    root, _ = inductor
    capsys.readouterr()
    assert main(["cache", "ls", "--root", str(root)]) == 0
    assert "use --layout tree" in capsys.readouterr().err
    (tmp_path / "launcher" / "inductor").mkdir(parents=True)
    assert main(["cache", "stats", "--layout", "neuron", "--root", str(tmp_path / "launcher")]) == 0
    assert "use --layout launcher" in capsys.readouterr().err
    assert main(["cache", "stats", "--root", str(tmp_path / "launcher"), "--json"]) == 0  # found without --layout
    assert list(json.loads(capsys.readouterr().out)["parts"]) == ["inductor"]

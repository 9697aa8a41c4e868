"""16 processes publish to and sync from one shared cache at once while some are killed with SIGKILL.

8 `cache publish` processes (one per stand-in node cache, sharing 4 entries and owning 3 each) and 8 `cache sync`
loops run together; a reader process checks all the while that every visible entry is whole. Killed publishers
and syncers are then run again, as a SLURM requeue would. Expected contents come from the stand-in trees the
test builds (tests/fixtures/fake_neuron_cache.py), never from the code under test.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_hpc.cli.main import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
import fake_neuron_cache as fake

pytestmark = pytest.mark.multiprocess

NUM_NODES, NUM_SHARED, NUM_OWN = 8, 4, 3
WORKERS = Path(__file__).with_name("compile_cache_workers.py")
WAIT_S = 120
"""The limit on each process's end (its twin, test_compile_tree_publish.py, gives as long): 8 sync loops and a reader
share two cores with the publishers and the suite's other tiers."""
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def _build_nodes(base: Path) -> dict[str, dict[str, str]]:
    """Node caches with shared and own complete entries, plus failed/incomplete ones that must not travel."""
    expected: dict[str, dict[str, str]] = {}
    for node in range(NUM_NODES):
        root = base / f"node{node}"
        seeds = [(f"shared{i}", 1000 + i) for i in range(NUM_SHARED)]
        seeds += [(f"n{node}-own{i}", 100 * node + i) for i in range(NUM_OWN)]
        for label, seed in seeds:
            files = fake.entry_files("complete", seed=seed, neff_size=random.Random(seed).randint(64, 512) << 10)
            name = fake.module_name(0, salt=label)
            fake.write_entry(root, version=fake.VERSION, name=name, files=files)
            expected[f"neuronxcc-{fake.VERSION}/{name}"] = fake.checksums(files)
        for state in ("failed", "incomplete"):
            fake.write_entry(root, version=fake.VERSION, name=fake.module_name(node, salt=state),
                             files=fake.entry_files(state, seed=node))
    return expected


def _tree_digest(path: Path) -> dict[str, str]:
    """Contents of everything under `path` (links as their target text), to show it was left alone."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(path, followlinks=False):
        for name in filenames + dirnames:
            p = Path(dirpath, name)
            out[str(p)] = (f"link:{os.readlink(p)}" if p.is_symlink()
                           else hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir")
    return out


def _cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "megatron_hpc", "cache", *args], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _assert_whole(root: Path, expected: dict[str, dict[str, str]]) -> None:
    entries = {f"{p.parent.name}/{p.name}": p for p in root.glob("neuronxcc-*/MODULE_*") if not p.is_symlink()}
    assert set(entries) == set(expected), f"{root}: missing {set(expected) - set(entries)}"
    for key, path in entries.items():
        assert fake.checksums({p.name: p.read_bytes() for p in path.iterdir()}) == expected[key], key
    assert not list(root.glob("neuronxcc-*/.*")), f"{root}: temp dirs left after verify"


def test_concurrent_publish_and_sync_with_kills(tmp_path, capsys):
    seed = int(os.environ.get("CACHE_TEST_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    expected = _build_nodes(tmp_path)
    shared, outside = tmp_path / "shared", tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.bin").write_bytes(b"x" * 4096)
    link_entry = shared / f"neuronxcc-{fake.VERSION}" / f"MODULE_{'f' * 20}+{fake.FLAGS_HASH}"
    link_entry.parent.mkdir(parents=True)
    link_entry.symlink_to(outside, target_is_directory=True)
    (shared / "escape").symlink_to(outside / "precious.bin")
    (shared / "SENTINEL").write_text("keep me")
    guarded = {**_tree_digest(outside), "sentinel": (shared / "SENTINEL").read_text(),
               "links": (os.readlink(link_entry), os.readlink(shared / "escape"))}
    (tmp_path / "expected.json").write_text(json.dumps(expected))
    stop = tmp_path / "stop"

    reader = subprocess.Popen([sys.executable, str(WORKERS), "reader", str(shared), str(tmp_path / "expected.json"),
                               str(stop), str(tmp_path / "reader.json")], env=ENV)
    publishers = {n: _cli("publish", "--from", str(tmp_path / f"node{n}"), "--to", str(shared), "--json")
                  for n in range(NUM_NODES)}
    syncers = {n: subprocess.Popen([sys.executable, str(WORKERS), "sync-loop", str(shared),
                                    str(tmp_path / f"sync{n}"), str(stop)], env=ENV, stdout=subprocess.DEVNULL)
               for n in range(NUM_NODES)}
    victims = [("pub", n) for n in rng.sample(range(NUM_NODES), 3)] + [("sync", n) for n in rng.sample(range(8), 3)]
    # Kill once publishing is under way, as test_compile_tree_publish.py does: 17 processes starting at once on a
    # busy machine take a while, and kills before any import would leave nothing half-done to recover from.
    deadline = time.monotonic() + 60
    while not any(not p.is_symlink() for p in shared.glob("neuronxcc-*/MODULE_*")) and time.monotonic() < deadline:
        time.sleep(0.01)
    start = time.monotonic()
    for when, (kind, n) in sorted(zip(sorted(rng.uniform(0.2, 1.2) for _ in victims), victims)):
        time.sleep(max(0.0, start + when - time.monotonic()))
        (publishers if kind == "pub" else syncers)[n].send_signal(signal.SIGKILL)
    for n, proc in publishers.items():
        assert proc.wait(timeout=WAIT_S) in (0, -signal.SIGKILL), f"seed {seed}: publisher {n}: {proc.stderr.read()}"
    # requeue the killed publishers: afterwards every complete entry of every node is shared
    requeued = [_cli("publish", "--from", str(tmp_path / f"node{n}"), "--to", str(shared))
                for n, proc in publishers.items() if proc.returncode == -signal.SIGKILL]
    for again in requeued:
        assert again.wait(timeout=WAIT_S) == 0, again.stderr.read()
    time.sleep(0.3)  # let the surviving sync loops and the reader see the final state
    stop.touch()
    for n, proc in syncers.items():
        assert proc.wait(timeout=WAIT_S) in (0, -signal.SIGKILL), f"seed {seed}: syncer {n}"
    assert reader.wait(timeout=WAIT_S) == 0
    seen = json.loads((tmp_path / "reader.json").read_text())
    assert seen["violations"] == [], f"seed {seed}"
    assert seen["checks"] > 0 and seen["polls"] > 1

    # requeue the syncers, then verify sweeps the temp dirs that killed (now dead) local writers left
    leftovers = len(list(tmp_path.glob("*/neuronxcc-*/.*")))
    for root in [tmp_path / f"sync{n}" for n in range(NUM_NODES)]:
        assert main(["cache", "sync", "--from", str(shared), "--to", str(root)]) == 0
    for root in [shared] + [tmp_path / f"sync{n}" for n in range(NUM_NODES)]:
        main(["cache", "verify", "--root", str(root)])  # exit 1: it also reports the symlinks in shared
        _assert_whole(root, expected)
    print(f"seed {seed}: reader {seen['polls']} polls, {seen['checks']} entry checks; {leftovers} temp dirs swept")

    capsys.readouterr()
    assert main(["cache", "prune", "--root", str(shared), "--max-size", "0", "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)["removed"]) == set(expected)
    assert {**_tree_digest(outside), "sentinel": (shared / "SENTINEL").read_text(),
            "links": (os.readlink(link_entry), os.readlink(shared / "escape"))} == guarded

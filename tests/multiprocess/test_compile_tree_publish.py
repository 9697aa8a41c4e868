"""Publishing plain-tree caches (TorchInductor's) file by file, with real processes.

1. 8 `cache publish --layout tree` processes (one per stand-in node cache, sharing files and owning some) and
   8 `cache sync --layout tree` loops run together while some are killed with SIGKILL; a reader checks all the
   while that every file visible in the shared tree is whole and expected. Killed publishers are run again, as a
   SLURM requeue would; then every shareable file is shared and `cache verify` sweeps the killed ones' temps.
2. A symlink in a source or in the shared tree never leads a copy out of the cache.
3. Inductor's own cache, published by one process and synced into another folder, gives a second process a
   warm start: FX graph and AOTAutograd cache hits, the same gradients.
4. The node script syncs the shared cache into a node-local one before a phase and publishes after it.
Expected contents come from the trees the test builds, never from the code under test.
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
from megatron_hpc.compile_cache.paths import warm_start_env

from megatron_hpc.cli.main import main

pytestmark = pytest.mark.multiprocess

NUM_NODES, NUM_SHARED, NUM_OWN = 8, 12, 6
WORKERS = Path(__file__).with_name("tree_publish_workers.py")
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def _content(name: str, size: int) -> bytes:
    """Content-addressed: a file's bytes follow from its name, as in Inductor's cache."""
    return random.Random(name).randbytes(size)


def _inductor_files(label: str, *, big: bool) -> dict[str, bytes]:
    """One compiled graph's files in Inductor's layout (bucket folders, fxgraph/, aotautograd/) and a
    Triton-style kernel folder whose group file lists the kernel's files."""
    h = hashlib.sha256(label.encode()).hexdigest()[:20]
    size = random.Random(label).randint(64, 384) << 10 if big else 512
    kernel = {"kernel.so": _content(f"k{h}", size // 2), "kernel.json": _content(f"j{h}", 200)}
    group = json.dumps({"child_paths": {n: f"/elsewhere/{h}/{n}" for n in kernel}}).encode()
    return {
        f"{h[:2]}/c{h}.py": _content(f"py{h}", 4000),
        f"{h[:2]}/c{h}.so": _content(f"so{h}", size),
        f"fxgraph/{h[2:4]}/f{h}/{h[:8]}": _content(f"fx{h}", 3000),
        f"aotautograd/a{h}/{h[:8]}": _content(f"aot{h}", 2000),
        **{f"kernels/{h}/{n}": data for n, data in kernel.items()},
        f"kernels/{h}/__grp__kernel.json": group,
    }


def _write(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def _build_nodes(base: Path) -> dict[str, str]:
    """Node caches with shared and own files, plus locks and temps that must never travel; sha256 per file."""
    expected: dict[str, str] = {}
    for node in range(NUM_NODES):
        files: dict[str, bytes] = {}
        for i in range(NUM_SHARED):
            files.update(_inductor_files(f"shared{i}", big=True))
        for i in range(NUM_OWN):
            files.update(_inductor_files(f"n{node}-own{i}", big=i % 2 == 0))
        _write(base / f"node{node}", files)
        expected.update({rel: hashlib.sha256(data).hexdigest() for rel, data in files.items()})
        _write(base / f"node{node}", {f"locks/c{node}.lock": b"", f"ab/.{node}.140.tmp": b"half a file",
                                      f"kernels/tmp.pid_{node}_x/kernel.so": b"half a kernel"})
    return expected


def _shared_files(root: Path) -> dict[str, str]:
    out = {}
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            path = Path(dirpath, name)
            out[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _count_files(root: Path) -> int:
    return sum(len(names) for _, _, names in os.walk(root))


def _cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "megatron_hpc", "cache", *args], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_concurrent_tree_publish_and_sync_with_kills(tmp_path):
    seed = int(os.environ.get("CACHE_TEST_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    expected = _build_nodes(tmp_path)
    shared, stop = tmp_path / "shared", tmp_path / "stop"
    (tmp_path / "expected.json").write_text(json.dumps(expected))

    reader = subprocess.Popen([sys.executable, str(WORKERS), "reader", str(shared), str(tmp_path / "expected.json"),
                               str(stop), str(tmp_path / "reader.json")], env=ENV)
    publishers = {n: _cli("publish", "--layout", "tree", "--from", str(tmp_path / f"node{n}"), "--to", str(shared))
                  for n in range(NUM_NODES)}
    syncers = {n: subprocess.Popen([sys.executable, str(WORKERS), "sync-loop", str(shared),
                                    str(tmp_path / f"sync{n}"), str(stop)], env=ENV, stdout=subprocess.DEVNULL)
               for n in range(NUM_NODES)}
    victims = [("pub", n) for n in rng.sample(range(NUM_NODES), 3)] + [("sync", n) for n in rng.sample(range(8), 3)]
    # kill once publishing is under way (17 processes starting at once on a busy machine take a while)
    deadline = time.monotonic() + 60
    while _count_files(shared) < 20 and time.monotonic() < deadline:
        time.sleep(0.01)
    start = time.monotonic()
    for when, (kind, n) in sorted(zip(sorted(rng.uniform(0.0, 1.0) for _ in victims), victims)):
        time.sleep(max(0.0, start + when - time.monotonic()))
        (publishers if kind == "pub" else syncers)[n].send_signal(signal.SIGKILL)
    for n, proc in publishers.items():
        assert proc.wait(timeout=120) in (0, -signal.SIGKILL), f"seed {seed}: publisher {n}: {proc.stderr.read()}"
    killed = [n for n, proc in publishers.items() if proc.returncode == -signal.SIGKILL]
    for again in [_cli("publish", "--layout", "tree", "--from", str(tmp_path / f"node{n}"), "--to", str(shared))
                  for n in killed]:
        assert again.wait(timeout=120) == 0, again.stderr.read()
    time.sleep(0.3)  # let the surviving sync loops and the reader see the final state
    stop.touch()
    for n, proc in syncers.items():
        assert proc.wait(timeout=120) in (0, -signal.SIGKILL), f"seed {seed}: syncer {n}"
    assert reader.wait(timeout=120) == 0
    seen = json.loads((tmp_path / "reader.json").read_text())
    assert seen["violations"] == [], f"seed {seed}"
    assert seen["checks"] > 0 and seen["polls"] > 1

    # Killed writers (dead now, on this host) leave dot-name temps; verify removes them. Then each tree holds
    # exactly the shareable files, whole.
    temps = [n for d in ["shared", *(f"sync{n}" for n in range(NUM_NODES))]
             for _, _, names in os.walk(tmp_path / d) for n in names if n.startswith(".") and ".tmp." in n]
    for n in range(NUM_NODES):
        local = tmp_path / f"sync{n}"
        assert main(["cache", "sync", "--layout", "tree", "--from", str(shared), "--to", str(local)]) == 0
    for root in [shared] + [tmp_path / f"sync{n}" for n in range(NUM_NODES)]:
        assert main(["cache", "verify", "--layout", "tree", "--root", str(root)]) == 0
        assert _shared_files(root) == expected, f"seed {seed}: {root}"
    print(f"seed {seed}: {len(killed)} publishers requeued, reader {seen['polls']} polls, {seen['checks']} file "
          f"checks; {len(temps)} temps of killed writers swept")


def test_symlinks_never_lead_a_copy_out_of_the_cache(tmp_path, capsys):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.so").write_bytes(b"keep")
    src, shared = tmp_path / "src", tmp_path / "shared"
    _write(src, {"ab/cab.py": b"code", "cd/ccd.so": b"kernel", "ef/cef.py": b"more"})
    (src / "ab" / "link.so").symlink_to(outside / "precious.so")
    (shared / "cd").parent.mkdir(parents=True)
    (shared / "cd").symlink_to(outside, target_is_directory=True)

    capsys.readouterr()
    assert main(["cache", "publish", "--layout", "tree", "--from", str(src), "--to", str(shared), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert sorted(report["copied"]) == ["ab/cab.py", "ef/cef.py"]
    assert sorted(report["refused"]) == ["ab/link.so", "cd/ccd.so"]
    assert sorted(p.name for p in outside.iterdir()) == ["precious.so"]
    assert (outside / "precious.so").read_bytes() == b"keep"
    assert not (shared / "ab" / "link.so").exists()


def _probe(cache_dir: Path, out: Path) -> dict:
    # one compile thread: for a graph this small, starting Inductor's compile worker pool costs more than it saves
    env = {**ENV, **warm_start_env(backend="gloo", torch_compile=True), "TORCHINDUCTOR_CACHE_DIR": str(cache_dir),
           "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(WORKERS), "compile-probe", str(out)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_inductor_cache_published_and_synced_elsewhere_gives_a_warm_start(tmp_path):
    compile_node, shared, run_node = tmp_path / "compile-node", tmp_path / "shared", tmp_path / "run-node"
    cold = _probe(compile_node / "inductor", tmp_path / "cold.json")
    assert cold["inductor"].get("fxgraph_cache_miss", 0) >= 1 and not cold["inductor"].get("fxgraph_cache_hit")

    for action, src, dst in (("publish", compile_node, shared), ("sync", shared, run_node)):
        assert main(["cache", action, "--layout", "launcher", "--from", str(src), "--to", str(dst)]) == 0
    warm = _probe(run_node / "inductor", tmp_path / "warm.json")
    # forward and backward graphs both come from the cache, and the AOTAutograd split too (the custom
    # autograd.Function would make it bypass the cache without TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD)
    assert warm["inductor"].get("fxgraph_cache_miss", 0) == 0
    assert warm["inductor"].get("fxgraph_cache_hit", 0) >= 1
    assert warm["aot_autograd"].get("autograd_cache_hit") == 1
    assert warm["grad"] == cold["grad"]


def test_node_script_syncs_before_and_publishes_after_a_phase(tmp_path, own_compile_cache, capsys):
    """The real node script and trainer (one step of `tiny`): what the shared cache holds reaches the phase's
    node-local cache, and what the phase's cache gained reaches the shared one, where a bare `cache ls` shows it."""
    run_dir, local = tmp_path / "run", tmp_path / "node-local"
    # a quarter of tiny's width: the caches around the phase are the subject, not its one step
    sets = ["data.source=synthetic", "compile.num_steps=1", "train.num_steps=1", "train.tensorboard=false",
            "model.hidden_size=64", "model.vocab_size=512", "model.seq_length=32", "model.max_position_embeddings=32"]
    assert main(["submit", "--recipe", "tiny", "--cluster", "local", "--dry-run", "--out", str(run_dir),
                 *[a for s in sets for a in ("--set", s)]]) == 0
    _write(own_compile_cache / "inductor", {"ab/cab-from-shared.py": b"compiled earlier"})
    _write(local / "inductor", {"cd/ccd-from-this-node.py": b"compiled here"})
    env = {**ENV, "MEGATRON_HPC_LOCAL_CACHE_DIR": str(local), "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", str(run_dir / "node.sh"), "compile"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (local / "inductor" / "ab" / "cab-from-shared.py").read_bytes() == b"compiled earlier"
    assert (own_compile_cache / "inductor" / "cd" / "ccd-from-this-node.py").read_bytes() == b"compiled here"
    assert len(list((own_compile_cache / "megatron-hpc" / "fingerprints").glob("*.json"))) == 1
    capsys.readouterr()
    assert main(["cache", "ls", "--json"]) == 0  # what a user types after submit: no --root, no --layout
    keys = {row["key"] for row in json.loads(capsys.readouterr().out)}
    assert {"inductor/ab/cab-from-shared.py", "inductor/cd/ccd-from-this-node.py"} <= keys

    # without MEGATRON_HPC_LOCAL_CACHE_DIR each phase gets a fresh node-local cache under $TMPDIR, removed after
    env.pop("MEGATRON_HPC_LOCAL_CACHE_DIR")
    proc = subprocess.run(["bash", str(run_dir / "node.sh"), "run"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "inductor: 2 copied" in proc.stdout  # the sync before the run phase
    assert not list(tmp_path.glob("megatron-hpc-cache.*"))

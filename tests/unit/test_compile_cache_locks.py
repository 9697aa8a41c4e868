"""Stale and live locks, with real processes holding them (no mocks of the filesystem or of /proc)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from megatron_hpc.compile_cache import locks

from megatron_hpc.cli.main import main
from megatron_hpc.errors import CompileCacheError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
import fake_neuron_cache as fake

HOLDER = ("import sys, time\n"
          "from pathlib import Path\n"
          "from megatron_hpc.compile_cache import locks\n"
          "with locks.hold(Path(sys.argv[1])):\n"
          "    print('held', flush=True)\n"
          "    time.sleep(120)\n")


def _locked_entry(root: Path, i: int) -> Path:
    files = fake.entry_files("incomplete", seed=i)
    return fake.write_entry(root, version=fake.VERSION, name=fake.module_name(i), files=files)


def _spawn_holder(lock: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_lock_of_killed_process_is_cleared_and_live_one_kept(tmp_path, capsys):
    dead_lock = _locked_entry(tmp_path, 0) / fake.LOCK
    live_lock = _locked_entry(tmp_path, 1) / fake.LOCK
    dead, live = _spawn_holder(dead_lock), _spawn_holder(live_lock)
    try:
        dead.send_signal(signal.SIGKILL)
        dead.wait()
        assert dead_lock.exists() and Path(f"{dead_lock}.owner").exists()  # kill -9 left both behind
        # --stale-after 0: age alone would call both stale; the owner check must keep the live one
        assert main(["cache", "clear-locks", "--root", str(tmp_path), "--stale-after", "0", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert [c["path"] for c in out["cleared"]] == [str(dead_lock)]
        assert "is gone" in out["cleared"][0]["reason"]
        assert [k["path"] for k in out["kept"]] == [str(live_lock)]
        assert not dead_lock.exists() and not Path(f"{dead_lock}.owner").exists()
        assert live_lock.exists() and live.poll() is None
    finally:
        live.kill()
        live.wait()


def test_reused_pid_is_detected_by_start_time(tmp_path):
    lock = _locked_entry(tmp_path, 0) / fake.LOCK
    lock.touch()
    me = locks.current_owner()
    record = {"host": me.host, "boot_id": me.boot_id, "pid": me.pid, "start_time": me.start_time + 1,
              "created": me.created}
    Path(f"{lock}.owner").write_text(json.dumps(record))
    status = locks.lock_status(lock, stale_after=1e9)
    assert status.stale and "pid reused" in status.reason
    record["start_time"] = me.start_time
    Path(f"{lock}.owner").write_text(json.dumps(record))
    assert not locks.lock_status(lock, stale_after=0).stale


def test_other_hosts_lock_is_stale_only_after_timeout(tmp_path):
    lock = _locked_entry(tmp_path, 0) / fake.LOCK
    lock.touch()
    record = {"host": "some-other-node", "boot_id": "x", "pid": 1, "start_time": 1, "created": time.time()}
    Path(f"{lock}.owner").write_text(json.dumps(record))
    assert not locks.lock_status(lock, stale_after=3600).stale
    assert locks.lock_status(lock, stale_after=3600, now=time.time() + 7200).stale


def test_foreign_lock_needs_age_and_no_compiler(tmp_path):
    lock = _locked_entry(tmp_path, 0) / fake.LOCK
    lock.touch()  # 0 bytes, no owner record: what neuronx-cc leaves when killed
    assert not locks.lock_status(lock, stale_after=3600).stale
    old = time.time() - 7200
    os.utime(lock, (old, old))
    # a process named neuronx-cc on this host (a renamed `sleep`) may still be compiling it
    fake_cc = tmp_path / "bin" / "neuronx-cc"
    fake_cc.parent.mkdir()
    shutil.copy(shutil.which("sleep"), fake_cc)
    cc = subprocess.Popen([str(fake_cc), "60"])
    try:
        deadline = time.monotonic() + 5
        while not locks.compiler_running() and time.monotonic() < deadline:
            time.sleep(0.02)
        status = locks.lock_status(lock, stale_after=3600)
        assert not status.stale and "neuronx-cc runs" in status.reason
    finally:
        cc.kill()
        cc.wait()
    assert locks.lock_status(lock, stale_after=3600).stale


def test_hold_breaks_a_dead_owners_lock_and_refuses_a_live_one(tmp_path):
    lock = tmp_path / "x.lock"
    holder = _spawn_holder(lock)
    try:
        with pytest.raises(CompileCacheError, match="is held"), locks.hold(lock, wait_s=0.2):
            pass
    finally:
        holder.kill()
        holder.wait()
    with locks.hold(lock) as held:
        assert locks.read_owner(held).pid == os.getpid()
    assert not lock.exists() and not Path(f"{lock}.owner").exists()

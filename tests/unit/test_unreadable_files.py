"""Run folders and checkpoints another user cannot read: one line naming the file and the permission problem,
never a traceback, never "truncated or damaged", never advice to delete anything; `runs` lists the rest.

The tests run as root, whom file modes do not stop. The run folders and checkpoints therefore belong to another
user (nobody), as a colleague's would, and the commands under test run as root without the capabilities that
override file modes (setpriv drops CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH): the kernel then checks the modes as
for any other user. (Running them as nobody instead would lock them out of an interpreter under /root.)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from megatron_hpc.checkpoint.store import RankInfo, save_checkpoint
from megatron_hpc.cli.main import main

NOBODY = 65534


def _nobody_prefix(cwd: Path) -> tuple[list[str], dict[str, str]]:
    """The command prefix and environment that bind `python` by file modes: as root without its override
    capabilities (as this user when the tests do not run as root), on files that belong to nobody."""
    prefix: list[str] = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        assert setpriv, "setpriv (util-linux) is needed to run the command without root's file-mode override"
        prefix = [setpriv, "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search"]
        for d, _dirs, files in os.walk(cwd):  # everything the test made belongs to the other user
            for name in (d, *(os.path.join(d, f) for f in files)):
                os.chown(name, NOBODY, NOBODY)
    env = {**os.environ, "HOME": str(cwd), "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    return prefix, env


def _as_nobody(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`python args...` bound by file modes (see _nobody_prefix)."""
    prefix, env = _nobody_prefix(cwd)
    return subprocess.run([*prefix, sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return _as_nobody("-m", "megatron_hpc", *args, cwd=cwd)


def _one_error_line(proc: subprocess.CompletedProcess[str], *, names: Path, mode: str) -> str:
    """The command failed with one line that names `names` with its mode and the permission problem."""
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert line.startswith("megatron-hpc: error: cannot read ") and "Traceback" not in proc.stderr
    assert f"cannot read {names}: permission denied: mode {mode}, " in line or \
        f"permission denied: the folder {names} has mode {mode}, " in line, line
    if os.geteuid() == 0:
        assert "owner nobody, and this process runs as root" in line, line
    for wrong in ("truncated", "damaged", "delete", "incomplete", "missing"):
        assert wrong not in line, line
    return line


@pytest.fixture
def shared(tmp_path: Path) -> Iterator[Path]:
    """A folder nobody may enter and read (pytest's own temp folders are private to root)."""
    folder = Path(tempfile.mkdtemp(prefix="mhpc-unreadable-", dir="/tmp"))
    folder.chmod(0o755)
    old = os.umask(0o022)
    try:
        yield folder
    finally:
        os.umask(old)
        for d, _, _ in os.walk(folder):
            os.chmod(d, 0o755)
        shutil.rmtree(folder)


# One process bound by file modes that runs the commands one after another, in-process (the CLI's main(), or a
# snippet with its own sys.argv), so that the tests pay one interpreter and torch import instead of one per command:
# a request is one JSON line, the answer one JSON line with the exit code and what it printed.
SERVE = r"""
import contextlib, io, json, sys, traceback
from megatron_hpc.cli.main import main
for line in sys.stdin:
    request, out, err = json.loads(line), io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if "code" in request:
                sys.argv = ["-c", *request["args"]]
                exec(request["code"], {"__name__": "__main__"})
                code = 0
            else:
                code = main(request["args"])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
    print(json.dumps({"code": code, "out": out.getvalue(), "err": err.getvalue()}), flush=True)
"""


class _Nobody:
    """The commands of one test, run by one process bound by file modes (see SERVE)."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        prefix, env = _nobody_prefix(cwd)
        self.proc = subprocess.Popen([*prefix, sys.executable, "-c", SERVE], cwd=cwd, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def _ask(self, request: dict, argv: list[str]) -> subprocess.CompletedProcess[str]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        _nobody_prefix(self.cwd)  # what the test made since belongs to the other user too
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        return subprocess.CompletedProcess(argv, answer["code"], answer["out"], answer["err"])

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self._ask({"args": list(args)}, ["megatron-hpc", *args])

    def python(self, code: str, *args: str) -> subprocess.CompletedProcess[str]:
        return self._ask({"code": code, "args": list(args)}, ["python", "-c", code, *args])

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        assert self.proc.wait(timeout=60) == 0


@pytest.fixture
def nobody(shared: Path) -> Iterator[_Nobody]:
    session = _Nobody(shared)
    yield session
    session.close()


def _make_run(shared: Path, name: str, *, steps: int) -> Path:
    run_dir = shared / "runs" / name
    assert main(["submit", "--recipe", "tiny", "--dry-run", "--out", str(run_dir)]) == 0
    (run_dir / "submission.json").write_text(json.dumps({
        "cluster": "local", "ok": True, "reason": "",
        "jobs": [{"phase": "run", "job_id": "12", "state": "COMPLETED", "depends_on": None}]}))
    (run_dir / "metrics.jsonl").write_text(json.dumps({"iteration": steps, "phase": "run", "lm_loss": 4.5,
                                                       "elapsed_ms": 500.0, "tokens_per_s": 2048.0}) + "\n")
    (run_dir / "logs" / "run-node0.log").write_text("iteration 1\n")
    return run_dir


def test_runs_lists_the_readable_runs_and_marks_the_others(shared: Path) -> None:
    ok = _make_run(shared, "tiny/a-ok", steps=30)
    private_file = _make_run(shared, "tiny/b-file", steps=40)
    private_folder = _make_run(shared, "tiny/c-folder", steps=50)
    (private_file / "metrics.jsonl").chmod(0o600)
    private_folder.chmod(0o700)
    for run, stamp in ((ok, 1_000), (private_file, 2_000), (private_folder, 3_000)):
        os.utime(run / "submission.json", (stamp, stamp))

    proc = _cli("runs", cwd=shared)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    rows = {line.split()[0]: line for line in proc.stdout.splitlines()[1:]}
    assert set(rows) == {"tiny/a-ok", "tiny/b-file", "tiny/c-folder"}
    assert "30/100" in rows["tiny/a-ok"] and "4.5000" in rows["tiny/a-ok"]
    assert "unreadable: Permission denied" in rows["tiny/b-file"] and "40/" not in rows["tiny/b-file"]
    assert "unreadable: Permission denied" in rows["tiny/c-folder"]
    warnings = proc.stderr.strip().splitlines()
    assert len(warnings) == 2
    assert any(f"{private_file / 'metrics.jsonl'}: permission denied: mode 0600" in w for w in warnings), warnings
    assert any(f"the folder {private_folder} has mode 0700" in w for w in warnings), warnings

    as_json = json.loads(_cli("runs", "--json", cwd=shared).stdout)
    assert {Path(r["run_dir"]).name: r.get("unreadable") for r in as_json} == {
        "a-ok": None, "b-file": "Permission denied", "c-folder": "Permission denied"}


def test_status_and_logs_name_the_file_they_cannot_read(shared: Path) -> None:
    run = _make_run(shared, "tiny/r", steps=30)
    assert _cli("status", str(run), cwd=shared).returncode == 0  # readable: the check below is about the mode

    (run / "plan.json").chmod(0o600)
    _one_error_line(_cli("status", str(run), cwd=shared), names=run / "plan.json", mode="0600")
    (run / "plan.json").chmod(0o644)
    (run / "metrics.jsonl").chmod(0o600)
    _one_error_line(_cli("status", str(run), cwd=shared), names=run / "metrics.jsonl", mode="0600")
    (run / "metrics.jsonl").chmod(0o644)

    (run / "logs" / "run-node0.log").chmod(0o600)
    _one_error_line(_cli("logs", str(run), cwd=shared), names=run / "logs" / "run-node0.log", mode="0600")
    (run / "logs").chmod(0o700)  # a glob would see an empty folder and say "no logs yet"
    _one_error_line(_cli("logs", str(run), cwd=shared), names=run / "logs", mode="0700")
    (run / "logs").chmod(0o755)
    (run / "logs" / "run-node0.log").chmod(0o644)
    assert _cli("logs", str(run), cwd=shared).stdout == "iteration 1\n"

    run.chmod(0o700)
    for command in ("status", "logs"):
        _one_error_line(_cli(command, str(run), cwd=shared), names=run, mode="0700")
    # with no argument: the newest run is the unreadable one, so it is named instead of an older run shown
    _one_error_line(_cli("status", cwd=shared), names=run, mode="0700")


def _checkpoint(shared: Path) -> Path:
    root = shared / "ckpt"
    state = {"iteration": 7, "tensor_model_parallel_size": 1,
             "model": {"wte.weight": torch.arange(32.0).reshape(8, 4), "ln.bias": torch.ones(4)}}
    save_checkpoint(root, 7, state, ranks=RankInfo())
    return root


def test_ckpt_inspect_names_the_file_it_cannot_read(shared: Path, nobody: _Nobody) -> None:
    root = _checkpoint(shared)
    folder = root / "iter_0000007"
    tensor = sorted((folder / "mp_rank_00").glob("*.tensors/tensor_*.pt"))[0]
    assert nobody.cli("ckpt", "inspect", str(root), "--verify").returncode == 0

    tensor.chmod(0o600)
    for extra in ((), ("--verify",)):  # memory-mapped listing, and the checked read
        _one_error_line(nobody.cli("ckpt", "inspect", str(root), *extra), names=tensor, mode="0600")
    tensor.chmod(0o644)
    (folder / "manifest.json").chmod(0o600)
    _one_error_line(nobody.cli("ckpt", "inspect", str(root)), names=folder / "manifest.json", mode="0600")
    (folder / "manifest.json").chmod(0o644)
    root.chmod(0o700)
    _one_error_line(nobody.cli("ckpt", "inspect", str(root)), names=root, mode="0700")
    _one_error_line(nobody.cli("ckpt", "convert", str(root), "--to", "torch", str(shared / "out")),
                    names=root, mode="0700")


LOAD = """
import sys
from pathlib import Path
from megatron_hpc.checkpoint.store.loader import load_checkpoint
from megatron_hpc.checkpoint.store.ranks import RankInfo
from megatron_hpc.errors import CheckpointAccessError
try:
    found, state = load_checkpoint(Path(sys.argv[1]), ranks=RankInfo())
except CheckpointAccessError as exc:
    print(f"{type(exc).__name__}: {exc}")
else:
    print("loaded", found.iteration, state["model"]["wte.weight"].sum().item())
"""


def test_the_trainers_load_raises_a_checkpoint_error_naming_the_file(shared: Path, nobody: _Nobody) -> None:
    """What the trainer calls at start-up (checkpoint/store/loader.py): a file it may not read is neither damage
    (no fallback to an older checkpoint, no "truncated") nor a reason to delete anything."""
    root = _checkpoint(shared)
    folder = root / "iter_0000007"
    assert nobody.python(LOAD, str(root)).stdout.split() == ["loaded", "7", str(sum(range(32)) * 1.0)]
    main_file = folder / "mp_rank_00" / "model_optim_rng.pt"
    for path, mode in ((main_file, 0o600), (folder / "manifest.json", 0o600), (folder, 0o700),
                       (root / "latest_checkpointed_iteration.txt", 0o600)):
        before = path.stat().st_mode
        path.chmod(mode)
        proc = nobody.python(LOAD, str(root))
        path.chmod(before)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        out = proc.stdout.strip()
        assert out.startswith(f"CheckpointAccessError: cannot read {path}") or \
            out.startswith(f"CheckpointAccessError: cannot read {folder}/"), out
        assert f"{path}: permission denied: mode {mode:04o}" in out or \
            f"the folder {path} has mode {mode:04o}" in out, out
        for wrong in ("truncated", "damaged", "delete", "earlier"):
            assert wrong not in out, out

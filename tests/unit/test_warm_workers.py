"""Warm workers (megatron_hpc/warm_server.py, launch/warm_client.py): a real warm process (torch imported, a real
fork), the real client, a real Unix socket; the workers are tests/unit/warm/warm_probe.py run as `-m warm_probe`.
One warm process serves the module (its start imports torch: seconds); the SLURM tier runs the trainer through it
(tests/slurm/test_in_job_slurm.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from megatron_hpc.launch.scripts import in_job_command, render_node_script
from megatron_hpc.launch.stack_dump import find_workers
from megatron_hpc.launch.step_exit import worker_signal

from megatron_hpc.plan.jobs import PhaseSpec
from megatron_hpc.warm_protocol import REFUSED_NAME, SOCKET_NAME, encode, warm_folder, worker_envs

PROBE_DIR = Path(__file__).parent / "warm"
JOB, NODE = "4242", "warmnode"


def _env(tmp: Path, job: str = JOB) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "RANK", "WORLD_SIZE", "LOCAL_"))}
    return {**env, "SLURM_JOB_ID": job, "SLURMD_NODENAME": NODE, "TMPDIR": str(tmp),
            "PYTHONPATH": os.pathsep.join([str(PROBE_DIR), env.get("PYTHONPATH", "")])}


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """(environment, folder, pid) of a warm process for job JOB on node NODE."""
    tmp = tmp_path_factory.mktemp("warm")
    env = _env(tmp)
    server, folder = _start_server(env, tmp)
    yield env, folder, server.pid
    server.terminate()
    assert server.wait(timeout=30) == 0
    assert not folder.exists()  # a client after this one starts torchrun


def _start_server(env: dict[str, str], tmp: Path) -> tuple[subprocess.Popen, Path]:
    """A warm process for env's job, once it listens."""
    log = (tmp / "server.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "megatron_hpc.warm_server"], env=env, cwd=tmp, stdout=log,
                              stderr=subprocess.STDOUT)
    folder = warm_folder(env)
    deadline = time.monotonic() + 120
    while not (folder / SOCKET_NAME).exists():
        assert server.poll() is None and time.monotonic() < deadline, (tmp / "server.log").read_text()
        time.sleep(0.05)
    return server, folder


_CLIENTS: list[subprocess.Popen] = []
"""Clients and a test's own warm processes, ended after each test (a module's warm process is its fixture's)."""


@pytest.fixture(autouse=True)
def _no_client_left():
    """A test that failed halfway must not leave its client (and so its workers) running for the rest of the tier."""
    yield
    while _CLIENTS:
        proc = _CLIENTS.pop()  # the newest first: clients before the warm process they came after
        if proc.poll() is None:
            proc.terminate()  # passed on to its workers, as srun's teardown does
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def client(env: dict, *worker: str, nproc: int = 2, node_rank: int = 0, nnodes: int = 1, **popen) -> subprocess.Popen:
    argv = [sys.executable, "-m", "megatron_hpc.launch.warm_client", f"--nproc-per-node={nproc}",
            f"--node-rank={node_rank}", f"--nnodes={nnodes}", "--master-addr=10.0.0.1", "--master-port=29123", "--",
            sys.executable, "-m", "warm_probe", *worker]
    proc = subprocess.Popen(argv, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)
    _CLIENTS.append(proc)
    return proc


def _pids(prefix: Path, ranks: range, timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while not all(Path(f"{prefix}.{r}").exists() and Path(f"{prefix}.{r}").read_text() for r in ranks):
        assert time.monotonic() < deadline, f"the workers never wrote {prefix}.*"
        time.sleep(0.02)
    return [int(Path(f"{prefix}.{r}").read_text()) for r in ranks]


def _gone(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.02)
    return False


def test_forked_workers_get_torchruns_environment_and_the_clients_stdout_and_stderr(warm, tmp_path):
    env, _, server_pid = warm
    proc = client({**env, "PROBE_MARK": "from-node-sh"}, "env", node_rank=1, nnodes=2, cwd=tmp_path)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    lines = sorted(out.splitlines())
    assert [line.split(" pid=")[0] for line in lines] == [
        "RANK=2 LOCAL_RANK=0 WORLD_SIZE=4 LOCAL_WORLD_SIZE=2 GROUP_RANK=1 MASTER_ADDR=10.0.0.1 MASTER_PORT=29123 "
        "PROBE_MARK=from-node-sh",
        "RANK=3 LOCAL_RANK=1 WORLD_SIZE=4 LOCAL_WORLD_SIZE=2 GROUP_RANK=1 MASTER_ADDR=10.0.0.1 MASTER_PORT=29123 "
        "PROBE_MARK=from-node-sh"]
    # Forked by the warm process (no new interpreter), in the client's folder; stderr reached the client's stderr.
    assert all(f"ppid={server_pid} cwd={tmp_path} draws=" in line for line in lines)
    assert sorted(err.split()) == ["2", "3", "err", "err"]
    # Each worker's global generators seeded anew, as a new interpreter's: a fork shares numpy's (Python's
    # random reseeds itself after a fork).
    draws = [line.split(" draws=")[1] for line in lines]
    assert len({d.split(":")[0] for d in draws}) == 2 and len({d.split(":")[1] for d in draws}) == 2


def test_a_failed_worker_fails_the_client_as_torchrun_reports_it(warm, tmp_path):
    env, _, _ = warm
    proc = client(env, "exit", "5")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert sorted(out.split()) == ["0", "1", "exiting", "exiting"]
    assert "local rank 1 (pid " in err and "failed: exitcode  : 5" in err


@pytest.mark.parametrize("job", [JOB, "9997"], ids=["warm", "cold"])
def test_a_worker_ends_as_an_interpreter_would(warm, tmp_path, job):
    # The trainer's checkpoint writer is a non-daemon thread, and the CLI exits with messages: a forked worker
    # must join the one, run atexit handlers and print the other, as the cold worker's interpreter does.
    env = {**warm[0], "SLURM_JOB_ID": job}
    proc = client(env, "finish", str(tmp_path / "out"))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.atexit", "out.thread"]
    assert "fatal: rank 1 stops" in err and "failed: exitcode  : 1" in err


def test_a_killed_worker_is_named_by_its_signal_and_the_others_are_ended(warm, tmp_path):
    env, _, _ = warm
    proc = client(env, "sleep", str(tmp_path / "pid"))
    first, second = _pids(tmp_path / "pid", range(2))
    os.kill(second, signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and _gone(first)
    # Only the worker that failed by itself is named; the one ended after it (SIGTERM) is not a cause.
    assert err.count("exitcode") == 1 and f"(pid {second}) failed: exitcode  : -9 (SIGKILL)" in err
    assert worker_signal("megatron-hpc: run phase, node 0 of 1\n" + err) == 9


def test_the_workers_die_with_a_killed_client_and_are_found_for_debug_meanwhile(warm, tmp_path):
    env, folder, _ = warm
    run_dir = tmp_path / "run"
    proc = client(env, "sleep", str(tmp_path / "pid"), "--run-dir", str(run_dir))
    pids = _pids(tmp_path / "pid", range(2))
    # What the watchdog and `debug` see: /proc shows the warm process's command line, the registry the ranks.
    assert [(w.rank, w.pid) for w in find_workers(run_dir, warm=folder)] == [(0, pids[0]), (1, pids[1])]
    assert find_workers(tmp_path / "other", warm=folder) == []
    proc.kill()  # as srun's step teardown does
    proc.wait(timeout=10)
    assert all(_gone(pid) for pid in pids)
    assert find_workers(run_dir, warm=folder) == []


def test_a_client_gone_before_its_workers_started_ends_them_and_the_warm_process_serves_on(warm, tmp_path):
    # srun may kill a step as it starts (another node failed): the reply to a client that left must not end the
    # warm process, and what it forked for that client must not outlive it.
    env, folder, server_pid = warm
    envs = worker_envs(env, nproc_per_node=2, node_rank=0, nnodes=1, master_addr="m", master_port=7)
    message = {"argv": ["-m", "warm_probe", "sleep", str(tmp_path / "pid")], "cwd": str(tmp_path), "envs": envs}
    with open(os.devnull, "w") as null, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(folder / SOCKET_NAME))
        assert b'"hello"' in sock.recv(256)  # as the client does: the request goes to a warm process that answers
        socket.send_fds(sock, [encode(message)], [null.fileno(), null.fileno()])
    # The warm process serves one connection at a time: once the next client's workers ran (warm), it has read the
    # request of the one that left and forked its workers. Their end is then polled for, not slept for: on a loaded
    # machine the kill and the reap come when they come.
    proc = client(env, "exit", "0")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "cold" not in err, err
    assert Path(f"/proc/{server_pid}").exists() and (folder / SOCKET_NAME).exists()
    deadline = time.monotonic() + 60
    while list(folder.glob("worker-*.json")):  # killed and reaped: the registry empties
        assert time.monotonic() < deadline, sorted(p.name for p in folder.glob("worker-*.json"))
        time.sleep(0.02)
    forked = [int(p.read_text()) for p in tmp_path.glob("pid.*") if p.read_text()]
    assert all(_gone(pid) for pid in forked)


def test_signals_the_step_gets_reach_the_workers(warm, tmp_path):
    env, _, _ = warm
    proc = client(env, "term", str(tmp_path / "pid"))
    pids = _pids(tmp_path / "pid", range(2))
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    # Each worker's TERM handler ran (exit 7): the signal went through the client and the warm process.
    assert proc.returncode == 1 and all(_gone(p) for p in pids)
    assert [(tmp_path / f"pid.{r}.term").read_text() for r in range(2)] == ["7", "7"]
    # A teardown's victims, not a failure of this node: no failure line for step_exit.py to blame it by (torchrun,
    # signalled, prints no failure summary either). Naming them made the driver leave the victim's node out too.
    assert "exitcode" not in err, err


def test_cold_workers_signalled_by_the_teardown_are_not_named_either(tmp_path):
    env = _env(tmp_path, job="9997")
    proc = client(env, "term", str(tmp_path / "pid"))
    pids = _pids(tmp_path / "pid", range(2))
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and all(_gone(p) for p in pids) and "starting the workers cold" in err
    assert [(tmp_path / f"pid.{r}.term").read_text() for r in range(2)] == ["7", "7"]
    assert "exitcode" not in err, err


def test_a_draining_warm_process_sends_new_clients_cold_at_once_and_ends_with_its_workers(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("drain")  # short: the socket's path must fit AF_UNIX's 108 bytes
    env = _env(tmp_path, job="9996")
    server, folder = _start_server(env, tmp_path)
    _CLIENTS.append(server)  # ended after the test, its clients before it
    running = client(env, "sleep", str(tmp_path / "pid"))
    (pid, _) = _pids(tmp_path / "pid", range(2))
    server.send_signal(signal.SIGTERM)  # a job-level TERM: it serves its running workers to their end
    deadline = time.monotonic() + 60
    while (folder / SOCKET_NAME).exists() or not (folder / REFUSED_NAME).exists():  # the draining state
        assert time.monotonic() < deadline
        time.sleep(0.02)
    later = client(env, "exit", "0", nproc=1)
    _, err = later.communicate(timeout=60)
    # Not START_WAIT_S for a live process: a client that waited for it would say "no warm process ready ... after
    # 60 s" (or time out above); the note is read at once. No wall-clock bound: a loaded machine sets those.
    assert later.returncode == 0, err
    assert err.splitlines()[0].startswith("megatron-hpc: warm workers: the warm process refused to serve: it got "
                                          "SIGTERM"), err
    assert server.poll() is None  # still serving the first request
    running.send_signal(signal.SIGTERM)  # its workers end (sleep has no handler) and the warm process with them
    running.communicate(timeout=60)
    assert server.wait(timeout=30) == 0 and _gone(pid) and not folder.exists()


def test_without_a_warm_process_the_client_says_so_and_starts_the_workers_cold(tmp_path):
    env = _env(tmp_path, job="9999")
    proc = client(env, "env", nproc=2, cwd=tmp_path)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    folder = tmp_path / f"megatron-hpc-warm.9999.{NODE}"
    assert err.splitlines()[0] == (f"megatron-hpc: warm workers: no warm process at {folder}/{SOCKET_NAME} on "
                                   f"{NODE}; starting the workers cold (new interpreters, as torchrun would)")
    # Not torchrun (its agent would wait for agents on the warm nodes): the same environment as forked workers.
    lines = sorted(line.split(" pid=")[0] for line in out.splitlines())
    assert lines == [f"RANK={r} LOCAL_RANK={r} WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 GROUP_RANK=0 MASTER_ADDR=10.0.0.1 "
                     f"MASTER_PORT=29123 PROBE_MARK=None" for r in (0, 1)]
    assert all(f"ppid={proc.pid} " in line for line in out.splitlines())


def test_a_first_step_waits_for_a_starting_warm_process_but_not_for_one_that_refused(tmp_path):
    env = {**_env(tmp_path, job="9998"), "MEGATRON_HPC_IN_JOB_STEP": "0"}
    folder = warm_folder(env)
    folder.mkdir()
    (folder / "refused").write_text("3 threads after importing torch (a fork keeps only one)\n")
    proc = client(env, "exit", "3", nproc=2)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    # Not waited for: one that waited START_WAIT_S for a start would say "no warm process ready ... after 60 s".
    assert err.splitlines()[0].startswith("megatron-hpc: warm workers: the warm process refused to serve: 3 threads")
    assert "failed: exitcode  : 3" in err  # the cold workers' failure, named as for warm ones


def test_a_warm_process_that_never_answers_is_not_waited_for_forever(tmp_path):
    # A warm process alive but not serving (stopped, stuck): the kernel accepts the connection for it, and the
    # step must not hang on its reply. A listening socket nobody accepts on stands for it.
    env = _env(tmp_path, job="9996")
    folder = warm_folder(env)
    folder.mkdir()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as mute:
        mute.bind(str(folder / SOCKET_NAME))
        mute.listen(8)
        code = ("import sys; import megatron_hpc.launch.warm_client as c; c.REPLY_WAIT_S = 1.0; "
                "sys.exit(c.main(sys.argv[1:]))")
        proc = subprocess.run([sys.executable, "-c", code, "--nproc-per-node=2", "--node-rank=0", "--nnodes=1",
                               "--master-addr=m", "--master-port=7", "--", "python", "-m", "warm_probe", "exit", "0"],
                              env=env, text=True, capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines()[0] == ("megatron-hpc: warm workers: the warm process did not answer in 1 s on "
                                           f"{NODE}; starting the workers cold (new interpreters, as torchrun would)")
    assert sorted(proc.stdout.split()) == ["0", "1", "exiting", "exiting"]  # the cold workers ran


def test_worker_envs_follow_torchrun():
    envs = worker_envs({"PATH": "/bin"}, nproc_per_node=2, node_rank=3, nnodes=4, master_addr="m", master_port=7)
    assert [(e["RANK"], e["LOCAL_RANK"], e["GROUP_RANK"], e["WORLD_SIZE"]) for e in envs] == [
        ("6", "0", "3", "8"), ("7", "1", "3", "8")]
    assert envs[0]["OMP_NUM_THREADS"] == "1" and envs[0]["PATH"] == "/bin"  # torchrun's default for > 1 worker
    assert worker_envs({"OMP_NUM_THREADS": "4"}, nproc_per_node=2, node_rank=0, nnodes=1, master_addr="m",
                       master_port=7)[1]["OMP_NUM_THREADS"] == "4"


def test_node_script_and_driver_line_with_and_without_warm_workers():
    spec = PhaseSpec(phase="run", job_name="x", num_nodes=2, nproc_per_node=2, spare_nodes=1, warm_restart=True)
    kwargs = dict(recipe="r", run_dir="/r", bin_dir="/b", backend="gloo", shared_cache="/c")
    cold, hot = render_node_script(spec, **kwargs), render_node_script(spec, warm=True, **kwargs)
    # Nothing of the warm workers without them (the tune phase's "warm cache" is the compile cache's).
    assert not [line for line in cold.splitlines() if "warm" in line.replace("warm cache", "")]
    assert 'exec python -m megatron_hpc.warm_server >>"$LOG" 2>&1' in hot
    assert '( trap \'\' USR2; exec "${WARM_CLIENT[@]}" "${TORCHRUN_WRAPPER[@]}" torchrun' in hot
    assert subprocess.run(["bash", "-n"], input=hot, text=True).returncode == 0
    assert " --warm -- " in in_job_command(spec, run_dir="/r", srun=["bash", "/r/node.sh", "run"])


@pytest.mark.parametrize(("platform", "sets", "expected"), [
    ("cpu", ["launch.spare_nodes=1"], True),
    ("cpu", ["launch.spare_nodes=1", "launch.warm_restart=false"], False),
    ("cpu", [], False),  # no spares: no in-job steps, torchrun as before
    ("trn1", ["launch.spare_nodes=1"], False),  # torch_xla cannot be imported before a fork
])
def test_warm_restart_only_with_spares_and_never_on_xla(platform, sets, expected):
    from megatron_hpc.config.loader import load_recipe
    from megatron_hpc.config.platforms import get_platform
    from megatron_hpc.plan.jobs import warm_restart

    assert warm_restart(load_recipe("tiny", sets), get_platform(platform)) is expected


def test_the_driver_starts_the_warm_step_on_every_node_of_the_allocation(tmp_path):
    from megatron_hpc.launch.in_job import Driver

    driver = Driver(run_dir=tmp_path, num_nodes=2, max_restarts=3, max_requeues=3, exclude_stragglers=False,
                    srun_tail=["--kill-on-bad-exit=1", "--cpu-bind=none", "bash", "/r/node.sh", "run"], warm=True)
    assert driver.warm_argv(("n1", "n2", "n3")) == [
        "srun", "--overlap", "--no-kill", "--job-name=megatron-hpc-warm", "--nodes=3", "--ntasks=3",
        "--ntasks-per-node=1", "--nodelist=n1,n2,n3", "--cpu-bind=none", "bash", "/r/node.sh", "warm"]

"""Hot spares and the in-job restart without SLURM: the driver's pure rules, the nodes' exit records, the restart
request's refusals, restarts in `status`, and the plan and sbatch text of a run with spares.
(The real thing, on the local cluster: tests/slurm/test_in_job_slurm.py.)"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict

import pytest
from megatron_hpc.launch import in_job, requeue
from megatron_hpc.launch.in_job import Seen, hang_reports, marker_new
from megatron_hpc.launch.restart_log import read_restarts
from megatron_hpc.launch.restart_request import RestartRequest, check_request
from megatron_hpc.launch.restart_rules import (
    DriverState,
    Next,
    StepEnd,
    classify,
    decide,
    healthy_nodes,
    node_names,
    node_unusable,
    only_not_responding,
    step_nodes,
    stragglers_to_exclude,
)
from megatron_hpc.launch.run_status import JobStatus, RunStatus, format_status
from megatron_hpc.launch.step_exit import NodeExit, worker_signal

from megatron_hpc.errors import ConfigError, LaunchError
from megatron_hpc.run_folder import ATTEMPTS_FILE, RESTART_REQUEST_FILE, write_json
from megatron_hpc.run_markers import FATAL_FILE, STOP_REQUEST_FILE, STOPPED_FILE, write_marker

ALLOC = ("n1", "n2", "n3")


def end(**kw) -> StepEnd:
    base = dict(step=0, nodes=("n1", "n2"), exit_code=1, started_at=100.0, ended_at=130.0, allocation=ALLOC)
    return StepEnd(**{**base, **kw})


def exit_(host: str, t: float, code: int = 1, sig: int | None = None) -> NodeExit:
    return NodeExit(host=host, node_rank=0, exit_code=code, time=t, worker_signal=sig)


STATE = DriverState(num_nodes=2, max_restarts=3)


def test_healthy_nodes_and_the_next_steps_nodes():
    healthy = healthy_nodes(("n1", "n2", "n3", "n4"), unusable={"n2"}, excluded={"n4"})
    assert healthy == ("n1", "n3")
    # the survivors keep their place, a spare fills in; too few nodes is no step at all
    assert step_nodes(("n1", "n3", "n4"), num_nodes=2, previous=("n3", "n2")) == ("n3", "n1")
    assert step_nodes(("n1",), num_nodes=2) == ()
    assert node_unusable("IDLE+DRAIN") and node_unusable("DOWN") and node_unusable("ALLOCATED*")
    assert not node_unusable("ALLOCATED") and not node_unusable("MIXED")


def test_host_names_are_matched_to_the_allocations_node_names():
    assert node_names(["n2.cluster.local", "n3", "other.x"], ALLOC) == ("n2", "n3", "other.x")


def test_stragglers_are_left_out_only_while_enough_nodes_remain():
    assert stragglers_to_exclude(("n1", "n2", "n3"), ["n2", "n9"], num_nodes=2) == ("n2",)
    assert stragglers_to_exclude(("n1", "n2", "n3"), ["n3", "n2"], num_nodes=2) == ("n3",)  # slowest first
    assert stragglers_to_exclude(("n1", "n2"), ["n2"], num_nodes=2) == ()


@pytest.mark.parametrize("facts, reason, lost", [
    (dict(unusable=frozenset({"n2"})), "node_lost", ("n2",)),
    (dict(allocation=("n1", "n3")), "node_lost", ("n2",)),  # --no-kill dropped it from the job
    (dict(hang_suspects=("n2", "n9"), hang_detected_at=120.0), "hang", ("n2",)),
    # the node whose worker was killed, although the other node (a victim) reported first
    (dict(exits=(exit_("n1", 110.0), exit_("n2", 111.0, sig=9))), "rank_failed", ("n2",)),
    (dict(exits=(exit_("n2", 110.0), exit_("n1", 111.0))), "rank_failed", ("n2",)),  # else the first to fail
    (dict(requested=("n1",), stopped=True, exit_code=0), "requested", ("n1",)),
])
def test_why_a_step_failed(facts, reason, lost):
    failure = classify(end(**facts))
    assert (failure.reason, failure.nodes_lost) == (reason, lost)


def test_a_hang_without_suspects_blames_no_node_the_watchdog_killed():
    # Every rank stood at one position: the report names nobody. The watchdog's own SIGKILL of its node's workers
    # reads as "killed by signal 9" in that node's exit record; whichever watchdog fired first is no suspect.
    failure = classify(end(hang_detected_at=120.0, exits=(exit_("n1", 121.0, sig=9), exit_("n2", 122.0))))
    assert (failure.reason, failure.nodes_lost, failure.failed_at) == ("hang", (), 120.0)
    nxt = decide(end(hang_detected_at=120.0, exits=(exit_("n1", 121.0, sig=9),)), STATE)
    assert nxt.action == "restart" and nxt.excluded == frozenset()


def test_a_steps_hang_reports_and_markers_are_the_ones_it_wrote_whatever_the_writers_clock(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    # The step before: a hang report and a stopped.json (a restart request) written on a node whose clock ran a
    # minute ahead of the driver's, so their times are later than the next step's start.
    ahead = time.time() + 60.0
    (tmp_path / "hangs").mkdir()
    write_json(tmp_path / "hangs" / "20260101-000000-n2.json", {"detected_at": ahead, "suspect_nodes": ["n2"]})
    write_json(tmp_path / STOPPED_FILE, {"job_id": "77", "attempt": 0, "time": ahead})
    seen = Seen.now(tmp_path)
    assert hang_reports(tmp_path, seen=seen.hang_reports) == ((), None)
    assert not marker_new(tmp_path, STOPPED_FILE, seen.stopped) and not marker_new(tmp_path, FATAL_FILE, seen.fatal)
    # What this step writes counts, whatever its clock says.
    write_json(tmp_path / "hangs" / "20260101-000100-n3.json", {"detected_at": 5.0, "suspect_nodes": ["n3"]})
    write_marker(tmp_path, STOPPED_FILE, {"reason": "stop request"})
    assert hang_reports(tmp_path, seen=seen.hang_reports) == (("n3",), 5.0)
    assert marker_new(tmp_path, STOPPED_FILE, seen.stopped)


STUB_SCONTROL = """#!/usr/bin/env bash
# scontrol answers the job's node list {answers} time(s), then the controller is too busy to answer (exit 1).
case "$1 $2" in
  "show job") n=$(cat {count} 2>/dev/null || echo 0); echo $((n + 1)) > {count}; [ "$n" -ge {answers} ] && exit 1
    echo "JobId=77 JobState=RUNNING NodeList=n1,n2,n3";;
  "show hostnames") echo "$3" | tr , '\\n';;
  "show node") for n in $(echo "$4" | tr , ' '); do echo "NodeName=$n State=ALLOCATED"; done;;
  "requeue 77") sleep 5;;
esac
"""


def driver_on_stubs(tmp_path, monkeypatch, *, srun: str, answers: int = 1000) -> in_job.Driver:
    """A driver of job 77 (n1,n2,n3; steps of 2 nodes) with stand-ins for scontrol and srun on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = STUB_SCONTROL.format(answers=answers, count=tmp_path / "scontrol-calls")
    for tool, text in (("scontrol", scontrol), ("srun", f"#!/usr/bin/env bash\n{srun}\n")):
        (bin_dir / tool).write_text(text)
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    monkeypatch.setattr(in_job, "SCONTROL_RETRY_S", 0.0)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    return in_job.Driver(run_dir=run_dir, num_nodes=2, max_restarts=3, max_requeues=1, exclude_stragglers=False,
                         srun_tail=["bash", "node.sh", "run"], job_id="77")


def test_scontrol_answering_no_node_list_loses_no_node(tmp_path, monkeypatch):
    driver = driver_on_stubs(tmp_path, monkeypatch, srun="exit 1", answers=1)  # the step fails
    nodes, _ = driver.choose(STATE, ())
    assert nodes == ("n1", "n2")
    end = driver.run_step(0, nodes)  # scontrol answers nothing from here on
    assert end.allocation == ALLOC
    nxt = decide(end, STATE)
    assert nxt.action == "restart" and nxt.failure.reason == "rank_failed" and "n1" not in nxt.excluded


def test_scontrol_answering_nothing_as_the_job_starts_falls_back_to_the_starting_node_list(tmp_path, monkeypatch):
    driver = driver_on_stubs(tmp_path, monkeypatch, srun="exit 0", answers=0)
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n1,n2,n3")
    # Not "fewer than 2 healthy nodes": that would requeue a job holding every node it asked for.
    assert driver.choose(STATE, ()) == (("n1", "n2"), ())
    assert driver.known == ALLOC


def test_a_restart_request_taken_as_the_step_starts_survives_node_sh_clearing_old_stop_requests(tmp_path, monkeypatch):
    # The stand-in for node.sh removes an earlier attempt's stop request as it starts (a second after srun), then
    # stops (exit 0) once a stop request is there; without one it fails after 5 s.
    stop = tmp_path / "run" / STOP_REQUEST_FILE
    driver = driver_on_stubs(tmp_path, monkeypatch, srun=f"sleep 1; rm -f {stop}\n"
                             f"for i in $(seq 50); do [ -e {stop} ] && exit 0; sleep 0.1; done; exit 1")
    write_json(driver.run_dir / RESTART_REQUEST_FILE,
               asdict(RestartRequest(job_id="77", exclude=["n2"], requested_at=time.time())))
    end = driver.run_step(0, ("n1", "n2"))
    assert (end.exit_code, end.requested) == (0, ("n2",))


def test_scontrol_requeue_not_answering_leaves_the_driver_standing_and_the_attempt_recorded(tmp_path, monkeypatch):
    driver = driver_on_stubs(tmp_path, monkeypatch, srun="exit 1")
    monkeypatch.setattr(requeue, "SCONTROL_TIMEOUT_S", 0.5)  # the stand-in's requeue takes 5 s
    assert driver.finish(Next(action="requeue", message="no room"), exit_code=1) == 1
    [line] = (driver.run_dir / ATTEMPTS_FILE).read_text().splitlines()
    assert json.loads(line)["action"] == "requeue" and json.loads(line)["requeued"] is False


def test_a_hung_node_that_only_stopped_answering_pings_is_a_hang_not_a_lost_node():
    # Its slurmd busy tearing the hung step down, SLURM said n2 ALLOCATED* (not responding) for a few seconds.
    assert only_not_responding("ALLOCATED*") and only_not_responding("MIXED+NOT_RESPONDING")
    assert not only_not_responding("DOWN*") and not only_not_responding("IDLE+DRAIN") and \
        not only_not_responding("ALLOCATED")
    quiet = dict(unusable=frozenset({"n2"}), not_responding=frozenset({"n2"}))
    hang = classify(end(**quiet, hang_suspects=("n2",), hang_detected_at=120.0))
    assert (hang.reason, hang.nodes_lost) == ("hang", ("n2",))
    assert classify(end(**quiet)).reason == "node_lost"  # nothing else known: a node that stops answering is lost
    # It wrote its own exit record (a worker killed there): up, and the failure is that worker's.
    killed = classify(end(**quiet, exits=(exit_("n2", 110.0, sig=9), exit_("n1", 111.0))))
    assert (killed.reason, killed.nodes_lost) == ("rank_failed", ("n2",))
    down = classify(end(unusable=frozenset({"n2"}), hang_suspects=("n1",), hang_detected_at=120.0))
    assert (down.reason, down.nodes_lost) == ("node_lost", ("n2",))  # DOWN stays lost, whatever a watchdog said
    gone = classify(end(allocation=("n1", "n3"), not_responding=frozenset({"n2"}), hang_detected_at=120.0))
    assert gone.reason == "node_lost"


def test_failed_at_is_the_first_failure_not_when_the_driver_noticed():
    assert classify(end(exits=(exit_("n2", 110.0, sig=9),))).failed_at == 110.0
    assert classify(end(hang_suspects=("n1",), hang_detected_at=105.0)).failed_at == 105.0


def test_decide_restarts_in_the_job_until_spares_or_the_bound_run_out():
    nxt = decide(end(unusable=frozenset({"n2"})), STATE)
    assert nxt.action == "restart" and nxt.excluded == {"n2"} and "restart 1 of 3" in nxt.message
    # n3 was lost before: with n2 gone too only n1 is left
    fewer = decide(end(unusable=frozenset({"n2"})), DriverState(num_nodes=2, max_restarts=3, excluded={"n3"}))
    assert fewer.action == "requeue" and "1 healthy node(s) left" in fewer.message
    bound = decide(end(unusable=frozenset({"n2"})), DriverState(num_nodes=2, max_restarts=1, restarts_done=1))
    assert bound.action == "requeue" and "launch.max_in_job_restarts=1" in bound.message
    ending = decide(end(unusable=frozenset({"n2"}), job_ending=True), STATE)  # SLURM is ending the job
    assert ending.action == "requeue" and "got SIGTERM" in ending.message


def test_decide_done_stopped_and_fatal_behave_as_without_spares():
    assert decide(end(exit_code=0), STATE).action == "done"
    # a restart asked for as the last step ended comes too late: the run is done
    assert decide(end(exit_code=0, requested=("n1",)), STATE).action == "done"
    assert decide(end(exit_code=0, stopped=True), STATE).action == "stopped"  # SLURM's time signal: requeue
    assert decide(end(exit_code=0, stopped=True, requested=("n1",)), STATE).action == "restart"
    assert decide(end(fatal=True), STATE).action == "fail"


def test_the_worker_signal_comes_from_the_last_steps_torchrun_summary():
    summary = "  rank      : 1 (local_rank: 0)\n  exitcode  : -9 (pid: 7011)  (SIGKILL)\n"
    log = f"megatron-hpc: run phase, node 1 of 2, ...\n{summary}megatron-hpc: run phase, node 1 of 2, ...\nok\n"
    assert worker_signal(log) is None  # the kill was in an earlier step
    assert worker_signal(log + summary) == 9
    assert worker_signal("megatron-hpc: run phase, node 0\n  exitcode  : 1 (pid: 5)\n") is None


def _status(tmp_path, *, spares=1, state="RUNNING", cluster="slurm") -> RunStatus:
    (tmp_path / "config.json").write_text(json.dumps({"launch": {"spare_nodes": spares}}))
    return RunStatus(run_dir=str(tmp_path), recipe="tiny", cluster=cluster, plan={"num_nodes": 2},
                     jobs=[JobStatus(phase="run", job_id="7", state=state, source="scontrol")])


@pytest.mark.parametrize("kw, exclude, unusable, match", [
    (dict(spares=0), ["n1"], set(), "no in-job driver .launch.spare_nodes is 0.*--set launch.spare_nodes=1"),
    (dict(state="COMPLETED"), ["n1"], set(), "not running .job 7 is COMPLETED.*submit --resume"),
    (dict(), ["n9"], set(), "n9 not in job 7's allocation .n1,n2,n3."),
    (dict(), ["n1"], {"n3"}, "leaves 1 healthy node.*needs 2; exclude fewer"),
    (dict(cluster="local"), ["n1"], set(), "need --cluster slurm"),
])
def test_restart_requests_refused_with_the_fix(tmp_path, kw, exclude, unusable, match):
    with pytest.raises(LaunchError, match=match):
        check_request(_status(tmp_path, **kw), exclude, allocation=ALLOC, unusable=frozenset(unusable))
    assert check_request(_status(tmp_path), ["n1"], allocation=ALLOC, unusable=frozenset()) == "7"


def test_restart_cli_writes_nothing_for_a_run_without_spares(tmp_path, cli_in_process):
    run = tmp_path / "run"
    assert cli_in_process("submit", "--recipe", "tiny", "--dry-run", "--out", str(run)).returncode == 0
    (run / "submission.json").write_text(json.dumps({"cluster": "slurm", "jobs": [
        {"phase": "run", "job_id": "7", "state": "RUNNING"}]}))
    proc = cli_in_process("restart", str(run), "--exclude", "node2")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("megatron-hpc: error: ")
    assert "launch.spare_nodes is 0" in proc.stderr
    assert not (run / "restart-request.json").exists()


def test_status_reads_restarts_with_their_cost(tmp_path):
    rows = [{"step": 1, "reason": "node_lost", "nodes_lost": ["n2"], "nodes": ["n1", "n3"], "failed_at": 100.0,
             "detected_at": 101.0, "new_step_started_at": 101.5, "job_id": "7", "attempt": 0},
            {"step": 1, "first_step_done_at": 109.0, "job_id": "7", "attempt": 0},
            {"step": 2, "reason": "requested", "nodes_lost": ["n1"], "nodes": ["n3", "n4"], "failed_at": 200.0,
             "detected_at": 200.0, "new_step_started_at": 201.0, "job_id": "7", "attempt": 0}]
    (tmp_path / "restarts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "rea')
    first, second = read_restarts(tmp_path)
    assert (first.reason, first.nodes_lost, first.cost_s) == ("node_lost", ["n2"], 9.0)
    assert first.breakdown_s == {"detection": 1.0, "restart": 0.5, "first_step": 7.5}
    assert second.cost_s is None  # the new step has not logged an iteration yet
    status = RunStatus(run_dir=str(tmp_path), recipe="tiny", cluster="slurm", plan={}, spare_nodes=1,
                       restarts=[first, second], nodes_lost=["n2", "n1"])
    assert format_status(status).splitlines()[-3:] == [
        "spares    1 hot spare node(s), 2 in-job restart(s); nodes left out: n2 (node_lost), n1 (requested)",
        "restart   job 7 step 1: node_lost without n2, now on n1,n3; cost 9.0 s",
        "restart   job 7 step 2: requested without n1, now on n3,n4; no step logged since"]


def test_plan_counts_the_spares_and_the_sbatch_runs_the_driver(tmp_path, cli_in_process):
    sets = ["--set", "launch.spare_nodes=2", "--set", "data.source=synthetic", "--set", "compile.enabled=false"]
    plan = cli_in_process("plan", "--recipe", "tiny", "--nodes", "2", "--platform", "cpu", *sets)
    assert "nodes       2 + 2 hot spares (idle until a node fails; 4 billed)" in plan.stdout
    out = tmp_path / "run"
    assert cli_in_process("submit", "--recipe", "tiny", "--nodes", "2", "--platform", "cpu", "--dry-run",
                          "--cluster", "slurm", "--out", str(out), *sets).returncode == 0
    sbatch = (out / "run.sbatch").read_text().splitlines()
    assert "#SBATCH --nodes=4" in sbatch and "#SBATCH --no-kill" in sbatch
    assert sbatch[-1] == (f"exec {sys.executable.rsplit('/', 1)[0]}/python -m megatron_hpc.launch.in_job "
                          f"--run-dir {out} --nodes 2 --max-restarts 3 --max-requeues 3 --warm -- --kill-on-bad-exit=1 "
                          f"--cpu-bind=none bash {out}/node.sh run")


def test_spares_may_change_on_resume():
    from megatron_hpc.launch.resume import check_overrides

    check_overrides(["launch.spare_nodes=2", "launch.max_in_job_restarts=5", "launch.exclude_stragglers=true",
                     "launch.warm_restart=false"])
    with pytest.raises(ConfigError, match=r"parallel\.tensor cannot change on --resume"):
        check_overrides(["launch.spare_nodes=1", "parallel.tensor=2"])



ENDING_SCONTROL = """#!/usr/bin/env bash
# A stand-in for scontrol: job 77 on n1,n2,n3 is RUNNING until the test cancels it (the file `cancelled`).
state=RUNNING; [ -e {dir}/cancelled ] && state=CANCELLED
case "$1 $2" in
  "show job") echo "JobId=77 JobState=$state Restarts=0 NodeList=n1,n2,n3";;
  "show hostnames") echo "$3" | tr , '\\n';;
  "show node") for n in $(echo "$4" | tr , ' '); do echo "NodeName=$n State=ALLOCATED"; done;;
  "requeue 77") exit 1;;
esac
"""
# A stand-in for srun: the step runs until SLURM's SIGTERM, then its nodes' tasks fail (exit 1) a moment later.
ENDING_SRUN = """#!/usr/bin/env bash
echo $$ >> {dir}/steps
trap 'sleep 0.5; exit 1' TERM
while :; do sleep 0.1; done
"""


def test_the_batch_script_outlives_slurms_sigterm_to_record_the_attempt_and_starts_no_step_after_it(
        tmp_path, cli_in_process):
    # scancel, a preemption or the time limit: SLURM signals every process of the batch step at once, and once the
    # batch script's own process has exited it kills what is left of the step. That process must be the driver, and
    # the driver must wait for its step to end, not restart in a dying job, and record the attempt before it exits.
    out, bin_dir = tmp_path / "run", tmp_path / "bin"
    assert cli_in_process("submit", "--recipe", "tiny", "--nodes", "2", "--platform", "cpu", "--dry-run", "--cluster",
                          "slurm", "--out", str(out), "--set", "launch.spare_nodes=1", "--set", "data.source=synthetic",
                          "--set", "compile.enabled=false", "--set", "launch.warm_restart=false").returncode == 0
    bin_dir.mkdir()
    for tool, text in (("scontrol", ENDING_SCONTROL), ("srun", ENDING_SRUN)):
        (bin_dir / tool).write_text(text.format(dir=tmp_path))
        (bin_dir / tool).chmod(0o755)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")},
           "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "0"}
    # Its own process group stands for the batch step's processes, as SLURM's process tracking sees them.
    batch = subprocess.Popen(["bash", str(out / "run.sbatch")], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    steps, deadline = tmp_path / "steps", time.monotonic() + 60
    try:
        while not steps.exists() or not steps.read_text().strip():
            assert batch.poll() is None and time.monotonic() < deadline, "no step started"
            time.sleep(0.1)
        (tmp_path / "cancelled").touch()
        os.killpg(batch.pid, signal.SIGTERM)  # scancel: every process of the batch step
        batch.wait(timeout=60)
    finally:  # the batch script's process has ended: SLURM kills what is left of its step
        with contextlib.suppress(ProcessLookupError):
            os.killpg(batch.pid, signal.SIGKILL)
    stdout, _ = batch.communicate(timeout=60)
    rows = (out / ATTEMPTS_FILE).read_text().splitlines() if (out / ATTEMPTS_FILE).exists() else []
    assert batch.returncode == 1 and len(rows) == 1, (batch.returncode, rows, stdout)
    assert len(steps.read_text().split()) == 1, stdout  # no step started in the ending job
    row = json.loads(rows[0])
    assert (row["attempt"], row["action"], row["requeued"]) == (0, "requeue", False)
    assert "the job got SIGTERM" in stdout and "CANCELLED, not RUNNING: left as it is" in stdout, stdout

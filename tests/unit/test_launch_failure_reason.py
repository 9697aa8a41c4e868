"""Why a phase failed, as `submit` reports it, read from node logs shaped like real ones.

The torchrun summaries below follow torch's templates (torch/distributed/elastic/multiprocessing/errors:
_MSG_FORMAT_TEMPLATE, _FAILURE_FORMAT_TEMPLATE); the worker traceback is cut from a real run of
`submit --recipe tiny --cluster local --set optim.lr=-1` (torch 2.13).
"""

from megatron_hpc.launch.failure_reason import explain_failure

TORCHRUN_SUMMARY = """\
============================================================
megatron_hpc FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  exitcode  : 1 (pid: 1234)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""

HEADER = "megatron-hpc: run phase, node {node} of 2, master node1:20005, job 5\n"


def summary(*, rank: int, time: str, traceback: str = "To enable traceback see: https://pytorch.org/docs/"
            "stable/elastic/errors.html", exitcode: str = "1 (pid: 4242) ") -> str:
    return f"""\
Traceback (most recent call last):
  File "/venv/bin/torchrun", line 8, in <module>
    sys.exit(main())
  File "/venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n\
============================================================
megatron_hpc FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : {time}
  host      : node1
  rank      : {rank} (local_rank: 0)
  exitcode  : {exitcode}
  error_file: <N/A>
  traceback : {traceback}
============================================================
"""


WORKER_TRACEBACK = """\
[rank0]: Traceback (most recent call last):
[rank0]:   File "/work/megatron_hpc/train/optim.py", line 38, in build_optimizer
[rank0]:     return torch.optim.AdamW(groups, fused=kind in ("cpu", "cuda"), **kwargs)
[rank0]:   File "/venv/lib/python3.11/site-packages/torch/optim/adam.py", line 59, in __init__
[rank0]:     raise ValueError(f"Invalid learning rate: {lr}")
[rank0]: ValueError: Invalid learning rate: -1.0
E1124 00:44:11.434000 13872 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 0
"""


def write(run_dir, name, text):
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "logs" / name).write_text(text)


def test_trainer_error_line_wins_over_torchrun_boilerplate(tmp_path):
    error = "megatron-hpc: error: compile phase: the loss or gradients were not finite for 2 steps in a row"
    write(tmp_path, "compile-node0.log", f"iteration 1\n{error}\n{TORCHRUN_SUMMARY}")
    write(tmp_path, "compile-node1.log", f"{error}\n{TORCHRUN_SUMMARY}")
    assert explain_failure(tmp_path, "compile") == error  # once, though both nodes logged it


def test_the_workers_exception_wins_over_torchruns_child_failed_error(tmp_path):
    write(tmp_path, "run-node0.log", HEADER.format(node=0) + WORKER_TRACEBACK
          + summary(rank=0, time="2026-11-24_00:44:11"))
    assert explain_failure(tmp_path, "run") == "rank 0: ValueError: Invalid learning rate: -1.0"


def test_the_earliest_root_cause_over_the_nodes_names_the_rank(tmp_path):
    # node 1's rank 3 ran out of memory first; node 0's rank 0 then lost its peer
    write(tmp_path, "run-node0.log", HEADER.format(node=0)
          + "[rank0]: RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer\n"
          + summary(rank=0, time="2026-11-24_10:00:07"))
    write(tmp_path, "run-node1.log", HEADER.format(node=1)
          + "[rank2]: RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer\n"
          + "[rank3]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
          + summary(rank=3, time="2026-11-24_10:00:05"))
    assert explain_failure(tmp_path, "run") == ("rank 3: torch.OutOfMemoryError: CUDA out of memory. Tried to "
                                                "allocate 2.00 GiB")


def test_a_traceback_recorded_by_torchrun_is_used_when_the_worker_printed_none(tmp_path):
    recorded = ('Traceback (most recent call last):\n    File "x.py", line 3, in main\n'
                '      raise KeyError("tokenizer")\n  KeyError: \'tokenizer\'')
    write(tmp_path, "run-node0.log", HEADER.format(node=0) + summary(rank=2, time="t", traceback=recorded))
    assert explain_failure(tmp_path, "run") == "rank 2: KeyError: 'tokenizer'"


def test_a_killed_worker_is_named_with_its_signal(tmp_path):
    write(tmp_path, "run-node0.log", HEADER.format(node=0) + summary(
        rank=1, time="t", exitcode="-9 (pid: 77) (SIGKILL)", traceback="Signal 9 (SIGKILL) received by PID 77"))
    assert explain_failure(tmp_path, "run") == "rank 1: Signal 9 (SIGKILL) received by PID 77"


def test_only_the_last_attempt_of_a_requeued_job_counts(tmp_path):
    first = HEADER.format(node=0) + "[rank0]: RuntimeError: Connection reset by peer\n" + summary(rank=0, time="a")
    last = HEADER.format(node=0) + WORKER_TRACEBACK + summary(rank=0, time="b")
    write(tmp_path, "run-node0.log", first + last)
    assert explain_failure(tmp_path, "run") == "rank 0: ValueError: Invalid learning rate: -1.0"
    error = "megatron-hpc: error: a stop in an earlier attempt"
    write(tmp_path, "run-node0.log", HEADER.format(node=0) + error + "\n" + last)
    assert explain_failure(tmp_path, "run") == "rank 0: ValueError: Invalid learning rate: -1.0"


def test_last_exception_line_of_a_traceback(tmp_path):
    write(tmp_path, "run-node0.log", "Traceback (most recent call last):\n  File \"x.py\", line 1\n"
          "RuntimeError: Connection reset by peer\n" + TORCHRUN_SUMMARY)
    assert explain_failure(tmp_path, "run") == "RuntimeError: Connection reset by peer"


def test_tail_when_nothing_is_recognised(tmp_path):
    write(tmp_path, "run-node0.log", "\n".join(f"line {i}" for i in range(40)))
    reason = explain_failure(tmp_path, "run", lines=3)
    assert reason.endswith("line 37\nline 38\nline 39") and "line 36" not in reason


def test_no_log_at_all(tmp_path):
    assert "no log was written" in explain_failure(tmp_path, "compile")

"""Why a phase failed, as `submit` reports it, read from node logs shaped like real ones."""

from megatron_hpc.launch.submit import explain_failure

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


def write(run_dir, name, text):
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "logs" / name).write_text(text)


def test_trainer_error_line_wins_over_torchrun_boilerplate(tmp_path):
    error = "megatron-hpc: error: compile phase: the loss or gradients were not finite for 2 steps in a row"
    write(tmp_path, "compile-node0.log", f"iteration 1\n{error}\n{TORCHRUN_SUMMARY}")
    write(tmp_path, "compile-node1.log", f"{error}\n{TORCHRUN_SUMMARY}")
    assert explain_failure(tmp_path, "compile") == error  # once, though both nodes logged it


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

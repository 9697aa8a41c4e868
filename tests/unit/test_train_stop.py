"""train/stop.py: the reason a run stops on the node task's stop-request file."""

import json

import pytest
import torch

from megatron_hpc.run_markers import STOP_REQUEST_FILE, write_marker
from megatron_hpc.train.stop import StopWatch


@pytest.mark.parametrize(("written", "reason"), [("USR2", "signal SIGUSR2"), ("TERM", "signal SIGTERM"),
                                                 ("restart request", "stop request")])
def test_a_stop_request_names_the_signal_the_node_task_got(ctx, tmp_path, written, reason):
    # node.sh's trap writes the file when SLURM's USR2 reaches it, often before this rank handles its own copy:
    # the reason is still the signal (CI once read "on stop request" where SIGUSR2 was meant); the in-job
    # driver's request has no signal behind it
    watch = StopWatch(run_dir=tmp_path, time_budget_min=0, is_first_rank=True, device=torch.device("cpu"))
    try:
        assert watch.check(1) is None
        write_marker(tmp_path, STOP_REQUEST_FILE, {"signal": written})
        assert json.loads((tmp_path / STOP_REQUEST_FILE).read_text())["signal"] == written
        decision = watch.check(2)
        assert decision is not None and (decision.iteration, decision.reason) == (2, reason)
    finally:
        watch.close()

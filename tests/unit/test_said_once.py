"""cli/said_once.py: an error line said once per torchrun launch on a node, a different line said too."""

import uuid

from megatron_hpc.cli.said_once import first_to_say

TORCHRUN = {"LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "0"}


def test_the_same_line_is_said_once_and_another_line_too():
    line = f"megatron-hpc: error: {uuid.uuid4()}"  # this process's parent stands for torchrun's agent
    assert first_to_say(line, TORCHRUN) is True
    assert first_to_say(line, TORCHRUN) is False
    assert first_to_say(line + " (rank 1's own)", TORCHRUN) is True
    # torchrun restarting its workers is a new launch: its ranks say it again
    assert first_to_say(line, {**TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "1"}) is True


def test_without_torchrun_every_line_is_said():
    line = f"megatron-hpc: error: {uuid.uuid4()}"
    for env in ({}, {"LOCAL_WORLD_SIZE": "1"}):
        assert first_to_say(line, env) and first_to_say(line, env)

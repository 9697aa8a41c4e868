"""The callable submitit's local executor runs for `submit --cluster local`: the node script of one phase.

On SLURM the sbatch file runs the node script itself (`srun bash node.sh PHASE`, launch/scripts.py);
here the local executor stands in for sbatch and srun on this one machine. It is picklable and imports
neither torch nor the trainer; the node script starts torchrun, which starts `python -m megatron_hpc
train` in each worker.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from dataclasses import dataclass


class PhaseFailedError(RuntimeError):
    """The node script exited non-zero; submitit records the job as FAILED."""


@dataclass(frozen=True)
class NodeTask:
    node_script: str
    phase: str

    def command(self) -> list[str]:
        return ["bash", self.node_script, self.phase]

    def __call__(self) -> int:
        # submitit's own USR2 handler would requeue the job at once and exit, killing the workers in
        # the middle of their save. The node script handles the signal; here it only must not be fatal.
        # (A Python handler, not SIG_IGN: an ignored signal would be inherited by the node script, and
        # bash cannot trap a signal ignored at its start.)
        signal.signal(signal.SIGUSR2, _note_signal)
        # Output goes straight to this task's stdout, which submitit captures.
        sys.stdout.flush()
        code = subprocess.call(self.command())
        if code != 0:
            raise PhaseFailedError(f"{self.phase} phase: `{' '.join(self.command())}` exited with {code}")
        return code


def _note_signal(signum: int, frame: object) -> None:
    print(f"megatron-hpc: node task got {signal.Signals(signum).name}; the node script handles it", flush=True)

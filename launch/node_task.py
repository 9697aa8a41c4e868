"""The callable submitit runs once per node: the node script of one phase.

It is picklable and imports neither torch nor the trainer; the node script starts torchrun,
which starts `python -m megatron_hpc train` in each worker. A compiler wrapper (neuron_parallel_compile
on Trainium) is not put around the node script here but around torchrun inside it
(PhaseSpec.torchrun_wrapper), so that the script publishes the compiled graphs after the wrapper returned.
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
    wrapper: tuple[str, ...] = ()
    """Command around `bash node.sh PHASE` (PhaseSpec.wrapper); empty for every platform."""

    def command(self) -> list[str]:
        return [*self.wrapper, "bash", self.node_script, self.phase]

    def __call__(self) -> int:
        # submitit's own USR2 handler would requeue the job at once and exit, killing the workers in
        # the middle of their save. The node script handles the signal and requeues after the save;
        # here it only must not be fatal. (A Python handler, not SIG_IGN: an ignored signal would be
        # inherited by the node script, and bash cannot trap a signal ignored at its start.)
        signal.signal(signal.SIGUSR2, _note_signal)
        # Output goes straight to this task's stdout, which submitit and srun capture per node.
        sys.stdout.flush()
        code = subprocess.call(self.command())
        if code != 0:
            raise PhaseFailedError(f"{self.phase} phase: `{' '.join(self.command())}` exited with {code}")
        return code


def _note_signal(signum: int, frame: object) -> None:
    print(f"megatron-hpc: node task got {signal.Signals(signum).name}; the node script handles it", flush=True)

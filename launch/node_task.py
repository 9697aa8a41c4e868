"""The callable submitit runs once per node: the node script of one phase.

It is picklable and imports neither torch nor the trainer; the node script starts torchrun,
which starts `python -m megatron_hpc train` in each worker.
"""

from __future__ import annotations

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

    def command(self) -> list[str]:
        return [*self.wrapper, "bash", self.node_script, self.phase]

    def __call__(self) -> int:
        # Output goes straight to this task's stdout, which submitit and srun capture per node.
        sys.stdout.flush()
        code = subprocess.call(self.command())
        if code != 0:
            raise PhaseFailedError(f"{self.phase} phase: `{' '.join(self.command())}` exited with {code}")
        return code

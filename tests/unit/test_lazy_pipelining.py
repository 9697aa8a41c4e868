"""torch.distributed.pipelining (it imports dynamo and DTensor: about a second of CPU) is imported only when a
pipeline is built: a trainer, `generate`, `serve` or a whole-model `evaluate` process without one never pays it."""

from __future__ import annotations

import subprocess
import sys

MODULES = ("megatron_hpc.train.entry", "megatron_hpc.evaluate.scoring", "megatron_hpc.generate.engine",
           "megatron_hpc.generate.serving", "megatron_hpc.parallel.pipeline", "megatron_hpc.evaluate.pipelined")


def test_pipelining_is_imported_only_to_build_a_pipeline() -> None:
    code = (f"import sys\nimport {', '.join(MODULES)}\n"
            "print(sorted(m for m in ('torch.distributed.pipelining', 'torch._dynamo') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout

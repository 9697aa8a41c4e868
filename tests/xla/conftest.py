"""Shared by the xla tier's modules: the environment of the fresh processes that run real torch-xla on XLA:CPU."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    # Found, not imported: importing torch_xla (dynamo, inductor) costs this process about 10 CPU seconds, and only
    # the fresh processes below use it (tests/xla/env.sh checked that it imports).
    if importlib.util.find_spec("torch_xla") is None:
        pytest.fail("the xla tests need a real torch-xla; run them with bash tests/xla/run.sh (see tests/xla/env.sh)")
    out = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "XLA_USE_BF16",
                        "XLA_DOWNCAST_BF16")}
    out["PJRT_DEVICE"] = "CPU"
    # LLVM's optimisation off: XLA:CPU compiles this model's graphs about 4x faster, and the results are the same
    # (the float semantics are XLA's, not LLVM's: no fast-math). Compiling is most of this tier's time.
    out["XLA_FLAGS"] = (out.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
    out["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), out.get("PYTHONPATH", "")])
    return out

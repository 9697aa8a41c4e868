"""kubectl for the Kubernetes rendering tests: the one on PATH, else Debian's `kubernetes-client` installed with
apt-get (as root, like the SLURM packages of tests/slurm). It fails, never skips: a check that did not run is not
a pass. No cluster is used: kubectl only parses the files offline (`kubectl label --local`)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

APT_TIMEOUT_S = 600


@pytest.fixture(scope="session")
def kubectl() -> str:
    found = shutil.which("kubectl")
    if found:
        return found
    if os.geteuid() != 0:
        pytest.fail("kubectl is not on PATH and the tests are not root to install it; "
                    "run `apt-get install kubernetes-client` (Debian 12) and run the tests again")
    # The SLURM tier may be installing its packages at the same time (tests/run.sh runs it alongside): apt's own
    # locks would fail at once, so both installs take this lock first (slurm/local-cluster-start.sh does too).
    install = ("apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "
               "kubernetes-client")
    proc = subprocess.run(["flock", "/tmp/megatron-hpc-apt.lock", "sh", "-c", install], capture_output=True, text=True,
                          timeout=APT_TIMEOUT_S)
    found = shutil.which("kubectl")
    if proc.returncode != 0 or not found:
        pytest.fail(f"apt-get install kubernetes-client failed: {proc.stderr[-500:]}")
    return found

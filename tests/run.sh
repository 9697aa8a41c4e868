#!/usr/bin/env bash
# The project's test command (README, .ci/run). On a fresh Debian 12 machine as root it installs
# everything the suite needs: torch 2.13.0 (first, so this package's `torch>=2.4` is already met; the CPU
# build when pip finds its wheel locally, else install it from PyTorch's CPU wheel index first, as the
# README says: the default index gives the CUDA build on Linux), this package with its test extras, and
# (through the slurm fixture) Debian's Slurm and MariaDB.
# The SLURM tests run on a real local cluster that tests/slurm/conftest.py starts and stops.
# Then the xla tier (tests/xla/run.sh): real torch-xla 2.9 on XLA:CPU, in its own environment that it
# builds once and caches (torch 2.9 with its CUDA libraries, about 4 GB). Arguments go to the main
# suite's pytest; the xla tier always runs whole. Fails if either tier fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

"$PY" -m pip install -q --disable-pip-version-check torch==2.13.0
"$PY" -m pip install -q --disable-pip-version-check -e '.[test]'

"$PY" -m ruff check .
set +e
"$PY" -m pytest -m "not gpu and not neuron and not xla" "$@"
main=$?
# exit 5 means no test ran at all: a broken suite, not a pass
[ "$main" -eq 5 ] && echo "no tests were collected" >&2
bash tests/xla/run.sh -q
xla=$?
set -e
if [ "$main" -ne 0 ] || [ "$xla" -ne 0 ]; then
    echo "tests/run.sh: FAILED (main suite exit $main, xla tier exit $xla)" >&2
    [ "$main" -ne 0 ] && exit "$main"
    exit "$xla"
fi

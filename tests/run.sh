#!/usr/bin/env bash
# The project's test command (README, .ci/run). On a fresh Debian 12 machine as root it installs
# everything the suite needs: torch 2.13.0 (first, so this package's `torch>=2.4` is already met; the CPU
# build when pip finds its wheel locally, else install it from PyTorch's CPU wheel index first, as the
# README says: the default index gives the CUDA build on Linux), this package with its test extras, and
# (through the slurm fixture) Debian's Slurm and MariaDB.
# The SLURM tests run on a real local cluster that tests/slurm/conftest.py starts and stops.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

"$PY" -m pip install -q --disable-pip-version-check torch==2.13.0
"$PY" -m pip install -q --disable-pip-version-check -e '.[test]'

"$PY" -m ruff check .
set +e
"$PY" -m pytest -m "not gpu and not neuron and not xla" "$@"
code=$?
set -e
# exit 5 means no test ran at all: a broken suite, not a pass
[ "$code" -eq 5 ] && echo "no tests were collected" >&2
exit "$code"

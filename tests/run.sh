#!/usr/bin/env bash
# The project's test command (README, .ci/run). On a fresh Debian 12 machine as root it installs
# everything the suite needs: torch 2.13.0 (first, so this package's `torch>=2.4` is already met; the CPU
# build when pip finds its wheel locally, else install it from PyTorch's CPU wheel index first, as the
# README says: the default index gives the CUDA build on Linux), this package with its test extras, and
# (through the slurm fixture) Debian's Slurm and MariaDB.
#
# Four pytest sessions, each with its own --basetemp, side by side:
# - the SLURM tier (tests marked slurm) on a real local cluster that tests/slurm/conftest.py starts and
#   stops. Its tests mostly wait on the scheduler, on job start-up and on requeues, so it runs in the
#   background; its output is printed when it ends.
# - the multiprocess tier (tests marked multiprocess: gloo process groups, torchrun), in the background too.
# - the rest of the main suite (unit and k8s tests), in the foreground. A unit test is one Python process
#   that mostly keeps one core busy, so beside the multiprocess tier the machine's cores are used, not taken
#   in turns.
# - the xla tier (tests/xla/run.sh): real torch-xla 2.9 on XLA:CPU, in its own environment that it builds
#   once and caches (torch 2.9 with its CUDA libraries, about 4 GB). The build, mostly a download, starts
#   first in the background, and the tier runs there as soon as it is built, beside the others.
# Arguments go to the first three sessions' pytest; the xla tier always runs whole. Fails if any tier fails.
#
# One thread per process (OMP_NUM_THREADS=1, unless set): the sessions and their processes outnumber the cores,
# and an intra-op thread pool wider than the process's share of the cores spins waiting for its other threads:
# with two threads the main suite took about 1.7x the CPU time of one, and a loaded machine's wall time up to ten
# times (docs/testing.md). The models the tests train are too small for a second thread to help.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

work=$(mktemp -d "${TMPDIR:-/tmp}/megatron-hpc-tests.XXXXXX")
# The xla tier's environment needs nothing installed here (tests/xla/env.sh), so its build, mostly a download,
# starts first; tests/xla/run.sh then finds it in its cache (or says why it could not be built).
( bash tests/xla/env.sh > "$work/xla-env.log" 2>&1 || cat "$work/xla-env.log"; bash tests/xla/run.sh -q ) \
    > "$work/xla.log" 2>&1 &
xla_pid=$!

"$PY" -m pip install -q --disable-pip-version-check torch==2.13.0
"$PY" -m pip install -q --disable-pip-version-check -e '.[test]'

"$PY" -m ruff check .

set +e
skip="not gpu and not neuron and not xla"
# The slurm and multiprocess sessions leave out the folders that hold none of their tests, whose modules they would
# otherwise import only to deselect every test (about 8 CPU seconds each); test_tier_folders.py keeps the markers
# in their folders.
others=(--ignore=tests/unit --ignore=tests/k8s --ignore=tests/xla)
"$PY" -m pytest -m "slurm and $skip" --basetemp "$work/slurm" "${others[@]}" --ignore=tests/multiprocess "$@" \
    > "$work/slurm.log" 2>&1 &
slurm_pid=$!
"$PY" -m pytest -m "multiprocess and not slurm and $skip" --basetemp "$work/mp" "${others[@]}" \
    --ignore=tests/slurm "$@" > "$work/mp.log" 2>&1 &
mp_pid=$!
"$PY" -m pytest -m "not multiprocess and not slurm and $skip" --basetemp "$work/main" "$@"
main=$?
wait "$mp_pid"
mp=$?
echo "--- multiprocess tier (ran beside the tests above) ---"
cat "$work/mp.log"
wait "$slurm_pid"
slurm=$?
echo "--- SLURM tier (ran beside the tests above) ---"
cat "$work/slurm.log"
wait "$xla_pid"
xla=$?
echo "--- xla tier (ran beside the tests above once its environment was built) ---"
cat "$work/xla.log"
set -e
# exit 5 means no test ran at all: a broken suite, not a pass
[ "$main" -eq 5 ] && echo "no tests were collected in the unit tier" >&2
[ "$mp" -eq 5 ] && echo "no tests were collected in the multiprocess tier" >&2
[ "$slurm" -eq 5 ] && echo "no tests were collected in the SLURM tier" >&2
if [ "$main" -ne 0 ] || [ "$mp" -ne 0 ] || [ "$slurm" -ne 0 ] || [ "$xla" -ne 0 ]; then
    echo "tests/run.sh: FAILED (unit tier exit $main, multiprocess tier exit $mp, SLURM tier exit $slurm," \
         "xla tier exit $xla)" >&2
    for code in "$main" "$mp" "$slurm"; do
        [ "$code" -ne 0 ] && exit "$code"
    done
    exit "$xla"
fi
rm -rf "$work"

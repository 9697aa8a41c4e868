#!/usr/bin/env bash
# The xla tier: builds or reuses its own environment (tests/xla/env.sh: torch and torch-xla 2.9 pinned, cached),
# then runs tests/xla in it on XLA:CPU. Extra arguments go to pytest. tests/run.sh calls it after the main suite.
# Fails (never skips) when the environment cannot be built.
set -euo pipefail
cd "$(dirname "$0")/../.."
if ! xla_python=$(bash tests/xla/env.sh | tail -n 1) || [ -z "$xla_python" ]; then
    echo "xla tier: FAILED: its environment could not be built (see above); the tier did not run" >&2
    exit 1
fi
# The project comes from this checkout, not from an install: one cached environment serves every clone.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PJRT_DEVICE=CPU
set +e
"$xla_python" -m pytest -m xla tests/xla "$@"
code=$?
set -e
[ "$code" -eq 5 ] && echo "xla tier: no tests were collected" >&2
exit "$code"

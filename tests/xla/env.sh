#!/usr/bin/env bash
# The xla tier's own environment: torch and torch-xla pinned (torch-xla needs its own torch, which
# cannot live beside the main suite's CPU torch), plus the project's runtime needs from setup.cfg and
# pytest. The project itself is not installed: the tier imports it from the checkout (PYTHONPATH),
# so one cached venv serves every clone.
#
# Prints the venv's python on the last line of stdout; progress goes to stderr. The venv is cached
# under $MEGATRON_HPC_CI_CACHE (default ~/.cache/megatron-hpc-ci), in a folder keyed by the pins, the
# Python version and the requirement list. It is reused only if it was finished (.complete) and its
# python still imports the pinned torch and torch-xla; anything else is removed and built again.
# Exits non-zero with one line on stderr when it cannot be built: the tier then fails, it never skips.
set -euo pipefail
cd "$(dirname "$0")/../.."

TORCH_VERSION=2.9.0
TORCH_XLA_VERSION=2.9.0
PY=${PYTHON:-python3}

# The project's install_requires (minus torch, pinned above) and pytest: one requirement a line.
reqs=$("$PY" - <<'PYEOF'
import configparser
cfg = configparser.ConfigParser()
cfg.read("setup.cfg")
lines = [r.strip() for r in cfg["options"]["install_requires"].splitlines()]
print("\n".join(r for r in lines if r and not r.startswith("#") and not r.startswith("torch")))
print("pytest>=8")
PYEOF
)
pyver=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
digest=$(printf '%s\n' "$TORCH_VERSION" "$TORCH_XLA_VERSION" "$pyver" "$reqs" | sha256sum | cut -c1-12)
home=~  # from the password database when HOME is unset
root=${MEGATRON_HPC_CI_CACHE:-${XDG_CACHE_HOME:-$home/.cache}/megatron-hpc-ci}
venv=$root/xla-torch$TORCH_VERSION-xla$TORCH_XLA_VERSION-py$pyver-$digest
mkdir -p "$root"

healthy() {
    [ -f "$venv/.complete" ] && "$venv/bin/python" - "$TORCH_VERSION" "$TORCH_XLA_VERSION" <<'PYEOF' 2>/dev/null
import sys
import torch, torch_xla, pytest, yaml, numpy  # noqa: F401
assert torch.__version__.split("+")[0] == sys.argv[1], torch.__version__
assert torch_xla.__version__.split("+")[0] == sys.argv[2], torch_xla.__version__
PYEOF
}

# uv, installed from the package index into the new venv, installs the wheels: it downloads them side by side and
# compiles the bytecode in parallel, in less time than pip (docs/testing.md). The bytecode is compiled here, not
# left to the first import: where PYTHONDONTWRITEBYTECODE is set nothing would ever write it, and every process of
# the tier would compile torch and torch_xla again (about 60% more CPU for the tier). uv's cache sits beside the
# venv on the same disk, so the files are hard-linked into the venv rather than copied, and it is removed
# afterwards: the venv is the cache. uv does not read pip's configuration, so an index set for pip (PIP_INDEX_URL,
# pip.conf) is handed to it.
install_into() {
    local venv=$1 pip_index
    "$PY" -m venv "$venv" || return 1
    PIP_NO_CACHE_DIR=1 "$venv/bin/python" -m pip install -q --disable-pip-version-check "uv>=0.5" || return 1
    pip_index=${PIP_INDEX_URL:-$("$venv/bin/python" -m pip config get global.index-url 2>/dev/null || true)}
    if [ -n "$pip_index" ] && [ -z "${UV_DEFAULT_INDEX:-}${UV_INDEX_URL:-}" ]; then
        export UV_DEFAULT_INDEX=$pip_index
    fi
    # shellcheck disable=SC2046  # one requirement a word
    UV_CACHE_DIR=$uv_cache UV_LINK_MODE=hardlink "$venv/bin/uv" pip install --quiet --compile-bytecode \
        --python "$venv/bin/python" \
        "torch==$TORCH_VERSION" "torch-xla==$TORCH_XLA_VERSION" $(printf '%s\n' "$reqs" | tr '\n' ' ')
}

# One build at a time per cache (two CI runs on one machine would otherwise race on the folder).
exec 9>"$root/.xla-env.lock"
flock 9
if healthy; then
    echo "xla tier: reusing $venv" >&2
else
    echo "xla tier: building $venv (torch $TORCH_VERSION with its CUDA libraries, about 4 GB, and torch-xla" \
         "$TORCH_XLA_VERSION)" >&2
    rm -rf "$venv"
    # Older keys (other pins) are ~5 GB each and never used again.
    find "$root" -mindepth 1 -maxdepth 1 -type d -name 'xla-*' -exec rm -rf {} +
    log=$root/xla-env-build.log
    uv_cache=$root/.uv-build
    rm -rf "$uv_cache"
    if ! install_into "$venv" >"$log" 2>&1; then
        rm -rf "$uv_cache"
        tail -n 20 "$log" >&2
        echo "xla tier: error: could not build $venv (log: $log); check the network and disk space" >&2
        exit 1
    fi
    rm -rf "$uv_cache"
    touch "$venv/.complete"
    if ! healthy; then
        echo "xla tier: error: $venv was built but does not import torch $TORCH_VERSION and torch-xla" \
             "$TORCH_XLA_VERSION; see $log" >&2
        exit 1
    fi
fi
echo "$venv/bin/python"

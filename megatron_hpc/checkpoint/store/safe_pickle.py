"""What a checkpoint's pickle may name, and the one-line refusal of anything else.

Loading is torch's weights-only unpickler (it never imports or calls anything outside an allowlist) with exactly the
globals that Megatron-family checkpoints hold added (shared/reference/neuron-xla.md 1.3, megatron-and-launchers.md 3.2):

- `argparse.Namespace`: Megatron-LM's `args`;
- numpy arrays, dtypes and scalars: `np_rng_state` is `np.random.get_state()`, a uint32 array. numpy 1 pickles them as
  `numpy.core.multiarray._reconstruct` / `scalar`, numpy 2 as `numpy._core.multiarray...`: both names are accepted,
  whichever numpy is installed. Object, void and datetime dtypes are not;
- `io.BytesIO`: Transformer Engine's `_extra_state` in older megatron-core checkpoints (pickled with a call of
  `bytes()`, answered by a `bytes` that builds from bytes only, never from a count to allocate);
- torch_xla's `TensorReference` (xser main files), passed in by the xser reader.

Megatron's own classes inside `args` (enums such as AttnBackend, small config objects) are not imported: each such
global from a `megatron.` module is answered by an inert stand-in that only records its arguments and state
(`ForeignObject`). Anything else (os.system, builtins.eval, ...) is refused before it is looked up.
"""

from __future__ import annotations

import argparse
import io
import pickle
import re
from typing import Any

import numpy as np

FOREIGN_MODULES = ("megatron.",)
"""Modules whose globals are answered by an inert ForeignObject instead of being refused."""

_GLOBAL_RE = re.compile(r"GLOBAL ([A-Za-z_][\w.]*)")
_CLASS_RE = re.compile(r"<class '([\w.]+)'>")
_FUNCTION_RE = re.compile(r"unrecognized function (<[^>]*>|[\w.]+)")
# torch's weights-only unpickler (torch/_weights_only_unpickler.py) on bytes that are not a pickle: a zeroed or
# overwritten region gives "Unsupported operand 0". Damage, not an object refused: "holds an object" misled.
_BROKEN_RE = re.compile(r"Unsupported operand \d+|String is too long|unsupported persistent id encountered")


class ForeignObject:
    """An object of a class we never import (Megatron's enums and configs inside `args`): its arguments and state."""

    qualified_name = "?"

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.qualified_name}{self.args if getattr(self, 'args', None) else ''}>"


def _bytes(*args: Any) -> bytes:
    """builtins.bytes for BytesIO's state: from nothing or from bytes, never bytes(n) (n zero bytes to allocate)."""
    if args and not isinstance(args[0], (bytes, bytearray, str)):
        raise pickle.UnpicklingError(f"bytes() of a {type(args[0]).__name__} is not read")
    return bytes(*args)


def _numpy_globals() -> list[Any]:
    """numpy's array, dtype and scalar reconstructors under the numpy 1 and numpy 2 module names."""
    try:
        from numpy._core import multiarray  # numpy 2
    except ImportError:  # numpy 1
        from numpy.core import multiarray  # type: ignore[no-redef]
    out: list[Any] = [np.ndarray, np.dtype]
    for name in ("_reconstruct", "scalar"):
        fn = getattr(multiarray, name)
        out += [(fn, f"numpy.core.multiarray.{name}"), (fn, f"numpy._core.multiarray.{name}")]
    # A dtype is rebuilt by numpy.dtype(...) and then given its state (BUILD), which needs its exact class
    # (numpy.dtypes.UInt32DType and the like since numpy 1.25).
    codes = np.typecodes["AllInteger"] + np.typecodes["AllFloat"] + "?SU"
    out += sorted({type(np.dtype(c)) for c in codes}, key=lambda t: t.__name__)
    return out


def allowed_globals(extra: tuple[type, ...] = (), foreign: tuple[str, ...] = ()) -> list[Any]:
    """torch.serialization.safe_globals' list: ours, `extra`, and a ForeignObject class for each name in `foreign`."""
    stubs = [(type(name.rsplit(".", 1)[-1], (ForeignObject,), {"qualified_name": name}), name) for name in foreign]
    return [argparse.Namespace, io.BytesIO, (_bytes, "builtins.bytes"), *_numpy_globals(), *extra, *stubs]


def refused_global(message: str) -> str | None:
    """The global torch's weights-only unpickler refused, from its error message (None when it names none)."""
    for pattern in (_GLOBAL_RE, _CLASS_RE, _FUNCTION_RE):
        match = pattern.search(message)
        if match:
            return match.group(1)
    return None


def is_foreign(name: str) -> bool:
    """Whether `name` is a global answered by a ForeignObject (a class of Megatron's) rather than refused."""
    return name.startswith(FOREIGN_MODULES)


def refusal(what: object, message: str) -> str:
    """The one-line error for a pickle that asked for something we do not load, or that is no pickle at all."""
    broken = _BROKEN_RE.search(message)
    if broken:
        return (f"{what} is not a readable pickle ({broken.group(0)}; nothing in it ran); it is damaged or truncated, "
                "copy it again")
    name = refused_global(message)
    asks = f"asks for {name}" if name else "holds an object"
    return (f"{what} {asks}, which a checkpoint may not contain, so it was not loaded (nothing in it ran); "
            "a checkpoint may hold tensors, numbers, strings, lists, dicts, argparse.Namespace and numpy arrays")

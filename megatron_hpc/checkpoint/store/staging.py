"""A whole checkpoint written away from the reader's eyes: every file goes into iter_XXXXXXX.tmp-<token> under the
checkpoint folder, which the writer then renames into place; a failure removes the temporary folder, so a reader
never meets half a checkpoint and an interrupted conversion leaves nothing behind."""

from __future__ import annotations

import contextlib
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from megatron_hpc.checkpoint.store import paths
from megatron_hpc.errors import CheckpointError


@contextmanager
def staged_iteration(root: Path, iteration: int) -> Iterator[Path]:
    """The empty temporary folder of `iteration` under `root` (made, with `root`), for the body to fill and move into
    place. On any exception the folder is removed, and `root` too when this call made it and it is empty again (a
    convert that fails on a damaged source mid-way leaves no empty --out folder); an OSError becomes one
    CheckpointError line."""
    made = not root.exists()
    root.mkdir(parents=True, exist_ok=True)
    tmp = paths.temp_dir(root, iteration, secrets.token_hex(4))
    tmp.mkdir()
    try:
        yield tmp
    except OSError as exc:
        _remove(tmp, root if made else None)
        raise CheckpointError(f"writing {root} failed ({exc}); nothing was left behind") from None
    except BaseException:
        _remove(tmp, root if made else None)
        raise


def _remove(tmp: Path, root: Path | None) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    if root is not None:
        with contextlib.suppress(OSError):  # only when empty: another writer may have put something there meanwhile
            root.rmdir()

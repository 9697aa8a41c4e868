"""Checks of a recipe's data made before anything is queued: every prefix of the blend opens.

Opening an IndexedDataset validates the whole index against the .bin size (a few milliseconds
for millions of documents), so a missing, truncated or foreign file fails at `submit` time
instead of after the job waited in the queue. numpy only; no torch.
"""

from __future__ import annotations

from pathlib import Path

from megatron_hpc.config.schema import DataConfig
from megatron_hpc.data.blending import parse_blend
from megatron_hpc.data.indexed import IndexedDataset
from megatron_hpc.errors import DataError

DEMO_DIR = Path("~/.cache/megatron-hpc/demo")


def check_data(data: DataConfig) -> None:
    """Raise DataError with a fix when the data of an indexed recipe cannot be read."""
    if data.source != "indexed":
        return
    if not data.path:
        raise DataError("data.source is indexed but data.path is not set; use --set data.path=PREFIX "
                        "(the .bin/.idx prefix) or --set data.source=synthetic")
    blend = parse_blend(data.path)
    for prefix in blend.prefixes:
        try:
            IndexedDataset(prefix)
        except DataError as exc:
            if Path(prefix).expanduser().parent == DEMO_DIR.expanduser():
                raise DataError(f"{exc}. Build the demo data first: megatron-hpc data demo") from None
            raise

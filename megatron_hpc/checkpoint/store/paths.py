"""Pure folder-layout functions of a checkpoint root (no I/O).

Layout (shared/reference/megatron-and-launchers.md 3.1, neuron-xla.md 1.3):

    <root>/latest_checkpointed_iteration.txt      str(iteration), no newline, or "release"
    <root>/iter_0000100/manifest.json             ours: mesh, size and crc32 of every file
    <root>/iter_0000100/mp_rank_00/model_optim_rng.pt                            (PP == 1)
    <root>/iter_0000100/mp_rank_00_003/model_optim_rng.pt                        (PP > 1: tp 0, pp 3)
    <root>/iter_0000100/mp_rank_00/model_optim_rng.pt.tensors/tensor_<tid>.pt   (xser only)
    <root>/iter_0000100.tmp-<id>/                 a save in progress, renamed when complete
"""

from __future__ import annotations

import re
from pathlib import Path

TRACKER = "latest_checkpointed_iteration.txt"
MAIN_FILE = "model_optim_rng.pt"
MANIFEST = "manifest.json"
RELEASE = "release"

_ITER_RE = re.compile(r"^iter_(\d{7,})$")
_TMP_RE = re.compile(r"^iter_(\d{7,})\.tmp-[0-9a-z]+$")
_RANK_RE = re.compile(r"^mp_rank_(\d{2,})(?:_(\d{3,}))?(?:_(\d{3,}))?$")


def iteration_dirname(iteration: int) -> str:
    """'iter_{:07d}', Megatron's get_checkpoint_name."""
    return f"iter_{iteration:07d}"


def iteration_dir(root: Path, iteration: int | str) -> Path:
    """The folder of one checkpoint; iteration "release" gives <root>/release."""
    return root / (RELEASE if iteration == RELEASE else iteration_dirname(int(iteration)))


def temp_dir(root: Path, iteration: int, token: str) -> Path:
    """Where a save writes before the rename: iter_XXXXXXX.tmp-<token>."""
    return root / f"{iteration_dirname(iteration)}.tmp-{token}"


def rank_dirname(tp_rank: int, pp_rank: int = 0, *, pp_size: int = 1) -> str:
    """Megatron's get_checkpoint_name: 'mp_rank_{tp:02d}' without pipeline parallelism, else
    'mp_rank_{tp:02d}_{pp:03d}' (the PP suffix appears whenever pp_size > 1, on every stage)."""
    if pp_size == 1:
        return f"mp_rank_{tp_rank:02d}"
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def parse_rank_dirname(name: str) -> tuple[int, int | None, int | None] | None:
    """(tp, pp, ep) of 'mp_rank_TT[_PPP[_EEE]]' (pp and ep None when absent; EEE is Megatron's expert-parallel
    rank), None for any other name."""
    match = _RANK_RE.match(name)
    if match is None:
        return None
    tp, pp, ep = match.groups()
    return int(tp), None if pp is None else int(pp), None if ep is None else int(ep)


def main_file(ckpt_dir: Path, tp_rank: int, pp_rank: int = 0, *, pp_size: int = 1) -> Path:
    return ckpt_dir / rank_dirname(tp_rank, pp_rank, pp_size=pp_size) / MAIN_FILE


def tensors_dir(main: Path) -> Path:
    """xser's tensor folder: the main file's path plus '.tensors'."""
    return main.with_name(main.name + ".tensors")


def tensor_file(main: Path, tid: int) -> Path:
    return tensors_dir(main) / f"tensor_{tid}.pt"


def tracker_file(root: Path) -> Path:
    return root / TRACKER


def parse_iteration_dirname(name: str) -> int | None:
    """The iteration of a final folder name, None for anything else (temp folders included)."""
    match = _ITER_RE.match(name)
    return int(match.group(1)) if match else None


def is_temp_dirname(name: str) -> bool:
    return _TMP_RE.match(name) is not None


def parse_tracker(text: str) -> int | str | None:
    """The tracker's iteration, "release", or None when the text is neither (Megatron read_metadata)."""
    value = text.strip()
    if value == RELEASE:
        return RELEASE
    return int(value) if value.isdigit() else None


def io_phase(*, local_index: int, io_workers_per_node: int) -> int:
    """Phase in which the `local_index`-th I/O rank of a node reads or writes (0-based)."""
    return local_index // max(1, io_workers_per_node)


def num_io_phases(*, ranks_per_node: int, io_workers_per_node: int) -> int:
    """Phases needed so that at most io_workers_per_node ranks of a node do I/O at once."""
    workers = max(1, io_workers_per_node)
    return max(1, -(-ranks_per_node // workers))


# Writers: DP rank 0 of each (tp, pp) pair. With Megatron's rank layout (tp fastest, then dp, then pp;
# plan/mesh.py) a rank's DP coordinate is (rank // tp) % dp, so with pipeline parallelism the writers of a
# node are not its first ranks: each stage's writers sit tp * dp ranks apart.

def is_writer_rank(rank: int, *, tp_size: int, dp_size: int) -> bool:
    return (rank // tp_size) % dp_size == 0


def writer_local_index(*, rank: int, ranks_per_node: int, tp_size: int, dp_size: int) -> int:
    """Index of writer `rank` among the writers of its node (what its write phase is taken from)."""
    start = rank - rank % ranks_per_node
    return sum(is_writer_rank(r, tp_size=tp_size, dp_size=dp_size) for r in range(start, rank))


def num_write_phases(*, world_size: int, ranks_per_node: int, tp_size: int, dp_size: int,
                     io_workers_per_node: int) -> int:
    """Phases every rank steps through on a save: enough for the node with the most writers."""
    most = 0
    for start in range(0, world_size, ranks_per_node):
        ranks = range(start, min(start + ranks_per_node, world_size))
        most = max(most, sum(is_writer_rank(r, tp_size=tp_size, dp_size=dp_size) for r in ranks))
    return num_io_phases(ranks_per_node=most, io_workers_per_node=io_workers_per_node)

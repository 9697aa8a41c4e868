"""The Neuron persistent compile cache on disk: where its root is, and what state each entry is in.

Format facts come from shared/reference/neuron-xla.md section 2:
- root (2.1): `--cache_dir` in NEURON_CC_FLAGS, else NEURON_COMPILE_CACHE_URL, else /var/tmp/neuron-compile-cache;
- layout (2.2): `<root>/neuronxcc-<compiler version>/MODULE_<graph hash>+<flags hash>/` holding
  model.hlo_module.pb, compile_flags.json, model.neff, model.done, model.log and `*.lock` while compiling.
We treat the layout as opaque beyond `neuronxcc-*/MODULE_*` (2.2, last caveat) and never follow a symlink:
scans use os.scandir with follow_symlinks=False, so a link in the cache cannot lead a scan (or a prune) outside.
"""

from __future__ import annotations

import enum
import os
import re
import shlex
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from megatron_hpc.errors import CompileCacheError

NEURON_DEFAULT_ROOT = "/var/tmp/neuron-compile-cache"
VERSION_PREFIX = "neuronxcc-"
MODULE_PREFIX = "MODULE_"
NEFF = "model.neff"
DONE = "model.done"
LOG = "model.log"
HLO_NAMES = ("model.hlo_module.pb", "model.hlo.pb")  # the second is what older releases wrote (2.2)
LOCK_SUFFIX = ".lock"
OLD_LAYOUT_SUBDIR = "neuron-compile-cache"  # older libneuronxla nested entries here under a custom --cache_dir

# Ray's XLA backend reads the explicit cache dir out of NEURON_CC_FLAGS with `--cache_dir[= ](\S+)` (2.5).
_CACHE_DIR_FLAG = re.compile(r"--cache_dir[= ](\S+)")
_MODULE_NAME = re.compile(r"^MODULE_(?P<graph>[0-9A-Za-z]+)\+(?P<flags>[0-9A-Za-z]+)$")


@dataclass(frozen=True, kw_only=True, slots=True)
class CacheRoot:
    """Where the cache is and which setting chose it."""

    path: Path
    source: str
    """`NEURON_CC_FLAGS --cache_dir`, `NEURON_COMPILE_CACHE_URL` or `default`."""
    warnings: tuple[str, ...] = ()


def resolve_root(env: Mapping[str, str] | None = None) -> CacheRoot:
    """The cache root exactly as Neuron picks it from `env` (default: os.environ).

    "The cache URL specified using `--cache_dir` is prioritized over that specified using
    `NEURON_COMPILE_CACHE_URL`" (neuron-xla.md 2.1). S3 caches are not files we can inspect.
    """
    env = os.environ if env is None else env
    flags = env.get("NEURON_CC_FLAGS", "")
    warnings: list[str] = []
    if "--no_cache" in _split_flags(flags):
        warnings.append("NEURON_CC_FLAGS has --no_cache: the compiler neither reads nor writes this cache")
    match = _CACHE_DIR_FLAG.search(flags)
    if match:
        url, source = match.group(1).strip("'\""), "NEURON_CC_FLAGS --cache_dir"
        if env.get("NEURON_COMPILE_CACHE_URL"):
            warnings.append(f"NEURON_COMPILE_CACHE_URL={env['NEURON_COMPILE_CACHE_URL']} is ignored: "
                            "--cache_dir in NEURON_CC_FLAGS takes precedence")
    elif env.get("NEURON_COMPILE_CACHE_URL"):
        url, source = env["NEURON_COMPILE_CACHE_URL"], "NEURON_COMPILE_CACHE_URL"
    else:
        url, source = NEURON_DEFAULT_ROOT, "default"
    if url.startswith("s3://"):
        raise CompileCacheError(f"the Neuron cache root from {source} is {url}, an S3 bucket; this command works "
                                "on a filesystem cache; pass --root PATH or use `aws s3` for S3 caches")
    return CacheRoot(path=Path(url).expanduser(), source=source, warnings=tuple(warnings))


def _split_flags(flags: str) -> list[str]:
    try:
        return shlex.split(flags)
    except ValueError:  # unbalanced quotes: the compiler wrapper would fail on them too; look at words
        return flags.split()


class State(enum.StrEnum):
    COMPLETE = "complete"
    """model.neff and model.done: the compiler succeeded."""
    LOCKED = "locked"
    """A `*.lock` file: a compile is in progress, or a killed one left the lock (see locks.py)."""
    FAILED = "failed"
    """model.log and no neff: a cached failure that blocks recompiling this graph (2.4)."""
    INCOMPLETE = "incomplete"
    """None of the above, e.g. the HLO that `neuron_parallel_compile` collect left to compile (2.5)."""


def classify(names: set[str]) -> State:
    """The state of an entry holding the files `names`.

    optimum-neuron checks FAILED before LOCKED (2.2 table); we check the lock first, so an entry that is being
    recompiled with --retry_failed_compilation is not deleted from under the compiler by `clear-failed`.
    """
    if NEFF in names and DONE in names:
        return State.COMPLETE
    if any(n.endswith(LOCK_SUFFIX) for n in names):
        return State.LOCKED
    if LOG in names and NEFF not in names:
        return State.FAILED
    return State.INCOMPLETE


@dataclass(frozen=True, kw_only=True, slots=True)
class Entry:
    """One `neuronxcc-<version>/MODULE_<graph>+<flags>` directory."""

    path: Path
    version: str
    name: str
    state: State
    files: tuple[str, ...]
    size: int
    """Apparent size of the regular files, from lstat (symlinks count as their own size)."""
    last_used: float
    """Newest of the directory's mtime and the neff's (or HLO's) atime and mtime: what LRU pruning sorts by."""
    locks: tuple[str, ...]

    @property
    def key(self) -> str:
        """`neuronxcc-<version>/MODULE_...`, the same in every cache root."""
        return f"{VERSION_PREFIX}{self.version}/{self.name}"

    @property
    def graph_hash(self) -> str | None:
        m = _MODULE_NAME.match(self.name)
        return m.group("graph") if m else None

    @property
    def flags_hash(self) -> str | None:
        m = _MODULE_NAME.match(self.name)
        return m.group("flags") if m else None


def iter_version_dirs(root: Path) -> Iterator[os.DirEntry]:
    """The real `neuronxcc-*` directories under `root` (symlinks are skipped, never followed)."""
    try:
        it = os.scandir(root)
    except FileNotFoundError:
        return
    with it:
        for d in it:
            if d.name.startswith(VERSION_PREFIX) and d.is_dir(follow_symlinks=False):
                yield d


def iter_entry_dirs(version_dir: str | os.PathLike) -> Iterator[os.DirEntry]:
    """The real `MODULE_*` directories of one version directory. Dot-names (our temp dirs) are not entries."""
    try:
        it = os.scandir(version_dir)
    except FileNotFoundError:  # removed by a concurrent prune
        return
    with it:
        for d in it:
            if d.name.startswith(MODULE_PREFIX) and d.is_dir(follow_symlinks=False):
                yield d


def read_entry(path: str | os.PathLike, *, version: str) -> Entry | None:
    """Stat one entry directory; None if it vanished meanwhile (a concurrent prune or publish)."""
    path = Path(path)
    names: list[str] = []
    size = 0
    times: list[float] = []
    try:
        dir_st = os.lstat(path)
        with os.scandir(path) as it:
            for f in it:
                st = f.stat(follow_symlinks=False)
                names.append(f.name)
                size += st.st_size
                if f.name == NEFF or f.name in HLO_NAMES:
                    times += (st.st_atime, st.st_mtime)
    except FileNotFoundError:
        return None
    names.sort()
    name_set = set(names)
    return Entry(path=path, version=version, name=path.name, state=classify(name_set), files=tuple(names),
                 size=size, last_used=max([dir_st.st_mtime, *times]),
                 locks=tuple(n for n in names if n.endswith(LOCK_SUFFIX)))


def scan(root: Path) -> Iterator[Entry]:
    """Every entry under `root`, in directory order."""
    for v in iter_version_dirs(root):
        version = v.name[len(VERSION_PREFIX):]
        for e in iter_entry_dirs(v.path):
            entry = read_entry(e.path, version=version)
            if entry is not None:
                yield entry


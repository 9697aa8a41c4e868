"""`megatron-hpc cache`: inspect, verify, prune and share the Neuron compile cache.

    megatron-hpc cache ls | stats | verify | clear-locks | clear-failed | prune [--older-than 7d] [--max-size 50G]
    megatron-hpc cache publish --from LOCAL --to SHARED      # after a compile phase on node-local disk
    megatron-hpc cache sync --from SHARED --to LOCAL         # before a run, so lookups stay off NFS

Every action but publish and sync takes `--root` and `--layout`: `launcher` (the root `submit` gives its jobs:
neuron/ and inductor/ below it), `neuron` (Neuron's neuronxcc-*/MODULE_* entries) or `tree` (a plain tree of files
such as TorchInductor's cache, shared file by file; an entry is a file, or a folder of Triton group files).
clear-locks and clear-failed work on Neuron entries only (a launcher root's neuron/ folder).

Without `--root` a command works on the shared cache `submit` uses ($MEGATRON_HPC_CACHE_DIR, else
~/.cache/megatron-hpc/compile-cache), so a user who just submitted sees what the jobs compiled; it notes Neuron's
own cache when that holds entries too. `--layout neuron` without `--root` is the root Neuron itself would use
(NEURON_CC_FLAGS --cache_dir, NEURON_COMPILE_CACHE_URL, /var/tmp/neuron-compile-cache); a tree needs `--root`.
With `--root` and no `--layout`, a root holding neuron/, inductor/ or megatron-hpc/ is a launcher root and any
other is read as Neuron's layout. Results go to stdout (`--json` for scripts), notes to stderr.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import asdict
from pathlib import Path

from megatron_hpc.compile_cache import fingerprint, layouts, locks, neuron, prune, store
from megatron_hpc.compile_cache.paths import LAUNCHER_LAYOUT, default_cache_root
from megatron_hpc.errors import CompileCacheError

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhdw]?)$")
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)([KMGT]?)(i?B)?$", re.IGNORECASE)
_BYTES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_duration(text: str) -> float:
    """`7d`, `12h`, `30m`, `90s` or plain seconds."""
    m = _DURATION.match(text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration; use e.g. 90s, 30m, 12h, 7d")
    return float(m.group(1)) * _SECONDS[m.group(2)]


def parse_size(text: str) -> int:
    """`50G`, `500M`, `1T` (powers of 1024, as du -h) or plain bytes."""
    m = _SIZE.match(text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; use e.g. 500M, 50G, 1T")
    return int(float(m.group(1)) * _BYTES[m.group(2).upper()])


def human(n: float) -> str:
    for unit in ("B", "K", "M", "G", "T"):
        if abs(n) < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}T"  # unreachable; keeps type checkers quiet


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="cache_command", metavar="ACTION", required=True)

    def action(name: str, summary: str, *, root: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=summary, description=summary)
        p.add_argument("--json", action="store_true", help="print JSON for scripts")
        if root:
            p.add_argument("--root", type=Path, default=None,
                           help="cache root (default: the shared compile cache of submit, $MEGATRON_HPC_CACHE_DIR "
                                "else ~/.cache/megatron-hpc/compile-cache; with --layout neuron, the one Neuron "
                                "picks from NEURON_CC_FLAGS --cache_dir, NEURON_COMPILE_CACHE_URL, else "
                                "/var/tmp/neuron-compile-cache)")
        return p

    ls = action("ls", "list the entries with their state, size and last use")
    ls.add_argument("--state", choices=[s.value for s in neuron.State], help="only entries in this state")
    _add_layout(ls)
    _add_layout(action("stats", "counts per state, sizes and compiler versions (per folder for a tree)"))
    for name, summary in (("verify", "check every entry; remove old temp dirs of killed publishers"),
                          ("clear-locks", "remove stale locks (their owner is gone); never a live one"),
                          ("clear-failed", "remove cached compile failures so the graphs compile again"),
                          ("prune", "remove least recently used entries by age and/or total size")):
        p = action(name, summary)
        p.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
        _add_layout(p, choices=("launcher", "neuron", "tree") if name in ("verify", "prune")
                    else ("launcher", "neuron"))
        if name in ("verify", "clear-locks"):
            p.add_argument("--stale-after", type=parse_duration, default=locks.DEFAULT_STALE_AFTER_S,
                           metavar="DURATION", help="age after which a lock whose owner cannot be checked "
                           "(another host, or neuronx-cc's own) counts as stale when no neuronx-cc runs here "
                           "(default 1h)")
        if name in ("verify", "prune"):
            p.add_argument("--leftovers-older-than", type=parse_duration, default=store.DEFAULT_LEFTOVER_AGE_S,
                           metavar="DURATION", help="remove temp dirs of dead publishers older than this "
                           "(default 1h; those of dead processes on this host go at once)")
        if name == "prune":
            p.add_argument("--older-than", type=parse_duration, default=None, metavar="DURATION",
                           help="remove entries unused for this long, e.g. 7d")
            p.add_argument("--max-size", type=parse_size, default=None, metavar="SIZE",
                           help="then remove least recently used entries until the cache holds at most SIZE, "
                                "e.g. 50G")
    for name, summary, src, dst in (("publish", "copy complete entries of a node-local cache into a shared one",
                                     "LOCAL", "SHARED"),
                                    ("sync", "copy complete entries of a shared cache missing from a local one",
                                     "SHARED", "LOCAL")):
        p = action(name, summary, root=False)
        p.add_argument("--from", dest="src", type=Path, required=True, metavar=src, help="cache to copy from")
        p.add_argument("--to", dest="dst", type=Path, required=True, metavar=dst, help="cache to copy into")
        p.add_argument("--group-writable", action="store_true",
                       help="make new entries group writable (g+w, setgid directories) for a team cache")
        p.add_argument("--quiet", action="store_true",
                       help="say only what was copied or refused (what the node script runs before and after "
                            "each phase)")
        _add_layout(p, default="neuron")


def _add_layout(p: argparse.ArgumentParser, *, choices: tuple[str, ...] = ("launcher", "neuron", "tree"),
                default: str | None = None) -> None:
    # default None: the layout follows from --root (see _root), so a bare command shows the cache submit uses
    p.add_argument("--layout", choices=choices, default=default,
                   help=f"launcher: a megatron-hpc root ({', '.join(LAUNCHER_LAYOUT)}), the default without "
                        "--root; neuron: Neuron's neuronxcc-*/MODULE_* entries; tree: a plain tree of files "
                        "(Inductor's, Triton's). With --root and no --layout: launcher if the root holds its "
                        "folders, else neuron")


def _root(args: argparse.Namespace) -> Path:
    """The root to work on; sets `args.layout` when the command line left it open."""
    if args.root is not None:
        if not args.root.exists():  # every action here reads an existing cache: a root that is not there is a typo
            raise CompileCacheError(f"--root {args.root} does not exist; pass the cache's folder, or leave --root out "
                                    "for the shared compile cache of submit")
        if args.layout is None:
            args.layout = "launcher" if _looks_like_launcher(args.root) else "neuron"
            if args.layout == "launcher":
                print(f"cache root {args.root} (a megatron-hpc root: --layout launcher)", file=sys.stderr)
        return args.root
    if args.layout in (None, "launcher"):
        args.layout = "launcher"
        root = default_cache_root()
        print(f"cache root {root} (the shared compile cache of submit)", file=sys.stderr)
        _note_neuron_default(root)
        return root
    if args.layout != "neuron":
        raise CompileCacheError(f"--layout {args.layout} needs --root PATH; only Neuron and launcher caches have a "
                                "default root")
    resolved = neuron.resolve_root()
    for warning in resolved.warnings:
        print(f"megatron-hpc: warning: {warning}", file=sys.stderr)
    print(f"cache root {resolved.path} (from {resolved.source})", file=sys.stderr)
    return resolved.path


def _looks_like_launcher(root: Path) -> bool:
    return any((root / folder).is_dir() for folder in (*LAUNCHER_LAYOUT, fingerprint.MARKER_DIR.split("/")[0]))


def _note_neuron_default(shared: Path) -> None:
    """Jobs of `submit` compile into the shared root; a compiler run by hand outside them fills the root Neuron
    picks itself. Name that one when it holds entries, so neither stays invisible."""
    try:
        own = neuron.resolve_root()
    except CompileCacheError:  # an S3 URL: nothing on this filesystem to mention
        return
    if own.path in (shared, shared / "neuron"):
        return
    try:
        found = sum(1 for version in neuron.iter_version_dirs(own.path) for _ in neuron.iter_entry_dirs(version))
    except OSError:
        return
    if found:
        print(f"megatron-hpc: note: Neuron's own cache {own.path} (from {own.source}) holds {found} entries too; "
              "see them with --layout neuron", file=sys.stderr)


def _neuron_roots(args: argparse.Namespace) -> list[tuple[str, Path]]:
    """(key prefix, root) of each Neuron-layout part of a clear-locks/clear-failed target: a launcher root's
    neuron/ folder, or the root itself."""
    root = _root(args)
    return [(f"{folder}/" if folder else "", path) for folder, path, sub in layouts.parts(root, layout=args.layout)
            if sub == "neuron"]


def _hint_layout(root: Path, layout: str) -> None:
    """Say so when a Neuron view of `root` found nothing because it is another layout."""
    if layout != "neuron" or any(True for _ in neuron.iter_version_dirs(root)):
        return
    if _looks_like_launcher(root):
        print(f"megatron-hpc: note: {root} holds {', '.join(f'{f}/' for f in LAUNCHER_LAYOUT)} folders: "
              "a megatron-hpc cache root; use --layout launcher", file=sys.stderr)
    elif any((root / folder).is_dir() for folder in ("fxgraph", "aotautograd")):
        print(f"megatron-hpc: note: {root} looks like TorchInductor's cache; use --layout tree", file=sys.stderr)


def _out(args: argparse.Namespace, payload: object, lines: list[str]) -> None:
    if args.json:
        print(json.dumps(payload, indent=2, default=str))
    else:
        for line in lines:
            print(line)


def run(args: argparse.Namespace) -> int:
    handler = {"ls": _ls, "stats": _stats, "verify": _verify, "clear-locks": _clear_locks,
               "clear-failed": _clear_failed, "prune": _prune, "publish": _transfer, "sync": _transfer}
    return handler[args.cache_command](args)


def _ls(args: argparse.Namespace) -> int:
    root = _root(args)
    entries = sorted(layouts.entries(root, layout=args.layout), key=lambda e: e.key)
    if args.state:
        entries = [e for e in entries if e.state == args.state]
    now = time.time()
    rows = [{"key": e.key, "state": e.state, "bytes": e.size, "last_used": e.last_used, "files": list(e.files)}
            for e in entries]
    lines = [f"{'state':<11} {'size':>8} {'idle':>8}  entry"]
    lines += [f"{e.state:<11} {human(e.size):>8} {(now - e.last_used) / 86400:>7.1f}d  {e.key}" for e in entries]
    _out(args, rows, lines if entries else ["no entries"])
    if not entries:
        _hint_layout(root, args.layout)
    return 0


def _stats(args: argparse.Namespace) -> int:
    root = _root(args)
    s = layouts.stats(root, layout=args.layout)
    lines = [f"root      {s['root']}", f"entries   {s['entries']}  ({human(s['bytes'])})"]
    lines += _stats_lines(s)
    if s["layout"] == "launcher":
        for folder, part in s["parts"].items():
            lines.append(f"{folder}/: {part['entries']} entries, {human(part['bytes'])}")
            lines += [f"  {line}" for line in _stats_lines(part)]
        lines.append(f"fingerprints {s['fingerprints']} (compile phases that may be skipped)")
    _out(args, s, lines)
    if not s["entries"]:
        _hint_layout(root, args.layout)
    return 0


def _stats_lines(s: dict) -> list[str]:
    if s["layout"] == "neuron":
        lines = ["states    " + "  ".join(f"{k} {n}" for k, n in s["counts"].items())]
        for version, vs in s["versions"].items():
            lines.append(f"neuronxcc-{version}: {sum(vs['counts'].values())} entries, {human(vs['bytes'])}, "
                         + ", ".join(f"{k} {n}" for k, n in vs["counts"].items() if n))
        return lines
    if s["layout"] == "tree":
        # "??" is the JSON key of Inductor's two-character hash folders, counted together; the text says what they are
        return [f"{folder + '/':<14} {f['entries']} entries, {human(f['bytes'])}"
                + ("  (Inductor's generated code, in its two-character hash folders)" if folder == "??" else "")
                for folder, f in s["folders"].items()]
    return []


def _verify(args: argparse.Namespace) -> int:
    root = _root(args)  # first: it settles args.layout
    r = layouts.verify(root, layout=args.layout, stale_after=args.stale_after,
                       leftover_age=args.leftovers_older_than, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    lines = [f"{verb} leftover {p}" for p in r.leftovers_removed]
    lines += [f"{p.path}: {p.what}; fix: {p.fix}" for p in r.problems]
    lines.append(f"{r.entries} entries, {len(r.problems)} problems")
    _out(args, asdict(r), lines)
    return 1 if r.problems else 0


def _clear_locks(args: argparse.Namespace) -> int:
    r = prune.ClearLocksReport()
    for _prefix, root in _neuron_roots(args):
        part = prune.clear_locks(root, stale_after=args.stale_after, dry_run=args.dry_run)
        r.cleared += part.cleared
        r.kept += part.kept
        r.orphan_records += part.orphan_records
    verb = "would clear" if args.dry_run else "cleared"
    lines = [f"{verb} {s.path}: {s.reason}" for s in r.cleared]
    lines += [f"kept    {s.path}: {s.reason}" for s in r.kept]
    lines.append(f"{len(r.cleared)} stale locks {verb}, {len(r.kept)} live kept")
    _out(args, {"cleared": [asdict(s) for s in r.cleared], "kept": [asdict(s) for s in r.kept],
                "orphan_records": r.orphan_records}, lines)
    return 0


def _clear_failed(args: argparse.Namespace) -> int:
    removed = [prefix + key for prefix, root in _neuron_roots(args)
               for key in prune.clear_failed(root, dry_run=args.dry_run)]
    verb = "would remove" if args.dry_run else "removed"
    _out(args, {"removed": removed}, [f"{verb} {k}" for k in removed] + [f"{len(removed)} failed entries {verb}"])
    return 0


def _prune(args: argparse.Namespace) -> int:
    if args.older_than is None and args.max_size is None:
        raise CompileCacheError("prune needs --older-than DURATION and/or --max-size SIZE, e.g. --older-than 7d")
    root = _root(args)  # first: it settles args.layout
    r = prune.prune(root, layout=args.layout, older_than=args.older_than, max_size=args.max_size,
                    dry_run=args.dry_run, leftover_age=args.leftovers_older_than)
    verb = "would remove" if args.dry_run else "removed"
    lines = [f"{verb} {k}" for k in r.removed]
    lines += [f"{verb} leftover {p}" for p in r.leftovers_removed]
    if r.folders_removed:
        lines.append(f"{verb} {len(r.folders_removed)} empty folders")
    if r.fingerprints_removed:
        lines.append(f"{verb} {len(r.fingerprints_removed)} compile fingerprints: the next submit of each of those "
                     "runs compiles what is missing again")
    lines += [f"refused {k}: {why}" for k, why in r.refused.items()]
    lines.append(f"{verb} {len(r.removed)} entries ({human(r.bytes_freed)}); {human(r.bytes_left)} left; "
                 f"{len(r.kept_locked)} locked entries kept")
    _out(args, asdict(r), lines)
    return 1 if r.refused else 0


def _transfer(args: argparse.Namespace) -> int:
    reports = layouts.transfer(args.src, args.dst, layout=args.layout, group_writable=args.group_writable)
    lines = []
    for folder, r in reports.items():
        if args.quiet and not (r.copied or r.refused):
            continue
        if args.layout == "neuron":  # entries are few and large: name each one
            lines += [f"copied {k}" for k in r.copied]
        lines += [f"refused {folder + '/' if folder else ''}{k}: {why}" for k, why in r.refused.items()]
        lines.append(f"{folder + ': ' if folder else ''}{len(r.copied)} copied ({human(r.bytes_copied)}), "
                     f"{len(r.already_there)} already there, {len(r.lost_race)} published by another process "
                     f"meanwhile, {len(r.not_complete)} not complete (not shared), {len(r.refused)} refused")
    if not reports and not args.quiet:
        lines.append(f"{args.src} holds no compile cache yet: nothing to copy")
    payload = {k: asdict(r) for k, r in reports.items()} if args.layout == "launcher" else asdict(reports[""])
    _out(args, payload, lines)
    return 1 if any(r.refused for r in reports.values()) else 0

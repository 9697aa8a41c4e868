"""Where a benchmark's ranks meet: a rendezvous file, never a port picked free and bound later.

A port found free (bind to 0, read it back, close) and handed to the ranks stays unbound until rank 0's store binds
it again; beside the test suite's other process groups another listener took it in that gap (EADDRINUSE in CI's
smoke test of pipeline_cpu.py). A FileStore file needs no port. The scripts import this module where they form a
world: benchmarks/ is first on sys.path when a script runs, and the tests that import a script only for its pure
parts form none.
"""

from __future__ import annotations

from pathlib import Path


def file_rendezvous(folder: Path | str, name: str) -> str:
    """init_method for one new process group: `file://FOLDER/NAME.rendezvous`, any earlier file of that name
    removed first (a FileStore file serves one world; ranks that found an old one would join a world long gone)."""
    path = Path(folder).resolve() / f"{name}.rendezvous"
    path.unlink(missing_ok=True)
    return f"file://{path}"

"""Whether a process runs on this machine: the one check the node watchdog and the warm workers' client share."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Signal 0 reaches `pid`: it runs (a process of another user answers PermissionError, and runs too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

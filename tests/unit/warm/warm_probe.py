"""A stand-in worker for tests/unit/test_warm_workers.py, run as `-m warm_probe ACTION` by a warm process (forked)
or by the client's fallback (a new interpreter). Small on purpose: the protocol is under test, not the trainer.

    env               print RANK LOCAL_RANK WORLD_SIZE MASTER_PORT, the pid and a draw of Python's and numpy's global
                      generators on stdout, `err <rank>` on stderr
    exit CODE         print `exiting <rank>` and exit with CODE on rank 1, 0 on the others
    sleep FILE        write this pid to FILE.<rank>, then sleep until killed
    term FILE         as sleep, but on SIGTERM write FILE.RANK.term and exit 7 (a handler, as the trainer's)
    finish FILE       rank 0: leave an atexit handler and a non-daemon thread (the checkpoint writer's kind),
                      writing FILE.atexit and FILE.thread, and return 0; rank 1: once both are written (10 s at
                      most), sys.exit with a message
"""

import atexit
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path


def main() -> int:
    action, rank = sys.argv[1], os.environ.get("RANK", "?")
    if action == "env":
        keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                "PROBE_MARK")
        # One write per line: two workers share the pipe, and print's pieces may be written one by one.
        line = " ".join(f"{k}={os.environ.get(k)}" for k in keys) + f" pid={os.getpid()} ppid={os.getppid()}"
        import numpy

        draws = f"{random.getrandbits(64)}:{numpy.random.randint(1 << 31)}"
        sys.stdout.write(f"{line} cwd={os.getcwd()} draws={draws}\n")
        sys.stdout.flush()
        sys.stderr.write(f"err {rank}\n")
        sys.stderr.flush()
        return 0
    if action == "exit":
        sys.stdout.write(f"exiting {rank}\n")
        sys.stdout.flush()
        return int(sys.argv[2]) if rank == "1" else 0
    if action == "finish" and rank == "0":
        atexit.register(Path(f"{sys.argv[2]}.atexit").write_text, "ran")
        threading.Thread(target=lambda: (time.sleep(0.3), Path(f"{sys.argv[2]}.thread").write_text("ran")),
                         daemon=False).start()
        return 0
    if action == "finish":  # after rank 0's end: the first failure ends the others, as under torchrun
        deadline = time.monotonic() + 10
        while not all(Path(f"{sys.argv[2]}.{what}").exists() for what in ("atexit", "thread")):
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
        sys.exit(f"fatal: rank {rank} stops")
    if action == "term":
        def on_term(*_: object) -> None:
            Path(f"{sys.argv[2]}.{rank}.term").write_text("7")
            sys.exit(7)

        signal.signal(signal.SIGTERM, on_term)
    with open(f"{sys.argv[2]}.{rank}", "w") as fh:
        fh.write(str(os.getpid()))
    while True:
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())

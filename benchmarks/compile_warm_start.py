"""torch.compile warm start: time to the end of the first training step of `tiny` (train.compile: true, CPU),
with a cold compile cache against a cache published by a real compile phase, in one run.

1. `megatron-hpc submit --dry-run` writes a run folder; `bash node.sh compile` runs its compile phase exactly as
   a compile job would (node-local cache, trial run, publish to the shared cache, fingerprint).
2. Then, alternating, each round starts the trainer (`python -m megatron_hpc train`, a world of one) twice:
   cold, with an empty Inductor cache; warm, after `megatron-hpc cache sync` of the shared cache into an empty
   node-local one, as the node script does before a run phase (the sync is inside the warm time). Each time is
   from starting the process(es) to the first iteration line the trainer prints.
Every process tree gets its own empty $TMPDIR, as on a fresh node: Inductor keeps some state outside its cache
folder (in $TMPDIR/torchinductor_<user>), which would otherwise carry over from one measurement to the next.
The first step's loss must be the same cold and warm. Goal: warm at most 0.3x cold.

    python benchmarks/compile_warm_start.py --rounds 3
    python benchmarks/compile_warm_start.py --rounds 1 --set train.compile_backend=aot_eager \
        --set model.num_layers=1 --set model.hidden_size=32 --set model.num_attention_heads=2 \
        --set model.seq_length=16 --set model.max_position_embeddings=16 --set model.vocab_size=64
        # smoke test (the suite runs it): the script's plumbing in seconds; aot_eager only traces, so there is no
        # Inductor cache to warm and the ratio means nothing (tests/multiprocess checks Inductor's warm start)
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatron_hpc.compile_cache.paths import cache_env, warm_start_env

SETS = ["train.compile=true", "data.source=synthetic", "train.num_steps=1", "compile.num_steps=1",
        "train.log_interval=1", "train.tensorboard=false"]
_ITERATION = re.compile(r"iteration\s+1/\s*\d+ .*lm loss: (\S+)")


def _sets(extra: list[str]) -> list[str]:
    return [arg for item in (*SETS, *extra) for arg in ("--set", item)]


def fresh_node(work: Path, env: dict[str, str], name: str) -> dict[str, str]:
    """`env` with an empty $TMPDIR of its own."""
    tmp = work / f"tmp-{name}"
    tmp.mkdir()
    return {**env, "TMPDIR": str(tmp)}


def publish_by_compile_phase(work: Path, env: dict[str, str], *, extra: list[str]) -> float:
    """A real compile phase (node.sh compile) that publishes to the shared cache; its wall time."""
    env = fresh_node(work, env, "compile")
    run_dir = work / "compile-run"
    subprocess.run([sys.executable, "-m", "megatron_hpc", "submit", "--recipe", "tiny", "--cluster", "local",
                    "--dry-run", "--out", str(run_dir), *_sets(extra)], env=env, check=True, stdout=subprocess.DEVNULL)
    t = time.perf_counter()
    proc = subprocess.run(["bash", str(run_dir / "node.sh"), "compile"], env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - t
    if proc.returncode != 0:
        sys.exit(f"the compile phase failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return elapsed


def first_step(env: dict[str, str], *, sync_from: Path | None, local: Path, extra: list[str]) -> tuple[float, str]:
    """Seconds from process start to the trainer's first iteration line, and that step's loss."""
    env = {**env, **cache_env(backend="gloo", root=str(local))}
    t = time.perf_counter()
    if sync_from is not None:
        subprocess.run([sys.executable, "-m", "megatron_hpc", "cache", "sync", "--layout", "launcher",
                        "--from", str(sync_from), "--to", str(local)], env=env, check=True, stdout=subprocess.DEVNULL)
    proc = subprocess.Popen([sys.executable, "-m", "megatron_hpc", "train", "--recipe", "tiny", *_sets(extra)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    found, tail = None, []
    for line in proc.stdout:
        tail = [*tail, line][-20:]
        m = _ITERATION.search(line)
        if m and found is None:
            found = (time.perf_counter() - t, m.group(1))
    if proc.wait() != 0 or found is None:
        sys.exit("the trainer failed:\n" + "".join(tail))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="work folder (default: a new temp dir, removed at the end)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a further override of the tiny recipe, for every run (e.g. a smaller model)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="warm-start-bench-", dir=args.dir))
    shared = work / "shared"
    env = {**os.environ, "MEGATRON_HPC_CACHE_DIR": str(shared),
           **warm_start_env(backend="gloo", torch_compile=True)}
    env.pop("MEGATRON_HPC_LOCAL_CACHE_DIR", None)
    try:
        published_s = publish_by_compile_phase(work, env, extra=args.set)
        print(f"compile phase (publishes to {shared}): {published_s:.1f} s", flush=True)
        cold, warm, losses = [], [], set()
        for r in range(args.rounds):
            for kind, times in (("cold", cold), ("warm", warm)):
                local = work / f"local-{kind}-{r}"
                seconds, loss = first_step(fresh_node(work, env, f"{kind}-{r}"), local=local,
                                           sync_from=shared if kind == "warm" else None, extra=args.set)
                shutil.rmtree(local, ignore_errors=True)
                shutil.rmtree(work / f"tmp-{kind}-{r}", ignore_errors=True)
                times.append(seconds)
                losses.add(loss)
                print(f"round {r + 1} {kind}: {seconds:.1f} s (first-step loss {loss})", flush=True)
        if len(losses) != 1:
            sys.exit(f"the first-step loss differs between cold and warm starts: {sorted(losses)}")
        c, w = statistics.median(cold), statistics.median(warm)
        print(f"{'start':<6} {'median s':>9}   all rounds")
        print(f"{'cold':<6} {c:>9.1f}   {' '.join(f'{x:.1f}' for x in cold)}")
        print(f"{'warm':<6} {w:>9.1f}   {' '.join(f'{x:.1f}' for x in warm)}")
        print(f"ratio warm/cold = {w / c:.2f}; goal <= 0.30 -> {'met' if w / c <= 0.3 else 'NOT met'}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How long `plan` takes: make_plan for every shipped recipe x platform x node count, refusals included.

Issue 29's performance goal: `plan` with the step-time model stays under 0.5 s for any shipped recipe at 512 nodes
(it searches every valid layout, and a refusal plans each fix it names, then searches node counts). Pure planning
(no cluster, no torch, no files but the recipes), timed in-process so interpreter start-up and imports are left
out: the best of --repeats runs of make_plan, as `plan` calls it, each with the planner's caches cleared first (one
`plan` command starts cold). The time is the process's CPU time (time.process_time): on a machine shared with
other work the wall clock measures the neighbours; single-threaded planning takes as long on an idle core.
Each row also gives the planned TP x PP (or a digest of the refusal's line), so
a speed-up that changed an answer shows up in a diff of two runs' output.

    python benchmarks/plan_speed.py [--nodes 16 128 512] [--platforms trn1 trn2 p5] [--repeats 5] > /tmp/speed.md
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

from megatron_hpc.config.loader import load_recipe
from megatron_hpc.config.platforms import get_platform
from megatron_hpc.errors import MegatronHpcError
from megatron_hpc.plan.planner import make_plan

try:  # the caches of the pure helpers, from issue 29's speed-up on
    from megatron_hpc.plan.planner import clear_plan_caches
except ImportError:
    def clear_plan_caches() -> None:
        pass

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


def shipped_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml") if not p.stem.startswith("_"))


def plan_once(recipe: str, *, nodes: int, platform: str) -> tuple[float, str]:
    """CPU seconds make_plan took, and what it answered (the mesh, or a digest of the refusal's line)."""
    cfg = load_recipe(recipe)
    clear_plan_caches()  # cold, as one `plan` command starts
    start = time.process_time()
    try:
        plan = make_plan(cfg, num_nodes=nodes, platform=get_platform(platform))
        answer = f"TP {plan.tensor_parallel} x PP {plan.pipeline_parallel}, {plan.predicted_step_time_s:.4g} s"
    except MegatronHpcError as exc:
        answer = f"refused {hashlib.sha256(str(exc).encode()).hexdigest()[:8]}"
    return time.process_time() - start, answer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[16, 128, 512])
    parser.add_argument("--platforms", nargs="+", default=["trn1", "trn2", "p5"])
    parser.add_argument("--recipes", nargs="+", default=None)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    print("| recipe | platform | " + " | ".join(f"{n} nodes: CPU s, answer" for n in args.nodes) + " |")
    print("|---|---|" + "---|" * len(args.nodes))
    worst = 0.0
    for recipe in args.recipes or shipped_recipes():
        for platform in args.platforms:
            cells = []
            for nodes in args.nodes:
                runs = [plan_once(recipe, nodes=nodes, platform=platform) for _ in range(args.repeats)]
                best = min(t for t, _ in runs)
                worst = max(worst, best)
                cells.append(f"{best:.3f}, {runs[0][1]}")
            print(f"| {recipe} | {platform} | " + " | ".join(cells) + " |", flush=True)
    print(f"\nslowest: {worst:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What now fits: the planner's TP x PP for the size-table recipes with each memory feature, and the fewest nodes.

Issue 15's table. Pure planning (make_plan on each recipe with --set overrides; no cluster, no torch, no timing),
so it needs no bench lock. For every recipe and platform:

- at the recipe's nominal node count (NOMINAL_NODES), the planner's TP x PP and estimated GiB per worker (the
  heaviest pipeline rank) under each setting of SETTINGS: every memory feature off, each alone, and together;
- the smallest node count, over powers of two up to --max-nodes, at which make_plan accepts the recipe at all,
  with the TP x PP planned there.

The planner chooses both sizes (parallel.tensor=0, parallel.pipeline=0, also for gpt3_175b and neox_20b, whose
recipes pin them) so that a feature can show up as a smaller mesh. Marks against the "off" column: `*` a smaller
TP x PP or node count, `^` a larger one (possible: the planner takes the smallest PP first, then the smallest TP,
so a feature can trade TP 1 x PP 2 for TP 8 x PP 1), `+` plans where "off" is refused. A refusal is shown by its
kind (refusal_kind). `!` after a mesh: `plan` sizes it but `submit` refuses it (pipeline parallelism does not run
on XLA in this release: planner.check_pipeline_runtime). The distributed optimizer is left out on XLA platforms:
there it is not only a memory feature but a precision change (bf16 weights with fp32 masters, 4 + 12/d bytes a
parameter, instead of pure bf16's 8: more memory below DP 3; train/xla_zero.py).

    python benchmarks/plan_fits.py > /tmp/fits.md
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from megatron_hpc.config.loader import load_recipe
from megatron_hpc.config.platforms import Platform, get_platform
from megatron_hpc.errors import MegatronHpcError
from megatron_hpc.plan.planner import Plan, make_plan, pipeline_runtime_warning

NOMINAL_NODES: dict[str, int] = {
    # Narayanan et al. 2021 table 1: its GPU count over the 8 GPUs of a server (p5 nodes).
    "gpt3_1.7b": 4,     # 32 GPUs
    "gpt3_3.6b": 8,     # 64
    "gpt3_7.5b": 16,    # 128
    "gpt3_18.4b": 32,   # 256
    "gpt3_39.1b": 64,   # 512
    "gpt3_76.1b": 128,  # 1024
    # 1536 and 1920 GPUs there (192 and 240 nodes) give DP 24 and 15 at the paper's TP x PP, which do not divide
    # the recipes' global batch of 1024 (the paper's was 2304 and 2160): the largest power of two below instead.
    "gpt3_145.6b": 128,
    "gpt3_310.1b": 128,
    "gpt3_6.7b": 16,    # the Neuron reference run: 16 x trn1.32xlarge
    "gpt3_175b": 16,    # the recipe's TP 8 x PP 16 on p5: one model replica
    "neox_20b": 4,      # neuronx-distributed's GPT-NeoX 20B tutorial: 4 trn1 nodes
}
"""The node count each recipe is meant for, used on every platform (a trn node has 32 or 64 workers, not 8)."""

PLATFORM_NAMES = ("p5", "trn1", "trn2")

FREE_MESH = ("parallel.tensor=0", "parallel.pipeline=0", "parallel.choose_layout=fits")
"""The planner chooses TP and PP by the memory rule (the first that fits): this table is about what fits, not what
is fastest (plan/layout_choice.py)."""


@dataclass(frozen=True, slots=True)
class Setting:
    name: str
    overrides: tuple[str, ...]
    """On top of FREE_MESH and every feature off (OFF)."""
    distributed_optimizer: bool = False
    """Left out on XLA platforms, where it changes the precision too (the module docstring)."""


OFF = ("model.recompute=false", "parallel.sequence_parallel=false", "parallel.distributed_optimizer=false")
SELECTIVE = "model.recompute_granularity=selective"
FULL = "model.recompute=true"  # full, uniform groups of 1 layer
SP = "parallel.sequence_parallel=true"
DISTOPT = "parallel.distributed_optimizer=true"

SETTINGS: tuple[Setting, ...] = (
    Setting("off", ()),
    Setting("selective", (SELECTIVE,)),
    Setting("SP", (SP,)),
    Setting("dist-opt", (DISTOPT,), distributed_optimizer=True),
    Setting("full", (FULL,)),
    Setting("sel+SP+DO", (SELECTIVE, SP, DISTOPT), distributed_optimizer=True),
    Setting("full+SP+DO", (FULL, SP, DISTOPT), distributed_optimizer=True),
)


def setting_overrides(setting: Setting, platform: Platform) -> tuple[str, ...]:
    """The --set list of a setting; on XLA its distributed optimizer is dropped (sel+SP+DO becomes sel+SP)."""
    extra = tuple(o for o in setting.overrides if not (o == DISTOPT and platform.backend == "xla"))
    return FREE_MESH + OFF + extra


def settings_for(platform: Platform) -> list[Setting]:
    """The columns of a platform: the distributed optimizer alone only where it runs."""
    return [s for s in SETTINGS if not (s.overrides == (DISTOPT,) and platform.backend == "xla")]


def column_name(setting: Setting, platform: Platform) -> str:
    return setting.name.replace("+DO", "") if platform.backend == "xla" else setting.name


@dataclass(frozen=True, slots=True)
class Cell:
    """One make_plan outcome: the plan, or the kind of refusal."""

    plan: Plan | None
    refusal: str | None = None

    @property
    def model_parallel(self) -> int | None:
        return None if self.plan is None else self.plan.tensor_parallel * self.plan.pipeline_parallel


def refusal_kind(message: str) -> str:
    """A refusal's cause in a word, from make_plan's one-line message."""
    if "needs tensor parallelism above 1" in message:
        return "SP@TP1"  # the planner chose TP 1 and then refused sequence parallelism there
    if "GiB per worker" in message:
        return "memory"
    if "global_batch_size" in message:
        return "batch"
    return "refused"


def plan_cell(recipe: str, setting: Setting, platform: Platform, *, nodes: int) -> Cell:
    cfg = load_recipe(recipe, list(setting_overrides(setting, platform)))
    try:
        return Cell(make_plan(cfg, num_nodes=nodes, platform=platform))
    except MegatronHpcError as exc:
        return Cell(None, refusal_kind(str(exc)))


def smallest_plan(recipe: str, setting: Setting, platform: Platform, *, max_nodes: int) -> Plan | None:
    """The plan at the smallest power of two up to max_nodes at which the recipe plans under the setting."""
    nodes = 1
    while nodes <= max_nodes:
        plan = plan_cell(recipe, setting, platform, nodes=nodes).plan
        if plan is not None:
            return plan
        nodes *= 2
    return None


@dataclass(frozen=True, slots=True)
class Row:
    recipe: str
    nodes: int
    cells: dict[str, Cell]
    """By setting name."""
    smallest: dict[str, Plan | None]
    """By setting name: smallest_plan."""


def build_row(recipe: str, platform: Platform, *, max_nodes: int, nodes: int | None = None) -> Row:
    nodes = NOMINAL_NODES[recipe] if nodes is None else nodes
    settings = settings_for(platform)
    return Row(recipe=recipe, nodes=nodes,
               cells={s.name: plan_cell(recipe, s, platform, nodes=nodes) for s in settings},
               smallest={s.name: smallest_plan(recipe, s, platform, max_nodes=max_nodes) for s in settings})


def mark(value: int | None, base: int | None) -> str:
    """`*` below the "off" value, `^` above it, `+` where "off" has none; empty otherwise."""
    if value is None:
        return ""
    if base is None:
        return "+"
    return "*" if value < base else "^" if value > base else ""


def format_cell(cell: Cell, base: Cell) -> str:
    if cell.plan is None:
        return f"- ({cell.refusal})"
    p = cell.plan
    idle = f", {p.idle_workers_per_node} idle/node" if p.idle_workers_per_node else ""
    return f"{_mesh(p)}{mark(cell.model_parallel, base.model_parallel)} {p.memory_per_worker_gib:.1f}{idle}"


def _mesh(plan: Plan) -> str:
    return f"{plan.tensor_parallel}x{plan.pipeline_parallel}{'!' if pipeline_runtime_warning(plan) else ''}"


def format_nodes(plan: Plan | None, base: Plan | None) -> str:
    """The node count, its mark against "off", and the mesh planned there."""
    if plan is None:
        return "-"
    return f"{plan.num_nodes}{mark(plan.num_nodes, base and base.num_nodes)} ({_mesh(plan)})"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def mesh_table(rows: list[Row], platform: Platform) -> list[str]:
    """TP x PP and GiB per worker at each recipe's nominal node count, one column per setting."""
    settings = settings_for(platform)
    body = [[r.recipe, str(r.nodes)] + [format_cell(r.cells[s.name], r.cells["off"]) for s in settings]
            for r in rows]
    return _table(["recipe", "nodes"] + [column_name(s, platform) for s in settings], body)


def nodes_table(rows: list[Row], platform: Platform) -> list[str]:
    """The smallest node count (power of two) at which each recipe plans, and its mesh there, per setting."""
    settings = settings_for(platform)
    body = [[r.recipe] + [format_nodes(r.smallest[s.name], r.smallest["off"]) for s in settings] for r in rows]
    return _table(["recipe"] + [column_name(s, platform) for s in settings], body)


def breakdown_table(row: Row, platform: Platform) -> list[str]:
    """One recipe's memory_breakdown_gib under each setting at its nominal node count."""
    body = []
    for s in settings_for(platform):
        p = row.cells[s.name].plan
        if p is None:
            body.append([column_name(s, platform), "-"] + [""] * 6)
            continue
        parts = p.memory_breakdown_gib
        body.append([column_name(s, platform), f"{p.tensor_parallel}x{p.pipeline_parallel}x{p.data_parallel}"]
                    + [f"{parts[k]:.2f}" for k in ("weights", "grads", "optimizer", "activations", "logits")]
                    + [f"{p.memory_per_worker_gib:.2f}"])
    return _table(["setting", "TPxPPxDP", "weights", "grads", "Adam", "activations", "logits", "total"], body)


BREAKDOWN_RECIPE: dict[str, str] = {"p5": "gpt3_175b", "trn1": "neox_20b", "trn2": "gpt3_175b"}
"""The recipe whose breakdown each platform shows: one that features move on that platform."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--platforms", nargs="+", default=list(PLATFORM_NAMES), choices=PLATFORM_NAMES)
    parser.add_argument("--recipes", nargs="+", default=list(NOMINAL_NODES), choices=list(NOMINAL_NODES))
    parser.add_argument("--max-nodes", type=int, default=1024, help="largest node count the search tries")
    return parser.parse_args(argv)


def report(args: argparse.Namespace) -> list[str]:
    lines = []
    for name in args.platforms:
        platform = get_platform(name)
        rows = [build_row(r, platform, max_nodes=args.max_nodes) for r in args.recipes]
        lines += ["", f"### {name} ({platform.workers_per_node} workers x {platform.memory_per_worker_gib:g} GiB "
                  "per node)", "", "TP x PP and GiB per worker at the nominal node count:", ""]
        lines += mesh_table(rows, platform)
        lines += ["", f"Smallest node count that plans (powers of two up to {args.max_nodes}):", ""]
        lines += nodes_table(rows, platform)
        shown = next((r for r in rows if r.recipe == BREAKDOWN_RECIPE[name]), rows[0])
        lines += ["", f"Memory breakdown, GiB per worker: {shown.recipe} on {shown.nodes} x {name}:", ""]
        lines += breakdown_table(shown, platform)
    return lines


def main(argv: list[str] | None = None) -> int:
    print("\n".join(report(parse_args(argv))))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`megatron-hpc report RUN [--out FILE.png]`: loss, learning rate and throughput of a run in one PNG.

Reads <run>/metrics.jsonl (train/metrics.py writes it from the last rank): iteration rows of the
run phase (the compile phase when the run phase has not logged yet) and its "valid" rows.
Throughput leaves out warm-up intervals. A resumed run logs some iterations twice; the later row
wins. matplotlib is imported only here, with the Agg canvas (no display needed).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from pathlib import Path

from megatron_hpc.errors import MegatronHpcError
from megatron_hpc.run_folder import METRICS_FILE, IterationRecord, ValidationRecord, read_metrics


@dataclass(slots=True)
class RunSeries:
    """(iteration, value) pairs per plotted quantity, sorted by iteration."""

    phase: str
    train_loss: list[tuple[int, float]] = field(default_factory=list)
    valid_loss: list[tuple[int, float]] = field(default_factory=list)
    lr: list[tuple[int, float]] = field(default_factory=list)
    tokens_per_s: list[tuple[int, float]] = field(default_factory=list)


def read_series(path: Path) -> RunSeries:
    """The series of one metrics.jsonl; MegatronHpcError when it holds no iteration rows."""
    rows = read_metrics(path)
    phases = {r.phase for r in rows}
    phase = "run" if "run" in phases else "compile"
    train = {r.iteration: r for r in rows if isinstance(r, IterationRecord) and r.phase == phase}
    if not train:
        raise MegatronHpcError(f"{path} has no iteration rows yet; wait for the first log interval "
                               f"(train.log_interval) and run report again")
    valid = {r.iteration: r for r in rows if isinstance(r, ValidationRecord) and r.phase == "valid"
             and r.train_phase == phase}
    series = RunSeries(phase=phase)
    for it in sorted(train):
        row = train[it]
        if math.isfinite(row.lm_loss):
            series.train_loss.append((it, row.lm_loss))
        series.lr.append((it, row.lr))
        if not row.warmup and math.isfinite(row.tokens_per_s):
            series.tokens_per_s.append((it, row.tokens_per_s))
    series.valid_loss = [(it, valid[it].lm_loss) for it in sorted(valid) if math.isfinite(valid[it].lm_loss)]
    return series


def plot_series(series: RunSeries, *, out: Path, title: str) -> None:
    """Three stacked panels against the iteration: lm loss (train, valid), learning rate, tokens/s."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise MegatronHpcError("report needs matplotlib, which is not installed; pip install matplotlib") from None
    fig = Figure(figsize=(8, 9), layout="constrained")
    FigureCanvasAgg(fig)
    loss_ax, lr_ax, tput_ax = fig.subplots(3, 1, sharex=True)
    for ax, points, label, style in ((loss_ax, series.train_loss, "train", "-"),
                                     (loss_ax, series.valid_loss, "valid", "o--"),
                                     (lr_ax, series.lr, "learning rate", "-"),
                                     (tput_ax, series.tokens_per_s, "tokens/s", "-")):
        if points:
            ax.plot(*zip(*points), style, label=label)
    loss_ax.set_ylabel("lm loss")
    loss_ax.legend()
    lr_ax.set_ylabel("learning rate")
    tput_ax.set_ylabel("tokens / s (all workers)")
    tput_ax.set_xlabel("iteration")
    for ax in (loss_ax, lr_ax, tput_ax):
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"{title} ({series.phase} phase)")
    fig.savefig(out, format="png", dpi=100)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", nargs="?", help="run folder (with metrics.jsonl) or job id (default: the latest run)")
    parser.add_argument("--out", type=Path, help="PNG to write (default: <run>/report.png)")


def run(args: argparse.Namespace) -> int:
    if args.run and (Path(args.run) / METRICS_FILE).is_file():
        run_dir = Path(args.run)
    else:
        from megatron_hpc.launch.run_status import find_run_dir

        run_dir = find_run_dir(args.run)
    metrics = run_dir / METRICS_FILE
    if not metrics.is_file():
        raise MegatronHpcError(f"{metrics} does not exist; the run has not logged an iteration yet")
    out = args.out if args.out is not None else run_dir / "report.png"
    plot_series(read_series(metrics), out=out, title=run_dir.name)
    print(out)
    return 0

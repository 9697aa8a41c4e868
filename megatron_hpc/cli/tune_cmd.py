"""`megatron-hpc tune`: run the K best predicted layouts for a few steps, refit the step-time model, pick the fastest.

One job through the launcher (the run folder, node.sh, torchrun; --cluster local or slurm) trains each candidate
for compile.num_steps steps and times a few collectives (train/tune_trials.py); its end fits the calibration and
writes tune.json and the winner's --set overlay (launch/tune_job.py). The calibration is kept in the shared cache,
where later `plan`s and `submit`s find it (compile_cache/calibrations.py). docs/planning.md#tune.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from megatron_hpc.cli.common import Resolved, add_recipe_arguments, resolve

DEFAULT_TOP = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_recipe_arguments(parser)
    add_tune_arguments(parser)
    parser.add_argument("--cluster", choices=("slurm", "local"), default="slurm",
                        help="slurm (default) queues the tune job with sbatch; local runs it on this machine")
    parser.add_argument("--cluster-config", metavar="FILE", type=Path,
                        help="cluster profile YAML (default $MEGATRON_HPC_CLUSTER_CONFIG, else "
                             "~/.config/megatron-hpc/cluster.yaml)")
    parser.add_argument("--partition", help="SLURM partition")
    parser.add_argument("--account", help="SLURM account")
    parser.add_argument("--time", type=int, metavar="MINUTES", help="time limit of the tune job in minutes")
    parser.add_argument("--out", type=Path, help="run folder (default runs/<recipe>-tune/<timestamp>)")
    parser.add_argument("--dry-run", action="store_true",
                        help="write the run folder (tune-candidates.json, node.sh, tune.sbatch); queue nothing")


def add_tune_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--top", type=int, default=DEFAULT_TOP, metavar="K",
                        help=f"how many of the best predicted layouts to run (default {DEFAULT_TOP})")


def run(args: argparse.Namespace) -> int:
    resolved = resolve(args)
    result = run_tune_job(args, resolved, echo=None if args.json else _echo)
    if result is None:
        return 0 if args.dry_run else 1
    if args.json:
        import json

        print(json.dumps(result, indent=2))
    else:
        print("\n".join(result_lines(result)))
    return 0


def _echo(line: str) -> None:
    print(line, flush=True)


def run_tune_job(args: argparse.Namespace, resolved: Resolved, *, echo: Any) -> dict[str, Any] | None:
    """Plan the candidates, write the run folder and run the tune job to its end (local, or SLURM followed until
    it ends); tune.json's content, or None after a dry run or a failed job (its reason on stderr)."""
    from megatron_hpc.cli.common import measured_calibration
    from megatron_hpc.launch import cluster_profile
    from megatron_hpc.launch.run_dir import default_run_dir, prepare_run_dir
    from megatron_hpc.launch.submit import SubmitRequest, check_cluster, submit, write_run_files
    from megatron_hpc.launch.tune_job import check_partition_nodes, plan_candidates, read_result, write_request
    from megatron_hpc.plan.calibration import DEFAULT_CALIBRATION

    base = measured_calibration(resolved.plan)[0] or DEFAULT_CALIBRATION
    candidates = plan_candidates(args.recipe, list(args.overrides), plan=resolved.plan,
                                 platform=resolved.platform, top=args.top, calibration=base)
    profile = cluster_profile.find_profile(args.cluster_config)
    options = cluster_profile.slurm_options(profile.profile, partition=args.partition, account=args.account,
                                            time_limit_min=args.time)
    if not args.dry_run:
        check_cluster(args.cluster, num_nodes=resolved.plan.num_nodes, platform=resolved.platform)
        if args.cluster == "slurm":  # the nodes sinfo reports, before the run folder is written
            check_partition_nodes(options.partition, platform=resolved.platform, constraint=options.constraint)
    run_dir = prepare_run_dir(args.out or default_run_dir(Path("runs"), f"{resolved.cfg.name}-tune"))
    first = candidates[0].spec
    req = SubmitRequest(cfg=first.config, plan=first.plan, platform=resolved.platform, cluster=args.cluster,
                        run_dir=run_dir, options=options, extra_env=cluster_profile.profile_env(profile.profile),
                        profile=cluster_profile.profile_to_json(profile), tune=True)
    write_request(run_dir, candidates, platform=resolved.platform, calibration=base, cache_root=req.cache_root,
                  cluster=args.cluster)
    if echo:
        n, steps = len(candidates), first.config.compile.num_steps
        echo(f"tune {resolved.cfg.name} on {resolved.plan.num_nodes} x {resolved.plan.hardware}: "
             f"{n} layout{'s' if n != 1 else ''} x {steps} steps; calibration before: {base.source}")
        if n < args.top:
            echo(f"  only {n} valid layout{'s' if n != 1 else ''} at this size (--top {args.top} asked): more nodes "
                 "or workers per node give more to compare")
        if steps != resolved.cfg.compile.num_steps:
            echo(f"  trials run {steps} steps: the recipe's compile.num_steps={resolved.cfg.compile.num_steps} leaves "
                 "too few to time after the warm-up (--set compile.num_steps=N to choose)")
        for c in candidates:
            echo(f"  {c.label}: predicted {c.predicted_s:.4g} s")
        echo(f"run folder: {run_dir}")
    if args.dry_run:
        write_run_files(req)
        if echo:
            echo(f"wrote {run_dir}: tune-candidates.json, node.sh, tune.sbatch, submit.sh (nothing submitted)")
        return None
    outcome = submit(req, wait=True, echo=echo)
    if not outcome.ok:
        print(f"megatron-hpc: {outcome.reason}", file=sys.stderr)
        return None
    return read_result(run_dir)


def result_lines(result: dict[str, Any]) -> list[str]:
    """Every candidate: predicted before and after the calibration, measured, error; then the winner."""
    from megatron_hpc.launch.tune_job import winner_line

    fit = result["fit"]
    scales = ", ".join(f"{k} x{v:.3g}" for k, v in fit["scales"].items())
    held = f"; held at 1 (not measurable here): {', '.join(fit['held'])}" if fit["held"] else ""
    lines = [f"calibration: {scales} of the previous prediction ({fit['observations']} measurements){held}; kept at "
             f"{result['calibration_path']}",
             f"{'layout':<24}{'predicted':>11}{'after':>11}{'measured':>11}{'error':>9}{'left out':>10}"]
    for row in result["candidates"]:
        left = row["error_left_out"]
        lines.append(f"{row['label']:<24}{row['predicted_before_s']:>10.4g}s{row['predicted_after_s']:>10.4g}s"
                     f"{row['measured_s']:>10.4g}s{row['error_after']:>+9.1%}"
                     + (f"{left:>+10.1%}" if left is not None else f"{'-':>10}"))
    if result.get("disturbed"):  # other work on the nodes during the trials (plan/calibration_fit.py)
        lines.append(result["disturbed"])
    lines.append(winner_line(result))
    return lines

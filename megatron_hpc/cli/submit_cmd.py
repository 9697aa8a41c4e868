"""`megatron-hpc submit`: plan, write the run folder, and queue the compile and run phases."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_hpc.cli.common import Resolved, add_recipe_arguments, resolve
from megatron_hpc.cli.tune_cmd import add_tune_arguments
from megatron_hpc.errors import ConfigError, DataError

if TYPE_CHECKING:  # imported where used: building the parser stays free of numpy, the launcher and the planner
    from megatron_hpc.data.preflight import DataSummary
    from megatron_hpc.launch import cluster_profile
    from megatron_hpc.launch.submit import SubmitRequest, SubmitResult


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_recipe_arguments(parser, recipe_required=False)
    parser.add_argument("--resume", metavar="RUN",
                        help="submit this run folder (or job id) again: it continues from its checkpoints; "
                             "instead of --recipe")
    parser.add_argument("--cluster", choices=("slurm", "local", "k8s"), default="slurm",
                        help="slurm (default) queues with sbatch; local runs both phases on this machine; k8s applies "
                             "Kubeflow PyTorchJobs to the current kube context (the recipe's k8s section)")
    parser.add_argument("--cluster-config", metavar="FILE", type=Path,
                        help="cluster profile YAML (partition, account, time limits, setup lines, env, container); "
                             "default $MEGATRON_HPC_CLUSTER_CONFIG, else ~/.config/megatron-hpc/cluster.yaml")
    parser.add_argument("--partition", help="SLURM partition")
    parser.add_argument("--account", help="SLURM account")
    parser.add_argument("--qos", help="SLURM quality of service")
    parser.add_argument("--constraint", help="SLURM node constraint (features), e.g. trn1.32xlarge")
    parser.add_argument("--exclude", help="SLURM nodes to avoid, e.g. node[3-4]")
    parser.add_argument("--time", type=int, metavar="MINUTES", help="time limit of each phase in minutes")
    parser.add_argument("--out", type=Path, help="run folder (default runs/<recipe>/<timestamp>)")
    parser.add_argument("--dry-run", action="store_true",
                        help="write config, plan, node script, compile.sbatch, run.sbatch and submit.sh; queue nothing")
    parser.add_argument("--wait", action="store_true", help="with --cluster slurm, follow the jobs until they end")
    parser.add_argument("--tune", action="store_true",
                        help="first run `megatron-hpc tune` (one job: the --top best predicted layouts, a few steps "
                             "each), then submit the run with the fastest measured layout")
    add_tune_arguments(parser)
    parser.add_argument("--recompile", action="store_true",
                        help="run the compile phase even when the shared compile cache already holds this run's "
                             "fingerprint")


def _resume(args: argparse.Namespace) -> tuple[Resolved, Path, list[str]]:
    """The stored config and plan of the run folder, with the few overrides a resumed run may take; and what the
    resume changes, in sentences for its summary."""
    from megatron_hpc.config.loader import load_recipe
    from megatron_hpc.config.platforms import resolve_platform
    from megatron_hpc.launch.resume import (
        check_hang_timeout,
        check_not_active,
        check_overrides,
        keep_lr_horizon,
        stored_plan,
    )
    from megatron_hpc.launch.run_status import find_run_dir, read_status
    from megatron_hpc.plan.planner import make_plan
    from megatron_hpc.run_folder import CONFIG_FILE, read_json

    if args.recipe or args.out:
        raise ConfigError("--resume continues a run folder with its stored recipe; drop --recipe and --out")
    run_dir = find_run_dir(args.resume)
    check_overrides(args.overrides)
    check_not_active(read_status(run_dir))
    stored = stored_plan(run_dir)
    for flag, given, kept in (("--nodes", args.nodes, stored.get("num_nodes")),
                              ("--platform", args.platform, stored.get("platform"))):
        if given is not None and given != kept:
            raise ConfigError(f"{run_dir} ran with {flag} {kept}; a resumed run keeps it (got {flag} {given})")
    extra, lr_note = keep_lr_horizon(read_json(run_dir / CONFIG_FILE), args.overrides)
    cfg = load_recipe(str(run_dir / CONFIG_FILE), [*args.overrides, *extra])
    check_hang_timeout(run_dir, cfg.launch.hang_timeout_s)  # against the steps it measured
    platform = _resumed_platform(args, stored, run_dir=run_dir) or resolve_platform(stored.get("platform"),
                                                                                   default=cfg.launch.platform)
    notes = [f"--set {item}" for item in args.overrides] + ([lr_note] if lr_note else [])
    return Resolved(cfg=cfg, platform=platform, plan=make_plan(cfg, num_nodes=stored["num_nodes"],
                                                               platform=platform)), run_dir, notes


def _resumed_platform(args: argparse.Namespace, stored: dict, *, run_dir: Path):
    """A resumed run planned on a platform file's or the cluster profile's hardware plans on it again; None for a
    built-in platform."""
    import copy

    from megatron_hpc.cli.common import chosen_platform

    hardware = stored.get("hardware")
    if not hardware or hardware == stored.get("platform"):
        return None
    again = copy.copy(args)
    again.platform = None if args.platform_file else hardware
    try:
        platform = chosen_platform(again, default=stored["platform"])
    except ConfigError:
        platform = None
    if platform is None or platform.hardware is None or platform.hardware.name != hardware:
        raise ConfigError(f"{run_dir} was planned on hardware {hardware} (a platform file, or the cluster profile's "
                          f"platforms); pass the same --platform-file FILE to resume it")
    return platform


def _profile(args: argparse.Namespace, resumed_dir: Path | None) -> cluster_profile.LoadedProfile:
    """--cluster-config, else the one the resumed run was submitted with, else the user's default."""
    from megatron_hpc.launch import cluster_profile

    if args.cluster_config is None and resumed_dir is not None:
        stored = cluster_profile.stored_profile(resumed_dir)
        if stored is not None:
            return stored
    return cluster_profile.find_profile(args.cluster_config)


def run(args: argparse.Namespace) -> int:
    if not args.recipe and not args.resume:
        raise ConfigError("submit needs --recipe NAME (a new run) or --resume RUN (continue a run folder)")
    if args.tune and not _tune_first(args):  # a dry run wrote the tune job only; a failed one said why
        return 0 if args.dry_run else 1
    # The launcher, the planner and the data checks load here, not with the parser (tests/unit/test_cli_startup.py)
    from megatron_hpc.cli.plan_cmd import data_summary, format_plan
    from megatron_hpc.launch import cluster_profile, env_checks
    from megatron_hpc.launch.run_dir import default_run_dir, prepare_run_dir
    from megatron_hpc.launch.submit import SubmitRequest, submit, write_run_files
    from megatron_hpc.plan.planner import check_data_source, check_pipeline_runtime

    resolved, resumed_dir, resume_notes = _resume(args) if args.resume else (resolve(args), None, [])
    check_data_source(resolved.plan)  # before anything is written: the plan has no data to train on
    check_pipeline_runtime(resolved.plan, cfg=resolved.cfg)  # ... or pipelines on a runtime that cannot run one
    check_checkpoint_to_load(resolved, resumed_dir=resumed_dir)  # ... or would load a checkpoint of another mesh
    profile = _profile(args, resumed_dir)
    options = cluster_profile.slurm_options(profile.profile, partition=args.partition, account=args.account,
                                            qos=args.qos, exclude=args.exclude, constraint=args.constraint,
                                            time_limit_min=args.time)
    warnings = _checks_before_writing(args, resolved, partition=options.partition)
    run_dir = prepare_run_dir(resumed_dir or args.out or default_run_dir(Path("runs"), resolved.cfg.name))
    warnings = env_checks.submit_warnings(os.environ, run_dir=run_dir, cluster=args.cluster,
                                          num_nodes=resolved.plan.num_nodes,
                                          nofile_limit=resolved.cfg.launch.nofile_limit) + warnings
    space = checkpoint_space_warning(resolved, run_dir=run_dir)
    warnings += [space] if space else []
    for warning in warnings:
        print(f"megatron-hpc: warning: {warning}", file=sys.stderr)
    req = SubmitRequest(
        cfg=resolved.cfg, plan=resolved.plan, platform=resolved.platform, cluster=args.cluster,
        run_dir=run_dir, options=options, recompile=args.recompile,
        extra_env=cluster_profile.profile_env(profile.profile), profile=cluster_profile.profile_to_json(profile),
        **_k8s_cache_root(resolved, args.cluster),
    )
    data = data_summary(resolved)
    if args.cluster == "k8s":
        return _submit_k8s(req, resolved, args=args, data=data, warnings=warnings)
    if args.dry_run:
        files = write_run_files(req)
        skipped = files.compile_skipped_by is not None
        if args.json:
            print(json.dumps({"run_dir": str(run_dir), "dry_run": True, "plan": resolved.plan.to_json(),
                              "data": data.to_json(), "compile_skipped": skipped,
                              "compile_left_out": files.compile_left_out, "fingerprint": files.fingerprint,
                              "cluster_config": req.profile["path"] if req.profile else None,
                              "resume": resume_notes, "warnings": warnings}, indent=2))
        else:
            print(format_plan(resolved, data=data))
            print(cluster_profile.describe(profile))
            _print_resume(resume_notes)
            note = files.compile_message(req.cache_root)
            if note:
                print(note)
            written = ", ".join(f"{p.phase}.sbatch" for p in files.phases)
            print(f"\nwrote {run_dir}: node.sh, {written}, submit.sh (nothing submitted)")
            print(f"submit by hand with: bash {run_dir}/submit.sh")
        return 0
    if not args.json:
        print(format_plan(resolved, data=data))
        print(cluster_profile.describe(profile))
        _print_resume(resume_notes)
        print(f"run folder: {run_dir}", flush=True)
    echo = None if args.json else (lambda line: print(line, flush=True))
    result = submit(req, wait=args.wait, echo=echo)
    _report(result, as_json=args.json, warnings=warnings, resumed=resumed_dir is not None,
            cluster_config=str(profile.path) if profile.path else None, data=data, resume_notes=resume_notes)
    return 0 if result.ok else 1


def _tune_first(args: argparse.Namespace) -> bool:
    """`submit --tune`: the tune job, run to its end, and the winner's overlay added to args.overrides; False when
    there is no winner (a dry run wrote the tune job's folder only: the run's plan depends on what it measures; or
    the job failed, said on stderr).

    Not an sbatch afterok chain: the run's plan (mesh, batch, compile fingerprint) is made and checked before
    it is queued, and a config changed after planning is refused, so the run is planned once the winner is known."""
    import copy

    from megatron_hpc.cli.tune_cmd import result_lines, run_tune_job

    if args.resume or args.cluster == "k8s":
        raise ConfigError("--tune plans a new run on --cluster slurm or local; drop --tune (a resumed run keeps its "
                          "layout; on k8s run `megatron-hpc tune` on a SLURM or local cluster first)")
    tune_args = copy.copy(args)
    tune_args.out = None
    echo = None if args.json else (lambda line: print(line, flush=True))
    result = run_tune_job(tune_args, resolve(tune_args), echo=echo)
    if result is None:
        return False
    if echo:
        for line in result_lines(result):
            echo(line)
    args.overrides = [*args.overrides, *result["winner"]["overlay"]]
    return True


def _checks_before_writing(args: argparse.Namespace, resolved: Resolved, *, partition: str | None) -> list[str]:
    """The cluster (and room in the partition for hot spares), the kube context and the data, checked before
    anything is written (a dry run warns about data these nodes cannot see instead), and the plan's warnings."""
    from megatron_hpc.data.preflight import check_data, check_tokenizer_vocabulary  # numpy once files are read
    from megatron_hpc.launch.submit import check_cluster, check_spares_fit
    from megatron_hpc.plan.planner import distributed_optimizer_warning, idle_workers_warning

    source = resolved.plan.data_source
    idle = idle_workers_warning(resolved.plan)
    warnings: list[str] = [idle] if idle else []
    warnings += [resolved.cfg.warning] if resolved.cfg.warning else []
    warnings += [resolved.calibration_note] if resolved.calibration_note else []
    pointless = distributed_optimizer_warning(resolved.plan)
    warnings += [pointless] if pointless else []
    if source == "synthetic" and resolved.plan.platform != "cpu":
        warnings.append(f"this run trains on SYNTHETIC tokens (data.source=synthetic), not real data, on "
                        f"{resolved.plan.num_nodes} x {resolved.plan.platform}; meant for benchmarks and smoke tests")
    if args.cluster == "k8s":  # the claim, image and instance type, and the kube context, before anything is written
        from megatron_hpc.launch import k8s_api, k8s_submit

        k8s_submit.pod_site(resolved.cfg, resolved.plan, run_id="check")
        if not args.dry_run:
            k8s_api.load_kube_config()
    if not args.dry_run and args.cluster != "k8s":
        check_cluster(args.cluster, num_nodes=resolved.plan.num_nodes, platform=resolved.platform)
        if args.cluster == "slurm" and resolved.cfg.launch.spare_nodes:
            check_spares_fit(resolved.plan.num_nodes, resolved.cfg.launch.spare_nodes, partition=partition)
        check_data(resolved.cfg.data, source=source)
    else:  # the scripts may be meant for another machine's files (k8s: the claim's): say so, but write them
        try:
            check_data(resolved.cfg.data, source=source)
        except DataError as exc:
            warnings.append(f"{exc} (the scripts are written; the run fails unless the nodes see the data)")
    if source == "indexed":  # a vocabulary too small for the tokenizer is refused here, dry run or not
        unchecked = check_tokenizer_vocabulary(resolved.cfg.data, vocab_size=resolved.cfg.model.vocab_size)
        warnings += [unchecked] if unchecked else []
    return warnings


def _k8s_cache_root(resolved: Resolved, cluster: str) -> dict:
    """On k8s the shared compile cache is on the claim, at the path the pods see (launch/k8s_objects.py)."""
    if cluster != "k8s":
        return {}
    from megatron_hpc.launch.k8s_objects import pod_cache_root

    return {"cache_root": Path(pod_cache_root(resolved.cfg.k8s))}


def _submit_k8s(req: SubmitRequest, resolved: Resolved, *, args: argparse.Namespace, data: DataSummary,
                warnings: list[str]) -> int:
    """Write the YAML (a dry run stops there) or apply it; the printed summary is the SLURM one's."""
    from megatron_hpc.cli.plan_cmd import format_plan
    from megatron_hpc.launch import k8s_submit

    if not args.json:
        print(format_plan(resolved, data=data))
    if args.dry_run:
        files, stages, _ = k8s_submit.write_k8s_files(req)
        jobs = [{"phase": s.phase, "job_id": s.job_id, "file": s.file} for s in stages]
    else:
        echo = None if args.json else (lambda line: print(line, flush=True))
        files, records = k8s_submit.submit_k8s(req, wait=args.wait, echo=echo)
        jobs = [r.to_json() for r in records]
    if args.json:
        print(json.dumps({"run_dir": str(req.run_dir), "dry_run": args.dry_run, "cluster": "k8s",
                          "plan": resolved.plan.to_json(), "compile_skipped": files.compile_skipped_by is not None,
                          "compile_left_out": files.compile_left_out, "fingerprint": files.fingerprint,
                          "jobs": jobs, "warnings": warnings}, indent=2))
        return 0
    note = files.compile_message(req.cache_root)
    if note:
        print(note)
    if args.dry_run:
        written = ", ".join([k8s_submit.CONFIGMAP_FILE, *(j["file"] for j in jobs)])
        print(f"\nwrote {req.run_dir}: {written}, {k8s_submit.APPLY_SCRIPT} (nothing applied)")
        print(f"apply by hand with: bash {req.run_dir}/{k8s_submit.APPLY_SCRIPT}")
    return 0


def check_checkpoint_to_load(resolved: Resolved, *, resumed_dir: Path | None) -> None:
    """CheckpointError (with the `ckpt reshard` command) when the checkpoint the run would load was saved at another
    TP x PP split than the plan's: refused here, before queueing, as the trainer would refuse it after the wait."""
    from megatron_hpc.run_folder import CHECKPOINT_DIR

    ckpt = resolved.cfg.checkpoint
    root = ckpt.load or ckpt.save or (str(resumed_dir / CHECKPOINT_DIR) if resumed_dir is not None else None)
    if root is None:  # a new run folder: nothing to load yet
        return
    from megatron_hpc.checkpoint.store import PipelineLayout, check_before_queue, check_finetune_source
    if ckpt.finetune and ckpt.load and resumed_dir is None:  # a resumed run may load its own checkpoints instead
        check_finetune_source(Path(ckpt.load).expanduser())
    plan = resolved.plan.to_json()
    layout = PipelineLayout.of_run(plan=plan, config=dataclasses.asdict(resolved.cfg))
    check_before_queue(Path(root).expanduser(), tensor_parallel=resolved.plan.tensor_parallel, layout=layout)


def _print_resume(notes: list[str]) -> None:
    if notes:
        print("resume  " + "; ".join(notes))


def checkpoint_space_warning(resolved: Resolved, *, run_dir: Path) -> str | None:
    """A warning when the save folder's filesystem cannot hold checkpoint.keep_last + 1 checkpoints (the newest
    is written in full before the oldest is removed)."""
    from megatron_hpc.run_folder import CHECKPOINT_DIR

    ckpt = resolved.cfg.checkpoint
    folder = Path(ckpt.save).expanduser() if ckpt.save else run_dir / CHECKPOINT_DIR
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free_gib = shutil.disk_usage(probe).free / 2**30
    except OSError:
        return None
    need = (ckpt.keep_last + 1) * resolved.plan.checkpoint_gib
    if free_gib >= need:
        return None
    return (f"{folder} has {free_gib:,.1f} GiB free, but keeping {ckpt.keep_last} checkpoints of "
            f"{resolved.plan.checkpoint_gib:,.1f} GiB needs {need:,.1f} GiB while the next one is written; free "
            f"space, lower checkpoint.keep_last, or point checkpoint.save at a larger filesystem")


def _report(result: SubmitResult, *, as_json: bool, warnings: list[str], resumed: bool,
            cluster_config: str | None, data: DataSummary, resume_notes: list[str]) -> None:
    if as_json:
        print(json.dumps({
            "run_dir": str(result.run_dir), "ok": result.ok, "reason": result.reason, "resumed": resumed,
            "resume": resume_notes, "warnings": warnings, "cluster_config": cluster_config,
            "data": data.to_json(),
            "compile_skipped": bool(result.files and result.files.compile_skipped_by is not None),
            "compile_left_out": result.files.compile_left_out if result.files else None,
            "fingerprint": result.files.fingerprint if result.files else None,
            "jobs": [j.to_json() for j in result.jobs],
        }, indent=2))
        return
    for job in result.jobs:
        dep = f" (afterok:{job.depends_on})" if job.depends_on else ""
        print(f"{job.phase:<8} job {job.job_id}{dep}: {job.state}")
    if not result.ok:
        print(f"megatron-hpc: {result.reason}", file=sys.stderr)

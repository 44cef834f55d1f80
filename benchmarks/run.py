"""Measure the pipeline against hand-written references in one run, and report the ratios.

    python -m benchmarks [--quick] [--out FILE.json] [--device auto|cpu|cuda]
        [--threads N] [--repeats N] [--time-to-accuracy RUN_DIR] [--section.field=VALUE ...]

Config overrides (and `--config FILE.toml`) are train.py's; they configure the measured job.
Each figure is a ratio of two things measured in the same run, interleaved, so that a busy or
slow machine moves both sides alike: overhead_ratio (benchmarks/pipeline.py),
weak_scaling_efficiency (scaling.py), loader_headroom (loaders.py), mfu (mfu.py),
checkpoint_save_ratio and async_checkpoint_stall_ratio (checkpoints.py); `--strategies MODEL`
compares ddp, zero and fsdp (strategies.py). Each figure is the median of `repeats` timed
rounds after warm-up, shown with min and max. The method: BENCHMARKS.md ("Method").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import data
from benchmarks.checkpoints import measure_async, measure_checkpoint
from benchmarks.common import FULL, QUICK, Plan, log_to
from benchmarks.loaders import measure_loader
from benchmarks.mfu import measure_mfu
from benchmarks.pipeline import build_rig, measure_overhead
from benchmarks.report import environment, table, time_to_accuracy, to_json
from benchmarks.resume import measure_resume
from benchmarks.scaling import measure_scaling
from benchmarks.strategies import measure_strategies, strategies_table
from cli import parse_args
from config import Config, ConfigError
from distributed import DistInfo


def measure(cfg: Config, device: torch.device, plan: Plan, scratch: Path) -> dict[str, Any]:
    """Every figure: first those of this process, then the spawned ranks (cores to themselves)."""
    info = DistInfo(rank=0, local_rank=0, world_size=1, device=device)
    splits = data.build_datasets(cfg.data, cfg.train.seed, info)
    stats = (splits.mean, splits.std)
    rig = build_rig(cfg, info, plan, stats, scratch / "single")
    try:
        overhead = measure_overhead(rig, plan)
        step_rate = overhead["pipeline_samples_per_s"].median
        # The measured batch size, with the configured workers.
        workers = dataclasses.replace(rig.cfg.data, num_workers=cfg.data.num_workers)
        loader = measure_loader(
            dataclasses.replace(rig.cfg, data=workers), splits, info, plan, step_rate
        )
        mfu = measure_mfu(rig, plan, step_rate)
        ckpt = measure_checkpoint(rig, plan)
        async_save = measure_async(rig, plan, ckpt["save_s"].median)
    finally:
        rig.close()
    unavailable = {}
    scaling = None
    if device.type == "cuda" and torch.cuda.device_count() < 2:
        unavailable["weak_scaling_efficiency"] = "needs 2 GPUs on this machine"
    else:
        scaling = measure_scaling(cfg, device, plan, stats, scratch)
    return {
        "overhead_ratio": overhead["ratio"],
        "overhead_ratio_cpu_time": overhead["ratio_cpu_time"],
        "weak_scaling_efficiency": None if scaling is None else scaling["efficiency"],
        "loader_headroom": loader["headroom"],
        "mfu": mfu["mfu"],
        "checkpoint_save_ratio": ckpt["ratio"],
        "checkpoint_save_ratio_64mib": ckpt["large"]["ratio"],
        "async_checkpoint_stall_ratio": async_save["ratio"],
        "unavailable": unavailable,
        "details": {
            "overhead": overhead,
            "scaling": scaling,
            "loader": loader,
            "mfu": mfu,
            "checkpoint": ckpt,
            "async": async_save,
        },
    }


def parse(argv: list[str]) -> tuple[argparse.Namespace, Config]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Benchmark the training pipeline. Other arguments (--section.field=VALUE, "
        "--config FILE.toml) configure the measured job as for train.py.",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a short smoke run (about a minute on 2 cores)"
    )
    parser.add_argument("--out", type=Path, help="also write the report here as JSON")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: what torchrun gives each rank)"
    )
    parser.add_argument("--repeats", type=int, help="timed rounds per figure (default 5)")
    parser.add_argument(
        "--time-to-accuracy",
        type=Path,
        metavar="RUN_DIR",
        help="also report when RUN_DIR/metrics.jsonl first reached 90%% and 92%% accuracy",
    )
    parser.add_argument(
        "--strategies",
        metavar="MODEL",
        help="also measure ddp, zero and fsdp at 2 ranks on model.name MODEL (resnet50): bytes "
        "of parameters, gradients and optimizer state per rank, peak memory, samples/s",
    )
    parser.add_argument(
        "--only-strategies",
        action="store_true",
        help="with --strategies: measure the strategies alone (not the pipeline's figures)",
    )
    parser.add_argument(
        "--resume-turns",
        type=int,
        help="with --strategies: turns of fsdp's fresh start, resume and whole-tensor resume "
        "whose peak memory is compared (default 3, 1 with --quick)",
    )
    args, rest = parser.parse_known_args(argv)
    return args, parse_args(rest, prog="python -m benchmarks")


def strategies_and_resume(
    args: argparse.Namespace, device: torch.device, plan: Plan, parent: Path
) -> dict[str, Any]:
    """--strategies: ddp, zero and fsdp side by side, then fsdp's resume against a fresh
    start, from the checkpoint fsdp's runs wrote."""
    scratch = Path(tempfile.mkdtemp(prefix=".benchmark-", dir=parent))
    try:
        result = measure_strategies(args.strategies, device, plan, scratch)
        turns = args.resume_turns or (1 if plan.quick else 3)
        result["resume"] = measure_resume(args.strategies, device.type, scratch, turns, 64, 8)
        return result
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    try:
        args, cfg = parse(sys.argv[1:] if argv is None else argv)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if cfg.dist.strategy != "ddp":
        # The figures compare train.py's loop with a hand-written DDP loop on the same model;
        # the strategies are measured side by side with --strategies MODEL instead.
        print(
            f"error: dist.strategy={cfg.dist.strategy}: the benchmark measures the ddp pipeline "
            "against a bare DDP loop; use --strategies MODEL to compare ddp, zero and fsdp",
            file=sys.stderr,
        )
        return 2
    plan = QUICK if args.quick else FULL
    if args.repeats:
        plan = dataclasses.replace(plan, repeats=args.repeats)
    torch.set_num_threads(args.threads)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    env = environment(device)
    # Beside the run dir: on the filesystem the run's checkpoints would go to.
    parent = Path(cfg.run.dir).resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".benchmark-", dir=parent))
    try:
        log_to(scratch / "pipeline.log")
        report = {} if args.only_strategies else measure(cfg, device, plan, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.time_to_accuracy:
        report["time_to_accuracy"] = time_to_accuracy(args.time_to_accuracy)
    if args.strategies:
        report["strategies"] = strategies_and_resume(args, device, plan, parent)
    report.update(
        environment=env,
        plan=dataclasses.asdict(plan),
        config=cfg.to_dict(),
        command=sys.argv,
        load_average_at_end=os.getloadavg()[0],
        wall_s=time.perf_counter() - started,
    )
    if not args.only_strategies:
        print(table(report))
    if "strategies" in report:
        print(strategies_table(report["strategies"]))
    if args.out:
        args.out.write_text(json.dumps(to_json(report), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

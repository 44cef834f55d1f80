"""Weak scaling in spawned ranks, 1 thread each: weak_scaling_efficiency.

- weak_scaling_efficiency: samples/s of 2 ranks / (2 x samples/s of 1 rank), 1 thread each,
  and the share of a step spent in the gradient all-reduce that backward does not hide.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import distributed
from benchmarks.common import Plan, Spread, Stats, interleaved, log_to, rates
from benchmarks.pipeline import bare_steps, build_rig, measured_config
from config import Config, global_batch_size
from distributed import DistInfo


def measure_rank(
    cfg: Config, info: DistInfo, plan: Plan, stats: Stats, run_dir: Path
) -> dict[str, Any]:
    """Seconds per round of the pipeline; with several ranks also of the bare loop with and
    without the gradient all-reduce, whose difference is the all-reduce time backward does
    not hide. `cpu_share` per rank (CPU seconds / wall seconds of the rounds) tells whether
    each rank had a core to itself: below 1 other processes took part of it."""
    rig = build_rig(cfg, info, plan, stats, run_dir)
    try:
        steps = plan.scaling_steps
        rig.pipeline.run(plan.warmup_steps)
        bare_steps(rig.bare, plan.warmup_steps)
        fns: dict[str, Callable[[], Any]] = {"pipeline": partial(rig.pipeline.run, steps)}
        if info.world_size > 1:
            fns["bare_sync"] = partial(bare_steps, rig.bare, steps)
            fns["bare_no_sync"] = partial(bare_steps, rig.bare, steps, sync=False)
        cpu_started, wall_started = time.process_time(), time.perf_counter()
        seconds: dict[str, Any] = interleaved(fns, plan.repeats, info)
        cpu_share = (time.process_time() - cpu_started) / (time.perf_counter() - wall_started)
        seconds["cpu_share"] = distributed.all_gather_object(cpu_share)
        return seconds
    finally:
        rig.close()


def rank_entry(
    rank: int,
    world_size: int,
    device_type: str,
    cfg: Config,
    plan: Plan,
    stats: Stats,
    scratch: str,
) -> None:
    """One spawned rank: join a group through a file store (no port to race for), measure."""
    torch.set_num_threads(1)
    run_dir = Path(scratch) / f"ranks{world_size}"
    log_to(Path(scratch) / f"ranks{world_size}-rank{rank}.log")
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    backend = None
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before NCCL binds its communicator to a device
    if world_size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=f"file://{scratch}/store{world_size}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=300),
        )
    try:
        info = DistInfo(rank, rank, world_size, device, backend)
        seconds = measure_rank(cfg, info, plan, stats, run_dir)
        if info.is_main:
            (run_dir / "seconds.json").write_text(json.dumps(seconds))
    finally:
        distributed.teardown()


def measure_scaling(
    cfg: Config, device: torch.device, plan: Plan, stats: Stats, scratch: Path
) -> dict[str, Any]:
    """1 rank, then 2 ranks, both spawned the same way: only the world size differs."""
    seconds = {}
    for world_size in (1, 2):
        mp.start_processes(
            rank_entry,
            args=(world_size, device.type, cfg, plan, stats, str(scratch)),
            nprocs=world_size,
            start_method="spawn",
        )
        seconds[world_size] = json.loads(
            (scratch / f"ranks{world_size}" / "seconds.json").read_text()
        )
    samples = plan.scaling_steps * global_batch_size(measured_config(cfg, plan, scratch), 1)
    one = rates(seconds[1]["pipeline"], samples)
    two = rates(seconds[2]["pipeline"], 2 * samples)
    synced, unsynced = Spread.of(seconds[2]["bare_sync"]), Spread.of(seconds[2]["bare_no_sync"])
    return {
        "one_rank_samples_per_s": one,
        "two_ranks_samples_per_s": two,
        "efficiency": two.median / (2 * one.median),
        "bare_step_s_with_allreduce": synced.median / plan.scaling_steps,
        "bare_step_s_without_allreduce": unsynced.median / plan.scaling_steps,
        # Below the noise the difference can come out negative: read it as fully hidden.
        "allreduce_exposed_fraction": (synced.median - unsynced.median) / synced.median,
        "cpu_share_one_rank": seconds[1]["cpu_share"],
        "cpu_share_two_ranks": seconds[2]["cpu_share"],
    }

"""Strategies: what each rank holds, and how fast, under ddp, zero and fsdp at 2 ranks.

`--strategies MODEL`: bytes of parameters, gradients and optimizer state per rank, peak
memory and samples/s of each strategy, each in fresh processes; under fsdp also the sharded
and one-file checkpoint timings and the stall of an asynchronous sharded save.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import auto
import distributed
import engine
import parallel
import sharding
from benchmarks.common import Plan, Spread, rates, timed
from ckpt import parts, sharded, single, storage, writer
from config import DistConfig, ModelConfig, OptimConfig
from distributed import DistInfo
from model import build
from optim import spec

STRATEGIES = ("ddp", "zero", "fsdp")


def rss_bytes() -> int:
    """This process's resident set now (/proc/self/statm, pages)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM). Not getrusage's ru_maxrss, which Linux carries
    over exec: a rank spawned from a parent that had grown larger read the parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _local_bytes(tensors: Iterator[torch.Tensor]) -> int:
    return sum(
        sharding.local_tensor(t).numel() * t.element_size()
        for t in tensors
        if isinstance(t, torch.Tensor)
    )


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """This rank's optimizer state tensors (ZeRO: its local optimizer's, its shard)."""
    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer.optim
    for entry in local.state.values():
        yield from (value for value in entry.values() if isinstance(value, torch.Tensor))


def strategy_entry(
    rank: int,
    strategy: str,
    model_name: str,
    image: int,
    batch: int,
    steps: int,
    rounds: int,
    device_type: str,
    scratch: str,
    store: int,
    async_stall: bool,
) -> None:
    """One of 2 spawned ranks under `strategy` (`store`: a file store of its own): bytes of
    parameters, gradients and optimizer state this rank holds after a step, its peak memory,
    and seconds per `steps` steps; under fsdp the checkpoint timings too (the async stall
    unless `async_stall` is false)."""
    device, backend = join_pair(rank, device_type, f"file://{scratch}/store-{strategy}-{store}")
    try:
        info = DistInfo(rank, rank, 2, device, backend)
        report = strategy_report(
            info, strategy, model_name, image, batch, steps, rounds, Path(scratch), async_stall
        )
        gathered = distributed.all_gather_object(report)
        if rank == 0:
            (Path(scratch) / f"strategy-{strategy}.json").write_text(json.dumps(gathered))
        # Every rank's figures are on disk: leave without gloo's C++ teardown, which has
        # aborted a rank here ("terminate called without an active exception") as it does in
        # the tests' spawned ranks under load (tests/helpers.py); the kernel closes the sockets.
        dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    finally:  # a failure: spawn reports this rank's exception
        distributed.teardown()


def join_pair(rank: int, device_type: str, init_method: str) -> tuple[torch.device, str]:
    """Join the group of 2 ranks through a file store (no port to race for), one thread."""
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=300),
    )
    return device, backend


def strategy_report(
    info: DistInfo,
    strategy: str,
    model_name: str,
    image: int,
    batch: int,
    steps: int,
    rounds: int,
    scratch: Path,
    async_stall: bool,
) -> dict[str, Any]:
    """This rank's figures under `strategy` (strategy_entry says which)."""
    rss_start = rss_bytes()
    par, optimizer = build_strategy(info, strategy, model_name, image)
    held: dict[str, int] = {}
    step = training_step(info, par, optimizer, batch, image, held)
    step(count=True)
    held["params"] = _local_bytes(par.bare.parameters())
    held["optimizer_state"] = _local_bytes(optimizer_state_tensors(optimizer))
    seconds = [
        timed(partial(lambda: [step() for _ in range(steps)]), info.device) for _ in range(rounds)
    ]
    peak, peak_kind = peak_memory(info.device, rss_start)
    report = {**held, "peak_bytes": peak, "peak_kind": peak_kind, "seconds": seconds}
    if strategy == "fsdp":  # after the peak: the saves' buffers are not training's
        report["checkpoint"] = time_checkpoints(info, par, optimizer, scratch, rounds)
        if async_stall:
            sync_s = statistics.median(report["checkpoint"]["save_sharded_s"])
            report["checkpoint"] |= time_async_stall(info, par, optimizer, scratch, 3, step, sync_s)
    return report


def build_strategy(
    info: DistInfo, strategy: str, model_name: str, image: int
) -> tuple[parallel.Parallel, torch.optim.Optimizer]:
    """`model_name` (100 classes, the same initial weights on every rank) under `strategy`,
    with AdamW built the strategy's way."""
    torch.manual_seed(0)
    model = build(ModelConfig(name=model_name), (3, image, image), 100)
    if not parallel.Layout.of(DistConfig(strategy=strategy), info).shards:  # see build_model
        model = model.to(info.device)
    par = parallel.parallelize(model, info, DistConfig(strategy=strategy))
    kind, groups, settings = spec.optimizer_spec(
        par.bare, OptimConfig(name="adamw"), auto.optimizer_impl("auto", info.device)
    )
    return par, par.build_optimizer(kind, groups, **settings)


def training_step(
    info: DistInfo,
    par: parallel.Parallel,
    optimizer: torch.optim.Optimizer,
    batch: int,
    image: int,
    held: dict[str, int],
) -> Callable[..., None]:
    """One optimizer step on a fixed random batch of this rank's; `step(count=True)` also
    records in `held` the bytes of the gradients this rank holds."""
    scaler = engine.make_scaler(info.device, None)
    loss_fn = nn.CrossEntropyLoss()
    generator = torch.Generator().manual_seed(info.rank)
    images = torch.randn(batch, 3, image, image, generator=generator).to(info.device)
    labels = torch.randint(0, 100, (batch,), generator=generator).to(info.device)

    def step(count: bool = False) -> None:
        engine.forward_backward(
            par.model, [(images, labels)], optimizer, scaler, loss_fn, None, 0.0
        )
        if count:  # gradients exist between backward and the update
            held["grads"] = _local_bytes(p.grad for p in par.bare.parameters())
        engine.apply_update(optimizer, scaler)

    return step


def peak_memory(device: torch.device, rss_start: int) -> tuple[int, str]:
    """This rank's peak memory so far, and what it is."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "max_memory_allocated"
    peak = peak_rss_bytes() - rss_start
    return peak, "peak RSS above the RSS before the model was built"


def time_checkpoints(
    info: DistInfo, par: Any, optimizer: torch.optim.Optimizer, scratch: Path, rounds: int
) -> dict[str, list[float]]:
    """Collective, under fsdp: seconds to save the model and optimizer state as a sharded
    checkpoint (every rank its rows, in parallel) and as one file (gathered whole, rank 0
    writes), alternately on the same state, and to load each back whole on every rank."""
    model_part, optim_part = parts.ModelState(par.bare), parts.OptimizerState(optimizer)
    gather = distributed.all_gather_object

    def agree(error: BaseException | None, what: str) -> None:
        distributed.raise_if_any_failed(info, error, what)

    sharded_dir, file_dir = scratch / "ckpt-sharded", scratch / "ckpt-file"
    times: dict[str, list[float]] = {"save_sharded_s": [], "save_file_s": []}
    times |= {"load_sharded_s": [], "load_file_s": []}
    for step in range(1, rounds + 1):
        started = time.perf_counter()
        state = {
            "model": model_part.sharded_state_dict(),
            "optimizer": optim_part.sharded_state_dict(),
            "step": step,
        }
        sharded.save_sharded(state, sharded_dir, step, 1, None, info.rank, gather, agree)
        times["save_sharded_s"].append(time.perf_counter() - started)
        started = time.perf_counter()
        whole = {"model": model_part.state_dict(), "optimizer": optim_part.state_dict()}
        write = partial(single.save, {**whole, "step": step}, file_dir, step, 1, None)
        distributed.run_on_main(info, "saving the file checkpoint", write)
        times["save_file_s"].append(time.perf_counter() - started)
        for kind, path in (("sharded", sharded_dir / f"step_{step}"), ("file", None)):
            dist.barrier()
            started = time.perf_counter()
            target = path if path is not None else file_dir / f"step_{step}.pt"
            storage.load(target, torch.device("cpu"), verified=info.rank != 0)
            dist.barrier()
            times[f"load_{kind}_s"].append(time.perf_counter() - started)
    return times


def time_async_stall(
    info: DistInfo,
    par: Any,
    optimizer: torch.optim.Optimizer,
    scratch: Path,
    rounds: int,
    step: Callable[[], None],
    sync_s: float,
) -> dict[str, list[float]]:
    """Collective, under fsdp: training steps with an asynchronous sharded save handed over
    at their start (ckpt.async_save: each rank's writer process) vs the same steps without,
    interleaved. A round spans enough steps to cover a synchronous save and ends once the
    manifest is written, so a write that outlasts the steps counts in full; the stall is the
    difference (prepare, the copy into shared memory, and the writers' competition for the
    cores)."""
    model_part, optim_part = parts.ModelState(par.bare), parts.OptimizerState(optimizer)
    started = _clock(info.device)
    step()
    steps = max(2, math.ceil(sync_s / (_clock(info.device) - started)) + 1)
    saver = writer.ProcessSaver()
    directory = scratch / "ckpt-async"
    times: dict[str, list[float]] = {"steps_s": [], "steps_with_async_save_s": []}
    times["async_handover_s"] = []
    try:
        for number in range(rounds + 1):  # round 0: warm-up (the writer's buffers)
            plain, handover, with_save = _async_round(
                info, (model_part, optim_part), saver, directory, number + 1, steps, step
            )
            if number:
                times["steps_s"].append(plain)
                times["steps_with_async_save_s"].append(with_save)
                times["async_handover_s"].append(handover)
    finally:
        saver.close()
    return times


def _clock(device: torch.device) -> float:
    """perf_counter after the device's queued work (CUDA runs ahead of the host)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _async_round(
    info: DistInfo,
    state_parts: tuple[parts.ModelState, parts.OptimizerState],
    saver: writer.ProcessSaver,
    directory: Path,
    save_step: int,
    steps: int,
    step: Callable[[], None],
) -> tuple[float, float, float]:
    """Collective: seconds of `steps` plain steps, then of the hand-over of a sharded save
    as of `save_step` and of the steps after it until the manifest is written."""
    model_part, optim_part = state_parts
    gather = distributed.all_gather_object

    def agree(error: BaseException | None, what: str) -> None:
        distributed.raise_if_any_failed(info, error, what)

    dist.barrier()
    started = _clock(info.device)
    for _ in range(steps):
        step()
    plain = _clock(info.device) - started
    dist.barrier()
    started = _clock(info.device)
    state = {
        "model": model_part.sharded_state_dict(),
        "optimizer": optim_part.sharded_state_dict(),
        "step": save_step,
    }
    plan = sharded.prepare_sharded(state, directory, save_step, info.rank, gather, agree)
    saver.write_sharded(plan)
    handover = _clock(info.device) - started
    for _ in range(steps):
        step()
    written = saver.wait()
    sharded.finish_sharded(plan, written, None, 1, None, info.rank, gather, agree)
    return plain, handover, _clock(info.device) - started


def measure_strategies(
    model_name: str,
    device: torch.device,
    plan: Plan,
    scratch: Path,
    image: int = 64,
    batch: int = 8,
) -> dict[str, Any]:
    """ddp, zero and fsdp at 2 ranks on `model_name`, each in fresh processes (a peak of
    memory is a process's), the strategies' turns interleaved over rounds (one with --quick)."""
    steps = max(2, plan.scaling_steps // 4)
    per_strategy = run_strategies(model_name, device, plan, scratch, image, batch, steps)
    result: dict[str, Any] = {
        "model": model_name,
        "input": [3, image, image],
        "batch_per_rank": batch,
        "steps_per_round": steps,
    }
    ddp_state = None
    for strategy, runs in per_strategy.items():
        result[strategy] = summarise_strategy(runs, batch, steps)
        state = result[strategy]["state_bytes_max_rank"]
        ddp_state = ddp_state or state
        result[strategy]["state_vs_ddp"] = state / ddp_state
    summarise_fsdp_checkpoints(result, per_strategy["fsdp"])
    return result


def run_strategies(
    model_name: str,
    device: torch.device,
    plan: Plan,
    scratch: Path,
    image: int,
    batch: int,
    steps: int,
) -> dict[str, list[list[dict[str, Any]]]]:
    """Each strategy's runs, in turns: per run, what each of its 2 ranks reported."""
    per_strategy: dict[str, list[list[dict[str, Any]]]] = {s: [] for s in STRATEGIES}
    for repeat in range(1 if plan.quick else max(2, plan.repeats // 2)):
        order = STRATEGIES if repeat % 2 == 0 else tuple(reversed(STRATEGIES))
        for strategy in order:
            mp.start_processes(
                strategy_entry,
                args=(
                    strategy,
                    model_name,
                    image,
                    batch,
                    steps,
                    2,
                    device.type,
                    str(scratch),
                    repeat,
                    not plan.quick,  # the async stall: minutes more on 2 cores
                ),
                nprocs=2,
                start_method="spawn",
            )
            ranks = json.loads((scratch / f"strategy-{strategy}.json").read_text())
            per_strategy[strategy].append(ranks)
    return per_strategy


def summarise_strategy(runs: list[list[dict[str, Any]]], batch: int, steps: int) -> dict[str, Any]:
    """One strategy's bytes per rank (of its first run), peak memory and samples/s."""
    first = runs[0]  # bytes do not vary between runs; the peak barely does
    state = max(r["params"] + r["grads"] + r["optimizer_state"] for r in first)
    rounds = [s for run in runs for r in run[:1] for s in r["seconds"]]
    return {
        "params_bytes_per_rank": [r["params"] for r in first],
        "grads_bytes_per_rank": [r["grads"] for r in first],
        "optimizer_state_bytes_per_rank": [r["optimizer_state"] for r in first],
        "state_bytes_max_rank": state,
        "peak_bytes_per_rank": Spread.of([max(r["peak_bytes"] for r in run) for run in runs]),
        "peak_kind": first[0]["peak_kind"],
        "samples_per_s": rates(rounds, 2 * batch * steps),
    }


def summarise_fsdp_checkpoints(
    result: dict[str, Any], fsdp_runs: list[list[dict[str, Any]]]
) -> None:
    """Into `result`: fsdp's checkpoint timings (rank 0's), and the async save's stall and
    hand-over against a synchronous sharded save, where they were measured."""
    if "checkpoint" not in fsdp_runs[0][0]:
        return
    result["checkpoint"] = {
        key: Spread.of([s for run in fsdp_runs for s in run[0]["checkpoint"][key]])
        for key in fsdp_runs[0][0]["checkpoint"]
    }
    if "steps_s" not in fsdp_runs[0][0]["checkpoint"]:
        return
    stalls = [
        a - p
        for run in fsdp_runs
        for a, p in zip(
            run[0]["checkpoint"]["steps_with_async_save_s"],
            run[0]["checkpoint"]["steps_s"],
            strict=True,
        )
    ]
    result["stall_s"] = Spread.of(stalls)
    # Below the noise the difference can come out negative: no measurable stall.
    sync = result["checkpoint"]["save_sharded_s"].median
    result["stall_ratio"] = max(0.0, result["stall_s"].median) / sync
    result["handover_ratio"] = result["checkpoint"]["async_handover_s"].median / sync


def strategies_table(result: dict[str, Any]) -> str:
    """MB per rank (the larger of the two ranks), peak memory and samples/s of each strategy."""
    lines = [
        f"strategies at 2 ranks: {result['model']} on {result['input']} inputs, batch "
        f"{result['batch_per_rank']} per rank, AdamW; MB per rank (the larger rank)",
        f"{'strategy':<9} {'params':>8} {'grads':>8} {'optim':>8} {'state':>8} {'vs ddp':>7}  "
        f"{'peak MB':<18} samples/s",
    ]
    for strategy in STRATEGIES:
        r = result[strategy]
        peak = r["peak_bytes_per_rank"]
        lines.append(
            f"{strategy:<9} {max(r['params_bytes_per_rank']) / 1e6:>8.1f} "
            f"{max(r['grads_bytes_per_rank']) / 1e6:>8.1f} "
            f"{max(r['optimizer_state_bytes_per_rank']) / 1e6:>8.1f} "
            f"{r['state_bytes_max_rank'] / 1e6:>8.1f} {r['state_vs_ddp']:>7.2f}  "
            f"{f'{peak.median / 1e6:.0f} [{peak.min / 1e6:.0f}-{peak.max / 1e6:.0f}]':<18} "
            f"{r['samples_per_s'].show('{:.1f}')}"
        )
    lines.append(f"peak: {result[STRATEGIES[0]]['peak_kind']}")
    if "checkpoint" in result:
        c = result["checkpoint"]
        lines.append(
            "fsdp checkpoint of model + optimizer state, seconds: save sharded "
            f"{c['save_sharded_s'].show('{:.3f}')} vs one file by rank 0 "
            f"{c['save_file_s'].show('{:.3f}')}; load sharded {c['load_sharded_s'].show('{:.3f}')}"
            f" vs one file {c['load_file_s'].show('{:.3f}')}"
        )
        if "stall_ratio" in result:
            lines.append(
                f"async sharded save: stall {result['stall_s'].show('{:.3f}')} s over "
                f"{c['steps_s'].median:.1f} s of steps, hand-over "
                f"{c['async_handover_s'].show('{:.3f}')} s ({result['handover_ratio']:.2f} of a "
                f"synchronous sharded save); stall / synchronous sharded save "
                f"{result['stall_ratio']:.2f}"
            )
    if "resume" in result:
        r = result["resume"]
        fresh, rows, whole = (r[f"{k}_peak_bytes"] for k in ("fresh", "resume", "resume_whole"))
        lines.append(
            "fsdp peak over a start and one step, MB (the larger rank): fresh "
            f"{_mb(fresh)}; resumed, each rank reading its rows {_mb(rows)} "
            f"({r['resume_vs_fresh']:.2f} of fresh), every tensor read whole {_mb(whole)} "
            f"({r['resume_whole_vs_fresh']:.2f}) ({r['peak_kind']})"
        )
    return "\n".join(lines)


def _mb(spread: Spread) -> str:
    return f"{spread.median / 1e6:,.0f} [{spread.min / 1e6:,.0f}-{spread.max / 1e6:,.0f}]"

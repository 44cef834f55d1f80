"""The report: the figures' table, what each was computed from, and time to accuracy."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import Spread
from runpaths import RunPaths

TARGETS = {
    "overhead_ratio": ">= 0.98",
    "weak_scaling_efficiency": ">= 0.90",
    "loader_headroom": ">= 20",
    "mfu": "-",
    "checkpoint_save_ratio": "<= 1.5",
    "checkpoint_save_ratio_64mib": "<= 1.5",
    "async_checkpoint_stall_ratio": "<= 0.1",
}


def time_to_accuracy(run_dir: Path, targets: tuple[float, ...] = (0.90, 0.92)) -> dict[str, Any]:
    """The first evaluation at or above each target in RUN_DIR/metrics.jsonl.

    `time_s` is train.py's: seconds from the start of training (after the job is built) to
    the end of that evaluation; a resumed run restarts the clock.
    """
    lines = RunPaths(run_dir).metrics.read_text().splitlines()
    evals = [row for row in map(json.loads, filter(str.strip, lines)) if row["kind"] == "eval"]
    found = {}
    for target in targets:
        row = next((r for r in evals if r["accuracy"] >= target), None)
        keys = ("step", "epoch", "accuracy", "time_s")
        found[f"{target:.0%}"] = None if row is None else {key: row.get(key) for key in keys}
    return found


def environment(device: torch.device) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line for line in cpuinfo.read_text().splitlines() if line.startswith("model name")]
        cpu = names[0].split(":", 1)[1].strip() if names else cpu
    return {
        "torch": str(torch.__version__),
        "python": platform.python_version(),
        "cpu": cpu,
        "cpus_usable": len(os.sched_getaffinity(0)),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
        "load_average_at_start": os.getloadavg()[0],
    }


def to_json(value: Any) -> Any:
    if isinstance(value, Spread):
        return dataclasses.asdict(value)
    if isinstance(value, dict):
        return {key: to_json(item) for key, item in value.items()}
    return value


def _host_verdicts(o: dict[str, Any]) -> str:
    if o.get("host_verdicts_samples_per_s") is None:
        return f"; verdicts {o.get('verdicts', 'host')}"
    host, ratio = o["host_verdicts_samples_per_s"].show(), o["ratio_host_verdicts"]
    said = f"train.verdict=host in the same rounds: {host} samples/s, ratio {ratio:.3f}"
    return f"; verdicts on the device ({said})"


def notes(details: dict[str, Any]) -> dict[str, str]:
    """One line per figure: what it was computed from (median [min-max])."""
    o, ld, m, c = details["overhead"], details["loader"], details["mfu"], details["checkpoint"]
    lines = {
        "overhead_ratio": f"pipeline {o['pipeline_samples_per_s'].show()} / "
        f"bare {o['bare_samples_per_s'].show()} samples/s; by CPU time {o['ratio_cpu_time']:.3f}"
        + _host_verdicts(o),
        "loader_headroom": f"loader {ld['loader_samples_per_s'].show()} samples/s "
        f"({ld['num_workers']} workers) / step {ld['step_samples_per_s']:,.0f}",
        "mfu": f"{m['flops_per_step'] / 1e9:.2f} GFLOP/step, {m['model_flops_per_s'] / 1e9:.2f} "
        f"GFLOP/s / peak {m['peak_flops_per_s']:,.3g} FLOP/s ({m['peak_source']})",
        "checkpoint_save_ratio": f"save {c['save_s'].show('{:.4f}')} s / raw "
        f"{c['raw_write_s'].show('{:.4f}')} s, {c['bytes'] / 1e6:.2f} MB; one small atomic "
        f"write {c['small_atomic_write_s'].show('{:.4f}')} s",
        "checkpoint_save_ratio_64mib": f"save {c['large']['save_s'].show('{:.4f}')} s / raw "
        f"{c['large']['raw_write_s'].show('{:.4f}')} s, {c['large']['bytes'] / 1e6:.1f} MB; "
        f"handed to a writer process, save() blocks {c['large']['handover_s'].show('{:.4f}')} "
        f"s, {c['large']['handover_ratio']:.3f} of the synchronous save",
    }
    if (s := details["scaling"]) is not None:
        lines["weak_scaling_efficiency"] = (
            f"2 ranks {s['two_ranks_samples_per_s'].show()} / 2 x 1 rank "
            f"{s['one_rank_samples_per_s'].show()} samples/s; all-reduce not hidden: "
            f"{s['allreduce_exposed_fraction']:.1%} of a step; CPU share per rank "
            f"{'/'.join(f'{share:.2f}' for share in s['cpu_share_two_ranks'])}"
        )
    if (a := details["async"]) is not None:
        lines["async_checkpoint_stall_ratio"] = (
            f"stall {a['stall_s'].show('{:.4f}')} s in {a['rounds']} rounds of "
            f"{a['steps_per_round']} steps ({a['plain_round_s'].show('{:.3f}')} s without a save); "
            f"save() blocks {a['save_call_s'].show('{:.4f}')} s, {a['handover_ratio']:.3f} of a "
            "synchronous save"
        )
    return lines


def table(report: dict[str, Any]) -> str:
    explained = {**notes(report["details"]), **report["unavailable"]}
    lines = [f"{'figure':<29} {'value':>6}  {'target':<7}  detail: median [min-max]"]
    for key, target in TARGETS.items():
        value = "null" if report[key] is None else f"{report[key]:.3g}"
        lines.append(f"{key:<29} {value:>6}  {target:<7}  {explained[key]}")
    for name, row in report.get("time_to_accuracy", {}).items():
        reached = "not reached"
        if row is not None:
            seconds = "no time_s" if row["time_s"] is None else f"{row['time_s']:.0f} s"
            reached = f"{seconds}, step {row['step']} (epoch {row['epoch']})"
        lines.append(f"{'time to ' + name + ' accuracy':<29} {reached}")
    env = report["environment"]
    lines.append(
        f"torch {env['torch']} on {env['device']}, {env['cpu']} ({env['cpus_usable']} CPUs), "
        f"{env['torch_threads']} thread(s), load average {env['load_average_at_start']:.2f} "
        f"at start, {report['load_average_at_end']:.2f} at end; {report['wall_s']:.0f} s"
    )
    return "\n".join(lines)

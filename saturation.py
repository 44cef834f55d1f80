"""Whether the hardware is kept busy: CPU use of each rank's trainer process and of its loader
workers, GPU utilisation and memory, and advice when the loader or the step size holds the
training back.

`Usage.sample()` measures one rank since its previous call (no collective);
`Instruments.log_train` gathers every rank's sample at log intervals, in the same collective
step on every rank, and `reduce` turns them into min / median / max over ranks. `advice` reads
the reduced figures and says what to change; `oversubscribed` checks a node's cores once at
start-up.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

log = logging.getLogger("train")

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

# What each sampled figure is, in the order a rank's sample travels in (NaN: not measured here).
FIELDS = (
    "cpu_trainer_cores",  # CPU time of the training process (all its threads) / wall time
    "cpu_loader_cores",  # the same for all its loader workers together
    "cpu_loader_worker_frac",  # per loader worker: 1.0 = one core kept busy
    "gpu_util_pct",  # NVML's utilisation over the interval's last sample (nvidia-ml-py)
    "gpu_mem_allocated_gb",  # tensors now
    "gpu_mem_reserved_gb",  # held by the caching allocator now
    "gpu_mem_peak_gb",  # the most allocated at once since the previous sample
)

# Advice thresholds (docs/observability.md, "Saturation").
DATA_WAIT_HIGH = 0.10  # of the step: the loader holds the step back
WORKER_BUSY = 0.80  # of a core per worker: the workers are CPU-bound
GPU_IDLE_PCT = 60.0  # GPU utilisation under this with the loader keeping up: a small step
DATA_WAIT_LOW = 0.05


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` (its threads included), None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            fields = file.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime (fields 14 and 15)


class _Nvml:
    """GPU utilisation through NVML (nvidia-ml-py), when present."""

    def __init__(self, device: torch.device) -> None:
        self.handle: Any = None
        if device.type != "cuda":
            return
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            index = device.index if device.index is not None else torch.cuda.current_device()
            uuid = str(torch.cuda.get_device_properties(index).uuid)
            self.handle = next(
                handle
                for handle in map(
                    pynvml.nvmlDeviceGetHandleByIndex, range(pynvml.nvmlDeviceGetCount())
                )
                if str(pynvml.nvmlDeviceGetUUID(handle)).removeprefix("GPU-")
                == uuid.removeprefix("GPU-")
            )
            self.pynvml = pynvml
        except Exception as err:  # not installed, no driver access, a MIG slice, ...
            log.debug("no NVML utilisation: %s", err)
            self.handle = None

    def utilisation_pct(self) -> float:
        if self.handle is None:
            return math.nan
        try:
            return float(self.pynvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)
        except Exception:
            return math.nan


class Usage:
    """One rank's CPU and GPU use between calls of `sample`."""

    def __init__(self, device: torch.device, worker_pids: Callable[[], Sequence[int]]) -> None:
        self.device = device
        self.worker_pids = worker_pids
        self.nvml = _Nvml(device)
        self._start()

    def _start(self) -> None:
        self.wall = time.perf_counter()
        self.own = time.process_time()
        self.workers = {pid: _cpu_seconds(pid) for pid in self.worker_pids()}

    def sample(self) -> list[float]:
        """The FIELDS since the previous call (or since construction)."""
        wall = max(time.perf_counter() - self.wall, 1e-9)
        trainer = (time.process_time() - self.own) / wall
        pids = list(self.worker_pids())
        used = 0.0
        for pid in pids:
            before, now = self.workers.get(pid), _cpu_seconds(pid)
            if now is not None:  # a worker started in the interval counts from its start
                used += now - (before or 0.0)
        loader = used / wall if pids else math.nan
        per_worker = loader / len(pids) if pids else math.nan
        gpu = [math.nan] * 4
        if self.device.type == "cuda":
            gib = 1024**3
            gpu = [
                self.nvml.utilisation_pct(),
                torch.cuda.memory_allocated(self.device) / gib,
                torch.cuda.memory_reserved(self.device) / gib,
                torch.cuda.max_memory_allocated(self.device) / gib,
            ]
            torch.cuda.reset_peak_memory_stats(self.device)
        self._start()
        return [trainer, loader, per_worker, *gpu]


def reduce(samples: Sequence[Sequence[float]]) -> dict[str, float]:
    """Every rank's sample -> `<field>_min`, `_median`, `_max` over the ranks that measured it
    (fields no rank measured are left out)."""
    out: dict[str, float] = {}
    for i, name in enumerate(FIELDS):
        values = [s[i] for s in samples if not math.isnan(s[i])]
        if values:
            out[f"{name}_min"] = min(values)
            out[f"{name}_median"] = statistics.median(values)
            out[f"{name}_max"] = max(values)
    return out


def advice(
    figures: dict[str, float],
    num_workers: int,
    on_gpu: bool,
    compiled: bool = False,
    loader: str = "dataloader",
    decode: str = "none",
) -> list[tuple[str, str]]:
    """(kind, what to do) for each way the figures (a train row: data_wait_frac and the
    reduced usage) show the hardware held back. `compiled`: the model runs under
    torch.compile already, so that is not advised; `loader` and `decode` (data.loader and
    data.decode as resolved): what the run already uses is not advised either."""
    found = []
    wait = figures.get("data_wait_frac", 0.0)
    busy = figures.get("cpu_loader_worker_frac_median", math.nan)
    elsewhere = _off_the_cpu(on_gpu, decode)
    if wait > DATA_WAIT_HIGH and loader == "device":
        found.append(("device-loader", _device_loader_wait(wait, on_gpu)))
    elif wait > DATA_WAIT_HIGH and num_workers > 0 and busy >= WORKER_BUSY:
        found.append(
            (
                "loader-cpu-bound",
                f"data wait is {100 * wait:.0f}% of the step and the {num_workers} loader "
                f"workers per rank are CPU-bound ({100 * busy:.0f}% of a core each): add workers "
                "(data.num_workers, if the node has idle cores)"
                + (f", or move the work off the CPU ({elsewhere})" if elsewhere else ""),
            )
        )
    elif wait > DATA_WAIT_HIGH and num_workers == 0:
        found.append(
            (
                "loader-in-process",
                f"data wait is {100 * wait:.0f}% of the step with data.num_workers=0: the "
                "training process loads its own batches; use loader workers "
                f"(data.num_workers){f' or {elsewhere}' if elsewhere else ''}",
            )
        )
    util = figures.get("gpu_util_pct_median", math.nan)
    if on_gpu and util < GPU_IDLE_PCT and wait < DATA_WAIT_LOW:
        found.append(
            (
                "gpu-underused",
                f"the GPUs are busy {util:.0f}% of the time while the loader keeps up (data wait "
                f"{100 * wait:.0f}%): the step is too small for the GPU; raise data.batch_size"
                + ("" if compiled else ", or enable train.compile (fewer, fused kernels)"),
            )
        )
    return found


def _device_loader_wait(wait: float, on_gpu: bool) -> str:
    cpu = "; on a CPU it takes the training cores: data.loader=dataloader with data.num_workers "
    return (
        f"data wait is {100 * wait:.0f}% of the step with data.loader=device: each batch is "
        "gathered and augmented by the training process on its device, and the wait is that "
        "work" + ("" if on_gpu else cpu + "moves it to cores of its own")
    )


def _off_the_cpu(on_gpu: bool, decode: str) -> str:
    """The setting that moves loading off the CPU, where the run does not use it yet: an image
    folder's decoding to the GPU, or an in-memory dataset to the device loader."""
    if decode == "workers":
        return "data.decode=device on a GPU" if on_gpu else ""
    if decode == "device":
        return ""
    return "data.loader=device for an in-memory dataset"


def oversubscribed(local_ranks: int, num_workers: int, cores: int) -> str | None:
    """A warning when a node's ranks have more loader workers together than it has cores,
    else None. (The training processes need cores too: fewer workers than cores is not always
    enough, and `advice` says so when the figures show it.)"""
    workers = local_ranks * num_workers
    if workers <= cores:
        return None
    return (
        f"{local_ranks} rank(s) on this node with data.num_workers={num_workers} loader workers "
        f"each are {workers} workers for {cores} CPU cores: the workers starve each other and "
        "the training processes; lower data.num_workers (or give the job more cores)"
    )


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, which Slurm and cgroups-aware
    launchers narrow), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class Advisor:
    """Logs each kind of advice when it first applies, then at most every `every_s` seconds
    while it still does (rank 0)."""

    def __init__(self, every_s: float = 600.0) -> None:
        self.every_s = every_s
        self.last: dict[str, float] = {}

    def consider(self, found: list[tuple[str, str]]) -> list[str]:
        now, said = time.monotonic(), []
        for kind, message in found:
            if now - self.last.get(kind, -math.inf) >= self.every_s:
                self.last[kind] = now
                log.warning("%s", message)
                said.append(kind)
        return said

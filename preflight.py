"""Preflight: before step 0, every rank checks that all ranks form one consistent job.

Mixed torch/CUDA/NCCL versions, mixed GPU types, a different copy of the dataset or a different
config on one node make a job slow, wrong or hang hours later. One all-gather of a few strings
finds them in a second, and every rank fails with the same message naming the odd hosts.
"""

from __future__ import annotations

import logging
import platform
import socket
import time
from collections import Counter
from typing import Any

import torch

import distributed
from config import ConfigError
from distributed import DistInfo

log = logging.getLogger(__name__)

MUST_MATCH = ("python", "torch", "cuda", "nccl", "device", "dataset", "config")


class PreflightError(ConfigError):
    """The ranks of this job disagree about something that must be the same everywhere.

    A bad set-up, not a crash: like any bad input it ends the job with exit code 2 and the
    message, no traceback."""


def describe(info: DistInfo, dataset_fingerprint: str, config_hash: str) -> dict[str, Any]:
    """What this rank is and runs, as plain strings."""
    cuda = info.device.type == "cuda"
    return {
        "rank": info.rank,
        "local_rank": info.local_rank,
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "cuda": str(torch.version.cuda) if cuda else "none",
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else "none",
        "device": torch.cuda.get_device_name(info.device) if cuda else "cpu",
        "dataset": dataset_fingerprint,
        "config": config_hash,
    }


def mismatches(records: list[dict[str, Any]]) -> list[str]:
    """One line per field that differs across ranks, naming the ranks off the majority."""
    problems = []
    for key in MUST_MATCH:
        counts = Counter(r[key] for r in records)
        if len(counts) == 1:
            continue
        majority, _ = counts.most_common(1)[0]
        odd = ", ".join(
            f"{r['host']} rank {r['rank']}: {r[key]}" for r in records if r[key] != majority
        )
        problems.append(f"{key} differs: {counts[majority]} ranks have {majority}; {odd}")
    return problems


def check(info: DistInfo, dataset_fingerprint: str, config_hash: str) -> list[dict[str, Any]]:
    """Collective: gather every rank's description, fail everywhere on any mismatch."""
    records = distributed.all_gather_object(describe(info, dataset_fingerprint, config_hash))
    problems = mismatches(records)
    if problems:
        raise PreflightError("preflight found ranks that disagree:\n  " + "\n  ".join(problems))
    hosts = Counter(r["host"] for r in records)
    log.info(
        "preflight ok: %d ranks on %d hosts, torch %s, device %s, dataset %s",
        len(records),
        len(hosts),
        records[0]["torch"],
        records[0]["device"],
        records[0]["dataset"],
    )
    for r in records:
        log.info("  rank %d = %s local rank %d", r["rank"], r["host"], r["local_rank"])
    return records


def bandwidth(
    info: DistInfo, sizes_mb: tuple[int, ...] = (1, 16, 64), repeats: int = 5
) -> list[dict[str, float]]:
    """Collective: time all-reduces of a few sizes; report bus bandwidth per size.

    Bus bandwidth = 2 (n - 1) / n x bytes / time: the traffic each link carries in a ring
    all-reduce, comparable with the link's rated speed whatever the world size.
    """
    results = []
    n = info.world_size
    for size_mb in sizes_mb:
        tensor = torch.ones(size_mb * 2**20 // 4, device=info.device)
        distributed.all_reduce_sum(tensor)  # warm-up: connection set-up, allocator
        times = []
        for _ in range(repeats):
            distributed.barrier(info)
            started = time.perf_counter()
            distributed.all_reduce_sum(tensor)
            if info.device.type == "cuda":
                torch.cuda.synchronize(info.device)
            times.append(time.perf_counter() - started)
        median = sorted(times)[len(times) // 2]
        busbw = 2 * (n - 1) / n * tensor.numel() * 4 / median / 1e9 if n > 1 else 0.0
        results.append({"size_mb": size_mb, "seconds": median, "busbw_gb_s": busbw})
        log.info(
            "all-reduce %4d MB: %.2f ms, bus bandwidth %.2f GB/s", size_mb, 1e3 * median, busbw
        )
    return results

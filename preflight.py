"""Preflight: before step 0, every rank checks that all ranks form one consistent job.

Mixed torch/CUDA/NCCL versions, mixed GPU types, a different copy of the dataset, a different
config or different code (a stale checkout, an edited factory) on one node make a job slow,
wrong or hang hours later. One all-gather of a few strings
finds them in a second, and every rank fails with the same message naming the odd hosts.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import socket
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

import distributed
from config import ConfigError
from distributed import DistInfo

log = logging.getLogger(__name__)

MUST_MATCH = ("python", "torch", "cuda", "nccl", "device", "dataset", "config", "code")
REPO = Path(__file__).resolve().parent
DIGEST_CHARS = 12  # of a sha256, as shown; enough to tell two versions of a file apart


class PreflightError(ConfigError):
    """The ranks of this job disagree about something that must be the same everywhere.

    A bad set-up, not a crash: like any bad input it ends the job with exit code 2 and the
    message, no traceback."""


def source_files() -> dict[str, str]:
    """The Python source this process runs from the project and from the user (every loaded
    module whose file lies under this repository or the working directory, outside installed
    packages), as path -> sha256 prefix. Two nodes with the same config and different code
    (a stale checkout, an edited factory) train different models without another symptom."""
    roots = [Path(__file__).parent, REPO, Path.cwd(), Path.cwd().resolve()]
    spelled = tuple(dict.fromkeys(os.path.join(root, "") for root in roots))
    found = {}
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if not isinstance(file, str) or not file.endswith(".py") or not file.startswith(spelled):
            continue  # string tests first: resolving every loaded module's path is slow
        if "site-packages" in file or "dist-packages" in file:  # a virtualenv in the checkout
            continue
        path = Path(file).resolve()
        root = next((r for r in (REPO, Path.cwd().resolve()) if path.is_relative_to(r)), None)
        if root is None or _installed(path) or not path.is_file():
            continue
        name = path.relative_to(root).as_posix()
        found[name] = hashlib.sha256(path.read_bytes()).hexdigest()[:DIGEST_CHARS]
    return dict(sorted(found.items()))


def _addresses() -> list[str]:
    """This host's addresses as its name resolves (the ones its peers connect to, unless
    GLOO_SOCKET_IFNAME picks another interface): they name this node in a peer's error."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None)
    except OSError:
        return []
    return sorted({str(info[4][0]) for info in infos})


def _installed(path: Path) -> bool:
    """Python's own library or an installed package (a working directory of / or $HOME holds
    them too): their versions are the python and torch checks' business."""
    prefixes = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    packaged = {"site-packages", "dist-packages"} & set(path.parts)
    return bool(packaged) or any(path.is_relative_to(prefix) for prefix in prefixes)


def _digest(files: dict[str, str]) -> str:
    joined = "".join(f"{name}\0{digest}\n" for name, digest in files.items())
    return hashlib.sha256(joined.encode()).hexdigest()[:DIGEST_CHARS]


def describe(info: DistInfo, dataset_fingerprint: str, config_hash: str) -> dict[str, Any]:
    """What this rank is and runs, as plain strings."""
    cuda = info.device.type == "cuda"
    files = source_files()
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
        "code": _digest(files),
        "code_files": files,
        "addresses": _addresses(),
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
        if key == "code":
            problems += _files_apart(records, majority)
    return problems


def _files_apart(records: list[dict[str, Any]], majority: str) -> list[str]:
    """For the code digest: which files differ on each odd rank from the majority's."""
    usual = next(r for r in records if r["code"] == majority).get("code_files", {})
    lines = []
    for r in records:
        files = r.get("code_files", {})
        if r["code"] == majority or not files:
            continue
        apart = sorted(n for n in usual.keys() | files.keys() if usual.get(n) != files.get(n))
        shown = ", ".join(apart[:6]) + (f" and {len(apart) - 6} more" if apart[6:] else "")
        lines.append(f"  {r['host']} rank {r['rank']} runs other versions of: {shown}")
    return lines


def check(info: DistInfo, dataset_fingerprint: str, config_hash: str) -> list[dict[str, Any]]:
    """Collective: gather every rank's description, fail everywhere on any mismatch."""
    records = distributed.all_gather_object(describe(info, dataset_fingerprint, config_hash))
    distributed.know_peers(
        [{key: r[key] for key in ("rank", "host", "addresses")} for r in records]
    )
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

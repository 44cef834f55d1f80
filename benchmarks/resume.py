"""Peak host memory of a resume beside a fresh start, under fsdp at 2 ranks (BENCHMARKS.md,
"Checkpoints"): a model trained under fsdp because it does not fit under ddp must resume in
the memory it trained in.

Each start runs in fresh processes (a peak is a process's), the two kinds in turns. Both build
the model and optimizer and train one step; the resume first loads the newest sharded
checkpoint the strategies' fsdp run wrote, each rank reading only its rows, as
CheckpointManager does (rank 0 checks the files' CRCs, the others their sizes).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

import distributed
from benchmarks import strategies
from benchmarks.common import Spread
from ckpt import parts, retention, storage
from distributed import DistInfo

# fresh: built and trained a step; resume: the same after loading the checkpoint as the
# manager does (each rank its rows); resume_whole: every tensor read whole first, as resuming
# did before each rank read only its rows (storage.load without `lazy`)
KINDS = ("fresh", "resume", "resume_whole")


def resume_entry(
    rank: int,
    kind: str,
    model_name: str,
    image: int,
    batch: int,
    device_type: str,
    scratch: str,
    turn: int,
) -> None:
    """One of 2 spawned ranks: its peak memory over a `kind` start and one step."""
    init = f"file://{scratch}/store-{kind}-{turn}"
    device, backend = strategies.join_pair(rank, device_type, init)
    try:
        info = DistInfo(rank, rank, 2, device, backend)
        rss_start = strategies.rss_bytes()
        par, optimizer = strategies.build_strategy(info, "fsdp", model_name, image)
        step = strategies.training_step(info, par, optimizer, batch, image, {})
        if kind != "fresh":
            _, folder = retention.list_checkpoints(Path(scratch) / "ckpt-sharded")[-1]
            lazy = ("model", "optimizer") if kind == "resume" else ()
            state = storage.load(folder, device, verified=rank != 0, lazy=lazy)
            parts.ModelState(par.bare).load_state_dict(state["model"])
            parts.OptimizerState(optimizer).load_state_dict(state["optimizer"])
            del state
        step()
        peak, peak_kind = strategies.peak_memory(info.device, rss_start)
        gathered = distributed.all_gather_object({"peak_bytes": peak, "peak_kind": peak_kind})
        if rank == 0:
            (Path(scratch) / f"resume-{kind}.json").write_text(json.dumps(gathered))
        dist.barrier()  # then leave without gloo's teardown, as strategies.strategy_entry does
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    finally:  # a failure: spawn reports this rank's exception
        distributed.teardown()


def measure_resume(
    model_name: str, device_type: str, scratch: Path, rounds: int, image: int, batch: int
) -> dict[str, Any]:
    """The larger rank's peak per start of each kind, over `rounds` turns, and the ratios."""
    peaks: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for turn in range(rounds):
        for kind in KINDS[turn % 3 :] + KINDS[: turn % 3]:  # each kind first in one turn
            mp.start_processes(
                resume_entry,
                args=(kind, model_name, image, batch, device_type, str(scratch), turn),
                nprocs=2,
                start_method="spawn",
            )
            ranks = json.loads((scratch / f"resume-{kind}.json").read_text())
            peaks[kind].append(max(r["peak_bytes"] for r in ranks))
    result: dict[str, Any] = {f"{kind}_peak_bytes": Spread.of(peaks[kind]) for kind in KINDS}
    fresh = result["fresh_peak_bytes"].median
    result["resume_vs_fresh"] = result["resume_peak_bytes"].median / fresh
    result["resume_whole_vs_fresh"] = result["resume_whole_peak_bytes"].median / fresh
    result["peak_kind"] = ranks[0]["peak_kind"]
    return result

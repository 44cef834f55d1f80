"""What a checkpoint costs training: checkpoint_save_ratio and async_checkpoint_stall_ratio.

- checkpoint_save_ratio: train.py's synchronous checkpoint save / writing as many bytes raw
  with fsync, in the same directory (and _64mib: the same for a 64 MiB state, with the
  hand-over to a writer process);
- async_checkpoint_stall_ratio: training time lost to a save through writer.ProcessSaver /
  the synchronous save time.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import Plan, Spread, interleaved, timed
from benchmarks.pipeline import Rig, bare_steps
from ckpt import atomic, single, writer
from runpaths import RunPaths


def write_raw(path: Path, payload: bytes) -> None:
    with path.open("wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())


def measure_checkpoint(rig: Rig, plan: Plan) -> dict[str, Any]:
    """train.py's synchronous save vs writing as many bytes with one fsync, same directory.

    Each save reports a better accuracy than the last, as early in a run, so best.json is
    rewritten every time (the costlier path); retention deletes old files as in training.
    A small atomic write (temporary file, fsync, rename, directory fsync) is timed too: a save
    makes several (checkpoint, manifest, best.json), so on storage where fsync dominates the
    ratio is about their count.
    """
    directory = RunPaths(rig.cfg.run.dir).checkpoints
    raw_path, small_path = directory / "raw.bin", directory / "small.json"
    saves: list[float] = []
    raws: list[float] = []
    smalls: list[float] = []
    for step in range(plan.repeats + 1):  # step 0 is warm-up
        saves.append(
            timed(partial(rig.pipeline.save, step, 0.5 + 0.01 * step, None), rig.info.device)
        )
        payload = os.urandom((directory / f"step_{step}.pt").stat().st_size)
        raws.append(timed(partial(write_raw, raw_path, payload), rig.info.device))
        raw_path.unlink()
        small = partial(atomic.write_bytes, small_path, lambda f: f.write(b"{}"))
        smalls.append(timed(small, rig.info.device))
    save_s, raw_s = Spread.of(saves[1:]), Spread.of(raws[1:])
    large = measure_large_checkpoint(directory, plan, rig.info.device)
    return {
        "bytes": len(payload),
        "save_s": save_s,
        "raw_write_s": raw_s,
        "small_atomic_write_s": Spread.of(smalls[1:]),
        "ratio": save_s.median / raw_s.median,
        "large": large,
    }


def measure_large_checkpoint(directory: Path, plan: Plan, device: torch.device) -> dict[str, Any]:
    """single.save of a 64 MiB state (16 tensors of 4 MiB, the size of a mid-sized
    model's weights and momentum) vs a raw write of its bytes: where the fixed costs of a
    save (torch.save's per-tensor records, the manifest's fsyncs) no longer dominate."""
    state = {"model": {f"w{i}": torch.randn(1 << 20) for i in range(16)}, "step": 0}
    large_dir = directory / "large"
    saves: list[float] = []
    raws: list[float] = []
    for step in range(plan.repeats + 1):
        saves.append(timed(partial(single.save, state, large_dir, step, 1, None), device))
        payload = os.urandom((large_dir / f"step_{step}.pt").stat().st_size)
        raw_path = large_dir / "raw.bin"
        raws.append(timed(partial(write_raw, raw_path, payload), device))
        raw_path.unlink()
    save_s, raw_s = Spread.of(saves[1:]), Spread.of(raws[1:])
    # The same state handed to a writer process (ckpt.async_save): what training waits for
    # is the copy into the writer's shared buffers, which grows with the bytes as the write
    # does, while the fixed costs of a small state's hand-over (state dicts, the message) fade.
    handovers: list[float] = []
    saver = writer.ProcessSaver()
    try:
        for step in range(plan.repeats + 1):  # the first one makes the buffers
            started = time.perf_counter()
            saver.save(state, large_dir / "async", step, 1, None)
            handovers.append(time.perf_counter() - started)
            saver.wait()
    finally:
        saver.close()
    handover_s = Spread.of(handovers[1:])
    return {
        "bytes": len(payload),
        "save_s": save_s,
        "raw_write_s": raw_s,
        "ratio": save_s.median / raw_s.median,
        "handover_s": handover_s,
        "handover_ratio": handover_s.median / save_s.median,
    }


def measure_async(rig: Rig, plan: Plan, sync_save_s: float) -> dict[str, Any]:
    """Bare steps after a ProcessSaver save vs the same steps without one.

    A round spans enough steps to cover a whole synchronous save and ends in `wait()`, so a
    write that outlasts it is counted in full. The stall is what `save()` blocks for (building
    the state, the copy into shared memory) plus any slowdown the writer process
    causes the steps (cores, memory bandwidth, the page cache).
    """
    saver = writer.ProcessSaver()
    try:
        return _measure_async(rig, plan, sync_save_s, saver)
    finally:
        saver.close()


def _measure_async(
    rig: Rig, plan: Plan, sync_save_s: float, saver: writer.ProcessSaver
) -> dict[str, Any]:
    step_s = timed(partial(bare_steps, rig.bare, 1), rig.info.device)
    steps = max(2, math.ceil(sync_save_s / step_s) + 1)
    next_step = itertools.count(10**6)  # after the synchronous saves: retention prunes those
    blocking: list[float] = []

    def steps_with_save() -> None:
        started = time.perf_counter()
        rig.pipeline.save(next(next_step), None, saver)
        blocking.append(time.perf_counter() - started)
        bare_steps(rig.bare, steps)
        saver.wait()

    steps_with_save()  # warm-up: the writer has started, the shared buffers exist
    blocking.clear()
    # A stall of a few milliseconds in rounds of hundreds: three times the usual rounds.
    rounds = 3 * plan.repeats
    seconds = interleaved(
        {"plain": partial(bare_steps, rig.bare, steps), "async": steps_with_save},
        rounds,
        rig.info,
    )
    stall = Spread.of([a - p for a, p in zip(seconds["async"], seconds["plain"], strict=True)])
    save_call = Spread.of(blocking)
    return {
        "steps_per_round": steps,
        "rounds": rounds,
        "plain_round_s": Spread.of(seconds["plain"]),
        "stall_s": stall,
        "save_call_s": save_call,
        # What training waits for in save() alone, without the noise of the rounds
        "handover_ratio": save_call.median / sync_save_s,
        # Below the noise the difference can come out negative: no measurable stall.
        "ratio": max(0.0, stall.median) / sync_save_s,
    }

from __future__ import annotations

import json
from pathlib import Path

import torch

import auto
from ckpt import parts
from config import LogConfig
from distributed import DistInfo
from engine import StepStats
from instruments import Instruments
from metrics import MetricsWriter
from parallel import Layout
from runpaths import RunPaths

CPU = torch.device("cpu")
ONE = DistInfo(0, 0, 1, CPU)


def one_rank(cfg: LogConfig, run_dir: Path) -> tuple[Instruments, RunPaths, parts.Position]:
    """Instruments of one process without a Config: the log section, the run dir's paths, the
    resolved autos (CPU, no compile), a fixed lr of 0.25 and a 600 s stall timeout."""
    paths, position = RunPaths(run_dir), parts.Position()
    settings = auto.Auto("none", None, False, False, "foreach", "plain", "none", False, "file")
    writer = MetricsWriter(run_dir, True, cfg.tensorboard)
    layout = Layout("ddp", shards=False, world_size=1)
    instruments = Instruments(
        cfg, ONE, None, layout, settings, writer, position, lambda: 0.25, paths, 0, 600.0
    )
    return instruments, paths, position


def test_instruments_work_from_the_log_section_and_the_facts_they_are_given(tmp_path) -> None:
    """No Config: log.* (a row every 2 steps, a profile of steps 1-2), the run dir's paths,
    the resolved autos and the stall timeout. Two steps of 8 samples (loss 0.5 and 1.5 per
    sample, 4 and 6 correct) give one row averaging them, and a trace under the profile dir."""
    cfg = LogConfig(every_steps=2, profile_steps=(1, 3), tensorboard=False)
    instruments, paths, position = one_rank(cfg, tmp_path)
    assert instruments.watchdog.timeout_s == 600.0
    instruments.open(resume_step=0, pending_eval=False)
    with instruments.running(total_steps=2):
        for loss, correct in ((0.5, 4), (1.5, 6)):
            with instruments.step() as timer:
                timer.loaded()
                eight, norm = torch.tensor(8), torch.tensor(1.0)
                stats = StepStats(torch.tensor(8 * loss), torch.tensor(correct), 8, norm, eight)
                timer.agreed(stats, skipped=False)
                position.step += 1
    instruments.close()
    rows = [json.loads(line) for line in paths.metrics.read_text().splitlines()]
    assert [(r["kind"], r["step"], r["loss"], r["accuracy"], r["lr"]) for r in rows] == [
        ("train", 2, 1.0, 10 / 16, 0.25)
    ]
    traces = list(Path(paths.profile).glob("rank0*.pt.trace.json"))
    assert len(traces) == 1


def test_a_profile_window_outside_the_run_is_said(tmp_path, caplog) -> None:
    """Before, log.profile_steps=5,8 on a run of 2 steps recorded nothing without a word."""
    cfg = LogConfig(every_steps=1, profile_steps=(5, 8), tensorboard=False)
    instruments, paths, position = one_rank(cfg, tmp_path)
    instruments.open(resume_step=0, pending_eval=False)
    with caplog.at_level("WARNING"), instruments.running(total_steps=2):
        pass
    instruments.close()
    said = "log.profile_steps=5,8: no profiler trace; the steps left to this run: steps 0-1"
    assert said in caplog.text, caplog.text
    assert not list(Path(paths.profile).glob("*.pt.trace.json"))

"""The mode run.mode names, run on this rank (train.main calls `run` for every mode but train)."""

from __future__ import annotations

import signal
from typing import Any

from config import Config
from distributed import DistInfo
from modes import evaluate, export, predict

RUNS = {"evaluate": evaluate.run, "predict": predict.run, "export": export.run}


def run(cfg: Config, info: DistInfo) -> dict[str, Any]:
    """The mode cfg.run.mode names, on this rank; its summary (a "step" key among others)."""
    # No checkpoint to write on a stop signal: the signals end the process as they would any
    # program (train.py's first lines deferred them, for training's handler).
    for name in cfg.run.preempt_signals:
        signal.signal(signal.Signals[name], signal.SIG_DFL)
    return RUNS[cfg.run.mode](cfg, info)

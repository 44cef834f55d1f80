"""The DataLoader's worker processes under the signals clusters send.

Slurm and the kubelet signal every process of a job, and torchrun signals each worker's process
group, so a loader worker can be hit at any moment of its life, including while it starts.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

from helpers import REPO

# The training process's side: real loaders from data.py over a small tensor dataset, started
# again and again (a new epoch's or evaluation's workers), with SIGTERM handled as train.py
# handles it (a flag). It prints how many loaders it started and how many signals it saw.
CHILD = textwrap.dedent(
    """
    import signal, sys, time
    sys.path.insert(0, sys.argv[1])
    import torch
    from torch.utils.data import TensorDataset
    import data
    from config import DataConfig
    from distributed import DistInfo
    from inputs.sources import DataSplits

    seen = []
    signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    images = torch.zeros(64, 1, 4, 4, dtype=torch.uint8)
    split = TensorDataset(images, torch.zeros(64, dtype=torch.long))
    splits = DataSplits(split, split, (1, 4, 4), 2, (0.5,), (0.5,))
    cfg = DataConfig(batch_size=8, eval_batch_size=8, num_workers=2)
    info = DistInfo(0, 0, 1, torch.device("cpu"))
    print("ready", flush=True)
    started, deadline = 0, time.monotonic() + float(sys.argv[2])
    while time.monotonic() < deadline:
        for loader in (
            data.build_eval_loader(splits, cfg, info, 0),
            data.build_train_loader(splits, cfg, info, 0, "dataloader"),
        ):
            for _ in loader:
                pass
            data.close_loader(loader)
            started += 1
    print("started", started, "signals", len(seen), flush=True)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the driver may still be sending
    """
)


def test_loader_workers_survive_sigterm_bursts_while_they_start(tmp_path) -> None:
    """SIGTERM to the training process's group every 2 ms while loaders start their workers.

    torch's worker loop installs a SIGTERM handler that kills the worker unless its parent
    sent the signal (torch/csrc/DataLoader.cpp, handler_SIGTERM) before `worker_init_fn` can
    ignore it; a burst landing in that window killed a starting worker and the training process
    raised "DataLoader worker ... exited unexpectedly" (seen in CI: SIGTERM to torchrun, which
    killpg's each worker's group, as the first evaluation's loader workers started). Before the
    fix this failed within the first second."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(REPO), "6"],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith("ready")
    sent = 0
    while proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            break
        sent += 1
        time.sleep(0.002)
    output = proc.stdout.read()
    assert proc.returncode == 0, output[-3000:]
    found = re.search(r"started (\d+) signals (\d+)", output)
    assert found, output[-3000:]
    started, signals = int(found[1]), int(found[2])
    assert started >= 10, output  # the loop did run loaders while the signals came
    assert signals > 0 and sent > 100

"""CUDA paths (NCCL, autocast, GradScaler, pinned memory). Skipped cleanly without a GPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import REPO

import auto

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

JOB = [
    "--data.dataset=synthetic",
    "--data.synthetic_train_size=4096",
    "--train.epochs=2",
    "--optim.warmup_steps=5",
    "--log.every_steps=8",
    "--dist.timeout_s=120",
]


def test_auto_precision_is_bf16_on_ampere_or_newer() -> None:
    expected = torch.bfloat16 if torch.cuda.get_device_capability()[0] >= 8 else None
    assert auto.amp("auto", torch.device("cuda", 0)) == expected


@pytest.mark.slow
@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_single_gpu_run_learns(tmp_path, amp) -> None:
    proc = subprocess.run(
        [sys.executable, "train.py", f"--run.dir={tmp_path}", f"--train.amp={amp}", *JOB],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "device cuda:0" in proc.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert evals[-1]["accuracy"] > 0.5 and evals[-1]["num_samples"] == 2048


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for NCCL")
def test_two_gpu_nccl_run(tmp_path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "train.py",
            f"--run.dir={tmp_path}",
            *JOB,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "backend nccl" in proc.stderr

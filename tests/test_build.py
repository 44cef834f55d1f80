"""build.py: the model as step 1 runs it, checked before step 1 (issue 31 C3)."""

from __future__ import annotations

import pytest
import torch
from helpers import REPO, final_state, launch
from torch import nn

import auto


class _ViewFlat(nn.Module):
    """An MLP on images that flattens with `x.view(N, -1)`: fine on contiguous batches, a
    RuntimeError on channels_last ones ("view size is not compatible with input tensor's size
    and stride"), the memory format model.channels_last gives the batches."""

    def __init__(self, in_channels: int, num_classes: int) -> None:
        super().__init__()
        self.hidden = nn.Linear(in_channels * 8 * 8, 16)
        self.out = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x.view(x.shape[0], -1))))


def view_flat(*, in_channels: int, num_classes: int) -> nn.Module:
    return _ViewFlat(in_channels, num_classes)


def _run(tmp_path, strategy: str, setting: str):  # noqa: ANN202
    return launch(
        2,
        f"--run.dir={tmp_path / f'{strategy}-{setting}'}",
        f"--dist.strategy={strategy}",
        f"--model.channels_last={setting}",
        "--model.factory=test_build:view_flat",
        "--data.dataset=synthetic",
        "--data.synthetic_shape=3,8,8",
        "--data.synthetic_train_size=32",
        "--data.synthetic_eval_size=8",
        "--data.batch_size=4",
        "--data.num_workers=0",
        "--train.max_steps=2",
        "--log.tensorboard=false",
        env={"PYTHONPATH": str(REPO / "tests")},
    )


@pytest.mark.e2e
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_channels_last_on_is_refused_for_a_model_that_cannot_take_it(tmp_path, strategy) -> None:
    """Before: the start-up checks (contiguous) passed, and step 1 failed on channels_last
    batches with "view size is not compatible with input tensor's size and stride", exit 1.
    Now exit 2 before step 1, naming model.channels_last and the fixes."""
    refused = _run(tmp_path, strategy, "on")
    assert "exitcode: 2" in refused.output, refused.output[-4000:]
    assert "model.channels_last=on: model.factory=test_build:view_flat fails on" in refused.output
    assert "--model.channels_last=off" in refused.output
    assert "step 1" not in refused.output


@pytest.mark.e2e
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_channels_last_auto_falls_back_to_contiguous_for_such_a_model(tmp_path, strategy) -> None:
    """auto is on for AVX-512 CPUs and CUDA: before, the default settings failed at step 1
    (exit 1). Now the run trains contiguous, with a warning, under ddp (each rank checks) and
    fsdp (rank 0 checks its host model and tells the others)."""
    if not auto.channels_last("auto", torch.device("cpu")):
        pytest.skip("model.channels_last=auto is off on this CPU (no AVX-512)")
    done = _run(tmp_path, strategy, "auto")
    assert done.returncode == 0, done.output[-4000:]
    assert "model.channels_last=auto -> off: model.factory=test_build:view_flat" in done.output
    assert final_state(tmp_path / f"{strategy}-auto")["step"] == 2

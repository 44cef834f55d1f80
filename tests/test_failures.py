"""A training sample that fails to load mid-epoch: real corrupt JPEGs in real folders and
data.factory datasets that raise, trained by torchrun at 2 ranks (inputs/failures.py)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
from helpers import assert_same_training_state, final_state, launch
from test_imagefolder import make_folder

from distributed import DistInfo
from inputs import failures, imagefolder, sampling
from resilience import StepGuard

BATCH = 2  # per rank: 32 images, 2 ranks, 8 steps an epoch


def sample_of(rank: int, step: int, num_samples: int, seed: int = 0) -> int:
    """The first sample `rank` loads for optimizer step `step` (1-based) of epoch 0, as the
    training sampler deals it (DistributedSampler's seeded permutation, interleaved)."""
    sampler = sampling.EpochSampler(range(num_samples), DistInfo(rank, rank, 2, "cpu"), seed)
    sampler.set_epoch(0, 0)
    return [index for _, index in sampler][(step - 1) * BATCH]


def image_folder(root: Path) -> Path:
    make_folder(root / "train", {"cat": 16, "dog": 16}, size=(20, 20))
    make_folder(root / "val", {"cat": 4, "dog": 4}, size=(20, 20))
    return root


def image_args(run_dir: Path, root: Path, *extra: str) -> list[str]:
    return [
        f"--run.dir={run_dir}",
        f"--data.root={root}",
        "--data.dataset=imagefolder",
        "--data.image_size=16",
        f"--data.batch_size={BATCH}",
        "--data.eval_batch_size=4",
        "--train.epochs=1",
        "--model.widths=8,16",
        "--log.tensorboard=false",
        *extra,
    ]


@pytest.mark.parametrize("workers", [1, 0])
def test_a_corrupt_training_jpeg_mid_epoch_keeps_the_steps_trained(tmp_path, workers) -> None:
    """Before: rank 1 raised UnreadableImage at step 3 and rank 0 died in its collective
    ("Connection closed by peer"); the run left no checkpoint of the 2 steps trained.
    Now every rank learns of it through the step's vote, the checkpoint of step 2 is written
    and equals an uninterrupted run's step 2 bit for bit, the file is named, and the run exits
    2 (bad input: launchers do not retry it)."""
    good = image_folder(tmp_path / "good")
    every_step = ["--ckpt.every_steps=1", "--ckpt.keep=20"]  # the reference's step 2
    workers_arg = f"--data.num_workers={workers}"
    reference = launch(2, *image_args(tmp_path / "reference", good, workers_arg, *every_step))
    assert reference.returncode == 0, reference.output[-4000:]
    bad_root = image_folder(tmp_path / "bad")
    folder = imagefolder.ImageFolder(bad_root / "train", 16, 0.875, (0.08, 1.0), False)
    index = sample_of(1, 3, len(folder))
    path = Path(folder.samples[index][0])
    path.write_bytes(path.read_bytes()[:60])  # a truncated JPEG
    run_dir = tmp_path / "run"
    failed = launch(2, *image_args(run_dir, bad_root, workers_arg))
    assert "exitcode: 2" in failed.output, failed.output[-4000:]
    assert (
        f"data.dataset=imagefolder: train[{index}] failed to load: cannot read image {path}"
        in failed.output
    )
    assert "checkpoint of step 2 written" in failed.output
    saved = torch.load(run_dir / "checkpoints" / "step_2.pt", weights_only=True)
    theirs = torch.load(tmp_path / "reference" / "checkpoints" / "step_2.pt", weights_only=True)
    assert saved["step"] == 2 and not (run_dir / "checkpoints" / "step_3.pt").exists()
    assert_same_training_state(saved, theirs)
    assert saved["ledger"] == theirs["ledger"]  # the failed step's samples are not counted


RAISING = """
import errno
import os
import torch

class Samples(torch.utils.data.Dataset):
    def __init__(self, n, seed, bad=None, how=None):
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 2, (n,), generator=generator)
        noise = torch.randint(0, 40, (n, 1, 8, 8), generator=generator)
        self.images = (noise + 100 * self.labels.view(n, 1, 1, 1)).to(torch.uint8)
        self.bad, self.how = bad, how

    def __len__(self):
        return len(self.images)

    def __getitem__(self, index):
        if index == self.bad and self.how == "value":
            raise ValueError(f"no such record: {index}")
        if index == self.bad and self.how == "eio":
            raise OSError(errno.EIO, "Input/output error", f"/nfs/shard-{index}")
        return self.images[index], int(self.labels[index])

def make(*, root, bad=None, how=None):
    return {"train": Samples(32, 1, bad, how), "eval": Samples(8, 2), "num_classes": 2,
            "input_shape": (1, 8, 8)}
"""


@pytest.mark.parametrize(("how", "code"), [("value", 2), ("eio", 74)])
def test_a_factory_sample_that_raises_is_named_and_classed(tmp_path, how, code) -> None:
    """Before: a ValueError from __getitem__ at step 3 ended the run with exit 1 (which
    launchers retry), no checkpoint and no index named beyond the worker's traceback; an EIO
    ended as the same crash on the other rank. Now the steps trained are checkpointed, the
    index is named, and the exit is 2 for the ValueError, 74 (transient, retried) for EIO, on
    every rank."""
    (tmp_path / "raising.py").write_text(RAISING)
    bad = sample_of(0, 3, 32)
    args = [
        f"--run.dir={tmp_path / 'run'}",
        "--data.factory=raising:make",
        f"--data.root={tmp_path}",
        f'--data.kwargs={{"bad": {bad}, "how": "{how}"}}',
        f"--data.batch_size={BATCH}",
        "--data.num_workers=1",
        "--train.epochs=1",
        "--model.widths=8,16",
        "--log.tensorboard=false",
    ]
    failed = launch(2, *args, env={"PYTHONPATH": str(tmp_path)})
    assert f"exitcode: {code}" in failed.output, failed.output[-4000:]
    assert f"data.factory=raising:make: train[{bad}] failed to load" in failed.output
    assert "checkpoint of step 2 written" in failed.output
    saved = final_state(tmp_path / "run")
    assert saved["step"] == 2
    if how == "value":
        assert "no such record" in failed.output and "in __getitem__" in failed.output


def test_an_error_rebuilt_from_a_worker_keeps_its_message_and_class() -> None:
    """torch rebuilds a worker's exception as exc_type(text with the worker's traceback)
    (torch/_utils.py, ExceptionWrapper.reraise); a rebuilt OSError had errno None, which
    exitcodes.exit_for_os_error classes as bad input."""
    named = failures.NamedSamples([None], [None], "data.factory=m:f")
    wrapper = torch.utils.data._utils.worker.ExceptionWrapper
    for raised, kind in ((OSError(errno.ESTALE, "Stale file handle"), failures.SampleIOError),
                         (KeyError("label"), failures.BadSample)):  # fmt: skip
        try:
            try:
                raise raised
            except Exception as err:
                raise named.failure(0, err) from err
        except Exception:
            rebuilt = wrapper(where="in DataLoader worker process 0")
        with pytest.raises(kind) as caught:
            rebuilt.reraise()
        assert "Traceback" not in str(caught.value)
        assert "data.factory=m:f: train[0] failed to load: " in str(caught.value)
        if kind is failures.SampleIOError:
            assert caught.value.errno == errno.ESTALE


def test_a_failed_load_skips_the_step_without_counting_it_as_non_finite() -> None:
    """The step's vote carries "my batch failed to load": the step is skipped and flagged, and
    neither logged nor counted toward train.max_nonfinite_steps (the stand-in's loss may be
    anything), so the run stops for the sample, not as a divergence."""
    guard = StepGuard(DistInfo(0, 0, 1, torch.device("cpu")), 1, check_grad=True)
    nan = torch.tensor(float("nan"))
    verdict = guard.agree(nan, nan, None, 3, load_failed=True)
    assert verdict.load_failed and verdict.skip and guard.consecutive == 0
    assert not guard.agree(torch.tensor(1.0), torch.tensor(1.0), None, 3).load_failed

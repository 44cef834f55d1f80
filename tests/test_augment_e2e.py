"""The reference recipe's augmentation end to end: a 2-rank torchrun job with mixup, cutmix,
a policy, random erasing and repeated augmentation on, stopped by SIGTERM to every process of
the job mid-epoch and resumed, ends `torch.equal` to the same job never stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import needs_fashion_mnist
from helpers import (
    REPO,
    assert_same_training_state,
    final_state,
    launch,
    rows,
    tiny_job_args,
    wait_for_train_rows,
)
from test_signals import checkpoints, deliver, job_tree, launcher_command

import exitcodes
from inputs import imagefolder

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = 150
STEPS_PER_EPOCH = 2048 // (2 * 8 * 2)  # train size / (ranks x batch x accumulation)
JOB = tiny_job_args(
    data_synthetic_train_size=2048,
    data_synthetic_shape="3,16,16",
    data_batch_size=8,
    train_grad_accum_steps=2,  # each micro-batch draws its own mixing
    data_num_workers=1,  # the policy runs in the loader workers, which must survive SIGTERM
    log_every_steps=1,
    dist_preflight=False,
    dist_timeout_s=30,
    train_max_steps=STEPS,
    train_epochs=3,
    aug_mixup_alpha=0.2,
    aug_cutmix_alpha=1.0,
    aug_auto_augment="ta_wide",
    aug_random_erase=0.25,
    aug_repeated_augment=3,
)


def test_every_augmentation_on_stopped_by_sigterm_mid_epoch_resumes_exactly(tmp_path) -> None:
    reference_dir = tmp_path / "reference"
    done = launch(2, f"--run.dir={reference_dir}", *JOB, timeout=600)
    assert done.returncode == 0, done.output[-3000:]
    assert "data.loader=auto->dataloader" in done.output  # the policy needs the workers
    losses = [row["loss"] for row in rows(reference_dir, "train")]
    assert sum(losses[-20:]) < sum(losses[:20])  # mixed targets still train

    run_dir, log = tmp_path / "run", tmp_path / "out.log"
    command, env = launcher_command("train_single_node.sh")  # 2 ranks under torchrun
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*command, f"--run.dir={run_dir}", *JOB],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for_train_rows(run_dir, proc, rows=3)
        tree = job_tree(proc.pid)
        assert len(tree["workers"]) == 2 and len(tree["loaders"]) >= 2, tree
        deliver(proc.pid, [("all", "SIGTERM")])  # as slurmstepd and the kubelet deliver it
        returncode = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = log.read_text()
    assert returncode == exitcodes.EXIT_PREEMPTED, output[-4000:]
    [stopped] = checkpoints(run_dir)
    assert 3 <= stopped < STEPS_PER_EPOCH, output[-2000:]  # mid-epoch, in the first epoch

    resumed = launch(2, f"--run.dir={run_dir}", *JOB, timeout=600)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert f"at step {stopped} " in resumed.output
    reference = final_state(reference_dir)
    assert reference["step"] == STEPS
    assert_same_training_state(final_state(run_dir), reference)


@pytest.fixture
def fashion_jpegs(tmp_path) -> Path:
    """Fashion-MNIST as JPEG files at 40 px: 10 classes x 40 training images, 10 x 10 val."""
    sys.path.insert(0, str(REPO / "scripts"))
    from export_imagefolder import export

    root = tmp_path / "fashion"
    export(root, size=40, train_per_class=40, val_per_class=10, root=str(tmp_path / "fm"))
    return root


@needs_fashion_mnist
def test_a_jpeg_folder_trains_with_the_recipes_augmentation_and_sizes(tmp_path, fashion_jpegs):
    """Every part on an image folder through train.py, with an unreadable image skipped (its
    IGNORED label mixed into no other sample), the evaluation at its own sizes: it trains, and
    the epoch's sample count is that of the repeated order's first 400 keys, less the broken
    file's copies among them."""
    root = fashion_jpegs
    (root / "train" / "coat" / "broken.jpg").write_bytes(b"\xff\xd8\xff not really a JPEG")
    args = [
        f"--run.dir={tmp_path / 'run'}",
        "--data.dataset=imagefolder",
        f"--data.root={root}",
        "--data.image_size=24",
        "--data.eval_resize_size=36",
        "--data.eval_crop_size=32",
        "--data.batch_size=40",
        "--data.bad_images=skip",
        "--data.num_workers=1",
        "--train.epochs=4",
        "--log.tensorboard=false",
        "--aug.mixup_alpha=0.2",
        "--aug.cutmix_alpha=1.0",
        "--aug.auto_augment=ra",
        "--aug.random_erase=0.25",
        "--aug.repeated_augment=2",
    ]
    done = launch(None, *args, timeout=600)
    assert done.returncode == 0, done.output[-4000:]
    assert "data.decode=auto->workers" in done.output
    first, *_, last = rows(tmp_path / "run", "eval")
    assert first["num_samples"] == last["num_samples"] == 100
    assert last["accuracy"] > 0.15 and last["loss"] < first["loss"]  # ten classes: chance 0.1
    paths = [path for path, _ in imagefolder.scan(root / "train")[1]]
    broken = paths.index(str(root / "train" / "coat" / "broken.jpg"))
    order = torch.randperm(401, generator=torch.Generator().manual_seed(0))
    keys = order.repeat_interleave(2)[:400].tolist()
    assert first["epoch_samples_seen"] == 400 - keys.count(broken)

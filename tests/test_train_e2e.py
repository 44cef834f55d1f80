"""The real entry points as subprocesses: torchrun train.py, resume, failures, the launcher."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
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
    free_port,
    launch,
    rows,
    tiny_job_args,
    train_command,
)

import data
from inputs import imagefolder

pytestmark = pytest.mark.e2e

SMALL = [
    "--model.widths=8,16,32",
    "--data.num_workers=1",
    "--log.every_steps=10",
    "--data.eval_batch_size=1000",
    "--dist.timeout_s=60",
]


def run(cmd: list[str], timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    proc = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=full_env
    )
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-8000:])
    return proc


@needs_fashion_mnist
def test_torchrun_two_ranks_learns_fashion_mnist_and_resumes(tmp_path) -> None:
    run_dir = tmp_path / "run"
    common = [
        f"--run.dir={run_dir}",
        f"--data.root={tmp_path / 'data'}",
        "--data.download=false",
        "--data.subset=6144",
        "--data.batch_size=64",
        "--optim.warmup_steps=10",
        "--data.augment=false",
        "--model.widths=16,32,64",
        *SMALL[1:],
    ]
    first = run(
        train_command(
            2, *common, "--train.epochs=2", "--train.max_steps=60", "--ckpt.every_steps=25"
        )
    )
    assert first.returncode == 0
    train_rows, eval_rows = rows(run_dir, "train"), rows(run_dir, "eval")
    assert train_rows[-1]["step"] == 60 and train_rows[0]["loss"] > train_rows[-1]["loss"]
    assert set(train_rows[0]) >= {"kind", "step", "epoch", "loss", "lr", "samples_per_s"}
    assert eval_rows[-1]["num_samples"] == 10000  # the whole test set, counted once
    assert eval_rows[-1]["accuracy"] > 0.5  # chance is 0.1
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["data"]["subset"] == 6144 and saved["model"]["widths"] == [16, 32, 64]
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    steps = sorted(int(p.stem.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*.pt"))
    assert steps[-1] == 60 and 50 in steps  # the mid-epoch save and the final one
    state = torch.load(run_dir / "checkpoints" / "step_60.pt", weights_only=True)
    assert state["step"] == 60 and not any(k.startswith("module.") for k in state["model"])

    second = run(
        train_command(2, *common, "--train.epochs=2", "--train.max_steps=80", "--ckpt.resume=auto")
    )
    assert second.returncode == 0
    assert "resuming from" in second.stderr and "step_60.pt" in second.stderr
    new_rows = rows(run_dir, "train")[len(train_rows) :]
    assert new_rows and min(r["step"] for r in new_rows) > 60 and new_rows[-1]["step"] == 80


def test_single_process_python_train_py_on_synthetic(tmp_path) -> None:
    run_dir = tmp_path / "run"
    proc = run(
        train_command(
            None,
            *tiny_job_args(
                run_dir,
                *SMALL[:1],
                data_synthetic_train_size=2048,
                data_synthetic_eval_size=None,
                data_batch_size=64,
                train_epochs=2,
                optim_warmup_steps=5,
                log_every_steps=8,
            ),
        )
    )
    assert proc.returncode == 0
    train_rows, eval_rows = rows(run_dir, "train"), rows(run_dir, "eval")
    assert [r["epoch"] for r in eval_rows] == [0, 1]
    assert eval_rows[-1]["num_samples"] == 2048 and eval_rows[-1]["accuracy"] > 0.5
    assert train_rows[-1]["loss"] < train_rows[0]["loss"]
    assert "world size 1" in proc.stderr


def test_rank_failure_stops_the_job_with_the_root_cause(tmp_path) -> None:
    proc = run(
        train_command(
            2,
            f"--run.dir={tmp_path / 'run'}",
            "--data.dataset=imagefolder",
            f"--data.root={tmp_path / 'nothing'}",
            "--dist.timeout_s=30",
        ),
        timeout=120,
    )
    assert proc.returncode != 0
    assert "nothing/train" in proc.stderr and "does not exist" in proc.stderr


def test_launch_multinode_script_single_node(tmp_path) -> None:
    run_dir = tmp_path / "run"
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "NNODES": "1",
        "NODE_RANK": "0",
        "NPROC_PER_NODE": "2",
        "MAX_RESTARTS": "0",
    }
    proc = run(
        [
            "bash",
            "scripts/launch_multinode.sh",
            *tiny_job_args(
                run_dir,
                *SMALL,
                data_synthetic_train_size=512,
                data_synthetic_eval_size=None,
                data_batch_size=64,
                log_tensorboard=None,
                train_max_steps=3,
            ),
        ],
        **env,
    )
    assert proc.returncode == 0
    assert "torch.distributed.run" in proc.stdout and "--rdzv-backend=c10d" in proc.stdout
    assert rows(run_dir, "eval")[-1]["num_samples"] == 2048


def test_launch_multinode_script_validates_its_environment() -> None:
    def launch(env: dict[str, str]) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", "scripts/launch_multinode.sh"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )

    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "NNODES")}
    proc = launch(env)
    assert proc.returncode != 0 and "MASTER_ADDR" in proc.stderr
    env.update(MASTER_ADDR="10.0.0.1", NNODES="2", NODE_RANK="5", NPROC_PER_NODE="2")
    proc = launch(env)
    assert proc.returncode != 0 and "NODE_RANK=5" in proc.stderr
    # torchrun's own words for the process count are accepted (PYTHON=true: a dry run).
    env.update(NODE_RANK="1", RDZV_CHECK="0", PYTHON="true")
    for nproc in ("gpu", "cpu", "auto", "3"):
        proc = launch({**env, "NPROC_PER_NODE": nproc})
        assert proc.returncode == 0, proc.stderr
        assert f"--nproc-per-node={nproc}" in proc.stdout
    proc = launch({**env, "NPROC_PER_NODE": "two"})
    assert proc.returncode == 2 and "NPROC_PER_NODE=two" in proc.stderr


def test_resume_mid_epoch_matches_the_uninterrupted_run_exactly(tmp_path) -> None:
    """2 ranks, accumulation, workers: resuming from a mid-epoch checkpoint == never stopping."""
    args = tiny_job_args(
        None,
        *SMALL,
        data_synthetic_train_size=1536,
        data_synthetic_eval_size=256,
        data_batch_size=32,
        train_grad_accum_steps=2,
        train_epochs=2,
        ckpt_every_steps=5,
        ckpt_keep=10,
        optim_warmup_steps=3,
    )
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    assert run(train_command(2, f"--run.dir={full}", *args)).returncode == 0  # 12 steps per epoch
    (resumed / "checkpoints").mkdir(parents=True)
    for name in ("step_5.pt", "step_5.manifest.json"):
        shutil.copy(full / "checkpoints" / name, resumed / "checkpoints" / name)
    proc = run(train_command(2, f"--run.dir={resumed}", *args))
    assert proc.returncode == 0 and "resuming from" in proc.stderr
    final_full = torch.load(full / "checkpoints" / "step_24.pt", weights_only=True)
    final_resumed = torch.load(resumed / "checkpoints" / "step_24.pt", weights_only=True)
    for key, value in final_full["model"].items():
        assert torch.equal(value, final_resumed["model"][key]), key
    for index, state in final_full["optimizer"]["state"].items():
        assert torch.equal(
            state["momentum_buffer"], final_resumed["optimizer"]["state"][index]["momentum_buffer"]
        )
    same = ("step", "loss", "accuracy", "num_samples", "epoch_samples_seen", "epoch_sample_digest")
    assert [{k: r[k] for k in same} for r in rows(full, "eval")][-1:] == [
        {k: r[k] for k in same} for r in rows(resumed, "eval")
    ][-1:]


def test_fresh_run_in_a_used_run_dir_is_refused_and_changes_no_file(tmp_path) -> None:
    args = [
        sys.executable,
        "train.py",
        *tiny_job_args(
            tmp_path,
            data_synthetic_eval_size=None,
            data_batch_size=64,
            model_widths=8,
            train_max_steps=2,
        ),
    ]
    assert run(args).returncode == 0
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    proc = run([*args, "--ckpt.resume=never", "--optim.lr=0.05"])
    assert proc.returncode == 2
    assert (
        "already holds checkpoints of steps [2]" in proc.stderr and "new --run.dir" in proc.stderr
    )
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_speed_figures_stragglers_and_profiler_trace(tmp_path) -> None:
    """2 ranks: every train row carries the step breakdown, all-reduce time and MFU; a
    straggler row names a rank; --log.profile_steps writes a trace TensorBoard can open."""
    run_dir = tmp_path / "run"
    proc = run(
        train_command(
            2,
            *tiny_job_args(
                run_dir,
                *SMALL,
                data_synthetic_train_size=512,
                data_synthetic_eval_size=None,
                data_batch_size=32,
                log_tensorboard=None,  # the profiler's trace goes there
                train_max_steps=6,
                log_straggler_every_steps=3,
                log_profile_steps="2,4",
            ),
        )
    )
    assert proc.returncode == 0
    for row in rows(run_dir, "train"):
        parts = row["data_ms"] + row["fwd_bwd_ms"] + row["optimizer_ms"]
        assert 0 < parts <= row["step_ms"] * 1.01
        assert row["allreduce_ms"] > 0 and row["mfu"] > 0 and row["tflops_per_rank"] > 0
    stragglers = rows(run_dir, "stragglers")
    assert [r["step"] for r in stragglers] == [3, 6]
    assert all(r["slowest_rank"] in (0, 1) and r["arrival_ms_max"] > 0 for r in stragglers)
    assert "stragglers at step 3" in proc.stderr
    traces = list((run_dir / "tensorboard" / "profile").glob("rank*.pt.trace.json"))
    assert sorted(t.name.split(".")[0] for t in traces) == ["rank0", "rank1"]


# ---------------------------------------------------------------------------------------------
# Your model and your data: a torchvision model on a real JPEG folder, and the examples/


@pytest.fixture(scope="module")
def jpeg_folder(tmp_path_factory) -> Path:
    """Fashion-MNIST as real JPEG files at 40 px: 10 classes x 40 training images, 101 val
    images (one class has an extra one: 2 ranks get shards of 51 and 50)."""
    sys.path.insert(0, str(REPO / "scripts"))
    from export_imagefolder import export

    root = tmp_path_factory.mktemp("jpegs") / "fashion"
    export(
        root, size=40, train_per_class=40, val_per_class=10, root=str(tmp_path_factory.mktemp("fm"))
    )
    shutil.copy(root / "val" / "bag" / "00000.jpg", root / "val" / "bag" / "extra.jpg")
    return root


def assert_resumes_exactly(tmp_path: Path, args: list[str], stop_after: int) -> Path:
    """An uninterrupted 2-rank run, and one preempted (SIGTERM on every rank) after
    `stop_after` steps then resumed: the same final weights and optimizer state, bit for bit.
    Returns the uninterrupted run's dir."""
    reference = tmp_path / "reference"
    done = launch(2, f"--run.dir={reference}", *args)
    assert done.returncode == 0, done.output[-4000:]
    run_dir = tmp_path / "run"
    first = launch(2, f"--run.dir={run_dir}", *args, faults=f"sigterm@step={stop_after - 1}")
    # Each worker exits 75 (preempted); torchrun itself reports any worker's exit as failure.
    assert first.returncode != 0 and "exitcode: 75" in first.output, first.output[-4000:]
    assert "exitcode: 1 " not in first.output
    second = launch(2, f"--run.dir={run_dir}", *args)
    assert second.returncode == 0, second.output[-4000:]
    assert f"resuming from {run_dir / 'checkpoints' / f'step_{stop_after}.pt'}" in second.output
    assert_same_training_state(final_state(run_dir), final_state(reference))
    return reference


@needs_fashion_mnist
def test_resnet18_on_a_jpeg_folder_learns_counts_every_image_and_resumes_exactly(
    tmp_path, jpeg_folder
) -> None:
    args = [
        "--data.dataset=imagefolder",
        f"--data.root={jpeg_folder}",
        "--data.image_size=32",
        "--data.crop_scale=0.35,1",
        "--model.name=resnet18",
        "--data.batch_size=25",  # 8 steps per epoch on 2 ranks
        "--train.epochs=3",
        "--optim.lr=0.05",
        "--optim.warmup_steps=3",
        "--data.num_workers=1",
        "--log.every_steps=4",
        "--log.tensorboard=false",
    ]
    reference = assert_resumes_exactly(tmp_path, args, stop_after=11)  # mid-epoch 1
    evals = rows(reference, "eval")
    assert [row["num_samples"] for row in evals] == [101, 101, 101]  # every image, once
    assert evals[-1]["accuracy"] > 0.3  # chance is 0.1
    state = final_state(reference)
    assert state["classes"][:3] == ["ankle_boot", "bag", "coat"] and len(state["classes"]) == 10
    assert state["model"]["conv1.weight"].shape == (64, 3, 7, 7)


@needs_fashion_mnist
def test_examples_train_your_model_on_your_data_under_torchrun(tmp_path) -> None:
    """examples/custom_model.py (dropout: random draws in every step) on
    examples/custom_data.py, with bf16 autocast, channels_last, torch.compile and a weight
    average (train.ema_decay)."""
    args = [
        "--model.factory=examples.custom_model:small_cnn",
        '--model.kwargs={"width": 16, "dropout": 0.3}',
        "--data.factory=examples.custom_data:idx_images",
        f"--data.root={data.DEBIAN_FASHION_MNIST}",
        '--data.kwargs={"limit": 3000, "eval_limit": 1001}',
        "--train.amp=bf16",
        "--model.channels_last=on",
        "--train.compile=on",
        "--train.ema_decay=0.99",
        "--train.epochs=2",
        "--data.batch_size=50",  # 30 steps per epoch on 2 ranks
        "--optim.warmup_steps=5",
        "--data.num_workers=1",
        "--log.every_steps=10",
        "--log.tensorboard=false",
    ]
    reference = assert_resumes_exactly(tmp_path, args, stop_after=37)
    evals = rows(reference, "eval")
    assert [row["num_samples"] for row in evals] == [1001, 1001]
    assert evals[-1]["accuracy"] > 0.6
    state = final_state(reference)
    assert not any(key.startswith(("module.", "_orig_mod.")) for key in state["model"])
    assert state["classes"][0] == "T-shirt/top"
    assert state["ema"]["updates"] == 60 and state["ema"]["weights"].keys() == state["model"].keys()


@pytest.mark.extended  # CI: the examples test compiles a factory model in bf16, channels_last
def test_resnet18_trains_with_compile_bf16_and_channels_last(tmp_path) -> None:
    run_dir = tmp_path / "run"
    proc = launch(
        None,
        *tiny_job_args(
            run_dir,
            data_synthetic_shape="3,32,32",
            data_batch_size=32,
            model_widths=None,
            model_name="resnet18",
            train_compile="on",
            train_amp="bf16",
            model_channels_last="on",
            train_epochs=2,
            optim_warmup_steps=2,
            log_every_steps=4,
        ),
    )
    assert proc.returncode == 0, proc.output[-4000:]
    assert "GFLOP per training sample" in proc.output  # MFU's count ran
    losses = [row["loss"] for row in rows(run_dir, "train")]
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]
    assert not any(key.startswith("_orig_mod.") for key in final_state(run_dir)["model"])


@needs_fashion_mnist
def test_a_one_epoch_run_on_a_subset_learns(tmp_path) -> None:
    """23 steps with the default optim.warmup_steps=100: the warmup is cut to a quarter of
    the run (with a warning) instead of lasting all of it."""
    run_dir = tmp_path / "run"
    proc = launch(
        None,
        f"--run.dir={run_dir}",
        f"--data.root={tmp_path / 'data'}",
        "--data.download=false",
        "--data.subset=6000",
        "--data.batch_size=256",
        "--train.epochs=1",
        "--data.num_workers=0",
        "--log.tensorboard=false",
    )
    assert proc.returncode == 0, proc.output[-4000:]
    assert "optim.warmup_steps=100 is more than a quarter of this run's 23 steps" in proc.output
    assert rows(run_dir, "eval")[-1]["accuracy"] > 0.3  # chance is 0.1


@needs_fashion_mnist
def test_unreadable_images_are_skipped_counted_and_named_when_asked(tmp_path, jpeg_folder) -> None:
    root = tmp_path / "fashion"
    shutil.copytree(jpeg_folder, root)
    (root / "train" / "coat" / "broken.jpg").write_bytes(b"\xff\xd8\xff not really a JPEG")
    (root / "val" / "dress" / "broken.jpg").write_bytes(b"")
    args = [
        "--data.dataset=imagefolder",
        f"--data.root={root}",
        "--data.image_size=24",
        "--data.batch_size=40",
        "--train.epochs=1",
        "--data.num_workers=1",
        "--log.tensorboard=false",
    ]
    failed = launch(None, f"--run.dir={tmp_path / 'strict'}", *args)
    assert failed.returncode == 2, failed.output[-4000:]
    assert re.search(rf"cannot read image {root}/(train/coat|val/dress)/broken.jpg", failed.output)
    skipped = launch(None, f"--run.dir={tmp_path / 'run'}", *args, "--data.bad_images=skip")
    assert skipped.returncode == 0, skipped.output[-4000:]
    assert str(root / "train" / "coat" / "broken.jpg") in skipped.output
    assert str(root / "val" / "dress" / "broken.jpg") in skipped.output
    assert "evaluated 101 of the 102 samples: 1 unreadable images were left out" in skipped.output
    evaluated = rows(tmp_path / "run", "eval")[-1]
    assert evaluated["num_samples"] == 101
    # The epoch trains on the first 400 of its permutation of the 401 files (10 steps of 40):
    # the broken one is not trained on when it is among them (before, it was counted).
    paths = [path for path, _ in imagefolder.scan(root / "train")[1]]
    order = torch.randperm(401, generator=torch.Generator().manual_seed(0))[:400].tolist()
    trained = 400 - (paths.index(str(root / "train" / "coat" / "broken.jpg")) in order)
    assert evaluated["epoch_samples_seen"] == trained


@needs_fashion_mnist
def test_device_decoding_trains_exactly_as_the_workers_do_and_resumes(
    tmp_path, jpeg_folder
) -> None:
    """data.decode=device (the path auto picks on a CUDA GPU: workers read the files, the
    training process decodes and crops each batch) on this CPU, preempted and resumed, against
    an uninterrupted 2-rank run that decodes in the loader workers: the same weights, bit for
    bit, and the same evaluations."""
    args = [
        "--data.dataset=imagefolder",
        f"--data.root={jpeg_folder}",
        "--data.image_size=24",
        "--data.batch_size=20",  # 10 steps per epoch on 2 ranks
        "--train.epochs=2",
        "--optim.warmup_steps=2",
        *SMALL,
        "--log.tensorboard=false",
    ]
    reference = tmp_path / "workers"
    done = launch(2, f"--run.dir={reference}", *args, "--data.decode=workers")
    assert done.returncode == 0, done.output[-4000:]
    assert "data.decode=workers" in done.output
    run_dir, device = tmp_path / "device", [*args, "--data.decode=device"]
    first = launch(2, f"--run.dir={run_dir}", *device, faults="sigterm@step=12")
    assert "exitcode: 75" in first.output and "data.decode=device" in first.output
    second = launch(2, f"--run.dir={run_dir}", *device)
    assert second.returncode == 0, second.output[-4000:]
    assert f"resuming from {run_dir / 'checkpoints' / 'step_13.pt'}" in second.output
    assert_same_training_state(final_state(run_dir), final_state(reference))
    ours, theirs = rows(run_dir, "eval"), rows(reference, "eval")
    assert [(r["step"], r["loss"], r["num_samples"]) for r in ours] == [
        (r["step"], r["loss"], r["num_samples"]) for r in theirs
    ]


BAD_EVAL_LABEL = """
import os
import torch

class Samples(torch.utils.data.Dataset):
    \"\"\"1x8x8 images of two classes, without a list of labels for the pipeline to read
    ahead: each label is checked as its sample loads.\"\"\"

    def __init__(self, n, seed, bad_index=None):
        generator = torch.Generator().manual_seed(seed)
        self.targets_of = torch.randint(0, 2, (n,), generator=generator)
        noise = torch.randint(0, 40, (n, 1, 8, 8), generator=generator)
        self.images = (noise + 100 * self.targets_of.view(n, 1, 1, 1)).to(torch.uint8)
        self.bad_index = bad_index

    def __len__(self):
        return len(self.images)

    def __getitem__(self, index):
        label = 7 if index == self.bad_index else int(self.targets_of[index])
        return self.images[index], label

def make(*, root):
    bad = os.path.exists(os.path.join(root, "bad"))  # the user fixes the data: removes it
    return {
        "train": Samples(64, 1),
        "eval": Samples(40, 2, bad_index=25 if bad else None),
        "num_classes": 2,
        "input_shape": (1, 8, 8),
    }
"""


def test_a_bad_evaluation_label_keeps_the_epoch_trained_and_names_the_sample(tmp_path) -> None:
    """Before: the label failed inside cross_entropy after the whole epoch and before its
    checkpoint (exit 1, no index named); every restart trained the epoch again. Now the epoch
    is checkpointed (owing its evaluation), the run exits 2 naming the sample, and once the
    data is fixed the same command evaluates and ends without training again. The checkpoint
    equals an uninterrupted run's on good data, bit for bit (2 ranks: sample 25 is on rank 1's
    shard only, so the ranks must agree on the failure; it lies past the first 8 evaluation
    samples, which the objective's start-up check reads and would refuse before training)."""
    (tmp_path / "bad_eval_label.py").write_text(BAD_EVAL_LABEL)
    root = tmp_path / "root"
    root.mkdir()
    args = [
        "--data.factory=bad_eval_label:make",
        f"--data.root={root}",
        "--data.batch_size=8",
        "--data.eval_batch_size=8",
        "--train.epochs=1",
        "--data.num_workers=0",
        "--log.tensorboard=false",
        "--model.widths=8,16",
    ]
    env = {"PYTHONPATH": str(tmp_path)}
    reference = launch(2, f"--run.dir={tmp_path / 'reference'}", *args, env=env)
    assert reference.returncode == 0, reference.output[-4000:]
    (root / "bad").touch()
    run_dir = tmp_path / "run"
    failed = launch(2, f"--run.dir={run_dir}", *args, env=env)
    assert failed.returncode != 0 and "exitcode: 2" in failed.output, failed.output[-4000:]
    assert "make: eval[25] has label 7: labels must be ints in [0, 2)" in failed.output
    assert "evaluation failed; checkpoint of step 4 written" in failed.output
    saved = final_state(run_dir)
    assert saved["pending_eval"] and saved["step"] == 4  # 64 samples / (2 ranks x 8)
    assert_same_training_state(saved, final_state(tmp_path / "reference"))
    (root / "bad").unlink()
    fixed = launch(2, f"--run.dir={run_dir}", *args, env=env)
    assert fixed.returncode == 0, fixed.output[-4000:]
    assert f"resuming from {run_dir / 'checkpoints' / 'step_4.pt'}" in fixed.output
    same = ("step", "loss", "accuracy", "num_samples", "epoch_samples_seen", "epoch_sample_digest")
    resumed, uninterrupted = rows(run_dir, "eval")[-1], rows(tmp_path / "reference", "eval")[-1]
    assert {key: resumed[key] for key in same} == {key: uninterrupted[key] for key in same}


def test_a_data_kwargs_typo_is_bad_input_naming_the_key(tmp_path) -> None:
    """Before: a TypeError traceback from the factory's call, exit 1 (a model.kwargs typo was
    already exit 2). The example factory fails on the key before it reads a file."""
    proc = launch(
        None,
        f"--run.dir={tmp_path / 'run'}",
        "--data.factory=examples.custom_data:idx_images",
        f"--data.root={tmp_path}",
        '--data.kwargs={"limt": 20000}',
    )
    assert proc.returncode == 2, proc.output[-4000:]
    assert "unexpected keyword argument 'limt'; did you mean limit?" in proc.output
    assert "Traceback" not in proc.output


def test_an_evaluation_set_smaller_than_the_world_size_is_evaluated_exactly(tmp_path) -> None:
    """Before: rank 1's empty shard raised StopIteration at start-up (the FLOP count read a
    batch of it) and the default configuration ended with exit 1. Now rank 1 evaluates
    nothing and the one sample is counted once."""
    run_dir = tmp_path / "run"
    args = tiny_job_args(
        run_dir,
        *SMALL[:2],
        data_synthetic_train_size=128,
        data_synthetic_eval_size=1,
        train_epochs=1,
    )
    done = launch(2, *args)
    assert done.returncode == 0, done.output[-4000:]
    (row,) = rows(run_dir, "eval")
    assert row["num_samples"] == 1 and row["accuracy"] in (0.0, 1.0)


def test_log_lines_never_land_on_the_progress_bars_line(tmp_path) -> None:
    """With the bar on (log.progress=on; auto shows it on a terminal), each log line starts a
    line of its own. Before, a train row written while the bar was drawn followed the bar's
    text on its line ('\\r 40%|####  | 4/10 [...]12:00:01 [rank 0] INFO ...'). Read as bytes:
    text mode would turn the bar's carriage returns into newlines."""
    args = tiny_job_args(tmp_path / "run", log_progress="on", log_every_steps=1, train_max_steps=6)
    done = subprocess.run(
        train_command(None, *args),
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        timeout=240,
    )
    err = done.stderr.decode()
    assert done.returncode == 0, err[-3000:]
    assert "step/s]" in err or "s/step]" in err  # the bar was drawn
    logged = [line for line in err.split("\n") if "[rank 0] INFO" in line]
    assert len(logged) >= 6
    for line in logged:  # what a terminal shows: the text after the line's last carriage return
        assert re.match(r"\d\d:\d\d:\d\d \[rank 0\]", line.rsplit("\r", 1)[-1]), repr(line)


def test_the_best_checkpoints_weights_give_the_logged_accuracy(tmp_path) -> None:
    """An EMA run evaluates (and picks its best by) the weight average; the docs' inference
    recipe (docs/checkpoints.md: load, build, evaluated_weights) must give exactly the logged
    figures. Before, `--model.weights`, consolidate_checkpoint.py --weights and the recipe took
    the checkpoint's `model`, the trained weights (0.633 against a logged 0.600 in one run).
    Reference: a plain evaluation loop here, on the run's own eval set and batch size."""
    import model
    import weightfiles
    from cli import parse_args
    from distributed import DistInfo

    args = tiny_job_args(tmp_path / "run", train_ema_decay=0.9, train_epochs=2, model_norm="group")
    done = launch(None, *args)
    assert done.returncode == 0, done.output[-3000:]
    checkpoints = tmp_path / "run" / "checkpoints"
    best = json.loads((checkpoints / "best.json").read_text())
    logged = {r["step"]: r for r in rows(tmp_path / "run", "eval")}[best["step"]]
    assert logged["accuracy"] == best["accuracy"]

    # The recipe, as the docs give it:
    state = torch.load(checkpoints / f"step_{best['step']}.pt", weights_only=True)
    cfg = parse_args(args)
    splits = data.build_datasets(cfg.data, cfg.train.seed, DistInfo(0, 0, 1, torch.device("cpu")))
    net = model.build(cfg.model, splits.input_shape, splits.num_classes)

    def evaluate(weights: dict) -> tuple[float, float]:
        net.load_state_dict(weights)
        net.eval()
        mean = torch.tensor(splits.mean).view(1, -1, 1, 1)
        std = torch.tensor(splits.std).view(1, -1, 1, 1)
        loss = correct = 0.0
        loader = torch.utils.data.DataLoader(splits.eval, batch_size=cfg.data.eval_batch_size)
        with torch.no_grad():
            for images, labels in loader:
                logits = net((images.float() / 255 - mean) / std)
                loss += torch.nn.functional.cross_entropy(logits, labels, reduction="sum").item()
                correct += (logits.argmax(1) == labels).sum().item()
        return correct / len(splits.eval), loss / len(splits.eval)

    accuracy, loss = evaluate(weightfiles.evaluated_weights(state))
    assert accuracy == logged["accuracy"]
    assert loss == pytest.approx(logged["loss"], rel=1e-5)
    _, trained_loss = evaluate(state["model"])  # the test tells the two apart
    assert trained_loss != pytest.approx(logged["loss"], rel=1e-5)


def test_a_finished_run_extended_or_continued_with_new_settings_is_said(tmp_path) -> None:
    """A second experiment in the same run dir (runs/default when --run.dir is left out) used to
    continue the first one with a line that did not say so: 'the run now ends at step 32
    instead of 16' for a finished run given more epochs."""
    run_dir = tmp_path / "run"
    first = launch(None, *tiny_job_args(run_dir, train_epochs=1))
    assert first.returncode == 0, first.output[-3000:]
    accuracy = rows(run_dir, "eval")[-1]["accuracy"]
    more = launch(None, *tiny_job_args(run_dir, train_epochs=2, optim_lr=0.05))
    assert more.returncode == 0, more.output[-3000:]
    said = (
        f"run.dir={run_dir} holds a run that finished at step 16 (eval accuracy {accuracy}): "
        "extending it to step 32. A new experiment belongs in a new run.dir"
    )
    assert said in more.output, more.output[-3000:]
    assert "optim.lr 0.2 -> 0.05. The run continues with both (its results mix them)" in more.output


LAYER_DROP = '''
from torch import nn


class LayerDrop(nn.Module):
    """Skips its middle block on every other training step after the first few (as LayerDrop
    does by chance): the start-up check sees every parameter used."""

    def __init__(self, in_channels, num_classes):
        super().__init__()
        self.stem = nn.Conv2d(in_channels, 8, 3, padding=1)
        self.block = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, num_classes)
        self.calls = 0

    def forward(self, x):
        x = self.stem(x).relu()
        self.calls += self.training
        if not (self.training and self.calls > 8 and self.calls % 2 == 0):
            x = self.block(x).relu()
        return self.head(x.mean((2, 3)))


def layer_drop(in_channels, num_classes):
    return LayerDrop(in_channels, num_classes)
'''


def test_a_model_whose_used_parameters_change_is_named_and_trains_with_the_setting(tmp_path):
    """Before, such a model died at the step after the first skip in a gloo abort whose first
    lines named nothing (DDP's own advice names an option the pipeline did not have)."""
    (tmp_path / "layer_drop.py").write_text(LAYER_DROP)
    env = {"PYTHONPATH": str(tmp_path)}
    args = tiny_job_args(
        model_factory="layer_drop:layer_drop", model_widths=None, train_max_steps=14
    )
    plain = launch(2, f"--run.dir={tmp_path / 'plain'}", *args, env=env)
    assert plain.returncode != 0
    assert "a parameter got no gradient in the previous step" in plain.output, plain.output[-3000:]
    assert "--dist.find_unused_parameters=true" in plain.output
    found = launch(
        2, f"--run.dir={tmp_path / 'found'}", *args, "--dist.find_unused_parameters=true", env=env
    )
    assert found.returncode == 0, found.output[-3000:]
    assert rows(tmp_path / "found", "train")[-1]["step"] == 14

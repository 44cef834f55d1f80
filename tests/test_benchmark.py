"""benchmarks/: the bare loop does the pipeline's math, and a quick run reports every figure
it promises."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import needs_fashion_mnist
from helpers import REPO, tiny_job_args

import data
import distributed
from benchmarks.common import QUICK
from benchmarks.pipeline import bare_steps, build_rig
from benchmarks.report import TARGETS, time_to_accuracy
from ckpt import storage
from cli import parse_args
from distributed import DistInfo

CPU = torch.device("cpu")


@pytest.mark.parametrize("accum", [1, 2])
def test_bare_loop_ends_with_the_pipelines_parameters(tmp_path, accum: int) -> None:
    """Same init, same batches, same steps: bit-identical weights and BatchNorm statistics.

    This is what makes overhead_ratio compare the same work: a bare loop that left out weight
    decay, clipping, label smoothing, the accumulation scaling or the normalisation would end
    elsewhere.
    """
    cfg = parse_args(
        tiny_job_args(
            data_synthetic_train_size=512,
            data_synthetic_eval_size=None,
            data_batch_size=32,
            data_num_workers=None,
            train_grad_accum_steps=accum,
            model_widths="8,16",
            optim_warmup_steps=3,
            optim_grad_clip=0.05,  # small enough that it clips: clipping is compared too
            log_every_steps=2,
        )
    )
    info = DistInfo(0, 0, 1, CPU)
    splits = data.build_datasets(cfg.data, cfg.train.seed, info)
    plan = QUICK
    rig = build_rig(cfg, info, plan, (splits.mean, splits.std), tmp_path)
    initial = {k: v.clone() for k, v in rig.bare.model.state_dict().items()}
    try:
        for num_steps in (5, 2):  # each call goes on with the replayed batches, in both loops
            rig.pipeline.run(num_steps)
            bare_steps(rig.bare, num_steps)
    finally:
        rig.close()
    pipeline = distributed.unwrap_model(rig.pipeline.model).state_dict()
    bare = rig.bare.model.state_dict()
    assert pipeline.keys() == bare.keys()
    assert not torch.equal(bare["head.weight"], initial["head.weight"])  # it did train
    different = [key for key in bare if not torch.equal(pipeline[key], bare[key])]
    assert not different, f"bare loop and pipeline differ in {different}"


def test_pipeline_saves_through_the_saver_it_is_given_and_synchronously_without(
    tmp_path,
) -> None:
    """The async A/B's seam (CheckpointManager.use_saver): a save handed to a saver reaches it
    and writes nothing itself; the next save without one is written by the Trainer's manager."""
    cfg = parse_args(
        [
            "--data.dataset=synthetic",
            "--data.synthetic_train_size=128",
            "--data.batch_size=32",
            "--model.widths=4,8",
            "--log.tensorboard=false",
        ]
    )
    info = DistInfo(0, 0, 1, CPU)
    splits = data.build_datasets(cfg.data, cfg.train.seed, info)
    rig = build_rig(cfg, info, QUICK, (splits.mean, splits.std), tmp_path)
    handed: list[tuple[int, float | None]] = []

    class Recorder:  # a ProcessSaver's save, recorded instead of written
        def save(self, state: dict, directory, step: int, keep: int, accuracy) -> None:
            assert state["step"] == step
            handed.append((step, accuracy))

    directory = storage.checkpoint_dir(tmp_path)
    try:
        rig.pipeline.save(3, 0.5, Recorder())  # type: ignore[arg-type]
        assert handed == [(3, 0.5)]
        assert not (directory / "step_3.pt").exists()
        rig.pipeline.save(4, 0.6, None)
        assert (directory / "step_4.pt").is_file()
        assert handed == [(3, 0.5)]
    finally:
        rig.close()


def test_time_to_accuracy_takes_the_first_evaluation_at_each_target(tmp_path) -> None:
    rows = [
        {"kind": "train", "step": 50, "time_s": 5.0},
        {"kind": "eval", "step": 100, "epoch": 0, "accuracy": 0.85, "time_s": 11.0},
        {"kind": "eval", "step": 200, "epoch": 1, "accuracy": 0.905, "time_s": 22.0},
        {"kind": "eval", "step": 300, "epoch": 2, "accuracy": 0.901, "time_s": 33.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    found = time_to_accuracy(tmp_path)
    assert found["90%"] == {"step": 200, "epoch": 1, "accuracy": 0.905, "time_s": 22.0}
    assert found["92%"] is None


@pytest.mark.e2e
def test_quick_run_reports_every_figure(tmp_path) -> None:
    out = tmp_path / "benchmark.json"
    finished = tmp_path / "finished"
    finished.mkdir()
    eval_row = {"kind": "eval", "step": 9, "epoch": 0, "accuracy": 0.93, "time_s": 4.0}
    (finished / "metrics.jsonl").write_text(json.dumps(eval_row) + "\n")
    command = [
        sys.executable,
        "-m",
        "benchmarks",
        "--quick",
        "--out",
        str(out),
        "--time-to-accuracy",
        str(finished),
        "--data.dataset=synthetic",
        "--model.widths=4,8,8",  # a small model: this checks the plumbing, not the speed
        "--data.batch_size=32",
        f"--run.dir={tmp_path / 'run'}",
    ]
    result = subprocess.run(
        command,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(out.read_text())
    for key in TARGETS:
        value = report[key]
        assert key in result.stdout
        if value is None:
            assert key in report["unavailable"], f"{key} is null without a reason"
        elif key == "async_checkpoint_stall_ratio":
            assert math.isfinite(value) and value >= 0  # 0: no stall above the noise
        else:
            assert math.isfinite(value) and value > 0, f"{key} = {value}"
    checkpoint = report["details"]["checkpoint"]["large"]
    for handover in (report["details"]["async"]["handover_ratio"], checkpoint["handover_ratio"]):
        assert math.isfinite(handover) and handover > 0  # save() always blocks for the copy
    assert report["time_to_accuracy"]["90%"]["time_s"] == 4.0
    assert report["environment"]["torch_threads"] == 1
    leftovers = sorted(path.name for path in tmp_path.iterdir())
    assert leftovers == sorted([out.name, finished.name])  # the scratch directory is gone


@needs_fashion_mnist
@pytest.mark.e2e
def test_imagefolder_benchmark_quick_run_reports_both_sides(tmp_path) -> None:
    out = tmp_path / "imagefolder.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.imagefolder", "--quick", "--sizes=32"]
        + [f"--out={out}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = json.loads(out.read_text())["sizes"]
    for figure in ("samples_per_s", "samples_per_s_per_core"):
        sides = ("ours", "ours+normalise", "reference")
        assert all(result[figure][side]["median"] > 0 for side in sides)
    assert result["ratios"]["ours / reference, per core"]["median"] > 0
    stages = result["us_per_sample_by_stage"]
    assert "decode" in stages["ours"] and "read+decode (PIL)" in stages["reference"]


@pytest.mark.e2e
def test_strategies_report_what_each_rank_holds(tmp_path) -> None:
    """--strategies: per-rank bytes of parameters, gradients and optimizer state, counted from
    the tensors each rank holds, against a hand computation for ResNet-18 (11,227,812
    parameters with 100 classes; AdamW keeps two fp32 moments of each): ddp holds everything,
    zero a share of the optimizer state, fsdp a share of everything."""
    out = tmp_path / "strategies.json"
    command = [sys.executable, "-m", "benchmarks", "--quick", "--strategies=resnet18"]
    command += ["--only-strategies", "--out", str(out), f"--run.dir={tmp_path / 'run'}"]
    result = subprocess.run(
        command,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(out.read_text())["strategies"]
    params = 11_227_812 * 4
    ddp, zero, fsdp = report["ddp"], report["zero"], report["fsdp"]
    assert ddp["params_bytes_per_rank"] == [params, params]
    assert ddp["grads_bytes_per_rank"] == [params, params]
    assert sum(ddp["optimizer_state_bytes_per_rank"]) >= 2 * 2 * params  # and the steps
    assert zero["params_bytes_per_rank"] == [params, params]
    assert 2 * params <= sum(zero["optimizer_state_bytes_per_rank"]) < 2 * params + 1e6
    assert sum(fsdp["params_bytes_per_rank"]) == params  # the shards add up to the model
    assert fsdp["state_vs_ddp"] < 0.55
    assert report["checkpoint"]["save_sharded_s"]["median"] > 0
    assert "fsdp" in result.stdout and "save sharded" in result.stdout
    # A resume reads each rank's rows: less memory than reading every tensor whole (a memory
    # figure, not a time: the same on a busy machine; the ratios are in BENCHMARKS.md).
    resume = report["resume"]
    assert resume["resume_peak_bytes"]["median"] < resume["resume_whole_peak_bytes"]["median"]

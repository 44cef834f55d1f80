"""CUDA paths (NCCL, autocast, GradScaler, pinned memory). Skipped cleanly without a GPU."""

from __future__ import annotations

import pytest
import torch
from helpers import final_state, launch, rows, tiny_job_args
from test_strategies import (
    TOLERANCE,
    assert_same_model_and_optimizer,
    copy_checkpoint,
    max_difference,
    relative_difference,
)

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


@pytest.mark.e2e
@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_single_gpu_run_learns(tmp_path, amp) -> None:
    proc = launch(None, f"--run.dir={tmp_path}", f"--train.amp={amp}", *JOB, timeout=600)
    assert proc.returncode == 0, proc.output[-4000:]
    assert "device cuda:0" in proc.output
    evals = rows(tmp_path, "eval")
    assert evals[-1]["accuracy"] > 0.5 and evals[-1]["num_samples"] == 2048


@pytest.mark.e2e
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for NCCL")
def test_two_gpu_nccl_run(tmp_path) -> None:
    proc = launch(2, f"--run.dir={tmp_path}", *JOB, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "backend nccl" in proc.stderr


def _smooth_folder(root) -> None:
    """Photograph-like JPEGs (smooth colour gradients and waves, as cameras produce; several
    sizes, one grayscale, one progressive) and a PNG."""
    import numpy as np
    from PIL import Image

    for index, (label, size) in enumerate(
        [("a", (50, 37)), ("a", (90, 64)), ("a", (37, 50)), ("b", (64, 64)), ("b", (41, 33))]
    ):
        w, h = size
        y, x = np.mgrid[0:h, 0:w].astype(np.float64)
        rgb = np.stack(
            [
                127 + 100 * np.sin(x / (7 + index)),
                127 + 100 * np.cos(y / (9 + index)),
                255 * (x + y) / (w + h),
            ],
            axis=-1,
        )
        (root / label).mkdir(parents=True, exist_ok=True)
        image = Image.fromarray(rgb.clip(0, 255).astype(np.uint8))
        image.save(root / label / f"{index}.jpg", quality=90)
    Image.open(root / "a" / "0.jpg").convert("L").save(root / "b" / "gray.jpg", quality=90)
    Image.open(root / "a" / "1.jpg").save(root / "a" / "progressive.jpg", progressive=True)
    Image.open(root / "b" / "3.jpg").save(root / "b" / "lossless.png")


def _device_and_cpu_views(root, cuda):
    from test_imagefolder import CPU, folder

    from inputs import sampling

    images = folder(root, size=32)
    items = [images.encoded_item(i) for i in range(len(images))]
    encoded, paths, labels = ([item[k] for item in items] for k in range(3))
    labels = torch.tensor(labels)
    keys = [sampling.mix64(1, 0, i) for i in range(len(images))]
    views = {}
    for name, view_keys in (("training crops", keys), ("evaluation views", None)):
        ours, _ = images.decode_batch(encoded, paths, labels, view_keys, cuda)
        cpu, _ = images.decode_batch(encoded, paths, labels, view_keys, CPU)
        assert ours.device == cuda
        views[name] = (ours.cpu().float() - cpu.float()).abs()
    return images, encoded, paths, views


def test_batched_gpu_decoding_matches_the_cpu_decoder(tmp_path) -> None:
    """nvJPEG against libjpeg-turbo on real JPEG files of several sizes (one grayscale, one
    progressive) with the content of photographs: the start-up check passes, auto picks it,
    and every training crop and evaluation view is within the rounding by which JPEG decoders
    (IDCT, chroma upsampling) and GPU resizing differ. On JPEGs of pure noise, the worst case
    for both, the difference is printed, not bounded (measured on an H200: mean 2.9 levels)."""
    from test_imagefolder import mixed_folder

    from inputs import imagefolder

    cuda = torch.device("cuda", 0)
    assert auto.decode("auto", True, cuda) == "device"
    _smooth_folder(tmp_path / "smooth")
    images, encoded, paths, views = _device_and_cpu_views(tmp_path / "smooth", cuda)
    for name, difference in views.items():
        per_image = [round(v, 2) for v in difference.flatten(1).mean(1).tolist()]
        print(
            f"smooth JPEGs, {name}: mean {difference.mean():.2f}, max {difference.max():.0f}, "
            f"per image {per_image}"
        )
    mixed_folder(tmp_path / "noise")
    for name, difference in _device_and_cpu_views(tmp_path / "noise", cuda)[3].items():
        print(f"noise JPEGs, {name}: mean {difference.mean():.2f}, max {difference.max():.0f}")
    for name, difference in views.items():
        assert difference.mean() < 1.5 and difference.max() < 40, name
    # A truncated JPEG is named on the GPU path as on the CPU's, not decoded to grey.
    cut = encoded[0][: len(encoded[0]) // 2]
    with pytest.raises(imagefolder.UnreadableImage, match=paths[0]):
        images.decode_batch([cut], [paths[0]], torch.tensor([0]), None, cuda)


# ---------------------------------------------------------------------------------------------
# dist.strategy on CUDA and NCCL (one GPU: world size 1 still runs fully_shard, the sharded
# checkpoint, the writer process and the fused optimizers on the device)

STRATEGY_ARGS = tiny_job_args(
    data_synthetic_train_size=480,  # 10 steps of 48 an epoch
    data_batch_size=None,  # the global batch size instead
    data_global_batch_size=48,
    data_synthetic_eval_size=65,
    data_eval_batch_size=16,
    data_augment=False,
    train_grad_accum_steps=2,
    train_epochs=2,
    train_ema_decay=0.9,
    train_compile="off",
    model_widths="8,16,16",
    optim_name="adamw",
    optim_lr=0.003,
    optim_warmup_steps=2,
    log_every_steps=4,
    dist_timeout_s=120,
    ckpt_keep=20,
    train_deterministic=True,
)
# torch's warning for an op without a deterministic kernel (warn_only=True; Context.cpp)
NONDETERMINISTIC = "does not have a deterministic implementation"


def _strategy_run(run_dir, strategy: str, *extra: str, faults: str | None = None, nproc=1):
    proc = launch(
        nproc,
        f"--run.dir={run_dir}",
        f"--dist.strategy={strategy}",
        *STRATEGY_ARGS,
        *extra,
        faults=faults,
        timeout=600,
    )
    return proc


@pytest.mark.e2e
def test_every_strategy_on_one_gpu_trains_as_ddp_does(tmp_path) -> None:
    """fp32 with deterministic kernels, no TF32: zero, fsdp and hybrid at world size 1 on NCCL
    end where ddp ends, within the CPU test's tolerance for 2 ranks."""
    exact = ("--model.norm=group", "--train.amp=none", "--train.cuda_fast_math=false")
    states = {}
    for strategy in ("ddp", "zero", "fsdp", "hybrid"):
        proc = _strategy_run(tmp_path / strategy, strategy, *exact)
        assert proc.returncode == 0, proc.output[-4000:]
        assert "backend nccl" in proc.output and "device cuda:0" in proc.output
        assert NONDETERMINISTIC not in proc.output, proc.output[-4000:]
        states[strategy] = final_state(tmp_path / strategy)
        assert states[strategy]["step"] == 20
    for strategy in ("zero", "fsdp", "hybrid"):
        difference = relative_difference(states[strategy]["model"], states["ddp"]["model"])
        largest = max_difference(states[strategy]["model"], states["ddp"]["model"])
        print(
            f"{strategy}: weights {difference:.1e} apart from ddp on cuda (largest {largest:.1e})"
        )
        assert difference < TOLERANCE, strategy


@pytest.mark.e2e
@pytest.mark.parametrize("strategy", ["fsdp", "zero"])
def test_a_gpu_run_resumed_with_async_saves_continues_and_its_checkpoint_loads_on_cpu(
    tmp_path, strategy
) -> None:
    """bf16 autocast and the fused AdamW of CUDA, BatchNorm, deterministic kernels. Preempted
    at step 8 with the writer process saving from the device; resumed, it ends bit for bit
    where the uninterrupted run (synchronous saves) ends. Every checkpoint file holds host
    tensors: `torch.load(weights_only=True)` without map_location reads it anywhere. The step 5
    checkpoint written on the GPU then continues on the CPU under ddp at 2 gloo ranks, every
    sample of each epoch seen once (the ledger's digest equals the GPU run's)."""
    every, amp = "--ckpt.every_steps=5", "--train.amp=bf16"
    full, run_dir, cpu = tmp_path / "full", tmp_path / "run", tmp_path / "cpu"
    proc = _strategy_run(full, strategy, every, amp)
    assert proc.returncode == 0, proc.output[-4000:]
    assert "optim.impl=auto->fused" in proc.output, proc.output[-4000:]
    first = _strategy_run(
        run_dir, strategy, every, amp, "--ckpt.async_save=true", faults="sigterm@step=7"
    )
    assert "checkpoint written, exiting with code 75" in first.output, first.output[-4000:]
    second = _strategy_run(run_dir, strategy, every, amp, "--ckpt.async_save=true")
    assert second.returncode == 0 and "resuming from" in second.output, second.output[-4000:]
    a, b = final_state(full), final_state(run_dir)
    assert a["step"] == b["step"] == 20
    assert NONDETERMINISTIC not in proc.output + second.output
    assert_same_model_and_optimizer(a, b)
    for state in (a, b):
        devices = {t.device.type for t in state["model"].values()}
        devices |= {t.device.type for e in state["optimizer"]["state"].values() for t in e.values()}
        assert devices == {"cpu"}, devices
    copy_checkpoint(full, cpu, 5)
    on_cpu = launch(
        2,
        f"--run.dir={cpu}",
        "--dist.strategy=ddp",
        *STRATEGY_ARGS,
        every,
        "--train.amp=none",
        env={"CUDA_VISIBLE_DEVICES": ""},
        timeout=600,
    )
    assert on_cpu.returncode == 0 and "resuming from" in on_cpu.output, on_cpu.output[-4000:]
    assert "device cpu" in on_cpu.output
    digests = [r["epoch_sample_digest"] for r in rows(full, "eval")]
    assert [r["epoch_sample_digest"] for r in rows(cpu, "eval")] == digests
    assert final_state(cpu)["step"] == 20


def test_async_save_from_the_gpu_pins_its_buffers_and_copies_the_latest_values(
    tmp_path, caplog
) -> None:
    """From the GPU the writer's buffers are page-locked once (cudaHostRegister) and filled by
    copies queued without waiting. Checked: every checkpoint equals its state copied to the
    host by plain `.cpu()`, with the values of matmuls still running when save() was called
    (the copies must queue after them on their stream); each live buffer from the GPU is
    registered, once; a buffer replaced (its leaf changed layout) or freed at close is
    unregistered, with cudaSuccess (writer._unpin warns otherwise)."""
    import gc

    from ckpt import storage, writer

    device = torch.device("cuda", 0)
    big = torch.randn(1 << 22, device=device)
    square = torch.randn(4096, 4096, device=device)
    states = [
        {
            "w": big,
            "b": torch.arange(6, device=device).view(2, 3),
            "c": torch.randn(4, 3, 5, 5, device=device).to(memory_format=torch.channels_last),
            "h": torch.ones(3),  # a host tensor beside them: not pinned
            "e": torch.empty(0, device=device),
        },
        {
            "w": big,
            "b": torch.arange(6, device=device).view(3, 2).bfloat16(),  # a new layout
            "c": torch.randn(4, 3, 5, 5, device=device).to(memory_format=torch.channels_last),
            "h": torch.ones(3) * 2,
            "e": torch.empty(0, device=device),
        },
    ]
    # The second state's layouts again: no buffer is made or registered (both wait for the
    # device), so only the copies' own stream order keeps them behind the matmuls.
    states.append({**states[1], "h": torch.ones(3) * 3})
    # Every kernel the loop launches, launched once first. Without this, step 1 found its
    # matmuls done before save() began on an H100, the sleep below notwithstanding; with it,
    # every step found them running. The likely cause (not proven): with CUDA's lazy module
    # loading (the default since CUDA 12.2) a kernel's first launch loads its module, and
    # that waits for the device.
    torch.cuda._sleep(1000)
    big.copy_((square @ square / 64).flatten()[: big.numel()] + 1)
    torch.cuda.synchronize()
    saver = writer.ProcessSaver()
    try:
        for step, state in enumerate(states, start=1):
            # The stream spins for about half a second (torch's test helper: a kernel that
            # waits a number of clock cycles), then multiplies: the copies must queue after it.
            torch.cuda._sleep(1_000_000_000)
            product = square
            for _ in range(12):
                product = product @ square / 64
            big.copy_(product.flatten()[: big.numel()] + step)
            queued = torch.cuda.Event()
            queued.record()
            assert not queued.query(), step  # still running as save() starts
            saver.save({"model": state, "step": step}, tmp_path, step=step, keep=3, accuracy=None)
            saver.wait()
            expected = {name: value.cpu() for name, value in state.items()}
            loaded = storage.load(tmp_path / f"step_{step}.pt", torch.device("cpu"))["model"]
            for name, value in expected.items():
                assert torch.equal(loaded[name], value) and loaded[name].dtype == value.dtype
            gc.collect()
            live = {b.data_ptr() for b in saver._buffers if b.numel() and b.data_ptr()}
            pinned = {b.data_ptr() for b in saver._buffers if b.numel() and b.is_pinned()}
            # w, b, c from the GPU; h is a host tensor, e is empty
            assert len(pinned) == 3 and set(writer._pinned) == pinned <= live, step
        assert loaded["c"].is_contiguous(memory_format=torch.channels_last)
    finally:
        saver.close()
    gc.collect()
    assert writer._pinned == set()  # every registration undone
    assert "cudaHostUnregister" not in caplog.text


def test_a_refused_page_lock_leaves_the_buffers_pageable_and_training_unharmed(caplog) -> None:
    """cudaHostRegister refused (here: the range is registered already, error 712) leaves
    the runtime's last error set; torch's next kernel-launch check would raise it in an
    unrelated kernel unless the writer resets it. The buffer is then copied into unpinned."""
    from ckpt import writer

    buffer = torch.empty(1 << 16)
    cudart = torch.cuda.cudart()
    assert (
        int(cudart.cudaHostRegister(buffer.data_ptr(), buffer.untyped_storage().nbytes(), 0)) == 0
    )
    try:
        writer._pin(buffer)  # registers the same range again: refused
        assert writer._pin_failed and buffer.data_ptr() not in writer._pinned
        assert "could not page-lock" in caplog.text
        (torch.ones(8, device="cuda") * 2).sum().item()  # kernels launch and check cleanly
        source = torch.randn(1 << 16, device="cuda")
        writer._copy_all([buffer], [source])
        assert torch.equal(buffer, source.cpu())
    finally:
        writer._pin_failed = False
        cudart.cudaHostUnregister(buffer.data_ptr())


def test_a_device_verdict_step_waits_for_the_gpu_nowhere(tmp_path) -> None:
    """train.verdict=auto on CUDA (the fused optimizer) decides the skip on the device: the
    steps between two reads of the vote make no synchronizing CUDA call, as torch's sync
    debug mode sees them (a stream or device synchronize, .item(), a pageable copy)."""
    import warnings

    import resilience
    import train
    from cli import parse_args
    from distributed import DistInfo

    args = ["--train.compile=off", "--log.every_steps=1000", "--log.tensorboard=false"]
    cfg = parse_args([f"--run.dir={tmp_path}", *JOB, *args])
    info = DistInfo(0, 0, 1, torch.device("cuda", 0))
    handler = resilience.PreemptionHandler(cfg.run.preempt_signals)
    with train.Trainer(cfg, info, handler) as trainer:
        assert trainer.verdicts.on_device
        trainer.resume()
        with trainer.instruments.running(trainer.total_steps):
            for _ in range(3):  # the first steps make the optimizer's state (read on the host)
                trainer.train_step()
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    for _ in range(5):
                        trainer.train_step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            trainer.verdicts.settle()
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert not syncs, syncs

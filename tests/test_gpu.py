"""CUDA paths (NCCL, autocast, GradScaler, pinned memory). Skipped cleanly without a GPU."""

from __future__ import annotations

import pytest
import torch
from helpers import launch, rows

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


def test_batched_gpu_decoding_matches_the_cpu_decoder(tmp_path) -> None:
    """nvJPEG against libjpeg-turbo on real JPEG files of several sizes (one grayscale): the
    start-up check passes, auto picks it, and every training crop is within the rounding
    JPEG decoders and GPU resizing differ by."""
    from test_imagefolder import CPU, folder, mixed_folder

    import data
    import imagefolder

    cuda = torch.device("cuda", 0)
    assert auto.decode("auto", True, cuda) == "device"
    mixed_folder(tmp_path)
    images = folder(tmp_path, size=32)
    items = [images.encoded_item(i) for i in range(len(images))]
    encoded, paths, labels = ([item[k] for item in items] for k in range(3))
    keys = [data._mix64(1, 0, i) for i in range(len(images))]
    ours, _ = images.decode_batch(encoded, paths, torch.tensor(labels), keys, cuda)
    cpu, _ = images.decode_batch(encoded, paths, torch.tensor(labels), keys, torch.device("cpu"))
    difference = (ours.cpu().float() - cpu.float()).abs()
    assert ours.device == cuda and difference.mean() < 2 and difference.max() < 40
    evaluated, _ = images.decode_batch(encoded, paths, torch.tensor(labels), None, cuda)
    reference, _ = images.decode_batch(encoded, paths, torch.tensor(labels), None, CPU)
    assert (evaluated.cpu().float() - reference.float()).abs().mean() < 2
    # A truncated JPEG is named on the GPU path as on the CPU's, not decoded to grey.
    cut = encoded[0][: len(encoded[0]) // 2]
    with pytest.raises(imagefolder.UnreadableImage, match=paths[0]):
        images.decode_batch([cut], [paths[0]], torch.tensor([0]), None, cuda)

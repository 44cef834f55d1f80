"""Every "auto" setting: what it becomes on this CPU machine, and what the log line says."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import auto
import parallel
from config import Config, ConfigError
from distributed import DistInfo

CPU = torch.device("cpu")
# channels_last's choice on this CPU: on with AVX-512 only (auto.channels_last says why)
NHWC_ON_THIS_CPU = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
ONE = DistInfo(0, 0, 1, CPU)  # python train.py: no process group
TWO = DistInfo(0, 0, 2, CPU, backend="gloo")


def test_auto_on_cpu_is_the_documented_cpu_choice_for_each_setting() -> None:
    resolved = auto.resolve(Config(), TWO, in_memory_numel=1000)
    assert resolved == auto.Auto(
        backend="gloo",  # as distributed.setup chose it (auto.backend)
        amp=None,  # fp32: CPUs gain nothing from autocast here
        compile=False,
        channels_last=NHWC_ON_THIS_CPU,  # oneDNN's AVX-512 convolutions prefer NHWC
        optimizer_impl="foreach",
        loader="device",  # in memory, and not a GPU whose free memory could be short
        decode="none",  # nothing to decode: Fashion-MNIST is held in memory
        progress=False,  # pytest's stderr is not a terminal
        ckpt_format="file",  # no process group: nothing is sharded
    )


def test_explicit_settings_are_kept() -> None:
    cfg = Config()
    cfg = dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, amp="bf16", compile="on"),
        model=dataclasses.replace(cfg.model, channels_last="off"),
        optim=dataclasses.replace(cfg.optim, impl="loop"),
        data=dataclasses.replace(cfg.data, loader="dataloader", decode="workers"),
        log=dataclasses.replace(cfg.log, progress="on"),
        dist=dataclasses.replace(cfg.dist, backend="gloo"),
        ckpt=dataclasses.replace(cfg.ckpt, format="sharded"),
    )
    resolved = auto.resolve(cfg, TWO, in_memory_numel=1000)
    assert resolved == auto.Auto(
        "gloo", torch.bfloat16, True, False, "loop", "dataloader", "none", True, "sharded"
    )
    # Nothing was "auto": the log line states values without arrows.
    assert "->" not in resolved.describe(cfg)


def test_checkpoints_are_sharded_when_the_run_shards_and_one_file_otherwise() -> None:
    fsdp, ddp = parallel.Layout("fsdp", True, 2), parallel.Layout("ddp", False, 2)
    assert auto.ckpt_format("auto", fsdp) == "sharded"
    assert auto.ckpt_format("auto", ddp) == "file"
    assert auto.ckpt_format("file", fsdp) == "file"
    assert auto.ckpt_format("sharded", ddp) == "sharded"
    cfg = Config()
    assert (
        auto.resolve(cfg, TWO, 1000, layout=fsdp)
        .describe(cfg)
        .endswith("ckpt.format=auto->sharded")
    )


def test_a_dataset_read_from_files_gets_the_dataloader() -> None:
    assert auto.loader("auto", "imagefolder", None, CPU) == "dataloader"
    with pytest.raises(ConfigError, match="data.loader=device needs an in-memory dataset"):
        auto.loader("device", "imagefolder", None, CPU)


def test_image_folders_decode_in_the_loader_workers_on_a_cpu() -> None:
    """A CPU's cores decode in parallel in the workers; device decoding is asked for only."""
    assert auto.decode("auto", True, CPU) == "workers"
    assert auto.decode("device", True, CPU) == "device"
    assert auto.decode("auto", False, CPU) == "none"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_nccl_without_cuda_is_bad_input() -> None:
    assert auto.backend("auto") == "gloo"
    with pytest.raises(ConfigError, match="dist.backend=nccl needs CUDA"):
        auto.backend("nccl")


def test_describe_names_each_setting_and_what_auto_became() -> None:
    line = auto.resolve(Config(), ONE, in_memory_numel=None).describe(Config())
    assert line.split(", ") == [
        "dist.backend=auto->none",  # one process: no process group
        "train.amp=auto->none",
        "train.compile=auto->off",
        f"model.channels_last=auto->{'on' if NHWC_ON_THIS_CPU else 'off'}",
        "optim.impl=auto->foreach",
        "data.loader=auto->dataloader",
        "data.decode=auto->none",
        "log.progress=auto->off",
        "ckpt.format=auto->file",
    ]


def test_decoding_on_a_gpu_is_chosen_only_where_it_pays_and_works(monkeypatch, caplog) -> None:
    """The CUDA branch of auto.decode, with the start-up check's verdict given: a folder of
    JPEG files on a decoder that works -> device; a failing check or a folder of mostly other
    formats -> the workers, saying why."""
    from inputs import imagefolder

    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(imagefolder, "device_decoding_problem", lambda device: None)
    assert auto.decode("auto", True, gpu, jpeg_share=1.0) == "device"
    with caplog.at_level("INFO"):
        assert auto.decode("auto", True, gpu, jpeg_share=0.5) == "workers"
    assert "50% of the training images are not JPEG files" in caplog.text
    monkeypatch.setattr(imagefolder, "device_decoding_problem", lambda device: "no nvJPEG")
    with caplog.at_level("WARNING"):
        assert auto.decode("auto", True, gpu) == "workers"
    assert "decoding in the loader workers; cuda:0: no nvJPEG" in caplog.text


# The weight gradient of a 1x1 stride-2 convolution with 4 input channels on 28x28 inputs (a
# MiniResNet shortcut of width 4 on Fashion-MNIST), in the memory format auto chooses.
_SHORTCUT_BACKWARD = """
import sys
import torch
import auto
nhwc = auto.channels_last("auto", torch.device("cpu"))
layout = torch.channels_last if nhwc else torch.contiguous_format
conv = torch.nn.Conv2d(4, 8, 1, stride=2, bias=False).to(memory_format=layout)
for _ in range(5):
    x = torch.randn(64, 4, 28, 28).to(memory_format=layout).requires_grad_()
    conv(x).sum().backward()
print("nhwc" if nhwc else "nchw", "done")
"""


@pytest.mark.slow
def test_the_memory_format_auto_picks_trains_a_narrow_shortcut_on_this_cpu() -> None:
    """On an AVX2-only CPU torch 2.14.1's oneDNN (jit_avx2_1x1_convolution_bwd_weights_t) spins
    forever or aborts ("double free or corruption") on this backward in channels_last: a
    MiniResNet of widths 4,8,8 then never finished its first step. Whatever this CPU is, what
    auto picks must finish in seconds (the timeout bounds a hang, it measures no speed)."""
    done = subprocess.run(
        [sys.executable, "-c", _SHORTCUT_BACKWARD],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(auto.__file__).parent,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("done"), done.stderr

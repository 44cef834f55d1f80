"""Every "auto" setting, resolved in one place for the device at hand, and logged.

The config keeps what the user asked for, "auto" included: a run resumed on other hardware
resolves again (a CPU run continued on a GPU gets bf16 and fused kernels there). Each rule is
one function below; `resolve` applies them all, and `Auto.describe` is the log line that says
what each became.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from config import Config, ConfigError
from distributed import DistInfo
from inputs import imagefolder
from parallel import Layout

log = logging.getLogger(__name__)


def backend(requested: str) -> str:
    """dist.backend: auto = nccl when CUDA is available, gloo otherwise."""
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise ConfigError(
            "dist.backend=nccl needs CUDA GPUs, but torch.cuda.is_available() is False on this "
            "host; use --dist.backend=gloo (or auto) on CPU"
        )
    return requested


def amp(setting: str, device: torch.device) -> torch.dtype | None:
    """train.amp as an autocast dtype, None for full precision. auto = bf16 on CUDA devices
    that run it natively; pre-Ampere GPUs emulate bf16 slowly, so fp32 there and on CPU."""
    if setting == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False):
            return torch.bfloat16
        return None
    return {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[setting]


def compile_model(setting: str, device: torch.device) -> bool:
    """train.compile: auto = on CUDA (fused kernels pay for the compile), off on CPU."""
    return setting == "on" or (setting == "auto" and device.type == "cuda")


def channels_last(setting: str, device: torch.device) -> bool:
    """model.channels_last: auto = on for CUDA (tensor cores read NHWC) and for CPUs with
    AVX-512 (oneDNN's NHWC convolutions there train the default job faster: BENCHMARKS.md,
    "Overhead"); off on other CPUs.

    Why not every CPU: on an AVX2-only CPU (torch 2.14.1's oneDNN, kernel
    jit_avx2_1x1_convolution_bwd_weights_t) the weight gradient of a channels_last 1x1
    stride-2 convolution with fewer than 8 input channels on 28x28 inputs (a MiniResNet
    shortcut of width 4) spins forever or aborts with "double free or corruption"
    (tests/test_auto.py reproduces it), and NHWC was never measured to help there."""
    if setting != "auto":
        return setting == "on"
    if device.type == "cpu":
        return torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    return device.type == "cuda"


def optimizer_impl(setting: str, device: torch.device) -> str:
    """optim.impl: auto = fused (one kernel) on CUDA, foreach elsewhere."""
    if setting == "auto":
        return "fused" if device.type == "cuda" else "foreach"
    return setting


def loader(
    setting: str,
    dataset: str,
    in_memory_numel: int | None,
    device: torch.device,
    per_sample: bool = False,
) -> str:
    """data.loader: auto = device for an in-memory dataset (on CPU always; on a GPU when its
    uint8 images take under a quarter of the free memory), dataloader otherwise, and whenever
    aug asks for work per sample (`per_sample`: a policy; config.Config refuses
    data.loader=device with one)."""
    if setting == "dataloader" or per_sample:
        return "dataloader"
    if in_memory_numel is None:
        if setting == "device":
            raise ConfigError(
                f"data.loader=device needs an in-memory dataset; {dataset} is not held in "
                "memory as one uint8 tensor: use data.loader=dataloader or auto"
            )
        return "dataloader"
    if setting == "device" or device.type != "cuda":
        return "device"
    free, _ = torch.cuda.mem_get_info(device)
    return "device" if in_memory_numel < free // 4 else "dataloader"


def decode(
    setting: str,
    image_folder: bool,
    device: torch.device,
    jpeg_share: float = 1.0,
    per_sample: bool = False,
) -> str:
    """data.decode: auto = device for an image folder of JPEG files (`jpeg_share`, the share of
    its training files named .jpg or .jpeg, at least 90%: other formats decode on the CPU in
    the training process on that path) on a CUDA GPU whose batched JPEG decoder works (checked
    on a test image; a warning says why not otherwise); workers elsewhere, where a CPU's cores
    decode in parallel in the loader workers, and wherever aug asks for work per sample (a
    policy, repeated copies: AugConfig.worker_only). "none" for datasets in memory."""
    if not image_folder:
        return "none"
    if setting != "auto":
        return setting
    if per_sample:
        return "workers"
    if device.type != "cuda":
        return "workers"
    if jpeg_share < 0.9:
        log.info(
            "data.decode=auto: decoding in the loader workers; %.0f%% of the training images are "
            "not JPEG files, which the GPU does not decode",
            100 * (1 - jpeg_share),
        )
        return "workers"
    problem = imagefolder.device_decoding_problem(device)
    if problem is not None:
        log.warning("data.decode=auto: decoding in the loader workers; %s: %s", device, problem)
        return "workers"
    return "device"


def progress(setting: str) -> bool:
    """log.progress: auto = a progress bar only when stderr is a terminal."""
    return setting == "on" or (setting == "auto" and sys.stderr.isatty())


def ckpt_format(setting: str, layout: Layout) -> str:
    """ckpt.format: auto = sharded when the run shards its parameters (every rank then writes
    its own piece of each tensor: ckpt/sharded.py), one file written by rank 0 otherwise."""
    if setting == "auto":
        return "sharded" if layout.shards else "file"
    return setting


def _key(name: str) -> Any:
    return field(metadata={"key": name})


@dataclass(frozen=True)
class Auto:
    """What each auto/on/off setting is on this device, with the config key it resolves."""

    backend: str = _key("dist.backend")  # "none": one process, no process group
    amp: torch.dtype | None = _key("train.amp")
    compile: bool = _key("train.compile")
    channels_last: bool = _key("model.channels_last")
    optimizer_impl: str = _key("optim.impl")
    loader: str = _key("data.loader")
    decode: str = _key("data.decode")
    progress: bool = _key("log.progress")
    ckpt_format: str = _key("ckpt.format")  # "file" or "sharded"

    def describe(self, cfg: Config) -> str:
        """`key=value` for every setting; `key=auto->value` where "auto" was resolved."""
        parts = []
        for f in dataclasses.fields(self):
            key = f.metadata["key"]
            section, name = key.split(".")
            setting = getattr(getattr(cfg, section), name)
            shown = _spelled(getattr(self, f.name))
            parts.append(f"{key}={setting}->{shown}" if setting == "auto" else f"{key}={shown}")
        return ", ".join(parts)


def _spelled(value: Any) -> str:
    """A resolved value as the config spells it: on/off, bf16/fp16/none."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None or isinstance(value, torch.dtype):
        return {torch.bfloat16: "bf16", torch.float16: "fp16", None: "none"}[value]
    return str(value)


def resolve(
    cfg: Config,
    info: DistInfo,
    in_memory_numel: int | None,
    jpeg_share: float = 1.0,
    layout: Layout | None = None,
) -> Auto:
    """Every setting for this rank's device; `in_memory_numel` is the training set's element
    count when it is held in memory as one tensor (data.in_memory_numel), else None. The
    backend is the one `distributed.setup` chose with `backend` above; `layout` the run's
    (parallel.Layout.of when not given)."""
    device = info.device
    layout = layout if layout is not None else Layout.of(cfg.dist, info)
    return Auto(
        backend=info.backend or "none",
        amp=amp(cfg.train.amp, device),
        compile=compile_model(cfg.train.compile, device),
        channels_last=channels_last(cfg.model.channels_last, device),
        optimizer_impl=optimizer_impl(cfg.optim.impl, device),
        loader=loader(
            cfg.data.loader,
            cfg.data.source,
            in_memory_numel,
            device,
            bool(cfg.aug.worker_only("loader")),
        ),
        decode=decode(
            cfg.data.decode,
            cfg.data.source == "data.dataset=imagefolder",
            device,
            jpeg_share,
            bool(cfg.aug.worker_only("decode")),
        ),
        progress=progress(cfg.log.progress),
        ckpt_format=ckpt_format(cfg.ckpt.format, layout),
    )

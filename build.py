"""What a rank builds on its device before training: the CUDA settings, and the model as the
parallel strategy needs it.

`build_model` gives every rank the same initial weights (they depend on train.seed alone). Under
fsdp and hybrid the model stays in host memory for `parallel.parallelize` to shard onto the
device, and every rank but rank 0 builds it on the meta device (shapes, no memory).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
from torch import nn

import data
import distributed
import model as models
import parallel
from config import Config, ConfigError
from distributed import DistInfo

log = logging.getLogger("train")  # its lines read as the run's, as they did from train.py


def configure_cuda(cfg: Config, info: DistInfo) -> None:
    """cudnn autotuning (fixed input shapes) and TF32 for fp32 matmuls and convolutions under
    train.cuda_fast_math, and neither without it; deterministic kernels under
    train.deterministic (without them a resumed run on a GPU drifts from the uninterrupted
    one: BENCHMARKS.md, "GPU"; tests/test_gpu.py)."""
    if cfg.train.deterministic:
        # cuBLAS reads this when it creates its handle, at the first matmul: before that.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # warn_only: torchvision's models pool with AdaptiveAvgPool2d, whose CUDA backward has
        # no deterministic kernel; refusing them would refuse the run.
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True
    if info.device.type != "cuda":
        return
    fast = cfg.train.cuda_fast_math
    # Autotuning may pick another algorithm after a restart: a resumed run would differ.
    torch.backends.cudnn.benchmark = fast and not cfg.train.deterministic
    torch.backends.cuda.matmul.allow_tf32 = fast
    # torch's own default for convolutions is TF32 (allow_tf32=True): off has to be said. Left
    # on, fsdp and ddp ended apart in "fp32" (the unsharded weights live elsewhere, and cuDNN
    # chose another TF32 algorithm; BENCHMARKS.md, "GPU").
    torch.backends.cudnn.allow_tf32 = fast


def build_model(
    cfg: Config,
    splits: data.DataSplits,
    info: DistInfo,
    channels_last: bool | data.Preprocess,
    layout: parallel.Layout,
) -> nn.Module:
    """The model (model.name or model.factory) on this rank's device (under fsdp and hybrid:
    in host memory, for parallelize to shard onto the device), the same initial
    weights on every rank; in channels_last memory format as model.channels_last resolved
    (auto.channels_last, in the run's auto.Auto record), or as the training batches'
    `Preprocess` has it, which `check_channels_last` may turn contiguous. `layout`: the run's
    parallel.Layout."""
    preprocess = channels_last if isinstance(channels_last, data.Preprocess) else None
    if preprocess is not None:
        channels_last = preprocess.memory_format == torch.channels_last
    # Under fsdp and hybrid the ranks but rank 0 build on the meta device (shapes, no memory,
    # no initialisation): parallelize gives them their shards of rank 0's weights, so only
    # rank 0 ever holds the whole model.
    meta = layout.builds_on_meta(info.is_main)
    # The initial weights depend on train.seed alone; the build draws nothing from the ranks'
    # own random streams (seed + rank), whatever the model's size or device.
    devices = [info.device] if info.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
        model = _build_on(torch.device("meta") if meta else None, cfg, splits)
    if cfg.model.norm == "syncbatch" and info.world_size > 1:
        if info.device.type != "cuda":
            # SyncBatchNorm.forward refuses CPU tensors ("expected input tensor to be on GPU
            # or XPU", torch/nn/modules/batchnorm.py). group is mini_resnet's only (config).
            mini = not cfg.model.factory and cfg.model.name == models.MINI_RESNET
            other = "batch or group" if mini else "batch"
            raise ConfigError(
                "model.norm=syncbatch needs CUDA devices (SyncBatchNorm runs on GPUs only); "
                f"use model.norm={other} on CPU"
            )
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if layout.shards:
        # Left in host memory: fully_shard moves each unit to the device as it shards it, so
        # the device holds one unit whole at a time, never the whole model. FSDP2 refuses
        # channels_last parameters (the inputs may still be channels_last, and convolutions
        # then run channels_last): the weights stay contiguous.
        if preprocess is not None and channels_last:
            settle_memory_format(model, cfg, info, layout, preprocess, splits.input_shape)
        return model
    memory_format = torch.channels_last if channels_last else torch.preserve_format
    model = model.to(device=info.device, memory_format=memory_format)
    if preprocess is not None and channels_last:
        settle_memory_format(model, cfg, info, layout, preprocess, splits.input_shape)
    return model


def settle_memory_format(
    model: nn.Module,
    cfg: Config,
    info: DistInfo,
    layout: parallel.Layout,
    preprocess: data.Preprocess,
    input_shape: tuple[int, ...],
) -> None:
    """The start-up checks (models.build) run contiguous; step 1 runs channels_last. A model
    that fails there (`x.view(N, -1)` on channels_last activations) is refused under
    model.channels_last=on, naming it, and trains contiguous under auto, said in a warning
    (model and batches both). Under fsdp rank 0 checks (the others may hold a meta model)."""
    error = None
    if not layout.shards or info.is_main:
        error = _channels_last_error(model, input_shape)
    if layout.shards:
        error = distributed.broadcast_object(error)
    if error is None:
        return
    what = (
        f"model.factory={cfg.model.factory}"
        if cfg.model.factory
        else f"model.name={cfg.model.name}"
    )
    if cfg.model.channels_last == "on":
        raise ConfigError(
            f"model.channels_last=on: {what} fails on channels_last inputs ({error}), the "
            "memory format training uses: set --model.channels_last=off, or flatten with "
            "x.flatten(1) or x.reshape(len(x), -1), which take any memory format"
        )
    log.warning(
        "model.channels_last=auto -> off: %s fails on channels_last inputs (%s); it trains "
        "in contiguous memory format (x.flatten(1) instead of x.view(N, -1) takes either)",
        what,
        error,
    )
    model.to(memory_format=torch.contiguous_format)
    preprocess.memory_format = torch.contiguous_format


def _channels_last_error(model: nn.Module, input_shape: tuple[int, ...]) -> str | None:
    """What an eval-mode forward of two channels_last samples raises (nothing updated, no
    random number drawn), or None."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    sample = torch.zeros(2, *input_shape, device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(sample.contiguous(memory_format=torch.channels_last))
    except Exception as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return f"{type(err).__name__}: {first}"
    finally:
        model.train(was_training)
    return None


def _build_on(device: torch.device | None, cfg: Config, splits: data.DataSplits) -> nn.Module:
    """models.build with `device` as the default device (None: as it is). A model that cannot
    be built on the meta device (an op without a meta kernel in its constructor, a check of
    its forward that reads values), or that keeps a tensor as a plain attribute (neither a
    parameter nor a buffer: nothing would give it values), is built in host memory instead:
    only the memory saving is lost."""
    crop = (
        cfg.data.eval_size[0] if cfg.data.dataset == "imagefolder" and not cfg.data.factory else 0
    )
    eval_shape = (splits.input_shape[0], crop, crop) if crop else ()
    options = (splits.input_shape, splits.num_classes, cfg.dist.find_unused_parameters, eval_shape)
    if device is None:
        return models.build(cfg.model, *options)
    try:
        with device:
            model = models.build(cfg.model, *options)
        plain = [
            f"{prefix}.{key}" if prefix else key
            for prefix, module in model.named_modules()
            for key, value in vars(module).items()
            if isinstance(value, torch.Tensor) and value.is_meta
        ]
        if not plain:
            return model
        why = f"tensors that are not parameters or buffers: {', '.join(plain[:3])}"
    except Exception as err:  # any failure: the host build says what is wrong, if anything
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
    log.warning("the model is built in host memory, not on the %s device (%s)", device, why)
    return models.build(cfg.model, *options)


def count_flops(
    model: nn.Module,
    sample: torch.Tensor,
    count: Callable[[nn.Module, torch.Tensor], None],
    rebuild: Callable[[], nn.Module],
    is_main: bool,
) -> None:
    """log.mfu: `count` the FLOPs of `model` on `sample`; a sharded model's on a copy that
    `rebuild` builds on the meta device (a shard cannot run alone, a copy takes no memory)."""
    sharded = parallel.is_sharded(model)
    try:
        if sharded:
            with torch.device("meta"):
                model = rebuild()
            sample = sample.to("meta")
        count(model, sample)
    except Exception as err:
        if not sharded:
            raise
        # A forward that reads values (.item(), data-dependent control flow) cannot
        # run on the meta device: the run trains, without an MFU figure.
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        if is_main:
            log.warning("log.mfu: no FLOP count for this model under fsdp (%s)", first)

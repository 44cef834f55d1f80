"""How the model is spread over the ranks: the one place where the data-parallel strategy
(`dist.strategy`) is chosen. `parallelize` wraps the freshly built model before anything else
sees its parameters (the optimizer, the weight average, the checkpoint parts) and returns a
`Parallel`, which the Trainer asks for everything that differs between strategies.

- ddp: DistributedDataParallel. Every rank holds the whole model, its gradients and its
  optimizer state; gradients are all-reduced (identity at world size 1).
- zero: DDP, with the optimizer state sharded over the ranks (`ZeroRedundancyOptimizer`):
  each rank updates its share of the parameters and broadcasts them.
- fsdp: FSDP2 `fully_shard`. Parameters, gradients and optimizer state are sharded; each
  wrapped block all-gathers its parameters for its forward and backward, and gradients are
  reduce-scattered, once per optimizer step.
- hybrid: fsdp within a node, replicated across nodes (a 2-D device mesh): the all-gathers
  stay on the node's fast links and only the gradient all-reduce crosses nodes.

Under every strategy a checkpoint holds full, unsharded tensors keyed as the bare model's
`state_dict` (and the optimizer's, by parameter index): ckpt/parts.py.

Step-level helpers (`gradient_sync`, `sync_buffers`, `is_sharded`) dispatch on
the module's type, so the training step itself never asks which strategy runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import distributed
import sharding
from config import SHARDED_STRATEGIES, ConfigError, DistConfig
from distributed import AllReduceTimer, DistInfo

log = logging.getLogger(__name__)

SHARDED = SHARDED_STRATEGIES


# ---------------------------------------------------------------------------------------------
# Step-level helpers: they look at the module, not at the config


def _inner(model: nn.Module) -> nn.Module:
    """The module under a torch.compile wrapper."""
    return getattr(model, "_orig_mod", model)


def is_sharded(model: nn.Module) -> bool:
    """Whether `model` (or what torch.compile wraps) is an FSDP2 module: its forward is a
    collective (every rank must run the same number of them)."""
    return isinstance(_inner(model), FSDPModule)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the gradient communication of the backward inside this block when `enabled` is
    False: DDP's all-reduce (`no_sync()`, around forward and backward, since DDP decides in
    forward) or FSDP's reduce-scatter (`set_requires_gradient_sync`: the unsharded gradients
    accumulate until a backward with sync on reduce-scatters their sum, once)."""
    inner = _inner(model)
    if isinstance(inner, FSDPModule):
        inner.set_requires_gradient_sync(enabled)
        try:
            yield
        finally:
            inner.set_requires_gradient_sync(True)
        return
    if enabled or not isinstance(inner, DistributedDataParallel):
        yield
        return
    with inner.no_sync():
        yield


def sync_buffers(model: nn.Module) -> None:
    """Under FSDP, give every rank rank 0's buffers (BatchNorm statistics), as DDP does at the
    first forward of each optimizer step: without it each rank's statistics drift apart with
    its own data. Nothing to do under DDP (DDP does it) or alone."""
    inner = _inner(model)
    if not isinstance(inner, FSDPModule) or not distributed.active():
        return
    buffers = list(inner.buffers())
    if buffers:
        distributed.broadcast_coalesced(buffers)


# ---------------------------------------------------------------------------------------------
# The strategy's answers, and the strategy object


@dataclass(frozen=True)
class Layout:
    """What the rest of the run asks of dist.strategy before and after the model is wrapped:
    whether this run shards the parameters, and so where its tensors live. Made once per run
    by `Layout.of` (the only place that derives it) and passed to whoever asks."""

    strategy: str
    shards: bool  # see `shards`: fsdp and hybrid under a process group
    world_size: int

    @classmethod
    def of(cls, cfg: DistConfig, info: DistInfo) -> Layout:
        return cls(cfg.strategy, shards(cfg.strategy), info.world_size)

    def builds_on_meta(self, is_main: bool) -> bool:
        """Whether this rank builds the model on the meta device: when sharding, every rank
        but rank 0 (parallelize gives them their shards of rank 0's weights)."""
        return self.shards and not is_main

    @property
    def collectives_inside_step(self) -> bool:
        """Sharded over several ranks: all-gathers and reduce-scatters run inside forward and
        backward, with no gradient all-reduce of their own to time."""
        return self.shards and self.world_size > 1


@dataclass
class Parallel:
    """The model as the training step calls it, and what the rest of the run needs of it.

    `model`: what forward and backward run (DDP wrapper or FSDP module; compiled when
    train.compile is on). `bare`: the module underneath (under fsdp the sharded module itself),
    whose parameters the optimizer updates. `comm_timer`: times DDP's gradient all-reduce of
    each step (None without DDP)."""

    strategy: str
    model: nn.Module
    bare: nn.Module
    comm_timer: AllReduceTimer | None
    mesh: DeviceMesh | None = None

    def build_optimizer(
        self, cls: type[torch.optim.Optimizer], groups: list[dict[str, Any]], **kwargs: Any
    ) -> torch.optim.Optimizer:
        """The optimizer over `groups` (of `bare`'s parameters); its state sharded under zero
        (and under fsdp, where the parameters themselves are)."""
        if self.strategy == "zero" and distributed.active():
            return ZeroRedundancyOptimizer(groups, optimizer_class=cls, **kwargs)
        if self.mesh is not None and cls is torch.optim.SGD and kwargs.get("fused"):
            # DTensor has no sharding rule for the fused SGD kernel (only fused Adam and
            # AdamW: torch/distributed/tensor/_ops/_pointwise_ops.py); foreach runs on shards.
            log.info("optim.impl: fused SGD does not run on FSDP shards: foreach instead")
            kwargs = {**kwargs, "fused": False, "foreach": True}
        return cls(groups, **kwargs)


# ---------------------------------------------------------------------------------------------
# Running out of memory


@dataclass(frozen=True)
class Placement:
    """What `parallelize` placed on this rank, for the out-of-memory message."""

    strategy: str
    world_size: int
    parameter_bytes: int  # of the whole model
    local_parameter_bytes: int  # held by this rank


_placed: list[Placement] = []  # the last `parallelize` of this process


def is_out_of_memory(err: BaseException) -> bool:
    """A failed allocation: CUDA's OutOfMemoryError, Python's MemoryError, or the CPU
    allocator's RuntimeError ("DefaultCPUAllocator: can't allocate memory", c10's
    alloc_cpu.cpp), also when another exception was raised from one."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, torch.OutOfMemoryError | MemoryError):
            return True
        if isinstance(current, RuntimeError) and "can't allocate memory" in str(current):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def out_of_memory_advice(err: BaseException, rank: int, batch_size: int) -> str:
    """What ran out, what this rank held under dist.strategy, and what to change."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    said = f"rank {rank} ran out of memory ({first})"
    if not _placed:
        return f"{said}; lower data.batch_size, or shard the model with --dist.strategy=fsdp"
    p = _placed[-1]
    mb = p.parameter_bytes / 1e6
    activations = (
        f"activations grow with data.batch_size ({batch_size} per rank): lower it and raise "
        "train.grad_accum_steps to keep the global batch"
    )
    if p.strategy in ("ddp", "zero"):
        held = (
            "its gradients and its optimizer state"
            if p.strategy == "ddp"
            else ("its gradients (the optimizer state is sharded)")
        )
        return (
            f"{said}. Under dist.strategy={p.strategy} every rank holds the whole model "
            f"({mb:.1f} MB of parameters), {held}: --dist.strategy=fsdp shards parameters, "
            f"gradients and optimizer state over the {p.world_size} ranks"
            + (", --dist.strategy=zero the optimizer state only" if p.strategy == "ddp" else "")
            + f"; {activations}"
        )
    return (
        f"{said}. Under dist.strategy={p.strategy} this rank holds "
        f"{p.local_parameter_bytes / 1e6:.1f} of the model's {mb:.1f} MB of parameters (and as "
        "much again per gradient and optimizer moment), plus one unit whole while it runs: "
        f"more ranks shard it finer; {activations}"
    )


# ---------------------------------------------------------------------------------------------
# Building


def shards(strategy: str) -> bool:
    """Whether `strategy` shards the parameters in this process: fsdp and hybrid under a
    process group (at world size 1 too, under torchrun: one GPU runs every fsdp path). A run
    without a process group (python train.py) holds the whole model whatever the setting."""
    return strategy in SHARDED and distributed.in_group()


def parallelize(
    model: nn.Module,
    info: DistInfo,
    cfg: DistConfig,
    compile: bool = False,
    nvtx: bool = False,
) -> Parallel:
    """Wrap `model` (on this rank's device, the same weights on every rank) as dist.strategy
    says, then compile the result when `compile` is set. Under fsdp and hybrid only rank 0's
    model needs its values (on the host; the others' may be on the meta device): every rank
    gets its shards of rank 0's, as DDP gives every rank rank 0's weights."""
    strategy = cfg.strategy
    timer: AllReduceTimer | None = None
    mesh = None
    if shards(strategy):
        if info.device.type == "cpu":
            return_freed_host_memory(info)
        mesh = device_mesh(info, strategy)
        whole = sum(p.numel() * p.element_size() for p in model.parameters())
        # Rank 0's values, whole, from before sharding: the only copy of the whole model. The
        # other ranks' models may be on the meta device (build.build_model): shapes only.
        several = info.world_size > 1
        values = sharding.module_tensors(model) if info.is_main and several else None
        units = shard(model, mesh, cfg)
        if any(t.is_meta for t in sharding.module_tensors(model).values()):
            model.to_empty(device=info.device)  # this rank's shards, uninitialised
        if several:
            sharding.broadcast_module_from_main(model, values, info)
        del values
        mine = sum(sharding.local_tensor(p).numel() * p.element_size() for p in model.parameters())
        if info.is_main:
            # fully_shard subclassed them as FSDP<name>
            kinds = sorted({type(unit).__name__.removeprefix("FSDP") for unit in units})
            log.info(
                "dist.strategy=%s: mesh %s, %d units (%s) and the root; rank 0 holds %.1f of "
                "%.1f MB of parameters",
                strategy,
                tuple(mesh.shape),
                len(units),
                ", ".join(kinds),
                mine / 1e6,
                whole / 1e6,
            )
        wrapped: nn.Module = model
    else:
        whole = mine = sum(p.numel() * p.element_size() for p in model.parameters())
        wrapped = distributed.wrap_model(model, info, cfg, nvtx=nvtx)
        timer = getattr(wrapped, "allreduce_timer", None)
    _placed[:] = [Placement(strategy, info.world_size, whole, mine)]
    if compile:
        # Under fsdp each unit's forward is a frame of its own (FSDP's hooks break the graph),
        # so one block class meets several shapes (its stages' widths), and dynamo's second
        # compile of it makes the shapes symbolic, which Inductor's BatchNorm cannot lower
        # ("Cannot convert expression to float"): a static graph per shape instead.
        wrapped = torch.compile(wrapped, dynamic=False if mesh is not None else None)
    return Parallel(strategy=strategy, model=wrapped, bare=model, comm_timer=timer, mesh=mesh)


# glibc's mallopt parameter: allocations at least this large get their own mapping
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's initial value


def return_freed_host_memory(info: DistInfo) -> bool:
    """Under fsdp on CPU: keep glibc's mmap threshold at its initial 128 KiB, so that the
    blocks FSDP all-gathers and frees at every forward and backward go back to the system.

    glibc raises the threshold to the size of any mapped block freed (up to 32 MiB), after
    which such blocks come from the heap, where freed memory stays resident between live
    ones: fsdp's peak RSS then grows step after step, past ddp's; with the fixed threshold
    it stays below ddp's. The price is speed on CPU, every block above the threshold mapped
    and unmapped (BENCHMARKS.md, "Strategies"). A MALLOC_MMAP_THRESHOLD_ in the environment
    is left as the user set it.
    Returns whether the threshold was set."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(None)
        done = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES) == 1
    except (OSError, AttributeError):  # not glibc
        done = False
    if done and info.is_main:
        log.info(
            "fsdp on CPU: glibc's mmap threshold fixed at %d KiB (freed all-gather buffers "
            "return to the system)",
            _MMAP_THRESHOLD_BYTES // 1024,
        )
    return done


def device_mesh(info: DistInfo, strategy: str) -> DeviceMesh:
    """fsdp: one dimension over every rank. hybrid: (nodes, ranks per node), replicated over
    the first, sharded over the second. The device type is given explicitly: without it the
    mesh follows the accelerator, which on a GPU host with gloo moves the model to CUDA
    (pytorch#132471)."""
    if strategy == "fsdp":
        return init_device_mesh(info.device.type, (info.world_size,), mesh_dim_names=("shard",))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))
    if per_node < 1 or info.world_size % per_node:
        raise ConfigError(
            f"dist.strategy=hybrid needs the same number of ranks on every node: world size "
            f"{info.world_size} is not a multiple of LOCAL_WORLD_SIZE={per_node}"
        )
    if info.world_size == per_node and info.is_main:  # one node: nothing to replicate over
        log.warning(
            "dist.strategy=hybrid on one node (%d ranks) shards over all of them, as fsdp "
            "does: hybrid replicates across nodes, and there is one",
            per_node,
        )
    return init_device_mesh(
        info.device.type,
        (info.world_size // per_node, per_node),
        mesh_dim_names=("replicate", "shard"),
    )


def shard(model: nn.Module, mesh: DeviceMesh, cfg: DistConfig) -> list[nn.Module]:
    """fully_shard each unit `wrap_units` picks, then the root (the parameters left over: the
    stem, the classifier). Parameters stay fp32 and gradients are reduced in fp32: train.amp
    runs under autocast as with DDP (16-bit parameters would also put the norm layers' weights
    in 16 bits, which BatchNorm refuses beside its fp32 statistics)."""
    refuse_scalar_parameters(model)
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    units = wrap_units(model, cfg.fsdp_units)
    for group in tied_groups(model, units):
        fully_shard(
            group if len(group) > 1 else group[0],
            mesh=mesh,
            reshard_after_forward=cfg.reshard_after_forward,
            mp_policy=policy,
        )
    # The root: None lets FSDP2 keep its parameters gathered between forward and backward (its
    # backward starts at once), unless resharding is off altogether.
    root = None if cfg.reshard_after_forward else False
    fully_shard(model, mesh=mesh, reshard_after_forward=root, mp_policy=policy)
    return units


def refuse_scalar_parameters(model: nn.Module) -> None:
    """fully_shard refuses 0-dim parameters (a learned temperature or scale) with a traceback:
    said as a setting, naming them, before anything is sharded."""
    scalars = [name for name, p in model.named_parameters() if p.dim() == 0]
    if scalars:
        raise ConfigError(
            f"dist.strategy=fsdp cannot shard 0-dim parameters ({', '.join(scalars[:8])}): "
            "FSDP2 shards every parameter along dim 0. Make each a 1-dim tensor of one element "
            "(nn.Parameter(torch.ones(1))), or train with --dist.strategy=ddp"
        )


def tied_groups(model: nn.Module, units: list[nn.Module]) -> list[list[nn.Module]]:
    """`units` grouped so that units sharing a parameter (tied weights) are one FSDP group, as
    fully_shard requires ("use fully_shard([module_a, module_b])"); a unit sharing one with
    the rest of the model is left out, its parameters to the root. Each change is logged."""
    names = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
    prefixes = [names[id(unit)] + "." for unit in units]
    holders: dict[int, set[int]] = {}  # parameter -> units holding it (-1: the root)
    for name, p in model.named_parameters(remove_duplicate=False):
        held = [i for i, prefix in enumerate(prefixes) if name.startswith(prefix)]
        holders.setdefault(id(p), set()).add(held[0] if held else -1)
    group = list(range(len(units)))  # union-find over the units

    def find(i: int) -> int:
        while group[i] != i:
            i = group[i]
        return i

    for held in holders.values():
        tied = sorted(held - {-1})
        for i in tied[1:]:
            group[find(i)] = find(tied[0])
    # A unit sharing a parameter with the root goes to the root, and so does every unit tied
    # to it (wrapped alone, such a unit would hold a parameter of the root's: overlapping).
    to_root = {find(i) for held in holders.values() if -1 in held for i in held if i >= 0}
    dropped = {i for i in range(len(units)) if find(i) in to_root}
    groups: dict[int, list[nn.Module]] = {}
    for i, unit in enumerate(units):
        if i not in dropped:
            groups.setdefault(find(i), []).append(unit)
    if dropped:
        left = ", ".join(names[id(units[i])] for i in sorted(dropped))
        log.info("dist.strategy=fsdp: %s share parameters with the root: not units", left)
    for members in groups.values():
        if len(members) > 1:
            tied = ", ".join(names[id(m)] for m in members)
            log.info("dist.strategy=fsdp: %s share parameters: one unit", tied)
    return list(groups.values())


def wrap_units(model: nn.Module, setting: str) -> list[nn.Module]:
    """The modules FSDP shards as units, outermost first (each all-gathers its parameters for
    its own forward and backward, so a smaller unit means less memory at a time).

    auto: the instances of the module class, defined outside torch.nn and used at least twice,
    that holds the most parameters (MiniResNet's BasicBlock; torchvision's Bottleneck,
    EncoderBlock, CNBlock, InvertedResidual...); a model without one gets its direct children
    that have parameters. Otherwise a comma list of class names: every instance of those
    classes not inside another."""
    instances: dict[str, list[nn.Module]] = {}
    for module in model.modules():
        if module is not model:
            instances.setdefault(type(module).__name__, []).append(module)
    if setting == "auto":
        counts = {
            name: _outermost(mods)
            for name, mods in instances.items()
            if len(mods) >= 2
            and not type(mods[0]).__module__.startswith("torch.")
            and any(p.numel() for m in mods for p in m.parameters())
        }
        if counts:
            best = max(counts, key=lambda n: (sum(_numel(m) for m in counts[n]), len(counts[n])))
            return counts[best]
        return [child for child in model.children() if _numel(child)]
    names = [name.strip() for name in setting.split(",") if name.strip()]
    unknown = [name for name in names if name not in instances]
    if unknown:
        known = sorted(n for n, mods in instances.items() if any(_numel(m) for m in mods))
        raise ConfigError(
            f"dist.fsdp_units={setting}: the model has no module of class "
            f"{', '.join(unknown)}; its classes with parameters: {', '.join(known)}"
        )
    return _outermost([m for name in names for m in instances[name]])


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _outermost(modules: list[nn.Module]) -> list[nn.Module]:
    """The modules not inside another of `modules`, in their order."""
    inside: set[int] = set()
    for module in modules:
        for sub in module.modules():
            if sub is not module:
                inside.add(id(sub))
    return [m for m in modules if id(m) not in inside]

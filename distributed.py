"""Process-group lifecycle and the few collectives the pipeline needs.

This module talks to `torch.distributed`'s process group (`sharding.py` to its DTensors). Every
helper is a no-op when no process group exists (a plain `python train.py`), so callers never
branch on "am I distributed".
Every helper is a collective: all ranks must call it, in the same order (a collective called
under `if rank == 0` hangs the other ranks until the timeout).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

# Re-exported for train.py: wrapping the entry point makes torchrun report the failing rank's
# exception and traceback instead of a bare "exitcode 1".
from torch.distributed.elastic.multiprocessing.errors import record as record
from torch.nn.parallel import DistributedDataParallel

import exitcodes
from config import ConfigError, DistConfig

log = logging.getLogger(__name__)

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job. Built once by `setup`, then passed explicitly."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str | None = None  # None: single process, no process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"environment variable {name}={value!r} is not an integer") from None


def read_env() -> tuple[int, int, int] | None:
    """(rank, local_rank, world_size) from torchrun's variables, or None outside torchrun."""
    present = [name for name in _TORCHRUN_VARS if name in os.environ]
    if not present:
        return None
    if len(present) != len(_TORCHRUN_VARS):
        missing = sorted(set(_TORCHRUN_VARS) - set(present))
        raise RuntimeError(
            f"incomplete launcher environment: {', '.join(present)} set but {', '.join(missing)} "
            "missing; launch with torchrun (or unset them to run a single process)"
        )
    rank, local_rank, world_size = _env_int("RANK"), _env_int("LOCAL_RANK"), _env_int("WORLD_SIZE")
    if not (0 <= rank < world_size and local_rank >= 0):
        raise RuntimeError(
            f"inconsistent launcher environment: RANK={rank} LOCAL_RANK={local_rank} "
            f"WORLD_SIZE={world_size}"
        )
    return rank, local_rank, world_size


def collective_grace_s(timeout_s: float) -> float:
    """Extra time a rank waiting in a collective gets over one doing its own work.

    A rank stuck in its own work (data loading) is aborted by its watchdog after
    dist.timeout_s; the ranks waiting for it in a collective time out only this grace later
    (the process group's timeout is timeout_s + grace), so the stuck rank fails first and is
    what torchrun's summary names as the root cause.
    """
    return max(5.0, 0.1 * timeout_s)


def _attempt_store(timeout: timedelta) -> dist.Store | None:
    """Under torchrun's shared rendezvous store on one node, a store namespaced by attempt.

    torchrun (c10d rendezvous) keeps one TCPStore for all restarts of a job and env://
    writes the process group's keys into it without an attempt prefix, so a restarted group
    can read the dead workers' addresses and fail in gloo's connectFullMesh ("Connection
    refused"). Our launchers set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a fresh store per
    rendezvous round), which fixes it everywhere. For plain torchrun on one node the attempt
    number (TORCHELASTIC_RESTART_COUNT, the same for all its workers) is a safe prefix; across
    nodes the agents' counts can differ, so there only the environment variable helps.
    None: use env:// as it is.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    if os.environ.get("LOCAL_WORLD_SIZE") != os.environ.get("WORLD_SIZE"):
        if os.environ.get("RANK") == "0":
            log.warning(
                "torchrun shares its rendezvous store across restarts: a restarted multi-node "
                "group may fail to connect. Set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for "
                "torchrun (scripts/launch_multinode.sh does)"
            )
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    client = dist.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=_env_int("MASTER_PORT"),
        is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(f"train/attempt_{attempt}/", client)


def setup(cfg: DistConfig, backend: str) -> DistInfo:
    """Join the process group described by torchrun's environment (or run alone without one),
    with `backend` as `auto.backend` resolved dist.backend."""
    env = read_env()
    if env is None:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return DistInfo(rank=0, local_rank=0, world_size=1, device=device)
    rank, local_rank, world_size = env
    device = torch.device("cpu")
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK={local_rank} but this host has only "
                f"{torch.cuda.device_count()} CUDA devices: lower --nproc_per_node"
            )
        device = torch.device("cuda", local_rank)
        # Before init_process_group: NCCL binds its communicator to the current device, and
        # without this every rank would create a context on GPU 0.
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=cfg.timeout_s + collective_grace_s(cfg.timeout_s))
    store = _attempt_store(timeout)
    dist.init_process_group(
        backend=backend,
        init_method=None if store is not None else "env://",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    return DistInfo(
        rank=rank, local_rank=local_rank, world_size=world_size, device=device, backend=backend
    )


def teardown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def active() -> bool:
    """A process group with more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def in_group() -> bool:
    """A process group, of any size (torchrun with one worker makes one of one rank)."""
    return dist.is_available() and dist.is_initialized()


def barrier(info: DistInfo) -> None:
    if not active():
        return
    if info.backend == "nccl":
        dist.barrier(device_ids=[info.local_rank])
    else:
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over ranks, in place, and return it."""
    if active():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


class PeerError(RuntimeError):
    """Work failed on another rank; that rank's own error says why. `exit_code` is 2 when
    every failure was bad input (so that all ranks exit alike), else 1."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# How a collective fails when another rank is gone: gloo raises plain RuntimeErrors
# (third_party/gloo/gloo/transport/tcp/pair.cc: "Connection reset by peer", "Connection closed
# by peer"); NCCL and the store raise errors of their own types.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
_PEER_GONE_TYPES = tuple(
    getattr(dist, name) for name in ("DistBackendError", "DistNetworkError") if hasattr(dist, name)
)
PEER_GRACE_S = 1.0
# gloo names the address whose connection broke (pair.cc): "Connection closed by peer
# [10.0.0.2]:41234", "Read error [10.0.0.2]:41234: Connection reset by peer"
_PEER_ADDRESS = re.compile(r"\[([0-9a-fA-F.:]+)\]:\d+")
# Every rank's host and addresses, as preflight gathered them (`know_peers`): a broken
# connection is then named by the node at its other end, not only by rank 0's own error.
_peers: list[dict[str, Any]] = []


def know_peers(records: list[dict[str, Any]]) -> None:
    """Remember who the ranks are: each record a rank's "rank", "host" and "addresses"."""
    _peers[:] = records


def broken_peer(error: BaseException) -> str | None:
    """Which node a collective's broken connection led to, from gloo's message and the ranks
    preflight met; None when the error names no address."""
    found = _PEER_ADDRESS.search(str(error))
    if found is None:
        return None
    address, me = found[1], int(os.environ.get("RANK", "0"))
    there = [r for r in _peers if address in r.get("addresses", ()) and r["rank"] != me]
    if not there:
        return f"the connection to {address} broke"
    hosts = ", ".join(sorted({str(r["host"]) for r in there}))
    ranks = ", ".join(str(r["rank"]) for r in sorted(there, key=lambda r: r["rank"]))
    return (
        f"the connection to {address} ({hosts}: rank {ranks}) broke: that rank failed first "
        "or is gone, and its own log names the root cause"
    )


def caused_by_a_peer(error: BaseException) -> bool:
    """Whether `error` is another rank's failure seen from here: PeerError, or a collective
    whose peer is gone."""
    if isinstance(error, (PeerError, *_PEER_GONE_TYPES)):
        return True
    return any(text in str(error) for text in _PEER_GONE)


def outlive_the_root_cause(error: BaseException) -> None:
    """Before a rank exits on another rank's failure, give the launcher time to see that rank
    end first. torchrun's "failed (exitcode: ..) local_rank: .." line names one failure: the
    smallest timestamp, in whole seconds, among the ranks it found ended at one poll
    (elastic/multiprocessing/api.py, `_poll`), every 0.1 s (run.py, --monitor-interval). A rank
    SIGKILLed and the peer whose collective broke with it ended within one poll, tied, and
    torchrun named the peer's "Connection closed by peer" (a CI run, 2026-11-26). The wait
    runs out in full (train.py's early handlers take torchrun's SIGTERM once training has
    given the stop signals back): a second more before a restart."""
    if active() and caused_by_a_peer(error):
        where = broken_peer(error)
        log.error(
            "another rank failed or is gone (%s%s): exiting in %.0f s, so that the launcher "
            "reports that rank's failure first",
            type(error).__name__,
            f": {where}" if where else "",
            PEER_GRACE_S,
        )
        time.sleep(PEER_GRACE_S)


def is_bad_input(error: BaseException) -> bool:
    """Errors that retrying cannot fix (train.py exits 2 for them): a config, file or
    checkpoint the user gave. Exception classes say so with `exit_code = 2`."""
    if isinstance(error, OSError):  # by errno: ESTALE mid-run is retryable (exitcodes.py)
        return exitcodes.exit_for_os_error(error) == exitcodes.EXIT_BAD_INPUT
    return getattr(error, "exit_code", None) == 2 or isinstance(error, ConfigError)


def raise_if_any_failed(info: DistInfo, error: BaseException | None, what: str) -> None:
    """Collective: every rank learns whether `what` failed on any rank, and all of them raise.

    Use it after work that only some ranks do (rank 0 saving, local rank 0 preparing data)
    instead of a bare barrier: a failing rank would otherwise leave the others waiting in the
    barrier until the timeout.
    """
    if not active():  # alone: no one to tell (and no tensor to build on every save)
        if error is not None:
            raise error
        return
    failed = error is not None
    transient = failed and _exit_code_of(error) == exitcodes.EXIT_IO
    flags = [float(failed), float(failed and is_bad_input(error)), float(transient)]
    counts = all_reduce_sum(torch.tensor(flags, device=info.device)).tolist()
    num_failed, num_bad_input, num_transient = (int(v) for v in counts)
    if error is not None:
        raise error
    if num_failed:
        code = 2 if num_bad_input == num_failed else 1
        raise PeerError(
            f"{what} failed on {num_failed} other rank(s); see their errors",
            exit_code=exitcodes.EXIT_IO if num_transient == num_failed else code,
        )


def _exit_code_of(error: BaseException) -> int | None:
    """The exit code an error asks for: by errno for an OSError, else its `exit_code`."""
    if isinstance(error, OSError):
        return exitcodes.exit_for_os_error(error)
    return getattr(error, "exit_code", None)


def run_on_main(info: DistInfo, what: str, fn: Callable[[], None], per_node: bool = False) -> None:
    """Collective: run `fn` on rank 0 only (or on local rank 0 of each node with `per_node`),
    then raise on every rank if it failed anywhere."""
    leader = info.local_rank == 0 if per_node else info.is_main
    error: Exception | None = None
    if leader:
        try:
            fn()
        except Exception as err:  # re-raised on this rank by raise_if_any_failed
            error = err
    raise_if_any_failed(info, error, what)


class PrepareTimeout(PeerError):
    """Waited longer than the configured bound for other ranks' preparation work."""


def run_on_node_leaders_bounded(
    info: DistInfo,
    what: str,
    fn: Callable[[], None],
    timeout_s: float,
    setting: str,
    progress_every_s: float = 30.0,
) -> None:
    """Collective: like `run_on_main(per_node=True)`, for work that may outlast dist.timeout_s
    (a dataset download): local rank 0 of each node runs `fn`, and every rank then waits for
    all of them up to `timeout_s` (`setting` names that bound in messages), not up to the
    process group's timeout.

    The wait is an all-reduce of the failure flag on a gloo group whose own timeout is the
    bound plus a grace, started asynchronously and polled: the waiting ranks log progress,
    and past the bound fail with a message naming the work and the ranks doing it.
    """
    if not active():
        run_on_main(info, what, fn, per_node=True)
        return
    doers = _node_leaders(info)
    grace = collective_grace_s(timeout_s)
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s + grace))
    error: Exception | None = None
    if info.local_rank == 0:
        try:
            fn()
        except Exception as err:  # re-raised on this rank after the others learn of it
            error = err
    flag = torch.tensor([float(error is not None)])
    work = dist.all_reduce(flag, op=dist.ReduceOp.SUM, group=group, async_op=True)
    _wait_bounded(info.rank, work, f"{what} by {doers}", timeout_s, setting, progress_every_s)
    work.wait()
    num_failed = int(flag.item())
    if error is not None:
        raise error
    if num_failed:
        raise PeerError(f"{what} failed on {num_failed} other rank(s); see their errors")


def _node_leaders(info: DistInfo) -> str:
    """Collective: the ranks that are local rank 0 of a node, with their hosts, for messages."""
    hosts = all_gather_object((info.local_rank, socket.gethostname()))
    leaders = [r for r, (local_rank, _) in enumerate(hosts) if local_rank == 0]
    return ", ".join(f"rank {r} (local rank 0 on {hosts[r][1]})" for r in leaders)


def _wait_bounded(
    rank: int, work: dist.Work, waiting_for: str, timeout_s: float, setting: str, every_s: float
) -> None:
    """Poll `work` until it completes, logging progress every `every_s`; past `timeout_s`,
    PrepareTimeout naming what it waits for (the work and the ranks doing it) and `setting`."""
    started = time.monotonic()
    next_report = started + every_s
    while not work.is_completed():
        waited = time.monotonic() - started
        if waited > timeout_s:
            raise PrepareTimeout(
                f"rank {rank} waited {waited:.0f} s for {waiting_for}, longer than "
                f"{setting}={timeout_s:g}: the preparation is too slow (a slow download?) or "
                f"stuck. Raise {setting}, or prepare the data beforehand"
            )
        if time.monotonic() >= next_report:
            log.warning(
                "rank %d: still waiting for %s (%.0f s of %s=%g)",
                rank,
                waiting_for,
                waited,
                setting,
                timeout_s,
            )
            next_report += every_s
        time.sleep(0.1)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s `obj` on every rank.

    Objects are pickled on the wire, like everything in the c10d store: the cluster network
    must be trusted.
    """
    if not active():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def all_gather_floats(values: list[float], device: torch.device) -> list[list[float]]:
    """Every rank's `values` (the same length on each), in rank order: one all-gather."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    if not active():
        return [values]
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [t.tolist() for t in out]


def all_gather_object(obj: Any) -> list[Any]:
    if not active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if active() else 0


def broadcast_coalesced(tensors: list[torch.Tensor], src: int = 0) -> None:
    """Give every rank `src`'s values of `tensors`, in place: one broadcast per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for group in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        dist.broadcast(flat, src=src)
        offset = 0
        for t in group:
            t.detach().copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def any_rank(flag: bool, device: torch.device) -> bool:
    """Collective: whether `flag` is true on at least one rank."""
    if not active():
        return flag
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


class AllReduceTimer:
    """A DDP communication hook around the default (or compressing) all-reduce that records,
    per optimizer step, when the first gradient bucket was handed to the all-reduce (this
    rank's arrival) and how long the buckets' all-reduces took from first start to last end.

    On gloo the completion callback runs when the all-reduce has finished; on NCCL it runs
    when the work is done on the stream as seen from the host, so treat those figures as
    approximate.
    """

    def __init__(self, inner: Any | None = None, nvtx: bool = False) -> None:
        self.inner = inner or default_hooks.allreduce_hook
        self.nvtx = nvtx  # a range per bucket, from its hand-over to its completion callback
        self.first_start: float | None = None
        self.last_end = 0.0

    # Registered as the bound method. No annotations: DDP's register_comm_hook rejects any but
    # its own classes, and with postponed evaluation every annotation here is a string.
    def hook(self, state, bucket):  # noqa: ANN001, ANN201
        now = time.perf_counter()
        if self.first_start is None:
            self.first_start = now

        span = None
        if self.nvtx:
            span = torch.cuda.nvtx.range_start(f"gradient all-reduce, bucket {bucket.index()}")

        def done(fut: torch.futures.Future) -> torch.Tensor:
            self.last_end = time.perf_counter()
            if span is not None:
                torch.cuda.nvtx.range_end(span)
            return fut.value()

        return self.inner(state, bucket).then(done)

    def take(self) -> tuple[float | None, float]:
        """(time of this step's first bucket, seconds of all-reduce) and reset."""
        first = self.first_start
        span = self.last_end - first if first is not None and self.last_end > first else 0.0
        self.first_start = None
        return first, span


def wrap_model(
    model: nn.Module, info: DistInfo, cfg: DistConfig | None = None, nvtx: bool = False
) -> nn.Module:
    """DistributedDataParallel around `model` when there is more than one rank, with the
    bucket, view, static-graph, unused-parameter and gradient-compression settings of `cfg`, and an
    `AllReduceTimer` as its communication hook (`model.allreduce_timer`)."""
    if info.world_size == 1:
        return model
    cfg = cfg or DistConfig()
    device_ids = [info.local_rank] if info.device.type == "cuda" else None
    ddp = DistributedDataParallel(
        model,
        device_ids=device_ids,
        bucket_cap_mb=cfg.bucket_cap_mb,
        gradient_as_bucket_view=cfg.gradient_as_bucket_view,
        static_graph=cfg.static_graph,
        find_unused_parameters=cfg.find_unused_parameters,
    )
    compression = {
        "none": None,
        "fp16": default_hooks.fp16_compress_hook,
        "bf16": default_hooks.bf16_compress_hook,
    }[cfg.grad_compression]
    timer = AllReduceTimer(compression, nvtx)
    ddp.register_comm_hook(state=None, hook=timer.hook)
    ddp.allreduce_timer = timer
    return ddp


def unwrap_model(model: nn.Module) -> nn.Module:
    """The bare module under DDP and torch.compile wrappers (clean state_dict keys)."""
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def average_buffers(model: nn.Module) -> None:
    """Average floating-point buffers (BatchNorm running statistics) over ranks, in place.

    DDP broadcasts rank 0's buffers at the start of each forward, then each rank updates its
    own copy from its own shard, so after the last step the ranks disagree slightly. Averaging
    before evaluation makes every rank evaluate the same model (the epoch-end checkpoint, taken
    after evaluation, then holds the averaged statistics). A module held in eval mode (a frozen
    group's BatchNorm, optim.param_groups) updates no statistics: its buffers agree on every
    rank already, and (x + x + x) / 3 need not give x back, so they are left alone.
    """
    if not active():
        return
    modules = [m for m in unwrap_model(model).modules() if m.training]
    buffers = [b for m in modules for b in m.buffers(recurse=False) if b.is_floating_point()]
    if not buffers:
        return
    flat = torch.cat([b.detach().reshape(-1).float() for b in buffers])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= dist.get_world_size()
    offset = 0
    for b in buffers:
        b.copy_(flat[offset : offset + b.numel()].view_as(b))
        offset += b.numel()

"""Asynchronous checkpoints: the write happens in a separate process, not in a thread.

A writer thread shares the training process's interpreter lock: pickling and checksumming a
checkpoint in it slowed training down by more than a synchronous save cost (the benchmark's
`async_checkpoint_stall_ratio` measured 1.73). Here training only copies its tensors into
shared-memory buffers (allocated at the first save and reused by every later one) and sends
the plain rest of the state over a socket; a child process runs `storage.save` on them, with
every guarantee a synchronous save has (atomic, fsynced, manifest last, pruning after), and
the same tensors, strides and storages as the synchronous save writes.

The writer process:
- is a fresh interpreter (`python -c`, not `multiprocessing`): nothing of the training
  process is forked (it runs gloo/NCCL threads) and, unlike multiprocessing's `spawn`, the
  user's main script is not run again in it;
- gets each buffer as an anonymous shared-memory file (memfd) passed over a Unix socket
  (SCM_RIGHTS). Both processes map it and close the descriptor: no file descriptor stays open
  per tensor (torch.multiprocessing's file_descriptor strategy keeps one per storage in both
  processes, past a default limit of 1024 for a ResNet-50 with AdamW), nothing is named in
  /dev/shm (a container's is 64 MiB by default), and nothing outlives the two processes;
- ignores the signals a cluster sends every process of a job (SIGTERM, SIGINT, SIGUSR1/2,
  SIGHUP), from its first instruction (they are blocked when it starts): the training
  process decides what a preemption means, and a write in flight is finished, not torn;
- dies with the training process (PR_SET_PDEATHSIG), and ends when the socket closes, so a
  killed job leaves no writer behind; an interrupted write leaves a temporary file that the
  next save removes, never a file under a checkpoint's name without its manifest;
- answers each write with its outcome; `wait()` raises a failed write's error in the
  training process, and a writer that died (killed, out of memory) is a failed write that
  names its exit signal.

Host memory: the buffers hold one copy of the checkpointed tensors for the life of the run
(the thread-based saver allocated the same copy at every save).
"""

from __future__ import annotations

import ctypes
import importlib
import json
import logging
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

import exitcodes
from ckpt import storage

log = logging.getLogger(__name__)

# "module:function" run first in every writer process: a test entry point installs its fault
# injection there (tests/faults.py). The module is imported from the training process's
# sys.path.
child_setup: str | None = None

# What a cluster sends every process of a job to stop it (loader workers ignore the same set)
_IGNORED_SIGNALS = exitcodes.LOADER_IGNORED_SIGNALS
_PR_SET_PDEATHSIG = 1
_FDS_PER_MESSAGE = 250  # the kernel's SCM_MAX_FD is 253
_HEADER = struct.Struct("!QI")  # payload bytes, descriptors
_REPO = Path(__file__).resolve().parents[1]
# Where a shared buffer goes in a message: not storage's own "__tensor__", which a sharded
# checkpoint's meta holds as data
_MARKER = "__shared_buffer__"


class WriterDied(RuntimeError):
    """The writer process ended before reporting the write it was given (killed, out of
    memory): a failed save that a restart may not meet again, so not bad input."""


class ProcessSaver:
    """Writes checkpoints (`storage.save`) in a child process; training stalls only for the
    copy into shared memory.

    At most one write is in flight: `save` first waits for the previous one. A failed write
    is re-raised by the next `save` or `wait`, so no error is lost.
    """

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        command = [
            sys.executable,
            "-c",
            f"import sys; sys.path.insert(0, {str(_REPO)!r}); import ckpt.writer as w; w._main()",
            str(theirs.fileno()),
            str(os.getpid()),
            json.dumps(sys.path),
            child_setup or "",
        ]
        # Blocked from the start (the mask survives exec): a preemption signal that arrives
        # while the writer imports torch stays pending, and the writer discards it once it
        # ignores these signals. This thread only: the training process's other threads still
        # take such a signal, and one pending here is delivered when the mask is restored.
        ignored = set(_IGNORED_SIGNALS)
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, ignored)
        try:
            self._process = subprocess.Popen(command, pass_fds=(theirs.fileno(),))
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
            theirs.close()
        self._socket = ours
        self._buffers: dict[str, torch.Tensor] = {}
        self._in_flight: tuple[int, float] | None = None  # (step, when it was handed over)

    @property
    def pid(self) -> int:
        return self._process.pid

    def save(
        self,
        state: dict[str, Any],
        directory: Path,
        step: int,
        keep: int,
        accuracy: float | None,
    ) -> None:
        """Copy `state`'s tensors to the writer's buffers and hand `storage.save` over."""
        self._hand_over(state, ("save", str(directory), step, keep, accuracy), step)

    def write_sharded(self, plan: storage.ShardedSave) -> None:
        """Copy this rank's pieces of a sharded checkpoint to the buffers and hand their
        files over (`storage.write_sharded`); `wait()` returns what was written."""
        payloads = {label: payload for label, (_, payload) in plan.files.items()}
        paths = {label: str(path) for label, (path, _) in plan.files.items()}
        self._hand_over(payloads, ("sharded", str(plan.folder), plan.step, paths), plan.step)

    def busy(self) -> bool:
        """Whether the write in flight has not answered yet (never blocks)."""
        if self._in_flight is None:
            return False
        readable, _, _ = select.select([self._socket], [], [], 0)
        return not readable

    def _hand_over(self, state: dict[str, Any], job: tuple[Any, ...], step: int) -> None:
        self.wait()
        skeleton, leaves = storage._flatten(state, _MARKER)
        names: list[str] = []
        layouts: list[tuple[str, str, list[int], list[int], int]] = []
        fds: list[int] = []
        kept: dict[str, torch.Tensor] = {}
        try:
            for name, tensor in leaves:
                value = tensor.detach()
                buffer = self._buffers.get(name)
                if buffer is None or not _same_layout(buffer, value):
                    layout = _layout(name, value)
                    fd = _memfd(layout, name)
                    fds.append(fd)
                    buffer = _mapped(fd, layout)
                    layouts.append(layout)
                buffer.copy_(value)
                kept[name] = buffer
                names.append(name)
            self._buffers = kept
            try:
                _send(self._socket, (skeleton, names, layouts, job), fds)
            except OSError as err:
                raise self._died(step) from err
        finally:
            for fd in fds:  # the mapping stays; the writer holds its own
                os.close(fd)
        self._in_flight = (step, time.monotonic())

    def wait(self) -> Any:
        """Block until the write in flight (if any) is on disk and return what it reported
        (a checkpoint's path; a sharded one's {file: {"bytes", "crc32"}}); raise its error if
        it failed."""
        if self._in_flight is None:
            return None
        step, handed = self._in_flight
        self._in_flight = None
        try:
            outcome, detail = _receive(self._socket)[0]
        except (OSError, EOFError) as err:
            raise self._died(step) from err
        if outcome == "error":
            raise detail
        log.info(
            "wrote the step %d checkpoint%s in the background (%.2f s after it was handed over)",
            step,
            f" {detail}" if isinstance(detail, str) else "'s shards",
            time.monotonic() - handed,
        )
        return detail

    def close(self) -> None:
        """Finish the write in flight, then stop the writer process (idempotent)."""
        try:
            self.wait()
        finally:
            if self._process.poll() is None:
                try:
                    self._socket.shutdown(socket.SHUT_WR)  # the writer's recv ends: it exits
                    self._process.wait(timeout=30)
                except (OSError, subprocess.TimeoutExpired):
                    self._process.kill()
                    self._process.wait()
            self._socket.close()
            self._buffers = {}

    def _died(self, step: int) -> WriterDied:
        try:
            code = self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        if code is not None and code < 0:
            how = f"killed by {signal.Signals(-code).name}"
        else:
            how = f"exit code {code}"
        return WriterDied(
            f"the checkpoint writer process ({how}) died before the step {step} checkpoint "
            "was written; the previous checkpoints are untouched"
        )


def _same_layout(buffer: torch.Tensor, value: torch.Tensor) -> bool:
    return (
        buffer.shape == value.shape
        and buffer.dtype == value.dtype
        and buffer.stride() == value.stride()
    )


def _layout(name: str, value: torch.Tensor) -> tuple[str, str, list[int], list[int], int]:
    """(name, dtype, shape, strides, elements of storage) of the buffer for `value`: its own
    strides where it is dense (channels_last stays channels_last), else contiguous ones."""
    probe = torch.empty_like(value, device="meta")  # keeps dense strides, packs the rest
    shape, stride = list(probe.shape), list(probe.stride())
    span = (
        1 + sum((n - 1) * st for n, st in zip(shape, stride, strict=True)) if probe.numel() else 0
    )
    return name, str(value.dtype).removeprefix("torch."), shape, stride, span


def _memfd(layout: tuple[str, str, list[int], list[int], int], name: str) -> int:
    _, dtype, _, _, span = layout
    size = span * getattr(torch, dtype).itemsize
    fd = os.memfd_create("checkpoint", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
    except OSError as err:
        os.close(fd)
        raise OSError(
            err.errno,
            f"cannot allocate {size} bytes of shared memory for {name.lstrip('/')} "
            f"(ckpt.async_save): {err.strerror}",
        ) from err
    return fd


def _mapped(fd: int, layout: tuple[str, str, list[int], list[int], int]) -> torch.Tensor:
    _, dtype, shape, stride, span = layout
    flat = torch.from_file(
        f"/proc/self/fd/{fd}", shared=True, size=span, dtype=getattr(torch, dtype)
    )
    return flat.as_strided(shape, stride)


def _send(sock: socket.socket, message: Any, fds: list[int]) -> None:
    """One message: its header, the descriptors (at most 250 a chunk, each chunk one marker
    byte), the pickled payload. Pickle is safe here: both ends are this pipeline."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    header = _HEADER.pack(len(payload), len(fds))
    if not fds:  # every save after the first: one system call
        sock.sendall(header + payload)
        return
    sock.sendall(header)
    for first in range(0, len(fds), _FDS_PER_MESSAGE):
        socket.send_fds(sock, [b"F"], fds[first : first + _FDS_PER_MESSAGE])
    sock.sendall(payload)


def _receive(sock: socket.socket) -> tuple[Any, list[int]]:
    """(message, descriptors) of the next `_send`; EOFError when the other end closed."""
    fds: list[int] = []
    header = _read(sock, _HEADER.size, fds)
    size, count = _HEADER.unpack(header)
    markers = -(-count // _FDS_PER_MESSAGE)
    _read(sock, markers, fds)
    payload = _read(sock, size, fds)
    if len(fds) != count:
        for fd in fds:
            os.close(fd)
        raise OSError(f"expected {count} descriptors from the other process, got {len(fds)}")
    return pickle.loads(payload), fds


def _read(sock: socket.socket, size: int, fds: list[int]) -> bytes:
    """Exactly `size` bytes, collecting any descriptors that come with them."""
    chunks, got = [], 0
    while got < size:
        data, received, _, _ = socket.recv_fds(sock, size - got, _FDS_PER_MESSAGE)
        if not data:
            raise EOFError("the other process closed the socket")
        chunks.append(data)
        fds.extend(received)
        got += len(data)
    return b"".join(chunks)


def _die_with_parent(parent: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the socket's end below still stops it
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _portable(err: BaseException) -> BaseException:
    """`err` if it survives pickling, else a RuntimeError with its message."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")


def _main() -> None:
    """The writer process: `python -c ... FD PARENT_PID SYS_PATH SETUP`."""
    ignored = set(_IGNORED_SIGNALS)
    for signum in ignored:
        signal.signal(signum, signal.SIG_IGN)  # discards what arrived while blocked
    signal.pthread_sigmask(signal.SIG_UNBLOCK, ignored)
    fd, parent, path, setup = sys.argv[1:5]
    _die_with_parent(int(parent))
    parent_path = json.loads(path)
    sys.path[:] = [*parent_path, *(p for p in sys.path if p not in parent_path)]
    torch.set_num_threads(1)
    if setup:
        module, function = setup.split(":")
        getattr(importlib.import_module(module), function)()
    _serve(socket.socket(fileno=int(fd)))


def _serve(sock: socket.socket) -> None:
    """One `storage.save` per message, each answered with its outcome."""
    buffers: dict[str, torch.Tensor] = {}
    while True:
        try:
            message, fds = _receive(sock)
        except (EOFError, OSError):
            return  # the training process closed the socket, or is gone
        skeleton, names, layouts, job = message
        for layout, fd in zip(layouts, fds, strict=True):
            buffers[layout[0]] = _mapped(fd, layout)
            os.close(fd)
        buffers = {name: buffers[name] for name in names}
        try:
            tensors = {index: buffers[name] for index, name in enumerate(names)}
            state = storage._unflatten(skeleton, tensors, _MARKER)
            reply: Any = ("ok", _run(job, state))
        except BaseException as err:  # reported to the training process, which decides
            reply = ("error", _portable(err))
        _send(sock, reply, [])


def _run(job: tuple[Any, ...], state: dict[str, Any]) -> Any:
    if job[0] == "save":
        _, directory, step, keep, accuracy = job
        return str(storage.save(state, Path(directory), step, keep, accuracy))
    _, folder, step, paths = job
    files = {label: (Path(paths[label]), payload) for label, payload in state.items()}
    return storage.write_sharded(storage.ShardedSave(Path(folder), step, files))

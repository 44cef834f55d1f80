"""Asynchronous checkpoints: the write happens in a separate process, not in a thread.

A writer thread shares the training process's interpreter lock: pickling and checksumming a
checkpoint in it slowed training down by more than a synchronous save cost (the benchmark's
`async_checkpoint_stall_ratio`; BENCHMARKS.md, "Checkpoints"). Here training only copies its
tensors into shared-memory buffers (allocated at the first save and reused by every later one)
and sends the plain rest of the state over a socket; a child process runs `single.save` on
them, with every guarantee a synchronous save has (atomic, fsynced, manifest last, pruning
after, the run dir's fence checked before each write and deletion: each job carries the
training process's, ckpt/fence.py), and the same tensors and strides as the synchronous save
writes.

The writer process is a fresh interpreter (nothing of the training process is forked); it
gets the buffers as memfds over a Unix socket, a batch at a time; it ignores the signals a
cluster sends every process of a job and dies with the training process; it answers each
write with its outcome, and a writer that died is a failed write naming its signal. Why each
of these, and the host memory the buffers hold: docs/checkpoints.md.
"""

from __future__ import annotations

import ctypes
import functools
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
import weakref
from pathlib import Path
from typing import Any

import torch

import exitcodes
from ckpt import fence, sharded, single

log = logging.getLogger(__name__)

# "module:function" run first in every writer process: a test entry point installs its fault
# injection there (tests/faults.py). The module is imported from the training process's
# sys.path.
child_setup: str | None = None

# What a cluster sends every process of a job to stop it (loader workers ignore the same set)
_IGNORED_SIGNALS = exitcodes.LOADER_IGNORED_SIGNALS
_PR_SET_PDEATHSIG = 1
_FDS_PER_MESSAGE = 64  # a batch (the kernel's SCM_MAX_FD is 253): few open at once
_HEADER = struct.Struct("!QI")  # payload bytes, descriptors
_REPO = Path(__file__).resolve().parents[1]
# Where a shared buffer goes in a message: not sharded.flatten's own "__tensor__", which a sharded
# checkpoint's meta holds as data
_MARKER = "__shared_buffer__"


class WriterDied(RuntimeError):
    """The writer process ended before reporting the write it was given (killed, out of
    memory): a failed save that a restart may not meet again, so not bad input."""


Layout = tuple[str, list[int], list[int], int]  # dtype, shape, strides, elements of storage


class ProcessSaver:
    """Writes checkpoints (`single.save`) in a child process; training stalls only for the
    copy into shared memory.

    At most one write is in flight: `save` first waits for the previous one. A failed write
    is re-raised by the next `save` or `wait`, so no error is lost. `signals`: more signals
    for the writer to ignore (run.preempt_signals), beyond those a cluster sends.
    """

    def __init__(self, signals: tuple[int, ...] = ()) -> None:
        # Blocked from the start (the mask survives exec): a preemption signal that arrives
        # while the writer imports torch stays pending, and the writer discards it once it
        # ignores these signals. This thread only: the training process's other threads still
        # take such a signal, and one pending here is delivered when the mask is restored.
        self._ignored = sorted(set(_IGNORED_SIGNALS) | set(signals))
        self._buffers: list[torch.Tensor] = []  # by leaf index: what the writer has mapped
        self._signatures: list[tuple[Any, ...]] = []  # (dtype, shape, strides) each was made for
        self._in_flight: tuple[int, float] | None = None  # (step, when it was handed over)
        self._start()

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        command = [
            sys.executable,
            "-c",
            f"import sys; sys.path.insert(0, {str(_REPO)!r}); import ckpt.writer as w; w._main()",
            str(theirs.fileno()),
            str(os.getpid()),
            json.dumps(sys.path),
            child_setup or "",
            json.dumps([int(signum) for signum in self._ignored]),
        ]
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, self._ignored)
        try:
            self._process = subprocess.Popen(command, pass_fds=(theirs.fileno(),))
        except BaseException:
            ours.close()
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
            theirs.close()
        self._socket = ours
        self._buffers, self._signatures = [], []

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
        """Copy `state`'s tensors to the writer's buffers and hand `single.save` over."""
        self._hand_over(state, ("save", str(directory), step, keep, accuracy), step)

    def write_sharded(self, plan: sharded.ShardedSave) -> None:
        """Copy this rank's pieces of a sharded checkpoint to the buffers and hand their
        files over (`sharded.write_sharded`); `wait()` returns what was written."""
        payloads = {label: payload for label, (_, payload) in plan.files.items()}
        paths = {label: str(path) for label, (path, _) in plan.files.items()}
        self._hand_over(payloads, ("sharded", str(plan.folder), plan.step, paths), plan.step)

    def busy(self) -> bool:
        """Whether the write in flight has not answered yet (never blocks)."""
        if self._in_flight is None:
            return False
        poller = select.poll()  # not select.select: it refuses descriptors past 1023
        poller.register(self._socket, select.POLLIN)
        return not poller.poll(0)

    def _hand_over(self, state: dict[str, Any], job: tuple[Any, ...], step: int) -> None:
        """New buffers for tensors whose layout is new (their descriptors sent in chunks, each
        mapped and closed by the writer before the next: a few hundred open at most, however
        many tensors), the values copied in, then the job."""
        self.wait()
        if self._process.poll() is not None:  # died since, or after a broken exchange
            code = self._process.returncode
            log.warning(
                "the checkpoint writer process had ended (%s): starting a new one",
                f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}",
            )
            self._socket.close()
            self._start()
        skeleton, leaves = sharded.flatten(state, _MARKER)
        values = [tensor for _, tensor in leaves]  # copied under no_grad: no detach needed
        signatures = [(v.dtype, v.shape, v.stride()) for v in values]
        buffers = self._buffers[: len(values)]
        buffers += [torch.empty(0)] * (len(values) - len(buffers))
        known = self._signatures
        fresh = [
            (index, _layout(value))
            for index, value in enumerate(values)
            if index >= len(known) or known[index] != signatures[index]
        ]
        sent = False
        try:
            for first in range(0, len(fresh), _FDS_PER_MESSAGE):
                chunk = fresh[first : first + _FDS_PER_MESSAGE]
                fds: list[int] = []
                try:
                    for index, layout in chunk:
                        fd = _memfd(layout, leaves[index][0]) if layout[3] else None
                        if fd is not None:
                            fds.append(fd)
                        buffers[index] = _mapped(fd, layout)
                    sent = True
                    _send(self._socket, ("buffers", chunk), fds)
                finally:
                    for fd in fds:  # the mapping stays; the writer maps its own
                        os.close(fd)
                outcome, detail = _receive(self._socket)[0]
                if outcome == "error":
                    raise detail
            _copy_all(buffers, values)
            sent = True
            _send(self._socket, ("job", skeleton, len(values), job, fence.held()), [])
        except BaseException as err:
            if not sent:  # nothing reached the writer (a buffer could not be made)
                raise
            # The two ends may disagree on what is mapped now: a fresh writer next time.
            died = self._process.poll() is not None
            self._stop(kill=True)
            if died or isinstance(err, EOFError | BrokenPipeError | ConnectionResetError):
                raise self._died(step) from err
            raise
        self._buffers, self._signatures = buffers, signatures
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
            self._stop(kill=False)

    def _stop(self, kill: bool) -> None:
        if self._process.poll() is None:
            try:
                if kill:
                    self._process.kill()
                else:
                    self._socket.shutdown(socket.SHUT_WR)  # the writer's recv ends: it exits
                self._process.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self._process.kill()
                self._process.wait()
        self._socket.close()
        self._buffers, self._signatures = [], []
        self._in_flight = None

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


@torch.no_grad()
def _copy_all(buffers: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """`buffer.copy_(value)` for each pair, in one foreach call per device (for host tensors,
    faster than a loop: BENCHMARKS.md, "Checkpoints"). From a GPU, each buffer is page-locked
    once (`_pin`) and the copies are queued without waiting, then waited for together, instead
    of one blocking copy each into pageable memory, the driver staging every one (BENCHMARKS.md,
    "GPU")."""
    by_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for buffer, value in zip(buffers, values, strict=True):
        if value.numel():
            pair = by_device.setdefault(value.device, ([], []))
            pair[0].append(buffer)
            pair[1].append(value)
    for device, (targets, sources) in by_device.items():
        if device.type != "cuda":
            torch._foreach_copy_(targets, sources)
            continue
        for target in targets:
            _pin(target)
        try:  # queued on the stream that produced the values, after their last kernel
            torch._foreach_copy_(targets, sources, non_blocking=True)
        finally:  # also after a failure part way: no copy may land in a buffer freed since
            torch.cuda.current_stream(device).synchronize()


_pinned: set[int] = set()  # data_ptr of each buffer page-locked for the GPU now
_pin_failed = False


def _pin(buffer: torch.Tensor) -> None:
    """Page-lock `buffer`'s mapping for the CUDA driver (cudaHostRegister), once: a copy from
    the GPU into it is then a direct, asynchronous transfer. It is unregistered when the buffer
    is freed, before its memory is unmapped (a weakref callback runs in the tensor's
    deallocation, before its storage is released). If the driver refuses, the buffers stay
    pageable: the same bytes, copied more slowly."""
    global _pin_failed
    pointer, size = buffer.data_ptr(), buffer.untyped_storage().nbytes()
    if not size or pointer in _pinned or _pin_failed:
        return
    if _cuda_runtime() is None:  # a refusal could not be cleared: do not ask
        _pin_failed = True
        log.info("no CUDA runtime library found: the checkpoint buffers stay pageable")
        return
    code = int(torch.cuda.cudart().cudaHostRegister(pointer, size, 0))
    if code != 0:
        _cuda_clear_error()
        _pin_failed = True
        log.warning(
            "could not page-lock the checkpoint buffers for the GPU (cudaHostRegister error "
            "%d): copies from the GPU to the writer's buffers take the slower pageable path",
            code,
        )
        return
    _pinned.add(pointer)
    weakref.finalize(buffer, _unpin, pointer)


def _unpin(pointer: int) -> None:
    if pointer not in _pinned:
        return
    _pinned.remove(pointer)
    code = int(torch.cuda.cudart().cudaHostUnregister(pointer))
    if code != 0:
        _cuda_clear_error()
        log.warning("cudaHostUnregister of a checkpoint buffer failed (error %d)", code)


@functools.cache
def _cuda_runtime() -> ctypes.CDLL | None:
    """The CUDA runtime library this process loaded with torch (found in /proc/self/maps;
    dlopen of the same file returns the same library, with the same per-thread state)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split(maxsplit=5)[-1].strip()
            if os.path.basename(path).startswith("libcudart.so"):
                return ctypes.CDLL(path)
    return None


def _cuda_clear_error() -> int | None:
    """cudaGetLastError: read and reset the runtime's last error; None where the runtime is not
    a library of its own (then nothing can reset it). torch.cuda.cudart() returns a refusal's
    code but leaves it set (C10_CUDA_ERROR_HANDLED), and torch's next kernel-launch check
    (C10_CUDA_KERNEL_LAUNCH_CHECK: cudaGetLastError) would raise it in an unrelated kernel."""
    runtime = _cuda_runtime()
    return None if runtime is None else int(runtime.cudaGetLastError())


def _layout(value: torch.Tensor) -> Layout:
    """(dtype, shape, strides, elements of storage) of the buffer for `value`: its own
    strides where it is dense (channels_last stays channels_last), else contiguous ones."""
    probe = torch.empty_like(value, device="meta")  # keeps dense strides, packs the rest
    shape, stride = list(probe.shape), list(probe.stride())
    span = 0
    if probe.numel():
        span = 1 + sum((n - 1) * st for n, st in zip(shape, stride, strict=True))
    return str(value.dtype).removeprefix("torch."), shape, stride, span


def _memfd(layout: Layout, name: str) -> int:
    dtype, _, _, span = layout
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


def _mapped(fd: int | None, layout: Layout) -> torch.Tensor:
    """The buffer on memfd `fd` (None: an empty tensor, nothing to share). torch.from_file
    opens /proc/self/fd/N, maps it and closes what it opened, so the descriptor can be closed
    right after (Python's mmap.mmap would keep a duplicate open per buffer)."""
    dtype, shape, stride, span = layout
    kind = getattr(torch, dtype)
    if fd is None:
        return torch.empty_strided(shape, stride, dtype=kind)
    flat = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=span, dtype=kind)
    return flat.as_strided(shape, stride)


def _send(sock: socket.socket, message: Any, fds: list[int]) -> None:
    """One message: its header, the descriptors (one marker byte carrying them all, at most
    64), the pickled payload. Pickle is safe here: both ends are this pipeline."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    header = _HEADER.pack(len(payload), len(fds))
    if not fds:
        sock.sendall(header + payload)
        return
    sock.sendall(header)
    socket.send_fds(sock, [b"F"], fds)
    sock.sendall(payload)


def _receive(sock: socket.socket) -> tuple[Any, list[int]]:
    """(message, descriptors) of the next `_send`; EOFError when the other end closed."""
    fds: list[int] = []
    try:
        size, count = _HEADER.unpack(_read(sock, _HEADER.size, fds))
        _read(sock, 1 if count else 0, fds)
        payload = _read(sock, size, fds)
        if len(fds) != count:
            raise OSError(f"expected {count} descriptors from the other process, got {len(fds)}")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return pickle.loads(payload), fds


def _read(sock: socket.socket, size: int, fds: list[int]) -> bytes:
    """Exactly `size` bytes, collecting any descriptors that come with them."""
    chunks, got = [], 0
    while got < size:
        data, received, flags, _ = socket.recv_fds(sock, size - got, _FDS_PER_MESSAGE)
        fds.extend(received)
        if flags & socket.MSG_CTRUNC:
            raise OSError("descriptors from the other process were cut off (MSG_CTRUNC)")
        if not data:
            raise EOFError("the other process closed the socket")
        chunks.append(data)
        got += len(data)
    return b"".join(chunks)


def _die_with_parent(parent: int) -> None:
    """SIGKILL when the training process dies. Linux ties it to the thread that started this
    process: the saver must be made by a thread that lives as long as the training (the main
    thread, in train.py and scripts/ray_train.py's processes)."""
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
    """The writer process: `python -c ... FD PARENT_PID SYS_PATH SETUP SIGNALS`."""
    fd, parent, path, setup, signals = sys.argv[1:6]
    ignored = [signal.Signals(signum) for signum in json.loads(signals)]
    for signum in ignored:
        signal.signal(signum, signal.SIG_IGN)  # discards what arrived while blocked
    signal.pthread_sigmask(signal.SIG_UNBLOCK, ignored)
    _die_with_parent(int(parent))
    parent_path = json.loads(path)
    sys.path[:] = [*parent_path, *(p for p in sys.path if p not in parent_path)]
    torch.set_num_threads(1)
    if setup:
        module, function = setup.split(":")
        getattr(importlib.import_module(module), function)()
    _serve(socket.socket(fileno=int(fd)))


def _serve(sock: socket.socket) -> None:
    """Map the buffers each "buffers" message brings; one `single.save` (or one rank's
    files of a sharded checkpoint) per "job" message, each answered with its outcome."""
    buffers: list[torch.Tensor] = []
    while True:
        try:
            message, fds = _receive(sock)
        except (EOFError, OSError):
            return  # the training process closed the socket, or is gone
        if message[0] == "buffers":
            try:
                handed = iter(fds)
                for index, layout in message[1]:
                    buffers += [torch.empty(0)] * (index + 1 - len(buffers))
                    buffers[index] = _mapped(next(handed) if layout[3] else None, layout)
                reply: Any = ("mapped", len(message[1]))
            except BaseException as err:
                reply = ("error", _portable(err))
            finally:
                for fd in fds:
                    os.close(fd)
            _send(sock, reply, [])
            continue
        _, skeleton, count, job, held = message
        del buffers[count:]
        fence.hold(held)  # the training process's: a write for a holder that lost never ends
        try:
            state = sharded.unflatten(skeleton, dict(enumerate(buffers)), _MARKER)
            reply = ("ok", _run(job, state))
        except BaseException as err:  # reported to the training process, which decides
            reply = ("error", _portable(err))
        _send(sock, reply, [])


def _run(job: tuple[Any, ...], state: dict[str, Any]) -> Any:
    if job[0] == "save":
        _, directory, step, keep, accuracy = job
        return str(single.save(state, Path(directory), step, keep, accuracy))
    _, folder, step, paths = job
    files = {label: (Path(paths[label]), payload) for label, payload in state.items()}
    return sharded.write_sharded(sharded.ShardedSave(Path(folder), step, files))

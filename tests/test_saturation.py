"""CPU use measured against processes made to burn a known share of a core, the warnings'
rules by hand, and the reduction over ranks."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest
import torch
from helpers import launch, rows
from torch.utils.data import DataLoader, Dataset

import data
import saturation

CPU = torch.device("cpu")


class Spinning(Dataset):
    """Each sample keeps its loader worker's core busy for `seconds` of CPU time; the sample is
    the worker's CPU time (time.process_time) when it was done: the worker's own account."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, index: int) -> float:
        end = time.thread_time() + self.seconds
        while time.thread_time() < end:
            pass
        return time.process_time()


def test_usage_is_each_processs_cpu_time_over_the_wall_time(monkeypatch) -> None:
    """From given CPU times and a given clock: the training process's CPU seconds per second,
    all its loader workers' together, and per worker; each sample covers the time since the
    previous one; a worker started in the interval counts from its start, one whose /proc entry
    is gone adds nothing; without workers the loader figures are not measured."""
    clock = SimpleNamespace(wall=100.0, own=5.0)
    monkeypatch.setattr(
        saturation,
        "time",
        SimpleNamespace(perf_counter=lambda: clock.wall, process_time=lambda: clock.own),
    )
    cpu = {11: 1.0, 12: 2.0}  # each worker's CPU seconds, as /proc/<pid>/stat gives them
    monkeypatch.setattr(saturation, "_cpu_seconds", cpu.get)
    pids = [11, 12]
    usage = saturation.Usage(CPU, lambda: pids)
    clock.wall, clock.own = 102.0, 5.5
    cpu.update({11: 2.5, 12: 2.5})  # 1.5 s and 0.5 s of CPU in 2 s
    trainer, loader_cores, per_worker, *gpu = usage.sample()
    assert (trainer, loader_cores, per_worker) == (0.25, 1.0, 0.5)
    assert all(math.isnan(v) for v in gpu)  # no GPU: not measured, left out of rows
    pids[:] = [11, 12, 13]
    del cpu[12]  # exited after it was listed
    cpu.update({11: 3.0, 13: 0.75})  # 13 started in this interval
    clock.wall, clock.own = 104.0, 6.0
    trainer, loader_cores, per_worker, *_ = usage.sample()
    assert (trainer, loader_cores) == (0.25, (0.5 + 0.75) / 2)
    assert per_worker == pytest.approx(loader_cores / 3)
    pids.clear()  # data.num_workers=0
    clock.wall, clock.own = 105.0, 7.0
    trainer, loader_cores, per_worker, *_ = usage.sample()
    assert trainer == 1.0 and math.isnan(loader_cores) and math.isnan(per_worker)


def test_loader_workers_cpu_use_is_measured_per_worker(monkeypatch) -> None:
    """A real loader worker spinning for every sample: the CPU time Usage reads for it from
    /proc lies between what the worker itself counted at the samples it can have finished when
    the interval began and ended, and the training process's is its own process time. Usage's
    clock is set to 1 s so that its figures are CPU seconds: nothing here depends on how busy
    the machine is (the share of a core itself is a measurement, not a test)."""
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(
        saturation,
        "time",
        SimpleNamespace(perf_counter=lambda: clock.now, process_time=time.process_time),
    )
    loader = DataLoader(Spinning(0.02), batch_size=1, num_workers=1, persistent_workers=True)
    ahead = loader.prefetch_factor * loader.num_workers  # samples asked for beyond those taken
    batches = iter(loader)
    done = [next(batches).item()]  # the worker is up: sample 0 is done
    own_before = time.process_time()
    usage = saturation.Usage(CPU, lambda: data.worker_pids(loader))
    assert len(data.worker_pids(loader)) == 1
    done += [next(batches).item() for _ in range(25)]
    clock.now = 1.0
    trainer, loader_cores, per_worker, *gpu = usage.sample()
    own_after = time.process_time()
    done += [next(batches).item() for _ in range(ahead)]
    data.close_loader(loader)
    # At the start the worker had finished sample 0 and at most `ahead` more; at the end, the
    # 25 taken and at most `ahead` more. Slack: /proc/<pid>/stat counts user and system time
    # apart in whole ticks of 0.01 s (up to 0.02 s short at either end), and the worker passes
    # each sample on after counting it (well under 0.01 s).
    slack = 0.02 + 0.01
    assert done[25] - done[ahead] - slack <= per_worker <= done[25 + ahead] - done[0] + slack
    assert per_worker >= 0.4 and loader_cores == per_worker  # 23 samples of 0.02 s at least
    assert 0.0 <= trainer <= own_after - own_before
    assert all(math.isnan(v) for v in gpu)


def test_reduce_gives_min_median_max_over_the_ranks_that_measured() -> None:
    nan = math.nan
    rows = [
        [1.0, 0.5, 0.25, nan, nan, nan, nan],
        [3.0, nan, nan, nan, nan, nan, nan],
        [2.0, 1.5, 0.75, nan, nan, nan, nan],
    ]
    out = saturation.reduce(rows)
    assert (out["cpu_trainer_cores_min"], out["cpu_trainer_cores_median"]) == (1.0, 2.0)
    assert out["cpu_trainer_cores_max"] == 3.0
    assert out["cpu_loader_cores_median"] == 1.0  # of the two ranks with workers
    assert not any(key.startswith("gpu_") for key in out)


def test_advice_names_what_to_change() -> None:
    busy = {"data_wait_frac": 0.3, "cpu_loader_worker_frac_median": 0.95}
    ((kind, message),) = saturation.advice(busy, num_workers=2, on_gpu=False)
    assert kind == "loader-cpu-bound" and "add workers (data.num_workers" in message
    idle_workers = {"data_wait_frac": 0.3, "cpu_loader_worker_frac_median": 0.2}
    assert saturation.advice(idle_workers, num_workers=2, on_gpu=False) == []
    ((kind, _),) = saturation.advice({"data_wait_frac": 0.3}, num_workers=0, on_gpu=False)
    assert kind == "loader-in-process"
    small = {"data_wait_frac": 0.01, "gpu_util_pct_median": 35.0}
    ((kind, message),) = saturation.advice(small, num_workers=2, on_gpu=True)
    assert kind == "gpu-underused" and "raise data.batch_size" in message
    assert "enable train.compile" in message
    # Already compiled (the default on CUDA): the advice said "enable train.compile" to a
    # compiled run on an H200 (the default job, GPU busy 15%).
    ((_, message),) = saturation.advice(small, num_workers=2, on_gpu=True, compiled=True)
    assert "raise data.batch_size" in message and "train.compile" not in message
    assert saturation.advice(small, num_workers=2, on_gpu=False) == []  # no GPU to underuse
    starved = {"data_wait_frac": 0.3, "gpu_util_pct_median": 35.0}  # the loader's fault
    assert [k for k, _ in saturation.advice(starved, 0, on_gpu=True)] == ["loader-in-process"]
    # What the run already uses is not advised: before, a run with data.loader=device (whose
    # data.num_workers is 0) was told to "use ... data.loader=device".
    ((kind, message),) = saturation.advice(starved, 0, on_gpu=False, loader="device")
    assert kind == "device-loader" and "data.loader=dataloader with data.num_workers" in message
    ((kind, message),) = saturation.advice(busy, 2, on_gpu=True, decode="device")
    assert kind == "loader-cpu-bound" and "data.decode=device" not in message
    ((_, message),) = saturation.advice(busy, 2, on_gpu=True, decode="workers")
    assert "or move the work off the CPU (data.decode=device on a GPU)" in message


def test_oversubscription_counts_every_local_ranks_workers() -> None:
    assert saturation.oversubscribed(local_ranks=2, num_workers=4, cores=16) is None
    message = saturation.oversubscribed(local_ranks=4, num_workers=5, cores=16)
    assert message is not None and "20 workers for 16 CPU cores" in message


def test_advice_is_repeated_only_after_a_while(caplog) -> None:
    advisor = saturation.Advisor(every_s=60)
    found = [("loader-cpu-bound", "add workers")]
    with caplog.at_level("WARNING"):
        assert advisor.consider(found) == ["loader-cpu-bound"]
        assert advisor.consider(found) == []  # not again at every log interval
    advisor.last["loader-cpu-bound"] -= 61
    assert advisor.consider(found) == ["loader-cpu-bound"]


SPINNING_DATA = '''
import time
import torch
from torch.utils.data import Dataset


class Spinning(Dataset):
    """Random-free images whose loading keeps a core busy for `seconds` each."""

    def __init__(self, size, seconds):
        self.size, self.seconds = size, seconds

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        end = time.thread_time() + self.seconds
        while time.thread_time() < end:
            pass
        return torch.full((1, 8, 8), index % 251, dtype=torch.uint8), index % 2


def spinning(*, root, seconds=0.01):
    return {"train": Spinning(512, seconds), "eval": Spinning(64, 0.0),
            "num_classes": 2, "input_shape": (1, 8, 8)}
'''


@pytest.mark.e2e
def test_a_cpu_bound_loader_and_a_crowded_node_are_reported(tmp_path) -> None:
    """Forced on this CPU: loader workers that spin for every sample (the data wait is most
    of the step) get the advice to add workers, with their CPU use in the rows; more workers
    than cores get the starvation warning at start-up."""
    (tmp_path / "spinning_data.py").write_text(SPINNING_DATA)
    args = [
        "--data.factory=spinning_data:spinning",
        "--model.widths=4,8",
        "--data.batch_size=16",
        "--log.every_steps=4",
        "--train.max_steps=16",
        "--log.tensorboard=false",
        "--log.mfu=false",
        # a hang (never seen here, once in CI) ends in the stall watchdog's stacks well before
        # the test's 240 s, not in a kill that says nothing
        "--dist.timeout_s=60",
    ]
    env = {"PYTHONPATH": str(tmp_path)}
    one = launch(None, f"--run.dir={tmp_path / 'one'}", *args, "--data.num_workers=1", env=env)
    assert one.returncode == 0, one.output[-4000:]
    train_rows = rows(tmp_path / "one", "train")
    assert all(r["data_wait_frac"] > saturation.DATA_WAIT_HIGH for r in train_rows)
    # Whether a spinning worker gets the 80% of a core that makes it "CPU-bound" depends on how
    # busy the machine is (a share of a core is a measurement, not a test): the advice must be
    # given exactly when a row's figures met its thresholds.
    bound = any(r["cpu_loader_worker_frac_median"] >= saturation.WORKER_BUSY for r in train_rows)
    assert ("loader workers per rank are CPU-bound" in one.output) == bound, train_rows
    assert ("add workers (data.num_workers" in one.output) == bound
    cores = saturation.available_cores()
    nvtx = "--log.nvtx=true"  # NVTX calls for real (without Nsight attached they cost nothing)
    crowded = launch(
        2, f"--run.dir={tmp_path / 'two'}", *args, f"--data.num_workers={cores}", nvtx, env=env
    )
    assert crowded.returncode == 0, crowded.output[-4000:]
    assert f"are {2 * cores} workers for {cores} CPU cores" in crowded.output
    assert crowded.output.count("workers starve each other") == 1  # once per node


def test_nvtx_ranges_follow_the_phases_of_a_step(monkeypatch) -> None:
    """data wait -> forward/backward -> optimizer, each range closed before the next opens,
    and none left open; nothing at all when log.nvtx is off."""
    import instruments

    calls: list[tuple[str, object]] = []
    ids = iter(range(100))

    def start(name: str) -> int:
        calls.append(("start", name))
        return next(ids)

    monkeypatch.setattr(torch.cuda.nvtx, "range_start", start)
    monkeypatch.setattr(torch.cuda.nvtx, "range_end", lambda i: calls.append(("end", i)))
    ranges = instruments.NvtxRange(enabled=True)
    for name in ("data wait", "forward/backward", "optimizer"):
        ranges.begin(name)
    ranges.end()
    ranges.end()  # nothing open: no call
    assert calls == [
        ("start", "data wait"),
        ("end", 0),
        ("start", "forward/backward"),
        ("end", 1),
        ("start", "optimizer"),
        ("end", 2),
    ]
    calls.clear()
    off = instruments.NvtxRange(enabled=False)
    off.begin("data wait")
    off.end()
    assert calls == []

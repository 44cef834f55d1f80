"""The training image (Containerfile), built once per test run and run for real.

The base image comes from the Debian archive alone (scripts/container/build_base.sh: no
registry), the image from scripts/container/build.sh with Podman. Each job runs read-only, as
a user that is not root, with only its run dir mounted, and is compared with the same job run
outside the image (same lock, same machine): equal weights, not just "it ran".
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from cluster import JOB as SYNTHETIC_JOB
from cluster import REPO, netns_cluster
from conftest import BUILD_TIMES
from helpers import final_state

CAN_BUILD = (
    os.geteuid() == 0
    and shutil.which("podman") is not None
    and shutil.which("debootstrap") is not None
    and shutil.which("ip") is not None
)
pytestmark = [
    pytest.mark.container,
    pytest.mark.multinode,
    # Under CI these must run (scripts/setup.sh installs podman and debootstrap): missing tools
    # fail instead of skipping.
    pytest.mark.skipif(
        not CAN_BUILD and not os.environ.get("CI"),
        reason="needs root, podman, debootstrap and iproute2",
    ),
]

ENGINE_ENV = {**os.environ, "ENGINE": "podman"}
# torch.compile on: the image must hold a compiler and /tmp must allow executables. amp none:
# the default job's bf16 is native on AVX512-BF16 and AMX CPUs only; elsewhere oneDNN emulates it
# (a training step of the default job's model: 2.0 s in bf16 against 0.11 s in fp32 on a 2-core
# AVX2 EPYC), and the run would time its emulation, twice, in its evaluation of 10,000 images.
DEFAULT_JOB = [
    "--train.max_steps=6",
    "--log.every_steps=2",
    "--log.tensorboard=false",
    "--train.compile=on",
    "--train.amp=none",
]


def engine_options() -> list[str]:
    """What scripts/container/engine.sh passes podman on this host (limits, runtime)."""
    out = subprocess.run(
        ["bash", "-c", 'source scripts/container/engine.sh && printf "%s\\n" "${ENGINE_OPTS[@]}"'],
        cwd=REPO,
        env=ENGINE_ENV,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [line for line in out.splitlines() if line]


def image_ids() -> set[str]:
    out = subprocess.run(
        ["podman", "images", "--all", "--quiet", "--no-trunc"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return set(out.split())


# What a build of the image takes at its peak (measured with Podman 4.3 on Debian 12): the
# environment stage's .venv (5.8 GB: torch's CUDA wheels) in its working container, its layer
# again in the final stage's container, a third time as the tar Podman writes to its temp dir
# to commit each layer. 2026-11-26, a CI run failed its build with "no space left on device"
# (stale leftovers of killed builds held 23 GB).
BUILD_BYTES = 25 * 10**9
STALE_S = 2 * 3600  # this module's build leftovers older than this have no process left
# Each build gets a TMPDIR of its own here, removed after it, whatever the build's outcome.
# Podman 4.3 makes its commit's temp dir there (default /var/tmp): with TMPDIR=/nonexistent/x
# a `podman build` fails its COMMIT with "creating a temporary directory: stat /nonexistent/x".
BUILD_TMP_ROOT = Path("/var/tmp")
BUILD_TMP_PREFIX = "ddp-test-build-"
CLEANUP_ERRORS = (OSError, ValueError, KeyError, subprocess.CalledProcessError)


def podman_json(*args: str) -> list[dict]:
    out = subprocess.run(
        ["podman", *args, "--format", "json"], check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out or "[]")


def graph_root() -> Path:
    out = subprocess.run(
        ["podman", "info", "--format", "{{.Store.GraphRoot}}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return Path(out.strip())


def working_containers() -> list[dict]:
    """buildah's "<image>-working-container" containers, which a build removes when it ends
    and a killed one leaves (`podman ps` lists them only with --external)."""
    return [
        c
        for c in podman_json("ps", "--all", "--external")
        if any("-working-container" in name for name in c["Names"])
    ]


def remove_containers_and_their_images(containers: list[dict]) -> None:
    if containers:
        subprocess.run(
            ["podman", "rm", "--force", *(c["Id"] for c in containers)], capture_output=True
        )
        # the stage images they were made from; refused (kept) where anything else uses one
        subprocess.run(["podman", "rmi", *{c["ImageID"] for c in containers}], capture_output=True)


def sweep_stale_builds() -> list[str]:
    """Remove what builds of this module killed hours ago left (a killed pytest runs no
    `finally`): working containers made from a build's stage images (buildah names those
    "<id>-tmp"; a user's `buildah from IMAGE` container is not one), this module's images
    (localhost/ddp-test*) and build temp dirs. Best effort; what it removed, for the log."""
    removed: list[str] = []
    try:
        now = time.time()
        stale = [
            c
            for c in working_containers()
            if c["Image"].endswith("-tmp:latest") and now - c["Created"] > STALE_S
        ]
        remove_containers_and_their_images(stale)
        if stale:
            removed.append(f"{len(stale)} build container(s)")
        images = [
            i["Id"]
            for i in podman_json("images", "--filter", "reference=localhost/ddp-test*")
            if now - i["Created"] > STALE_S
        ]
        if images:
            subprocess.run(["podman", "rmi", "--force", *images], capture_output=True)
            removed.append(f"{len(images)} ddp-test image(s)")
        for path in BUILD_TMP_ROOT.glob(f"{BUILD_TMP_PREFIX}*"):
            if now - path.stat().st_mtime > STALE_S:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(str(path))
    except CLEANUP_ERRORS as err:
        removed.append(f"(the sweep stopped: {err!r})")
    return removed


def require_build_space() -> None:
    """Fail before building, naming where space is short, rather than with Podman's error deep
    in a layer commit after minutes of building."""
    short = []
    for where in {graph_root(), BUILD_TMP_ROOT}:
        free = shutil.disk_usage(where).free
        if free < BUILD_BYTES:
            short.append(f"{where}: {free / 1e9:.1f} GB free")
    if short:
        pytest.fail(
            f"a build of the image needs about {BUILD_BYTES / 1e9:.0f} GB free; "
            + "; ".join(short)
            + " (podman system df shows what Podman holds)"
        )


def extra_ca_certs(tmp: Path) -> dict[str, str]:
    """The host's own CA certificates (Debian keeps local ones in /usr/local/share), passed to
    the build as its explicit argument: some networks intercept HTTPS."""
    certs = sorted(glob.glob("/usr/local/share/ca-certificates/**/*.crt", recursive=True))
    if not certs:
        return {}
    bundle = tmp / "extra-ca.pem"
    bundle.write_text("".join(Path(cert).read_text() for cert in certs))
    return {"EXTRA_CA_CERTS": str(bundle)}


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Iterator[str]:
    """Build the base and the image once for this module; remove both (and the build's
    intermediate images) afterwards, however the tests end. DDP_TEST_IMAGE names an image
    built already instead (while working on these tests)."""
    if os.environ.get("DDP_TEST_IMAGE"):
        yield os.environ["DDP_TEST_IMAGE"]
        return
    swept = sweep_stale_builds()
    if swept:
        pytestconfig.stash.setdefault(BUILD_TIMES, []).append(
            "removed stale build leftovers: " + ", ".join(swept)
        )
    require_build_space()
    tag = uuid.uuid4().hex[:8]
    base, name = f"localhost/ddp-test-base:{tag}", f"localhost/ddp-test:{tag}"
    before = image_ids()
    build_tmp = Path(tempfile.mkdtemp(prefix=BUILD_TMP_PREFIX, dir=BUILD_TMP_ROOT))
    env = {
        **ENGINE_ENV,
        "BASE": base,
        "TMPDIR": str(build_tmp),
        **extra_ca_certs(tmp_path_factory.mktemp("ca")),
    }
    try:
        for script, arg in (("build_base.sh", base), ("build.sh", name)):
            started = time.monotonic()
            containers_before = {c["Id"] for c in working_containers()}
            # A session of its own: a timeout stops podman build and debootstrap too.
            proc = subprocess.Popen(
                ["bash", f"scripts/container/{script}", arg],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            try:
                out, err = proc.communicate(timeout=1800)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                # A failed or killed build leaves its working containers, which hold its stage
                # images: gigabytes each. Those that appeared while it ran and outlived it.
                with contextlib.suppress(*CLEANUP_ERRORS):
                    remove_containers_and_their_images(
                        [c for c in working_containers() if c["Id"] not in containers_before]
                    )
            assert proc.returncode == 0, f"{script} failed:\n{out[-4000:]}\n{err[-4000:]}"
            # Build times belong in the CI log: tests/conftest.py prints them in the summary.
            pytestconfig.stash.setdefault(BUILD_TIMES, []).append(
                f"{script}: {time.monotonic() - started:.0f} s"
            )
        yield name
    finally:
        with contextlib.suppress(*CLEANUP_ERRORS):
            leftover = image_ids() - before
            if leftover:
                subprocess.run(["podman", "rmi", "--force", *leftover], capture_output=True)
        shutil.rmtree(build_tmp, ignore_errors=True)


STARTED: list[str] = []  # container names, removed after each test however it ends


@pytest.fixture(autouse=True)
def remove_containers() -> Iterator[None]:
    """A timed-out `podman run` leaves its container running (conmon keeps it): remove it."""
    yield
    while STARTED:
        subprocess.run(["podman", "rm", "--force", STARTED.pop()], capture_output=True)


def run_prefix(run_root: Path, name: str | None = "", nproc: int | None = 2) -> list[str]:
    """podman run, read-only (a tmpfs /tmp only), as uid 1000, with `run_root` as /runs.
    `name` None: unnamed (containers on the netns hosts die with their hosts)."""
    run_root.mkdir(parents=True, exist_ok=True)
    run_root.chmod(0o777)  # writable for the container's user, which is not root
    named = []
    if name is not None:
        name = name or f"ddp-test-{uuid.uuid4().hex[:8]}"
        STARTED.append(name)
        named = [f"--name={name}"]
    return [
        "podman",
        "run",
        "--rm",
        *named,
        *engine_options(),
        "--read-only",
        "--read-only-tmpfs=false",
        "--tmpfs=/tmp:rw,exec,mode=1777",  # torch.compile loads its kernels from there
        "--user=1000:1000",
        f"--volume={run_root}:/runs",
        "--env=OMP_NUM_THREADS=1",
        *([f"--env=NPROC_PER_NODE={nproc}"] if nproc else []),
    ]


def host_run(run_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The same job outside any container, the way the README runs it."""
    env = {**os.environ, "NPROC_PER_NODE": "2", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        ["bash", "scripts/train_single_node.sh", f"--run.dir={run_dir}", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint, weights_only=True)["model"]


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for key, value in wb.items():
        assert torch.equal(wa[key], value), key


def eval_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keys = ("step", "loss", "accuracy", "num_samples")
    return [{k: row[k] for k in keys} for row in rows if row["kind"] == "eval"]


def test_default_command_trains_the_default_job_read_only_as_a_non_root_user(
    image: str, tmp_path: Path
) -> None:
    """No command: the default job (configs/fashion_mnist.toml, Fashion-MNIST from the image),
    2 ranks, into /runs/default. Then a bad override exits 2 naming it, and leaves the run dir
    as it was."""
    runs = tmp_path / "runs"
    job = subprocess.run(
        [*run_prefix(runs), image, *DEFAULT_JOB], capture_output=True, text=True, timeout=300
    )
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    out = job.stdout + job.stderr
    assert "world size 2" in out
    run_dir = runs / "default"
    assert (run_dir / "checkpoints" / "step_6.pt").is_file()
    # The uid the job ran as owns what it wrote: nothing was written as root.
    assert {p.stat().st_uid for p in run_dir.rglob("*")} == {1000}

    reference = tmp_path / "host"
    host_run(reference, "--config", "configs/fashion_mnist.toml", *DEFAULT_JOB)
    assert_same_weights(
        run_dir / "checkpoints" / "step_6.pt", reference / "checkpoints" / "step_6.pt"
    )
    assert eval_rows(run_dir) == eval_rows(reference) and len(eval_rows(run_dir)) == 1

    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    bad = subprocess.run(
        [*run_prefix(runs), image, "--train.epochs=many"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2, bad.stdout[-2000:] + bad.stderr[-2000:]
    assert "train.epochs" in bad.stderr and "many" in bad.stderr
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before


@pytest.mark.extended  # CI runs fsdp under torchrun, launch_multinode.sh (hybrid) and Slurm
def test_fsdp_with_async_sharded_checkpoints_runs_in_the_read_only_image(
    image: str, tmp_path: Path
) -> None:
    """The image (read-only, uid 1000, /tmp the only tmpfs) trains with dist.strategy=fsdp and
    ckpt.async_save: each rank's writer process maps its buffers from memfds, which need no
    writable path; the sharded checkpoint holds what the same job holds outside the image."""
    job = [*SYNTHETIC_JOB, "--train.max_steps=6", "--ckpt.every_steps=3", "--train.amp=none"]
    job += ["--dist.strategy=fsdp", "--ckpt.async_save=true", "--run.dir=/runs/fsdp"]
    runs = tmp_path / "runs"
    result = subprocess.run(
        [*run_prefix(runs), image, *job], capture_output=True, text=True, timeout=300
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert "wrote the step 3 checkpoint's shards in the background" in out
    reference = tmp_path / "host"
    # The entry point runs overrides on top of the default job's config file
    host_run(reference, "--config", "configs/fashion_mnist.toml", *job[:-1])
    got, want = final_state(runs / "fsdp"), final_state(reference)
    assert got["step"] == want["step"] == 6
    for key, value in want["model"].items():
        assert torch.equal(got["model"][key], value), key


@pytest.mark.extended  # CI: tests/test_signals.py sends the same SIGTERM to the launcher
def test_sigterm_to_the_container_checkpoints_and_the_next_container_resumes_exactly(
    image: str, tmp_path: Path
) -> None:
    """`podman kill --signal TERM` signals the container's first process only, as a container
    runtime stopping a pod does: tini passes it on, the job checkpoints and exits 75, and the
    same command resumes to the weights of an uninterrupted run outside the image."""
    runs, name = tmp_path / "runs", f"ddp-test-{uuid.uuid4().hex[:8]}"
    job = [*SYNTHETIC_JOB, "--train.max_steps=200", "--run.dir=/runs/job"]
    proc = subprocess.Popen(
        [*run_prefix(runs, name), image, *job],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    signalled = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if " step 4 " in line and not signalled.is_set():
                signalled.set()
                subprocess.run(["podman", "kill", "--signal=TERM", name], capture_output=True)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            subprocess.run(["podman", "kill", name], capture_output=True)
            proc.wait()
    reader.join(timeout=10)
    out = "".join(lines)
    assert signalled.is_set(), out[-3000:]
    assert code == 75, out[-3000:]
    saved = list((runs / "job" / "checkpoints").glob("step_*.pt"))
    assert saved and not (runs / "job" / "checkpoints" / "step_200.pt").exists(), out[-3000:]

    resumed = subprocess.run(
        [*run_prefix(runs), image, *job], capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    # It continued from the preemption checkpoint: no train row of the steps before it.
    assert " step 2 epoch" not in resumed.stdout + resumed.stderr

    reference = tmp_path / "host"
    # The image's default command trains configs/fashion_mnist.toml (then the overrides).
    host_run(
        reference, "--config", "configs/fashion_mnist.toml", *SYNTHETIC_JOB, "--train.max_steps=200"
    )
    assert_same_weights(
        runs / "job" / "checkpoints" / "step_200.pt", reference / "checkpoints" / "step_200.pt"
    )


def test_two_netns_hosts_each_running_the_image_train_one_job(image: str, tmp_path: Path) -> None:
    """The image on two hosts (network namespaces with their own address and name), one rank
    each, rendezvous across the bridge: the same weights as 2 ranks on one host without it."""
    runs = tmp_path / "runs"
    with netns_cluster(2) as cluster:
        two_hosts = cluster.launch(
            [0, 1],
            nproc=1,
            args=["--run.dir=/runs/two", *SYNTHETIC_JOB],
            image=[*run_prefix(runs, name=None, nproc=None), image],
        )
        one_host = cluster.launch(
            [0], nproc=2, args=[f"--run.dir={tmp_path / 'one'}", *SYNTHETIC_JOB], port=29401
        )
    assert [r.returncode for r in two_hosts] == [0, 0] and one_host[0].returncode == 0
    node0, node1 = (r.stdout for r in two_hosts)
    assert "world size 2" in node0
    assert "rank 0 = node0 local rank 0" in node0 and "rank 1 = node1 local rank 0" in node0
    assert_same_weights(
        runs / "two" / "checkpoints" / "step_6.pt", tmp_path / "one" / "checkpoints" / "step_6.pt"
    )

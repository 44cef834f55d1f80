"""The Kubernetes manifests against the published CRD schemas of JobSet and Kubeflow Trainer v2
(tests/data/k8s, shipped: no network), with Kubernetes' strict field validation (an unknown
field is an error, as `kubectl apply` reports it since 1.27), and their restart semantics
against the exit codes train.py and scripts/supervise.py use."""

from __future__ import annotations

import copy
import gzip
from pathlib import Path
from typing import Any

import pytest
import yaml

import exitcodes

jsonschema = pytest.importorskip("jsonschema")

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "scripts" / "k8s"
SUPERVISOR_GRACE_S = 120  # scripts/supervise.py's default SUPERVISE_GRACE_S


def strict(schema: Any) -> Any:
    """A CRD's structural schema with unknown fields refused: objects that list their
    properties get additionalProperties: false unless they keep unknown fields."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict(value) for key, value in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the strict schema of every version the shipped CRDs serve."""
    schemas = {}
    for path in sorted((REPO / "tests" / "data" / "k8s").glob("*.yaml.gz")):
        for crd in yaml.safe_load_all(gzip.decompress(path.read_bytes())):
            if not crd:
                continue
            spec = crd["spec"]
            for version in spec["versions"]:
                if version.get("served"):
                    key = (f"{spec['group']}/{version['name']}", spec["names"]["kind"])
                    schemas[key] = strict(version["schema"]["openAPIV3Schema"])
    return schemas


SCHEMAS = crd_schemas()


def errors(doc: dict) -> list[str]:
    validator = jsonschema.Draft7Validator(SCHEMAS[(doc["apiVersion"], doc["kind"])])
    return [
        f"{'.'.join(map(str, error.absolute_path))}: {error.message}"
        for error in validator.iter_errors(doc)
    ]


def manifest(name: str) -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    return {d["kind"]: d for d in docs}


def test_the_shipped_schemas_are_the_current_apis() -> None:
    assert ("jobset.x-k8s.io/v1alpha2", "JobSet") in SCHEMAS
    assert ("trainer.kubeflow.org/v1alpha1", "TrainJob") in SCHEMAS
    assert ("trainer.kubeflow.org/v1alpha1", "ClusterTrainingRuntime") in SCHEMAS


@pytest.mark.parametrize(
    ("name", "kinds"),
    [("jobset.yaml", ["JobSet"]), ("trainjob.yaml", ["ClusterTrainingRuntime", "TrainJob"])],
)
def test_manifests_validate_against_the_crd_schemas(name, kinds) -> None:
    docs = manifest(name)
    assert sorted(docs) == sorted([*kinds, "PersistentVolumeClaim"])
    for kind in kinds:
        assert errors(docs[kind]) == [], kind


def test_the_validation_refuses_unknown_fields_wrong_types_and_values() -> None:
    """The check can fail: a misspelt field, a string for a number, an action JobSet lacks."""
    jobset = manifest("jobset.yaml")["JobSet"]
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    typo, wrong_type, wrong_value = (copy.deepcopy(jobset) for _ in range(3))
    typo["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicies"] = job[
        "podFailurePolicy"
    ]
    wrong_type["spec"]["replicatedJobs"][0]["template"]["spec"]["backoffLimit"] = "none"
    wrong_value["spec"]["failurePolicy"]["rules"][0]["action"] = "Restart"
    assert any("'podFailurePolicies' was unexpected" in e for e in errors(typo))
    assert any("backoffLimit: 'none' is not of type 'integer'" in e for e in errors(wrong_type))
    assert any("'Restart' is not one of" in e for e in errors(wrong_value))


def job_templates() -> list[tuple[str, dict]]:
    """The batch/v1 Job spec of each manifest (the JobSet's, the runtime's JobSet template)."""
    jobset = manifest("jobset.yaml")["JobSet"]["spec"]
    runtime = manifest("trainjob.yaml")["ClusterTrainingRuntime"]["spec"]["template"]["spec"]
    return [("jobset.yaml", jobset), ("trainjob.yaml", runtime)]


@pytest.mark.parametrize(("name", "jobset"), job_templates())
def test_restarts_follow_the_exit_codes(name, jobset) -> None:
    """Preempted (75): replaced without spending the failure budget. Bad input (2) and no
    progress (76): the job fails, no restart. Evictions: not failures. Anything else: the
    whole JobSet restarts (a fresh rendezvous), a bounded number of times."""
    (replicated,) = jobset["replicatedJobs"]
    job = replicated["template"]["spec"]
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # podFailurePolicy requires it
    by_action: dict[str, list] = {}
    for rule in job["podFailurePolicy"]["rules"]:
        if "onExitCodes" in rule:
            assert rule["onExitCodes"]["operator"] == "In"
            assert rule["onExitCodes"]["containerName"] == "node"
            by_action.setdefault(rule["action"], []).extend(rule["onExitCodes"]["values"])
        else:
            assert rule == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}
    assert by_action == {
        "Ignore": [exitcodes.EXIT_PREEMPTED],
        "FailJob": [exitcodes.EXIT_BAD_INPUT, exitcodes.EXIT_NO_PROGRESS],
    }
    assert job["backoffLimit"] == 0
    policy = jobset["failurePolicy"]
    assert policy["maxRestarts"] >= 1
    assert policy["rules"] == [
        {
            "name": "no-restart-for-bad-input-or-no-progress",
            "action": "FailJobSet",
            "onJobFailureReasons": ["PodFailurePolicy"],
        }
    ]
    # Long enough for the supervisor to wait for the workers' checkpoint after SIGTERM.
    assert pod["terminationGracePeriodSeconds"] > SUPERVISOR_GRACE_S
    (container,) = pod["containers"]
    command = container["command"]
    assert command[1:3] == ["scripts/supervise.py", "--"]  # exit 75 / 76 for the pod
    assert command.index("torch.distributed.run") < command.index("train.py")
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    claim = volumes["runs"]["persistentVolumeClaim"]["claimName"]
    pvc = manifest(name)["PersistentVolumeClaim"]
    assert pvc["metadata"]["name"] == claim and pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert mounts["runs"] == "/runs" and volumes["dshm"]["emptyDir"]["medium"] == "Memory"


def test_jobset_rendezvous_settings_agree() -> None:
    """Static rendezvous from environment variables torchrun reads: as many nodes as pods,
    node ranks from the completion index, node 0's stable host name, one rank per GPU."""
    jobset = manifest("jobset.yaml")["JobSet"]
    name = jobset["metadata"]["name"]
    (replicated,) = jobset["spec"]["replicatedJobs"]
    job = replicated["template"]["spec"]
    (container,) = job["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert job["completionMode"] == "Indexed" and replicated["replicas"] == 1
    assert int(env["PET_NNODES"]["value"]) == job["parallelism"] == job["completions"]
    index = env["PET_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert index == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert env["PET_MASTER_ADDR"]["value"] == f"{name}-{replicated['name']}-0-0.{name}"
    assert jobset["spec"]["network"]["enableDNSHostnames"] is True
    port = int(env["PET_MASTER_PORT"]["value"])
    assert port in [p["containerPort"] for p in container["ports"]]
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert int(env["PET_NPROC_PER_NODE"]["value"]) == gpus
    assert [a for a in container["command"] if a.startswith("--run.dir=")] == [
        f"--run.dir=/runs/{name}"
    ]


def test_trainjob_uses_the_runtime_and_a_run_dir_of_its_own() -> None:
    docs = manifest("trainjob.yaml")
    runtime, job = docs["ClusterTrainingRuntime"], docs["TrainJob"]
    assert job["spec"]["runtimeRef"]["name"] == runtime["metadata"]["name"]
    assert "torch" in runtime["spec"]["mlPolicy"]  # Trainer sets torchrun's PET_* variables
    trainer = job["spec"]["trainer"]
    assert trainer["numNodes"] >= 2
    assert trainer["numProcPerNode"] == int(trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"])
    name = job["metadata"]["name"]
    assert [a for a in trainer["args"] if a.startswith("--run.dir=")] == [f"--run.dir=/runs/{name}"]


def containers_of(value: Any) -> list[dict]:
    """Every container spec (a dict with image and command) anywhere in a manifest."""
    if isinstance(value, list):
        return [c for item in value for c in containers_of(item)]
    if not isinstance(value, dict):
        return []
    found = [value] if "image" in value and "command" in value else []
    return found + [c for item in value.values() for c in containers_of(item)]


@pytest.mark.parametrize("name", ["jobset.yaml", "trainjob.yaml", "pytorchjob.yaml"])
def test_pods_run_the_image_read_only_with_a_writable_tmp(name) -> None:
    """The Containerfile's image: its working directory, a read-only root file system, and
    the three places it writes (run dir, /dev/shm, /tmp) mounted from volumes."""
    workdir = [
        line.split()[1]
        for line in (REPO / "Containerfile").read_text().splitlines()
        if line.startswith("WORKDIR ")
    ]
    text = (K8S / name).read_text()
    docs = [d for d in yaml.safe_load_all(text) if d]
    containers = containers_of(docs)
    assert containers
    for container in containers:
        assert container["workingDir"] == workdir[-1]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert {"/runs", "/dev/shm", "/tmp"} <= mounts

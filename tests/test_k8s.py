"""The Kubernetes manifests (scripts/k8s) as a cluster would admit and run them, without a cluster.

A manifest passes `kubectl apply` only if it passes three gates, and a CRD's schema is only the
first: the published CRD schemas of JobSet, Kubeflow Trainer v2 and the legacy training-operator
(tests/data/k8s, shipped: no network) with Kubernetes' strict field validation (an unknown field
is an error, as `kubectl apply` reports it since 1.27) and the CEL rules those schemas carry;
then the projects' validating admission webhooks, whose rules live in Go source and not in any
schema (re-implemented below, each citing its file and function); then the namespace's Pod
Security admission, here the "restricted" level (kubernetes/pod-security-admission policy/).
Under Trainer v2 the second gate fails quietly (as issue 21 reports): the TrainJob is admitted,
the controller's JobSet is refused by the JobSet webhook, and no pod starts, with nothing but an
event to say why.

Then what the pods do: restart rules against exitcodes.py, the rendezvous (an id, a timeout a
cold start fits in), the preemption budget torchrun really gives, threads per rank, and that the
`kubectl logs` command in each header finds the pod by labels the controllers really set.

Upstream sources read, at these commits (the CRDs' own are in tests/data/k8s/README.md):
- kubernetes-sigs/jobset 08dfbdfd: pkg/webhooks/jobset_webhook.go, pkg/util/placement/
  placement.go, pkg/controllers/jobset_controller.go.
- kubeflow/trainer 8c0f5059: pkg/webhooks/*.go, pkg/runtime/framework/plugins/{torch,jobset,
  coscheduling}/*.go, pkg/constants/constants.go.
- kubeflow/training-operator v1.9.0 (6f74c7f6): pkg/webhooks/pytorch/pytorchjob_webhook.go,
  pkg/controller.v1/common/pod.go, pkg/util/train/train_util.go, pkg/controller.v1/pytorch/
  elastic.go.
- kubernetes/pod-security-admission 8f84a87c: policy/check_*.go.
"""

from __future__ import annotations

import copy
import gzip
import importlib.util
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import config
import exitcodes

jsonschema = pytest.importorskip("jsonschema")

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "scripts" / "k8s"
MANIFESTS = ("jobset.yaml", "trainjob.yaml", "pytorchjob.yaml")
TORCH = Path(importlib.util.find_spec("torch").submodule_search_locations[0])  # not imported
# What the manifests leave a node for its image pull and scheduling before the rendezvous gives
# up: 20 minutes, past torchrun's own defaults (test_rendezvous_timeout_outlasts_a_cold_start).
MIN_RENDEZVOUS_TIMEOUT_S = 1200
# terminationGracePeriodSeconds beyond the longer of the supervisor's and torchrun's waits: the
# supervisor's own exit after its SIGKILL, and the kubelet's signal reaching it.
GRACE_MARGIN_S = 15


# --- the manifests ------------------------------------------------------------------------------


def manifest(name: str) -> dict[str, dict]:
    """kind -> document of one manifest file."""
    docs = [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    return {d["kind"]: d for d in docs}


def trainer_jobset(docs: dict[str, dict]) -> dict:
    """The JobSet Trainer v2 creates for the TrainJob: named after the TrainJob, the runtime's
    template, the trainer job's parallelism and completions = trainer.numNodes (the torch
    plugin's EnforceMLPolicy sets the trainer PodSet's count from numNodes; plugins/jobset/
    jobset.go syncParallelCount copies it into the Job template)."""
    job = docs["TrainJob"]
    spec = copy.deepcopy(docs["ClusterTrainingRuntime"]["spec"]["template"]["spec"])
    for rjob in spec["replicatedJobs"]:
        labels = rjob["template"].get("metadata", {}).get("labels", {})
        if labels.get("trainer.kubeflow.org/trainjob-ancestor-step") == "trainer":
            nodes = job["spec"]["trainer"]["numNodes"]
            rjob["template"]["spec"].update(parallelism=nodes, completions=nodes)
            rjob["template"]["spec"].setdefault("completionMode", "Indexed")
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": job["metadata"]["name"]},
        "spec": spec,
    }


def jobsets() -> list[tuple[str, dict]]:
    """Each JobSet the manifests make the API server admit: the plain one and Trainer's."""
    return [
        ("jobset.yaml", manifest("jobset.yaml")["JobSet"]),
        ("trainjob.yaml", trainer_jobset(manifest("trainjob.yaml"))),
    ]


def pod_specs(name: str) -> list[dict]:
    """Every pod template spec of a manifest."""
    docs = manifest(name)
    if "PyTorchJob" in docs:
        replicas = docs["PyTorchJob"]["spec"]["pytorchReplicaSpecs"].values()
        return [r["template"]["spec"] for r in replicas]
    jobset = docs["JobSet"] if "JobSet" in docs else trainer_jobset(docs)
    return [r["template"]["spec"]["template"]["spec"] for r in jobset["spec"]["replicatedJobs"]]


def training_container(name: str) -> dict:
    """The container that runs supervise.py -> torchrun -> train.py."""
    (container,) = [
        c for pod in pod_specs(name) for c in pod["containers"] if "train.py" in c["command"]
    ]
    return container


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def header(name: str) -> str:
    """The comment block a manifest opens with (its usage notes)."""
    lines = (K8S / name).read_text().splitlines()
    return "\n".join(line for line in lines[: lines.index("---")])


# --- gate 1: CRD schemas, strict, and their CEL rules -------------------------------------------


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


def served_versions() -> list[tuple[tuple[str, str], dict]]:
    """((apiVersion, kind), schema) of every version the shipped CRDs serve."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: seconds faster
    out = []
    for path in sorted((REPO / "tests" / "data" / "k8s").glob("*.yaml.gz")):
        for crd in yaml.load_all(gzip.decompress(path.read_bytes()), Loader=loader):
            if not crd:
                continue
            spec = crd["spec"]
            for version in spec["versions"]:
                if version.get("served"):
                    key = (f"{spec['group']}/{version['name']}", spec["names"]["kind"])
                    out.append((key, version["schema"]["openAPIV3Schema"]))
    return out


SERVED = served_versions()
SCHEMAS = {key: strict(schema) for key, schema in SERVED}
VALIDATORS = {key: jsonschema.Draft7Validator(schema) for key, schema in SCHEMAS.items()}


def errors(doc: dict) -> list[str]:
    validator = VALIDATORS[(doc["apiVersion"], doc["kind"])]
    return [
        f"{'.'.join(map(str, error.absolute_path))}: {error.message}"
        for error in validator.iter_errors(doc)
    ]


def cel_rules(schema: dict, path: str = "") -> Iterator[tuple[str, str]]:
    """(field path, rule) of every x-kubernetes-validations rule that applies on create (the
    `self == oldSelf` immutability rules apply to updates only)."""
    for rule in schema.get("x-kubernetes-validations", []):
        if rule["rule"] != "self == oldSelf":
            yield path, " ".join(rule["rule"].split())
    for key, sub in schema.get("properties", {}).items():
        yield from cel_rules(sub, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        yield from cel_rules(schema["items"], f"{path}[]")


def at(doc: Any, path: str) -> list[Any]:
    """The values at a cel_rules path ('.spec.a[].b'); none where a field is absent."""
    values = [doc]
    for part in filter(None, path.split(".")):
        many = part.endswith("[]")
        key = part.removesuffix("[]")
        values = [v[key] for v in values if isinstance(v, dict) and key in v]
        if many:
            values = [item for v in values for item in v]
    return values


def _no_in_order_startup_with_depends_on(spec: dict) -> bool:
    order = spec.get("startupPolicy", {}).get("startupPolicyOrder")
    return not (order == "InOrder" and any("dependsOn" in r for r in spec["replicatedJobs"]))


DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# The create-time CEL rules of the shipped CRDs, each as Python: the API server evaluates them,
# jsonschema does not. A newer CRD with a rule missing here fails
# test_every_cel_rule_of_the_shipped_crds_is_checked.
CEL: dict[tuple[str, str, str], Callable[[Any], bool]] = {
    (
        "JobSet",
        ".spec",
        "!(has(self.startupPolicy) && self.startupPolicy.startupPolicyOrder == 'InOrder' && "
        "self.replicatedJobs.exists(x, has(x.dependsOn)))",
    ): _no_in_order_startup_with_depends_on,
    (
        "JobSet",
        ".spec.volumeClaimPolicies[]",
        "self.templates.all(t, !has(t.metadata.namespace) || size(t.metadata.namespace) == 0)",
    ): lambda p: all(not t.get("metadata", {}).get("namespace") for t in p["templates"]),
    (
        "ClusterTrainingRuntime",
        ".spec.mlPolicy",
        "[has(self.torch), has(self.mpi), has(self.jax), has(self.xgboost),has(self.flux)]"
        ".filter(x, x).size() <= 1",
    ): lambda p: sum(k in p for k in ("torch", "mpi", "jax", "xgboost", "flux")) <= 1,
    ("ClusterTrainingRuntime", ".spec.mlPolicy.flux.numProcPerNode", "self >= 1"): lambda n: n >= 1,
    ("ClusterTrainingRuntime", ".spec.mlPolicy.mpi.numProcPerNode", "self >= 1"): lambda n: n >= 1,
    (
        "ClusterTrainingRuntime",
        ".spec.mlPolicy.torch.envInjection.targets[].containerNames",
        "!self.exists(c, c == 'node')",
    ): lambda names: "node" not in names,
    (
        "ClusterTrainingRuntime",
        ".spec.template.spec",
        "!(has(self.startupPolicy) && self.startupPolicy.startupPolicyOrder == 'InOrder' && "
        "self.replicatedJobs.exists(x, has(x.dependsOn)))",
    ): _no_in_order_startup_with_depends_on,
    (
        "ClusterTrainingRuntime",
        ".spec.template.spec.volumeClaimPolicies[]",
        "self.templates.all(t, !has(t.metadata.namespace) || size(t.metadata.namespace) == 0)",
    ): lambda p: all(not t.get("metadata", {}).get("namespace") for t in p["templates"]),
    ("TrainJob", "", "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')"): lambda d: bool(
        DNS1035.match(d["metadata"]["name"])
    ),
    ("TrainJob", "", "size(self.metadata.name) <= 63"): lambda d: len(d["metadata"]["name"]) <= 63,
    (
        "TrainJob",
        ".spec.initializer.dataset.storageUri",
        "self == '' || self.matches('^[A-Za-z][A-Za-z0-9+.-]*://.+$')",
    ): lambda u: u == "" or bool(re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://.+$", u)),
    (
        "TrainJob",
        ".spec.initializer.model.storageUri",
        "self == '' || self.matches('^[A-Za-z][A-Za-z0-9+.-]*://.+$')",
    ): lambda u: u == "" or bool(re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://.+$", u)),
    (
        "TrainJob",
        ".spec.managedBy",
        "self in ['trainer.kubeflow.org/trainjob-controller', 'kueue.x-k8s.io/multikueue']",
    ): lambda m: m in ("trainer.kubeflow.org/trainjob-controller", "kueue.x-k8s.io/multikueue"),
    ("TrainJob", ".spec.trainer.numProcPerNode", "self >= 1"): lambda n: n >= 1,
    ("TrainJob", ".status.trainerStatus", "has(self.lastUpdatedTime)"): lambda s: (
        "lastUpdatedTime" in s
    ),
}


def cel_errors(doc: dict) -> list[str]:
    (schema,) = [s for (_, kind), s in SERVED if kind == doc["kind"]]
    return [
        f"{path or '.'}: {rule}"
        for path, rule in cel_rules(schema)
        if not all(CEL[(doc["kind"], path, rule)](value) for value in at(doc, path))
    ]


def test_the_shipped_schemas_are_the_current_apis() -> None:
    assert ("jobset.x-k8s.io/v1alpha2", "JobSet") in SCHEMAS
    assert ("trainer.kubeflow.org/v1alpha1", "TrainJob") in SCHEMAS
    assert ("trainer.kubeflow.org/v1alpha1", "ClusterTrainingRuntime") in SCHEMAS
    assert ("kubeflow.org/v1", "PyTorchJob") in SCHEMAS


@pytest.mark.parametrize(
    ("name", "kinds"),
    [
        ("jobset.yaml", ["JobSet"]),
        ("trainjob.yaml", ["ClusterTrainingRuntime", "TrainJob"]),
        ("pytorchjob.yaml", ["PyTorchJob"]),
    ],
)
def test_manifests_validate_against_the_crd_schemas_and_their_cel_rules(name, kinds) -> None:
    docs = manifest(name)
    assert sorted(docs) == sorted([*kinds, "PersistentVolumeClaim"])
    for kind in kinds:
        assert errors(docs[kind]) == [], kind
        assert cel_errors(docs[kind]) == [], kind


def test_every_cel_rule_of_the_shipped_crds_is_checked() -> None:
    shipped = {(kind, *rule) for (_, kind), schema in SERVED for rule in cel_rules(schema)}
    assert shipped == set(CEL)


def test_the_validation_refuses_unknown_fields_wrong_types_and_values() -> None:
    """The check can fail: a misspelt field, a string for a number, an action JobSet lacks,
    a TrainJob name the CEL rule refuses."""
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
    trainjob = copy.deepcopy(manifest("trainjob.yaml")["TrainJob"])
    trainjob["metadata"]["name"] = "DDP.train"
    assert cel_errors(trainjob) == [".: self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')"]


def test_the_gang_scheduling_option_of_the_runtime_is_valid() -> None:
    """trainjob.yaml offers Trainer's podGroupPolicy (coscheduling) commented out, because
    without the scheduler-plugins' PodGroup CRD Trainer's coscheduling plugin cannot build the
    PodGroup (plugins/coscheduling/coscheduling.go Build) and no pod starts. Uncommented, it
    must pass the schema like the rest."""
    text = (K8S / "trainjob.yaml").read_text()
    block = re.search(r"^  # (podGroupPolicy:\n(?:  #   .*\n)+)", text, re.MULTILINE)
    assert block, "the commented podGroupPolicy block"
    option = yaml.safe_load(re.sub(r"^  # ", "", block.group(1), flags=re.MULTILINE))
    runtime = manifest("trainjob.yaml")["ClusterTrainingRuntime"]
    runtime["spec"].update(option)
    assert errors(runtime) == []
    timeout = option["podGroupPolicy"]["coscheduling"]["scheduleTimeoutSeconds"]
    assert timeout >= MIN_RENDEZVOUS_TIMEOUT_S


@pytest.mark.parametrize("name", MANIFESTS)
def test_kueue_queues_every_job(name) -> None:
    """Kueue's gang admission (all pods or none) needs only the queue label on the top-level
    object (JobSet, TrainJob, PyTorchJob integrations); without Kueue it is inert."""
    docs = manifest(name)
    top = next(docs[k] for k in ("JobSet", "TrainJob", "PyTorchJob") if k in docs)
    assert top["metadata"]["labels"]["kueue.x-k8s.io/queue-name"]


# --- gate 2: the admission webhooks -------------------------------------------------------------

# jobset_webhook.go: ruleNameFmt, minRuleNameLength, maxRuleNameLength.
RULE_NAME = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
# jobset_webhook.go validOnJobFailureReasons (the batch/v1 Job failure reasons).
JOB_FAILURE_REASONS = {
    "BackoffLimitExceeded",
    "DeadlineExceeded",
    "FailedIndexes",
    "MaxFailedIndexesExceeded",
    "PodFailurePolicy",
}
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
MAX_INT32 = 2**31 - 1


def dns1035_label(value: str) -> list[str]:
    """k8s.io/apimachinery validation.IsDNS1035Label."""
    out = [] if len(value) <= 63 else ["must be no more than 63 characters"]
    return out + ([] if DNS1035.match(value) else ["must be a DNS-1035 label"])


def jobset_defaults(jobset: dict) -> dict:
    """jobset_webhook.go Default: what the mutating webhook fills in before validation."""
    js = copy.deepcopy(jobset)
    spec = js["spec"]
    spec.setdefault("successPolicy", {"operator": "All"})
    for rjob in spec["replicatedJobs"]:
        rjob.setdefault("replicas", 1)  # CRD default (+kubebuilder:default=1)
        rjob.setdefault("groupName", "default")  # CRD default
        rjob["template"]["spec"].setdefault("completionMode", "Indexed")
    for i, rule in enumerate(spec.get("failurePolicy", {}).get("rules", [])):
        rule.setdefault("name", f"failurePolicyRule{i}")
    return js


def jobset_webhook_errors(jobset: dict) -> list[str]:
    """jobset_webhook.go ValidateCreate and validateFailurePolicy, for what a JobSet without
    coordinator, volumeClaimPolicies, in-place restart or RestartJob actions can violate (the
    test asserts that these are unused)."""
    js = jobset_defaults(jobset)
    name, spec = js["metadata"]["name"], js["spec"]
    out: list[str] = []
    if spec["replicatedJobs"] and "dependsOn" in spec["replicatedJobs"][0]:
        out.append("DependsOn can't be set for the first ReplicatedJob")
    subdomain = spec.get("network", {}).get("subdomain", "")
    if subdomain and not (len(subdomain) <= 253 and DNS1123_SUBDOMAIN.match(subdomain)):
        out.append(f"spec.network.subdomain {subdomain!r}: not a DNS-1123 subdomain")
    out += [f"spec.network.subdomain: {e}" for e in dns1035_label(subdomain)] if subdomain else []
    names: list[str] = []
    for rjob in spec["replicatedJobs"]:
        names.append(rjob["name"])
        job = rjob["template"]["spec"]
        if job.get("parallelism", 1) * rjob["replicas"] > MAX_INT32:
            out.append(f"{rjob['name']}: replicas * parallelism > MaxInt32")
        out += [f"groupName {rjob['groupName']!r}: {e}" for e in dns1035_label(rjob["groupName"])]
        # placement.GenJobName: <jobset>-<replicatedJob>-<job index>, the last index longest.
        longest_job = f"{name}-{rjob['name']}-{rjob['replicas'] - 1}"
        out += [f"job name {longest_job!r}: {e}" for e in dns1035_label(longest_job)]
        if job["completionMode"] == "Indexed" and "completions" in job:
            # placement.GenPodName plus the Job controller's 5-character random suffix.
            pod = f"{longest_job}-{job['completions'] - 1}-abcde"
            out += [f"pod name {pod!r}: {e}" for e in dns1035_label(pod)]
        # The Go code checks against the names seen so far, this one's included.
        out += [
            f"{rjob['name']} cannot depend on {d['name']}"
            for d in rjob.get("dependsOn", [])
            if d["name"] not in names
        ]
    for target in spec["successPolicy"].get("targetReplicatedJobs", []):
        if target not in names:
            out.append(f"successPolicy: replicatedJob {target!r} does not exist")
    out += failure_policy_errors(spec.get("failurePolicy", {}), names)
    return out


def failure_policy_errors(policy: dict, replicated_job_names: list[str]) -> list[str]:
    """jobset_webhook.go validateFailurePolicy."""
    out: list[str] = []
    rules = policy.get("rules", [])
    for rule in rules:
        if not 1 <= len(rule["name"]) <= 128:
            out.append(f"rule name {rule['name']!r}: length not within 1..128")
        if not RULE_NAME.match(rule["name"]):
            out.append(f"invalid failure policy rule name {rule['name']!r}")
        out += [
            f"rule {rule['name']!r}: replicatedJob {t!r} does not exist"
            for t in rule.get("targetReplicatedJobs", [])
            if t not in replicated_job_names
        ]
        out += [
            f"rule {rule['name']!r}: job failure reason {r!r} not recognized"
            for r in rule.get("onJobFailureReasons", [])
            if r not in JOB_FAILURE_REASONS
        ]
    names = [rule["name"] for rule in rules]
    out += [f"rule names are not unique: {n!r}" for n in sorted(set(names)) if names.count(n) > 1]
    return out


@pytest.mark.parametrize(("name", "jobset"), jobsets())
def test_jobsets_pass_the_jobset_admission_webhook(name, jobset) -> None:
    """The JobSet webhook refuses what the CRD schema admits: a failure-policy rule name with
    '-', a generated pod name over 63 characters, a rule naming a job that does not exist."""
    spec = jobset["spec"]
    # Parts of ValidateCreate this re-implementation leaves out: the manifests must not use them.
    assert not {"coordinator", "volumeClaimPolicies", "managedBy"} & set(spec)
    policy = spec["failurePolicy"]
    assert policy.get("restartStrategy", "Recreate") == "Recreate"
    assert all(r["action"] in ("FailJobSet", "RestartJobSet") for r in policy["rules"])
    assert jobset_webhook_errors(jobset) == []


def test_the_jobset_webhook_rules_can_fail() -> None:
    """Each re-implemented rule refuses what the Go code refuses."""
    jobset = manifest("jobset.yaml")["JobSet"]
    bad = copy.deepcopy(jobset)
    rules = bad["spec"]["failurePolicy"]["rules"]
    rules[0]["name"] = "no-restart-for-bad-input-or-no-progress"
    rules.append({**rules[0], "name": "a_b", "targetReplicatedJobs": ["worker"]})
    rules.append({**rules[0], "name": "a_b", "onJobFailureReasons": ["Evicted"]})
    long = bad["metadata"]["name"] = "x" * 57  # + "-node-0": 64 characters
    assert jobset_webhook_errors(bad) == [
        f"job name '{long}-node-0': must be no more than 63 characters",
        f"pod name '{long}-node-0-1-abcde': must be no more than 63 characters",
        "invalid failure policy rule name 'no-restart-for-bad-input-or-no-progress'",
        "rule 'a_b': replicatedJob 'worker' does not exist",
        "rule 'a_b': job failure reason 'Evicted' not recognized",
        "rule names are not unique: 'a_b'",
    ]
    for good in ("a", "FailJobSet_on_exit_2,3:76", "x_"):
        assert RULE_NAME.match(good)
    for bad_name in ("1a", "a-b", "a:", "_a", ""):
        assert not RULE_NAME.match(bad_name)


# kubeflow/trainer pkg/constants/constants.go TorchRunReservedEnvNames: the torch plugin sets them.
TORCHRUN_RESERVED_ENV = {
    "PET_NNODES",
    "PET_NPROC_PER_NODE",
    "PET_NODE_RANK",
    "PET_MASTER_ADDR",
    "PET_MASTER_PORT",
}

# trainingruntime_webhook.go expectedContainerNames: the container each ancestor step must have.
ANCESTOR_CONTAINERS = {
    "trainer": "node",
    "dataset-initializer": "dataset-initializer",
    "model-initializer": "model-initializer",
}


def runtime_webhook_errors(runtime: dict) -> list[str]:
    """kubeflow/trainer pkg/webhooks/trainingruntime_webhook.go validateReplicatedJobs (called by
    clustertrainingruntime_webhook.go ValidateCreate): a replicated job labelled as an ancestor
    step has 1 replica (CRD default) and the step's container ("node" for the trainer)."""
    required = ANCESTOR_CONTAINERS
    out = []
    for rjob in runtime["spec"]["template"]["spec"]["replicatedJobs"]:
        labels = rjob["template"].get("metadata", {}).get("labels", {})
        step = labels.get("trainer.kubeflow.org/trainjob-ancestor-step")
        if step not in required:
            continue
        if rjob.get("replicas", 1) != 1:
            out.append(f"{rjob['name']}: replicas always must be 1")
        containers = rjob["template"]["spec"]["template"]["spec"]["containers"]
        if required[step] not in [c["name"] for c in containers]:
            out.append(f"{rjob['name']}: must contain the required container {required[step]}")
    return out


def trainjob_webhook_errors(trainjob: dict, runtimes: list[dict]) -> list[str]:
    """trainjob_webhook.go ValidateCreate -> runtime ValidateObjects (pkg/runtime/core/
    clustertrainingruntime.go: the runtime must exist first) -> the plugins' Validate: torch
    (plugins/torch/torch.go: no reserved PET_* in trainer.env, envInjection targets exist) and
    jobset (plugins/jobset/jobset.go: initializers and runtimePatches, unused here)."""
    ref = trainjob["spec"]["runtimeRef"]
    if (
        ref.get("apiGroup", "trainer.kubeflow.org") != "trainer.kubeflow.org"
        or ref.get("kind", "ClusterTrainingRuntime") != "ClusterTrainingRuntime"
    ):
        return [f"unsupported runtime: {ref}"]
    found = [r for r in runtimes if r["metadata"]["name"] == ref["name"]]
    if not found:
        return [f"clusterTrainingRuntime {ref['name']!r} must be created before the TrainJob"]
    out = []
    env = {e["name"] for e in trainjob["spec"].get("trainer", {}).get("env", [])}
    if env & TORCHRUN_RESERVED_ENV:
        out.append(
            f"spec.trainer.env: must not have reserved envs {sorted(env & TORCHRUN_RESERVED_ENV)}"
        )
    torch_policy = found[0]["spec"]["mlPolicy"].get("torch", {})
    for target in torch_policy.get("envInjection", {}).get("targets", []):
        rjobs = found[0]["spec"]["template"]["spec"]["replicatedJobs"]
        names = {
            c["name"]
            for r in rjobs
            if r["name"] == target["jobName"]
            for c in r["template"]["spec"]["template"]["spec"]["containers"]
        }
        out += [
            f"envInjection target {c!r} not found"
            for c in target["containerNames"]
            if c not in names
        ]
    return out


def test_trainer_passes_the_trainer_admission_webhooks() -> None:
    docs = manifest("trainjob.yaml")
    job, runtime = docs["TrainJob"], docs["ClusterTrainingRuntime"]
    assert not {"initializer", "runtimePatches"} & set(job["spec"])  # not re-implemented
    assert runtime_webhook_errors(runtime) == []
    assert trainjob_webhook_errors(job, [runtime]) == []
    # ... and the rules can fail.
    bad = copy.deepcopy(job)
    bad["spec"]["trainer"]["env"] = [{"name": "PET_NNODES", "value": "3"}]
    assert trainjob_webhook_errors(bad, [runtime]) == [
        "spec.trainer.env: must not have reserved envs ['PET_NNODES']"
    ]
    assert trainjob_webhook_errors(job, []) == [
        "clusterTrainingRuntime 'ddp-pipeline' must be created before the TrainJob"
    ]
    text = (K8S / "trainjob.yaml").read_text()
    assert text.index("kind: ClusterTrainingRuntime") < text.index("kind: TrainJob")  # apply order
    renamed = copy.deepcopy(runtime)
    renamed["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"][
        "spec"
    ]["containers"][0]["name"] = "trainer"
    assert runtime_webhook_errors(renamed) == ["node: must contain the required container node"]


def pytorchjob_webhook_errors(job: dict) -> list[tuple[str, str]]:
    """training-operator v1.9.0 pkg/webhooks/pytorch/pytorchjob_webhook.go validatePyTorchJob,
    validateSpec, validatePyTorchReplicaSpecs: ("error" | "warning", message)."""
    out = [("error", "metadata.name")] if dns1035_label(job["metadata"]["name"]) else []
    spec = job["spec"]
    replicas = spec.get("pytorchReplicaSpecs", {})
    elastic = spec.get("elasticPolicy")
    if elastic is not None and "Worker" not in replicas:
        out.append(("error", "Worker must be configured if elastic policy is used"))
    if elastic is not None and "nProcPerNode" in elastic:
        out.append(("warning", "elasticPolicy.nProcPerNode is deprecated"))
        if "nprocPerNode" in spec:
            out.append(("error", "elasticPolicy.nProcPerNode must not be used with nprocPerNode"))
    for role, rspec in replicas.items():
        if role not in ("Master", "Worker"):
            out.append(("error", f"{role}: not a supported replica type"))
        containers = rspec["template"]["spec"]["containers"]
        out += [("error", f"{role}: image required") for c in containers if not c.get("image")]
        if "pytorch" not in [c["name"] for c in containers]:
            out.append(("error", f"{role}: needs a container named pytorch"))
        if role == "Master" and rspec.get("replicas") != 1:
            out.append(("error", "Master: replicas must be 1"))
        if role == "Worker" and rspec.get("replicas", 1) < 1:
            out.append(("error", "Worker: replicas must be at least 1"))
    return out


def test_the_pytorchjob_passes_its_webhook_without_warnings() -> None:
    job = manifest("pytorchjob.yaml")["PyTorchJob"]
    assert pytorchjob_webhook_errors(job) == []
    legacy = copy.deepcopy(job)
    legacy["spec"]["elasticPolicy"]["nProcPerNode"] = 1
    assert pytorchjob_webhook_errors(legacy) == [
        ("warning", "elasticPolicy.nProcPerNode is deprecated"),
        ("error", "elasticPolicy.nProcPerNode must not be used with nprocPerNode"),
    ]


# --- gate 3: Pod Security admission, "restricted" ------------------------------------------------

# policy/check_restrictedVolumes.go restrictedVolumes_1_0: the volume sources restricted allows.
RESTRICTED_VOLUME_SOURCES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "image",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def containers_in(pod: dict) -> list[dict]:
    """policy/visitor.go visitContainers: init, regular and ephemeral containers."""
    return [*pod.get("initContainers", []), *pod["containers"], *pod.get("ephemeralContainers", [])]


def _container_or_pod(pod: dict, container: dict, key: str) -> Any:
    """A securityContext field as it applies to the container: its own, else the pod's."""
    own = container.get("securityContext", {})
    return own[key] if key in own else pod.get("securityContext", {}).get(key)


def pss_restricted_errors(pod: dict) -> list[str]:
    """The "restricted" level of kubernetes/pod-security-admission (policy/check_*.go, the
    newest version of each check), for a Linux pod without user namespaces (hostUsers)."""
    out = []
    for c in containers_in(pod):
        context, name = c.get("securityContext", {}), c["name"]
        # check_allowPrivilegeEscalation.go allowPrivilegeEscalation_1_8: explicitly false.
        if context.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation != false")
        # check_capabilities_restricted.go capabilitiesRestricted_1_22: drop ALL, add at most
        # NET_BIND_SERVICE.
        capabilities = context.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []):
            out.append(f"{name}: capabilities.drop must include ALL")
        if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: capabilities.add beyond NET_BIND_SERVICE")
        # check_runAsNonRoot.go runAsNonRoot1_0: true on the container or the pod, false nowhere.
        if _container_or_pod(pod, c, "runAsNonRoot") is not True:
            out.append(f"{name}: runAsNonRoot != true")
        # check_runAsUser.go runAsUser1_23: never uid 0.
        if _container_or_pod(pod, c, "runAsUser") == 0:
            out.append(f"{name}: runAsUser=0")
        # check_seccompProfile_restricted.go seccompProfileRestricted_1_19 and
        # check_seccompProfile_baseline.go validSeccomp: RuntimeDefault or Localhost.
        seccomp = _container_or_pod(pod, c, "seccompProfile") or {}
        if seccomp.get("type") not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile.type must be RuntimeDefault or Localhost")
        # Baseline, which restricted includes: check_privileged.go, check_procMount_*.go,
        # check_hostPorts.go; check_seLinuxOptions.go, check_windowsHostProcess.go and
        # check_appArmorProfile.go allow some values, which this re-implementation refuses.
        if context.get("privileged"):
            out.append(f"{name}: privileged")
        if context.get("procMount", "Default") != "Default":
            out.append(f"{name}: procMount")
        if any(p.get("hostPort", 0) for p in c.get("ports", [])):
            out.append(f"{name}: hostPort")
        if {"seLinuxOptions", "windowsOptions", "appArmorProfile"} & set(context):
            out.append(f"{name}: seLinuxOptions/windowsOptions/appArmorProfile not checked here")
        # check_hostProbesAndhostLifecycle.go: probes and lifecycle hooks name no host.
        handlers = [c.get(k, {}) for k in ("livenessProbe", "readinessProbe", "startupProbe")]
        handlers += c.get("lifecycle", {}).values()
        if any(h.get(kind, {}).get("host") for h in handlers for kind in ("httpGet", "tcpSocket")):
            out.append(f"{name}: probe or lifecycle host")
    # check_restrictedVolumes.go: only the listed volume sources (no hostPath, nfs, ...).
    for volume in pod.get("volumes", []):
        if set(volume) - {"name"} - RESTRICTED_VOLUME_SOURCES:
            out.append(f"volume {volume['name']}: restricted volume type")
    # check_hostNamespaces.go, check_sysctls.go (no sysctls at all here), check_appArmorProfile.go.
    out += [f"pod: {k}" for k in ("hostNetwork", "hostPID", "hostIPC") if pod.get(k)]
    context = pod.get("securityContext", {})
    if _container_or_pod(pod, {}, "runAsNonRoot") is False or context.get("runAsUser") == 0:
        out.append("pod: root")
    if context.get("sysctls") or "seLinuxOptions" in context or "appArmorProfile" in context:
        out.append("pod: sysctls/seLinuxOptions/appArmorProfile not checked here")
    return out


@pytest.mark.parametrize("name", MANIFESTS)
def test_pods_pass_the_restricted_pod_security_standard(name) -> None:
    for pod in pod_specs(name):
        assert pss_restricted_errors(pod) == []


def test_the_pod_security_checks_can_fail() -> None:
    (pod,) = pod_specs("jobset.yaml")
    bad = copy.deepcopy(pod)
    del bad["securityContext"]["runAsNonRoot"], bad["securityContext"]["seccompProfile"]
    bad["containers"][0]["securityContext"] = {"capabilities": {"add": ["SYS_PTRACE"]}}
    bad["volumes"].append({"name": "data", "nfs": {"server": "nfs", "path": "/export"}})
    assert pss_restricted_errors(bad) == [
        "node: allowPrivilegeEscalation != false",
        "node: capabilities.drop must include ALL",
        "node: capabilities.add beyond NET_BIND_SERVICE",
        "node: runAsNonRoot != true",
        "node: seccompProfile.type must be RuntimeDefault or Localhost",
        "volume data: restricted volume type",
    ]


@pytest.mark.parametrize("name", MANIFESTS)
def test_pods_run_as_a_user_that_can_be_matched_to_an_nfs_export(name) -> None:
    """fsGroup does not change the ownership of NFS volumes, so the pods name the user and
    groups outright for the operator to match to the export's owner; not root (root_squash
    would make it nobody anyway)."""
    for pod in pod_specs(name):
        context = pod["securityContext"]
        assert context["runAsUser"] > 0 and context["runAsGroup"] > 0
        assert context["runAsGroup"] in context["supplementalGroups"]
        assert "fsGroup" not in context  # would promise what NFS does not do
    assert "fsGroup does not apply to NFS" in (K8S / name).read_text()


def test_the_image_runs_as_any_user() -> None:
    """What the pods' arbitrary uid relies on in the Containerfile: /runs writable by all,
    HOME in the writable /tmp, no USER that the pod would have to match."""
    text = (REPO / "Containerfile").read_text()
    assert "mkdir -m 1777 /runs" in text
    assert "HOME=/tmp" in text
    assert not re.search(r"^USER ", text, re.MULTILINE)


@pytest.mark.parametrize("name", MANIFESTS)
def test_every_node_runs_the_same_image_pinned_by_digest(name) -> None:
    """A tag can be pushed again between two nodes' pulls, and imagePullPolicy's default for a
    tag other than latest is IfNotPresent (a node with an old copy keeps it): before, the
    manifests named `ddp-pipeline:CHANGE-ME` with no policy, so nodes could run different
    code. A digest names one image; the placeholder must stay unmistakable."""
    for pod in pod_specs(name):
        for container in containers_in(pod):
            image = container["image"]
            repository, _, digest = image.partition("@sha256:")
            assert digest, f"{name}: {container['name']}: {image} is not pinned by digest"
            assert ":" not in repository.rsplit("/", 1)[-1], image  # no tag beside the digest
            assert "CHANGE-ME" in digest  # the placeholder is the digest podman push prints
            assert container["imagePullPolicy"] == "IfNotPresent"


@pytest.mark.parametrize("name", MANIFESTS)
def test_pods_run_the_image_read_only_with_a_writable_tmp(name) -> None:
    """The Containerfile's image: its working directory, a read-only root file system, and
    the three places it writes (run dir, /dev/shm, /tmp) mounted from volumes."""
    workdir = [
        line.split()[1]
        for line in (REPO / "Containerfile").read_text().splitlines()
        if line.startswith("WORKDIR ")
    ]
    container = training_container(name)
    assert container["workingDir"] == workdir[-1]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/runs", "/dev/shm", "/tmp"} <= mounts


# --- what the pods do ---------------------------------------------------------------------------


def job_templates() -> list[tuple[str, dict]]:
    """The JobSet spec of each manifest that has batch/v1 Jobs (the JobSet's, Trainer's)."""
    return [(name, jobset["spec"]) for name, jobset in jobsets()]


@pytest.mark.parametrize(("name", "jobset"), job_templates())
def test_restarts_follow_the_exit_codes(name, jobset) -> None:
    """exitcodes.py's classes: preempted (75) is replaced without spending the failure budget;
    the final exits (2 bad input, 3 diverged, 76 no progress) fail the Job and the JobSet, no
    restart; evictions are not failures; anything else restarts the whole JobSet (a fresh
    rendezvous), a bounded number of times."""
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
        "FailJob": list(exitcodes.FAIL_JOB_EXITS),
    }
    assert all(exitcodes.is_final(code) for code in by_action["FailJob"])
    assert not exitcodes.is_final(exitcodes.EXIT_PREEMPTED)
    assert job["backoffLimit"] == 0
    policy = jobset["failurePolicy"]
    assert policy["maxRestarts"] >= 1
    (rule,) = policy["rules"]
    assert rule["action"] == "FailJobSet" and rule["onJobFailureReasons"] == ["PodFailurePolicy"]
    assert "targetReplicatedJobs" not in rule  # every replicated job
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


def operator_restarts(restart_policy: str, code: int) -> bool:
    """Whether training-operator v1.9.0 runs a worker again after it exits with `code`:
    OnFailure and Always restart the container in place (the kubelet) and the operator replaces
    a failed pod (pkg/controller.v1/common/pod.go ReconcilePods); ExitCode (pod restartPolicy
    Never, pkg/core/pod.go SetRestartPolicy) replaces it only when IsRetryableExitCode
    (pkg/util/train/train_util.go: exitCode >= 128) and fails the job otherwise."""
    if restart_policy in ("OnFailure", "Always"):
        return code != 0
    if restart_policy == "ExitCode":
        return code >= 128
    return False


def test_the_pytorchjob_restart_policy_and_its_documented_limit() -> None:
    """No policy of the legacy operator stops on 2, 3 and 76 yet resumes after 75: ExitCode
    would make a preemption (75) and every crash (1) final. So the manifest keeps OnFailure,
    and its header and docs/running.md say that final exits are retried up to backoffLimit."""
    assert operator_restarts("ExitCode", exitcodes.EXIT_PREEMPTED) is False
    assert operator_restarts("ExitCode", exitcodes.EXIT_FAILED) is False
    job = manifest("pytorchjob.yaml")["PyTorchJob"]
    policy = job["spec"]["pytorchReplicaSpecs"]["Worker"]["restartPolicy"]
    assert policy == "OnFailure"
    assert operator_restarts(policy, exitcodes.EXIT_PREEMPTED)
    assert operator_restarts(policy, exitcodes.EXIT_FAILED)
    retried_finals = [c for c in exitcodes.FAIL_JOB_EXITS if operator_restarts(policy, c)]
    assert retried_finals == list(exitcodes.FAIL_JOB_EXITS)
    text = header("pytorchjob.yaml")
    assert all(re.search(rf"\b{code} \(", text) for code in retried_finals), "each one named"
    assert "IsRetryableExitCode" in text and "backoffLimit" in text
    assert job["spec"]["runPolicy"]["backoffLimit"] >= 1
    running = " ".join((REPO / "docs" / "running.md").read_text().split())
    assert "legacy operator" in running and "IsRetryableExitCode" in running


def rdzv_conf(container: dict, job: dict | None = None) -> dict[str, str]:
    """torchrun's --rdzv-conf as the pod gives it: PET_RDZV_CONF, or the PyTorchJob's
    elasticPolicy.rdzvConf that the operator turns into PET_RDZV_CONF (elastic.go
    generateEnvRDZVConf)."""
    if job is not None:
        return {kv["key"]: kv["value"] for kv in job["spec"]["elasticPolicy"].get("rdzvConf", [])}
    value = env_of(container).get("PET_RDZV_CONF", {}).get("value", "")
    return dict(item.split("=", 1) for item in value.split(",") if item)


def torch_default(relative: str, pattern: str) -> int:
    """A default read from the installed torch's source (no import)."""
    match = re.search(pattern, (TORCH / relative).read_text())
    assert match, (relative, pattern)
    return int(match.group(1))


@pytest.mark.parametrize("name", MANIFESTS)
def test_rendezvous_timeout_outlasts_a_cold_start(name) -> None:
    """The static rendezvous (jobset, trainjob) waits rdzv_configs["timeout"]: 900 s by default
    under torchrun (torch/distributed/launcher/api.py LaunchConfig.__post_init__; the handler's
    own default, 600 s in elastic/rendezvous/static_tcp_rendezvous.py, applies only without
    torchrun). The c10d rendezvous (pytorchjob) waits join_timeout, 600 s by default
    (elastic/rendezvous/dynamic_rendezvous.py RendezvousTimeout). A pod pending for a GPU or
    pulling a large image onto a fresh node can take longer; a timeout fails the pod and spends a
    restart, so the manifests wait MIN_RENDEZVOUS_TIMEOUT_S at least."""
    launcher_default = torch_default("distributed/launcher/api.py", r"default_timeout = (\d+)")
    static_default = torch_default(
        "distributed/elastic/rendezvous/static_tcp_rendezvous.py",
        r"_default_timeout_seconds = (\d+)",
    )
    join_default = torch_default(
        "distributed/elastic/rendezvous/dynamic_rendezvous.py",
        r'"join": timedelta\(seconds=(\d+)\)',
    )
    assert max(launcher_default, static_default, join_default) < MIN_RENDEZVOUS_TIMEOUT_S
    container = training_container(name)
    if name == "pytorchjob.yaml":
        job = manifest(name)["PyTorchJob"]
        assert job["spec"]["elasticPolicy"]["rdzvBackend"] == "c10d"
        assert int(rdzv_conf(container, job)["join_timeout"]) >= MIN_RENDEZVOUS_TIMEOUT_S
    else:
        assert "PET_RDZV_BACKEND" not in env_of(container)  # static: torchrun's default backend
        assert int(rdzv_conf(container)["timeout"]) >= MIN_RENDEZVOUS_TIMEOUT_S


# The labels a pod of a JobSet carries: jobset_controller.go labelAndAnnotateObject puts the
# JobSet's own name under this key on every Job and pod template it creates.
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"


@pytest.mark.parametrize("name", MANIFESTS)
def test_every_pod_of_a_job_gets_the_same_explicit_rendezvous_id(name) -> None:
    """torchrun's --rdzv-id (PET_RDZV_ID, torch/distributed/run.py, argparse_util.env) becomes
    LaunchConfig.run_id, the rendezvous handler's run id, and the workers' TORCHELASTIC_RUN_ID
    (elastic/agent/server/local_elastic_agent.py), which ckpt.rundir.job_id takes for the job's
    identity. Its default, "none", makes that identity the agent's pid instead. The id must
    be the same in every pod and survive pod and JobSet restarts: the job's name is."""
    docs = manifest(name)
    if name == "pytorchjob.yaml":
        job = docs["PyTorchJob"]
        # elastic.go Generate: elasticPolicy.rdzvId -> PET_RDZV_ID in every pod.
        assert job["spec"]["elasticPolicy"]["rdzvId"] == job["metadata"]["name"]
        assert "PET_RDZV_ID" not in env_of(training_container(name))
        return
    rdzv_id = env_of(training_container(name))["PET_RDZV_ID"]
    assert "value" not in rdzv_id
    path = rdzv_id["valueFrom"]["fieldRef"]["fieldPath"]
    assert path == f"metadata.labels['{JOBSET_NAME_LABEL}']"
    # The JobSet's name: the plain JobSet's, or Trainer's, which is the TrainJob's name.
    (_, jobset) = next(j for j in jobsets() if j[0] == name)
    assert jobset["metadata"]["name"] not in ("", "none")


def pod_environment(name: str) -> dict[str, str]:
    """The training container's environment on node 0 as the kubelet resolves it, with what
    the controller adds: Trainer's torch plugin its PET_* (plugins/torch/torch.go
    EnforceMLPolicy, port constants.ContainerTrainerPort), the training operator its elastic
    PET_* (pkg/controller.v1/pytorch/elastic.go Generate, envvar.go setPodEnv)."""
    docs = manifest(name)
    env: dict[str, str] = {}
    if name == "pytorchjob.yaml":
        job = docs["PyTorchJob"]
        elastic, job_name = job["spec"]["elasticPolicy"], job["metadata"]["name"]
        env |= {
            "PET_RDZV_ENDPOINT": f"{job_name}-worker-0:23456",
            "PET_RDZV_BACKEND": elastic["rdzvBackend"],
            "PET_NNODES": f"{elastic['minReplicas']}:{elastic['maxReplicas']}",
            "PET_MAX_RESTARTS": str(elastic["maxRestarts"]),
            "PET_NPROC_PER_NODE": job["spec"]["nprocPerNode"],
            "PET_RDZV_ID": elastic["rdzvId"],
            "PET_RDZV_CONF": ",".join(f"{kv['key']}={kv['value']}" for kv in elastic["rdzvConf"]),
        }
    (_, jobset) = next((j for j in jobsets() if j[0] == name), (None, {"metadata": {}}))
    fields = {
        f"metadata.labels['{JOBSET_NAME_LABEL}']": jobset["metadata"].get("name"),
        "metadata.annotations['batch.kubernetes.io/job-completion-index']": "0",
    }
    for item in training_container(name)["env"]:
        ref = item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        env[item["name"]] = fields[ref] if ref else item["value"]
    if name == "trainjob.yaml":
        trainer = docs["TrainJob"]["spec"]["trainer"]
        master = jobset["metadata"]["name"]
        env |= {
            "PET_NNODES": str(trainer["numNodes"]),
            "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
            "PET_NODE_RANK": "0",
            "PET_MASTER_ADDR": f"{master}-node-0-0.{master}",
            "PET_MASTER_PORT": "29400",
        }
    return env


@pytest.mark.parametrize("name", MANIFESTS)
def test_torchrun_takes_the_rendezvous_id_timeout_and_budget_from_the_pod(
    name, monkeypatch
) -> None:
    """The installed torchrun's own argument parsing (PET_* as option defaults) and launch
    configuration, in-process on the pod's environment: the run id is the job's name, the
    rendezvous waits the manifest's timeout (the static handler built from it, as
    launcher/api.py launch_agent builds it), the shutdown timeout is the manifest's, and
    OMP_NUM_THREADS is the manifest's, not torchrun's (it sets 1 only for several ranks)."""
    run = pytest.importorskip("torch.distributed.run")
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import create_rdzv_handler

    for key in [k for k in os.environ if k.startswith(("PET_", "TORCH", "OMP_"))]:
        monkeypatch.delenv(key)
    env = pod_environment(name)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    command = training_container(name)["command"]
    torchrun_args = command[command.index("torch.distributed.run") + 1 :]
    args = run.parse_args(torchrun_args)
    assert args.master_port is not None or args.rdzv_backend != "static"  # no 1-node fallback
    launch, _, _ = run.config_from_args(args)
    assert launch.run_id == manifest_job_name(name)
    assert launch.shutdown_timeout == int(env["SUPERVISE_GRACE_S"])
    assert os.environ["OMP_NUM_THREADS"] == env["OMP_NUM_THREADS"]
    params = RendezvousParameters(
        backend=launch.rdzv_backend,
        endpoint=launch.rdzv_endpoint,
        run_id=launch.run_id,
        min_nodes=launch.min_nodes,
        max_nodes=launch.max_nodes,
        **launch.rdzv_configs,
    )
    if launch.rdzv_backend == "static":
        handler = create_rdzv_handler(params)
        assert handler.get_run_id() == manifest_job_name(name)
        assert handler.timeout.total_seconds() >= MIN_RENDEZVOUS_TIMEOUT_S
    else:
        assert launch.rdzv_backend == "c10d"
        assert params.get_as_int("join_timeout") >= MIN_RENDEZVOUS_TIMEOUT_S


def manifest_job_name(name: str) -> str:
    """The name of the object a user applies and deletes (JobSet, TrainJob, PyTorchJob)."""
    docs = manifest(name)
    return next(docs[k] for k in ("JobSet", "TrainJob", "PyTorchJob") if k in docs)["metadata"][
        "name"
    ]


@pytest.mark.parametrize("name", MANIFESTS)
def test_the_preemption_budget_torchrun_gives_fits_the_grace_period(name) -> None:
    """After a stop signal torchrun SIGKILLs its workers shutdown_timeout seconds later
    (torch/distributed/launcher/api.py LaunchConfig.__post_init__: TORCH_ELASTIC_SHUTDOWN_TIMEOUT,
    default 30, unless --shutdown-timeout), and scripts/supervise.py waits SUPERVISE_GRACE_S.
    torchrun must give the workers at least the supervisor's grace, and the kubelet
    (terminationGracePeriodSeconds) more than both."""
    assert (
        torch_default("distributed/launcher/api.py", r'"TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "(\d+)"')
        == 30
    )
    (pod,) = pod_specs(name)
    container = training_container(name)
    env = env_of(container)
    grace = int(env["SUPERVISE_GRACE_S"]["value"])
    shutdown = int(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]["value"])
    assert shutdown >= grace >= 60
    assert pod["terminationGracePeriodSeconds"] >= max(grace, shutdown) + GRACE_MARGIN_S
    assert not [a for a in container["command"] if a.startswith("--shutdown")]  # env only


def resources_per_node(name: str) -> dict:
    if name == "trainjob.yaml":
        return manifest(name)["TrainJob"]["spec"]["trainer"]["resourcesPerNode"]
    return training_container(name)["resources"]


def ranks_per_node(name: str) -> int:
    docs = manifest(name)
    if name == "trainjob.yaml":
        return docs["TrainJob"]["spec"]["trainer"]["numProcPerNode"]
    if name == "pytorchjob.yaml":
        return int(docs["PyTorchJob"]["spec"]["nprocPerNode"])
    return int(env_of(training_container(name))["PET_NPROC_PER_NODE"]["value"])


@pytest.mark.parametrize("name", MANIFESTS)
def test_one_rank_pods_set_omp_num_threads(name) -> None:
    """torchrun sets OMP_NUM_THREADS=1 only when nproc_per_node > 1 and the variable is unset
    (torch/distributed/run.py run: `if "OMP_NUM_THREADS" not in os.environ and nproc_per_node
    > 1`); a single rank would otherwise start one thread per host core, not per CPU of its
    limit. The threads and the loader workers of every rank fit the CPU limit."""
    source = (TORCH / "distributed/run.py").read_text()
    assert 'if "OMP_NUM_THREADS" not in os.environ and nproc_per_node > 1:' in source
    ranks = ranks_per_node(name)
    env = env_of(training_container(name))
    if ranks == 1:
        assert "OMP_NUM_THREADS" in env
    threads = int(env.get("OMP_NUM_THREADS", {"value": "1"})["value"])
    loaders = config.DataConfig().num_workers
    assert "--data.num_workers" not in " ".join(training_container(name)["command"])
    cpus = int(resources_per_node(name)["limits"]["cpu"])
    assert 1 <= ranks * (threads + loaders) <= cpus


def kubectl_logs_selectors(name: str) -> list[dict[str, str]]:
    """The label selectors of the `kubectl logs` commands in a manifest's header."""
    out = []
    for line in header(name).splitlines():
        if not re.match(r"#\s+kubectl logs ", line):
            continue
        words = line.split()
        assert "-l" in words, f"{name}: `kubectl logs` by pod name: {line.strip()}"
        assert any(w.startswith("--tail=") for w in words), "a selector shows 10 lines by default"
        selector = words[words.index("-l") + 1]
        out.append(dict(term.split("=", 1) for term in selector.split(",")))
    return out


@pytest.mark.parametrize("name", MANIFESTS)
def test_kubectl_logs_selects_the_pods_by_labels_they_really_carry(name) -> None:
    """Pod names of an indexed Job are <job>-<index>-<random> (kubernetes pkg/controller/job/
    indexed_job_utils.go podGenerateNameWithIndex; the JobSet webhook adds "-abcde" when it
    checks their length), so `kubectl logs ddp-train-node-0-0` finds nothing; the header
    selects by labels. A JobSet's pods: jobset-name (labelAndAnnotateObject) and the Job
    controller's batch.kubernetes.io/job-completion-index (indexed_job_utils.go
    addCompletionIndexLabel, Kubernetes 1.28+). A PyTorchJob's:
    training.kubeflow.org/job-name (common/job_controller.go GenLabels) and replica-index
    (common/pod.go)."""
    selectors = kubectl_logs_selectors(name)
    assert selectors
    docs = manifest(name)
    if name == "pytorchjob.yaml":
        expected = {
            "training.kubeflow.org/job-name": docs["PyTorchJob"]["metadata"]["name"],
            "training.kubeflow.org/replica-index": "0",
        }
    else:
        (_, jobset) = next(j for j in jobsets() if j[0] == name)
        expected = {
            JOBSET_NAME_LABEL: jobset["metadata"]["name"],
            "batch.kubernetes.io/job-completion-index": "0",
        }
    for selector in selectors:
        assert selector.items() <= expected.items()


# --- rendezvous and job shape -------------------------------------------------------------------


def test_jobset_rendezvous_settings_agree() -> None:
    """Static rendezvous from environment variables torchrun reads: as many nodes as pods,
    node ranks from the completion index, node 0's stable host name, one rank per GPU."""
    jobset = manifest("jobset.yaml")["JobSet"]
    name = jobset["metadata"]["name"]
    (replicated,) = jobset["spec"]["replicatedJobs"]
    job = replicated["template"]["spec"]
    (container,) = job["template"]["spec"]["containers"]
    env = env_of(container)
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


@pytest.mark.parametrize("name", ["pytorchjob.yaml", "jobset.yaml", "trainjob.yaml"])
def test_each_manifest_trains_fsdp_by_one_more_argument(name) -> None:
    """The line each manifest documents (a commented `- --dist.strategy=fsdp` under the run's
    arguments) turns it into an fsdp job with sharded checkpoints: the arguments with it
    uncommented pass train.py's config as they are."""
    from cli import parse_args

    text = (K8S / name).read_text()
    assert text.count("# - --dist.strategy=fsdp") == 1
    docs = manifest(name)
    if "TrainJob" in docs:
        args = docs["TrainJob"]["spec"]["trainer"]["args"]
    else:
        command = next(
            c["command"]
            for doc in docs.values()
            for c in _all_containers(doc)
            if "train.py" in c.get("command", [])
        )
        args = command[command.index("train.py") + 1 :]
    cfg = parse_args([*args, "--dist.strategy=fsdp"])
    assert cfg.dist.strategy == "fsdp" and cfg.ckpt.format == "auto"


def _all_containers(value: Any) -> list[dict]:
    """Every dict with a `command` anywhere in a manifest document."""
    if isinstance(value, dict):
        found = [value] if "command" in value else []
        return found + [c for item in value.values() for c in _all_containers(item)]
    if isinstance(value, list):
        return [c for item in value for c in _all_containers(item)]
    return []

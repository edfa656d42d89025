"""Fuzzed specs never crash the operator; each invalid one gets a condition naming its field.

Specs are generated from the CRDs' own schemas (Hypothesis, `from_openapi`) and then broken on
purpose (a wrong type, a value out of bounds, an unknown enum value or field, a missing required
field, a pattern violated), as objects stored under an older, looser CRD could be.

* The bulk runs through `reconcile.reconcile` with the Kubernetes calls replaced: the result must be
  a status, or `kopf.TemporaryError` (a distillation waiting for its teacher) and nothing else.
  An invalid spec gets phase Invalid and `Valid=False` whose message names the broken field; an
  accepted one renders a PyTorchJob that the official PyTorchJob CRD schema (training-operator
  v1.9) accepts unchanged (nothing pruned), with pods the API server would accept, and a
  ConfigMap the trainer parses back into the same spec.
* A smaller, seeded sample goes through the real operator process against the test API server
  with a loosened CRD: every bad object ends Invalid with its field named, the good ones get
  their jobs, and the operator keeps running.
"""

from __future__ import annotations

import copy
import logging
import random
import re
import time
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gem.api.crds import render_crd
from gem.api.types import KINDS, parse_object
from gem_operator import kube, reconcile
from tests.kubeapi import KubeAPIServer, schema as crd_schema
from tests.kubeapi.server import PYTORCHJOB_CRD, load_yaml_docs
from tests.test_reliability_support import API, OperatorProcess, status_of

LOG = logging.getLogger("fuzz")
KIND_NAMES = list(KINDS)


# --------------------------------------------------------------------------- schemas


def spec_schema(kind: str) -> dict:
    """The CRD's OpenAPI schema of `spec`, as stored in the cluster."""
    return render_crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


#: int64: what the API server can store in an integer field.
INT64 = 2**63 - 1


def from_openapi(s: dict) -> st.SearchStrategy:
    """Values valid under a Kubernetes structural schema (the OpenAPI v3.0 dialect of CRDs).

    (hypothesis-jsonschema would do this from a JSON Schema, but its 0.23 release uses Hypothesis
    internals that Hypothesis 6.170 no longer has; the CRD dialect is small enough to map here.)
    Strings are arbitrary text or name-like, so specs are often runnable as well as often not;
    unknown fields are never generated (the API server prunes them: the mutations add them);
    lists and maps stay small.
    """
    if "enum" in s:
        values = st.sampled_from(s["enum"])
    elif s.get("x-kubernetes-int-or-string"):  # a quantity: an integer, or a string (its pattern applies to strings)
        string = st.from_regex(s["pattern"], fullmatch=True) if "pattern" in s else _text()
        values = st.one_of(st.integers(0, INT64), string)
    elif s.get("type") == "object":
        props = s.get("properties")
        if props:
            required = set(s.get("required", []))
            values = st.fixed_dictionaries(
                {k: from_openapi(v) for k, v in props.items() if k in required},
                optional={k: from_openapi(v) for k, v in props.items() if k not in required},
            )
        else:
            addl = s.get("additionalProperties")
            items = from_openapi(addl) if isinstance(addl, dict) else st.one_of(st.integers(), st.text(max_size=8), st.booleans())
            values = st.dictionaries(_text(), items, max_size=3)
    elif s.get("type") == "array":
        values = st.lists(from_openapi(s["items"]), max_size=3)
    elif s.get("type") == "string":
        values = st.from_regex(s["pattern"], fullmatch=True) if "pattern" in s else _text(s.get("minLength", 0))
    elif s.get("type") == "integer":
        lo, hi = s.get("minimum", -INT64), s.get("maximum", INT64)
        values = st.integers(lo + bool(s.get("exclusiveMinimum")), hi - bool(s.get("exclusiveMaximum")))
    elif s.get("type") == "number":
        values = st.floats(s.get("minimum"), s.get("maximum"), exclude_min=bool(s.get("exclusiveMinimum")),
                           exclude_max=bool(s.get("exclusiveMaximum")), allow_nan=False, allow_infinity=False)
    elif s.get("type") == "boolean":
        values = st.booleans()
    else:
        raise NotImplementedError(f"schema {s}")
    return st.one_of(st.none(), values) if s.get("nullable") else values


def _text(min_size: int = 0) -> st.SearchStrategy:
    name_like = st.from_regex(r"[a-z][-a-z0-9]{0,18}[a-z0-9]", fullmatch=True)
    path_like = st.from_regex(r"(/[a-z0-9_.-]{1,8}){1,3}", fullmatch=True)
    return st.one_of(name_like, path_like, st.text(min_size=max(min_size, 0), max_size=24)).filter(lambda x: len(x) >= min_size)


def pytorchjob_schema() -> dict:
    crd = next(d for d in load_yaml_docs([PYTORCHJOB_CRD]) if d.get("kind") == "CustomResourceDefinition")
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return version["schema"]["openAPIV3Schema"]


JOB_SCHEMA = pytorchjob_schema()


# --------------------------------------------------------------------------- mutations


def _leaves(schema: dict, value: Any, path: tuple = ()) -> list[tuple[tuple, dict, Any]]:
    """(path, schema, value) of every field present in `value`, depth first."""
    out = [(path, schema, value)] if path else []
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        addl = schema.get("additionalProperties")
        for key, sub in value.items():
            sub_schema = props.get(key) or (addl if isinstance(addl, dict) else None)
            if sub_schema is not None:
                out += _leaves(sub_schema, sub, (*path, key))
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            out += _leaves(schema["items"], item, (*path, i))
    return out


def _wrong_type(schema: dict, rng: random.Random) -> Any:
    """A value no lax parser turns into the schema's type."""
    t = "int-or-string" if schema.get("x-kubernetes-int-or-string") else schema.get("type")
    choices = {
        "int-or-string": [[1, 2], {"a": 1}, True],
        "string": [[1, 2], {"a": 1}],
        "integer": ["many", {"n": 1}, [3]],
        "number": ["lots", {"x": 1.5}, [0.1]],
        "boolean": ["maybe", {"b": True}, [True]],
        "object": ["text", [1, 2]],
        "array": ["text", {"a": 1}],
    }[t]
    return rng.choice(choices)


def mutations(schema: dict, spec: dict, rng: random.Random) -> list[tuple[str, dict]]:
    """Ways to break `spec`, each as (the field path the operator must name, broken spec)."""
    out = []
    for path, sub, value in _leaves(schema, spec):
        name = "spec" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)
        if sub.get("type") in ("string", "integer", "number", "boolean", "object", "array"):
            out.append((name, _set(spec, path, _wrong_type(sub, rng))))
        if "enum" in sub:
            out.append((name, _set(spec, path, "not-" + str(sub["enum"][0]))))
        if "minimum" in sub and sub.get("type") in ("integer", "number"):
            out.append((name, _set(spec, path, sub["minimum"] - (0 if sub.get("exclusiveMinimum") else 1))))
        if "maximum" in sub:
            out.append((name, _set(spec, path, sub["maximum"] + 1)))
        if sub.get("minLength"):
            out.append((name, _set(spec, path, "")))
        if "pattern" in sub:
            out.append((name, _set(spec, path, "12 parsecs")))
        if "properties" in sub and isinstance(value, dict):
            out.append((f"{name}.extraField", _set(spec, (*path, "extraField"), 1)))
        for req in sub.get("required", []):
            if isinstance(value, dict) and req in value:
                broken = _set(spec, path, {k: v for k, v in value.items() if k != req})
                out.append((f"{name}.{req}", broken))
    out.append(("spec.notAField", {**spec, "notAField": {"x": 1}}))
    for req in schema.get("required", []):
        out.append((f"spec.{req}", {k: v for k, v in spec.items() if k != req}))
    return out


def _set(spec: dict, path: tuple, value: Any) -> dict:
    out = copy.deepcopy(spec)
    cur: Any = out
    for p in path[:-1]:
        cur = cur[p]
    cur[path[-1]] = value
    return out


def names_field(message: str, path: str) -> bool:
    """Whether the Valid message points at `path` (spec.a.b[0].c), in the operator's notation."""
    plain = path.replace("[", ".").replace("]", "")
    wanted = [path, plain, re.sub(r"\[\d+\]", "", path)]
    normalized = message.replace("[", ".").replace("]", "").replace("'", "")
    return any(w in message or w.replace("[", ".").replace("]", "") in normalized for w in wanted)


# --------------------------------------------------------------------------- the reconcile, without a cluster


class FakeKube:
    """Stands in for `gem_operator.kube`: records writes, answers reads from a tiny world."""

    def __init__(self, teacher: dict | None = None) -> None:
        self.teacher = teacher
        self.config_maps: list[dict] = []
        self.jobs: list[dict] = []
        self.statuses: list[dict] = []
        self.events: list[tuple[str, str, str]] = []

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(kube, "get_pytorchjob", lambda ns, name: None)
        monkeypatch.setattr(kube, "get_resource", lambda kind, ns, name: copy.deepcopy(self.teacher))
        monkeypatch.setattr(kube, "ensure_config_map", lambda cm: self.config_maps.append(copy.deepcopy(cm)))
        monkeypatch.setattr(kube, "ensure_pytorchjob", self._ensure_job)
        monkeypatch.setattr(kube, "patch_status", lambda kind, ns, name, status, rv=None: self.statuses.append(status))
        monkeypatch.setattr(kube, "post_event", lambda obj, t, reason, msg, key=None: self.events.append((t, reason, msg)))
        monkeypatch.setattr(kube, "list_job_pods", lambda ns, name: [])
        monkeypatch.setattr(kube, "list_nodes", lambda selector=None: [])  # no node carries a topology label

    def _ensure_job(self, job: dict, owner_uid: str) -> tuple[dict, bool]:
        self.jobs.append(copy.deepcopy(job))
        return {**job, "metadata": {**job["metadata"], "uid": "job-uid"}}, True


TEACHER = {
    "apiVersion": API, "kind": "GEMTraining",
    "metadata": {"name": "teacher", "namespace": "default", "uid": "t-uid", "generation": 1},
    "spec": {"checkpoint": {"claimName": "teacher-ckpt", "path": "/ckpt"}},
    "status": {"phase": "Succeeded", "latestCheckpoint": "/ckpt/default/teacher/step-00000200"},
}


def body_of(kind: str, spec: Any, name: str = "fuzzed") -> dict:
    return {"apiVersion": API, "kind": kind,
            "metadata": {"name": name, "namespace": "default", "uid": "uid-1", "generation": 1}, "spec": spec}


def run_reconcile(kind: str, spec: Any, monkeypatch, teacher: dict | None = TEACHER) -> tuple[dict | None, FakeKube]:
    fake = FakeKube(teacher)
    fake.install(monkeypatch)
    try:
        status = reconcile.reconcile(kind, body_of(kind, spec), LOG)
    except kopf.TemporaryError:
        # Only a distillation waiting for its teacher may ask to be called again; it says why.
        assert kind == "LoopFMDistill" and fake.statuses and fake.statuses[-1]["phase"] == "WaitingForTeacher"
        return None, fake
    return status, fake


# --------------------------------------------------------------------------- what the API server would say


_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_QUALIFIED = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                        r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY = re.compile(r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)(m|[KMGTPE]i?|[kMGTPE]|[eE][+-]?[0-9]+)?$")


def job_problems(job: dict) -> list[str]:
    """Why the API server (or the training operator's webhook) would refuse this PyTorchJob or its pods."""
    problems = [f"{f}: {m}" for f, _, m in crd_schema.validate(job, JOB_SCHEMA, root=True)]
    pruned = crd_schema.prune(copy.deepcopy(job), JOB_SCHEMA, root=True)
    if pruned != job:
        problems.append("the CRD schema prunes fields of the rendered job")
    meta = job["metadata"]
    if not _DNS1035.match(meta["name"]) or len(meta["name"]) > 63:
        problems.append(f"job name {meta['name']!r} is not a DNS-1035 label")
    for key, value in meta.get("labels", {}).items():
        if not _QUALIFIED.match(key) or not _LABEL_VALUE.match(value) or len(value) > 63:
            problems.append(f"label {key}={value!r}")
    for rtype, rs in job["spec"]["pytorchReplicaSpecs"].items():
        problems += [f"{rtype}: {p}" for p in pod_problems(rs["template"]["spec"])]
    return problems


def pod_problems(pod: dict) -> list[str]:
    out = []
    for key, value in (pod.get("nodeSelector") or {}).items():
        if not _QUALIFIED.match(key) or not _LABEL_VALUE.match(value) or len(value) > 63:
            out.append(f"nodeSelector {key}={value!r}")
    for tol in pod.get("tolerations") or []:
        if tol.get("key") and not _QUALIFIED.match(tol["key"]):
            out.append(f"toleration key {tol['key']!r}")
        if tol.get("operator") == "Exists" and tol.get("value"):
            out.append("toleration Exists with a value")
        if not tol.get("key") and tol.get("operator") != "Exists":
            out.append("toleration without key must be Exists")
        if tol.get("value") and (not _LABEL_VALUE.match(tol["value"]) or len(tol["value"]) > 63):
            out.append(f"toleration value {tol['value']!r}")
    if pod.get("priorityClassName") and not _SUBDOMAIN.match(pod["priorityClassName"]):
        out.append(f"priorityClassName {pod['priorityClassName']!r}")
    for vol in pod["volumes"]:
        claim = (vol.get("persistentVolumeClaim") or {}).get("claimName")
        if claim is not None and not _SUBDOMAIN.match(claim):
            out.append(f"claimName {claim!r}")
    for ctr in pod["containers"]:
        if not ctr["image"] or ctr["image"] != ctr["image"].strip():
            out.append(f"image {ctr['image']!r}")
        mounts = [m["mountPath"] for m in ctr["volumeMounts"]]
        if len(set(mounts)) != len(mounts) or any(not m.startswith("/") for m in mounts):
            out.append(f"mountPaths {mounts}")
        for ref in ctr.get("envFrom") or []:
            if not _SUBDOMAIN.match(ref["secretRef"]["name"]):
                out.append(f"secret {ref['secretRef']['name']!r}")
        for kind in ("requests", "limits"):
            for res, q in (ctr["resources"].get(kind) or {}).items():
                if not _QUANTITY.match(str(q)):
                    out.append(f"{kind}.{res} {q!r}")
    return out


def check_accepted(kind: str, spec: dict, status: dict, fake: FakeKube) -> None:
    assert status["phase"] == "Created", status
    assert [c for c in status["conditions"] if c["type"] == "Valid"][0]["status"] == "True"
    (job,) = fake.jobs
    assert job_problems(job) == [], (spec, job_problems(job))
    # The trainer reads the ConfigMap: the same spec comes back out of it.
    (cm,) = fake.config_maps
    manifest = yaml.safe_load(cm["data"]["config.yaml"])
    reread = parse_object(manifest)
    original = parse_object({"apiVersion": API, "kind": kind, "metadata": {"name": "x"}, "spec": spec})
    if kind == "LoopFMDistill" and original.spec.teacher.gem_training:  # resolved to its checkpoint
        assert reread.spec.teacher.checkpoint == TEACHER["status"]["latestCheckpoint"]
        reread.spec.teacher = original.spec.teacher
    assert reread.spec == original.spec


def check_invalid(status: dict, field: str | None, fake: FakeKube) -> None:
    assert status["phase"] == "Invalid", status
    valid = [c for c in status["conditions"] if c["type"] == "Valid"][0]
    # an impossible parallel plan or an unsized topology level has its own reason (docs/operator.md)
    assert valid["status"] == "False" and valid["reason"] in ("InvalidSpec", "InvalidParallelPlan", "InvalidTopology")
    assert re.search(r"(spec|metadata)(\.|\[|:)", valid["message"]), valid["message"]
    if field is not None:
        assert names_field(valid["message"], field), (field, valid["message"])
    assert not fake.jobs and not fake.config_maps
    assert [e for e in fake.events if e[1] == valid["reason"]]


# --------------------------------------------------------------------------- property tests

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large, HealthCheck.filter_too_much])


@pytest.mark.parametrize("kind", KIND_NAMES)
@SETTINGS
@given(data=st.data())
def test_specs_valid_by_the_crd_schema_run_or_get_a_condition(kind, data, monkeypatch):
    spec = data.draw(from_openapi(spec_schema(kind)), label="spec")
    status, fake = run_reconcile(kind, spec, monkeypatch)
    if status is None:
        return  # waiting for the teacher
    if status["phase"] == "Invalid":
        # What the schema cannot say: cross-field rules and what the children's names and paths need.
        check_invalid(status, None, fake)
    else:
        check_accepted(kind, spec, status, fake)


@pytest.mark.parametrize("kind", KIND_NAMES)
@SETTINGS
@given(data=st.data())
def test_broken_specs_get_invalid_naming_the_field(kind, data, monkeypatch):
    schema = spec_schema(kind)
    spec = data.draw(from_openapi(schema), label="spec")
    rng = random.Random(data.draw(st.integers(0, 2**32), label="seed"))
    candidates = mutations(schema, spec, rng)
    field, broken = data.draw(st.sampled_from(candidates), label="mutation")
    status, fake = run_reconcile(kind, broken, monkeypatch)
    assert status is not None, (field, broken)
    check_invalid(status, field, fake)


@pytest.mark.parametrize("spec", [None, [], "text", 3, {"teacher": None}], ids=repr)
def test_a_spec_that_is_not_an_object(spec, monkeypatch):
    status, fake = run_reconcile("LoopFMDistill", spec, monkeypatch)
    check_invalid(status, "spec", fake)


@pytest.mark.parametrize("teacher", [None, {**TEACHER, "status": {"phase": "Running"}},
                                     {**TEACHER, "status": {"phase": "Failed", "message": "boom"}}])
def test_a_distillation_whose_teacher_is_not_ready_waits_or_fails(teacher, monkeypatch):
    status, fake = run_reconcile("LoopFMDistill", {"teacher": {"gemTraining": "teacher"}}, monkeypatch, teacher=teacher)
    if status is None:
        assert fake.statuses[-1]["phase"] == "WaitingForTeacher"
    else:
        assert status["phase"] == "Failed" and "boom" in status["message"]
    assert not fake.jobs


def test_rejected_children_make_the_resource_invalid(monkeypatch):
    """A job the API server refuses (a webhook, a stricter schema) is not retried forever."""
    fake = FakeKube()
    fake.install(monkeypatch)

    def refuse(job, uid):
        raise kube.Rejected("PyTorchJob default/fuzzed-train: spec.runPolicy.activeDeadlineSeconds: Invalid value")

    monkeypatch.setattr(kube, "ensure_pytorchjob", refuse)
    status = reconcile.reconcile("GEMTraining", body_of("GEMTraining", {}), LOG)
    assert status["phase"] == "Invalid"
    valid = [c for c in status["conditions"] if c["type"] == "Valid"][0]
    assert valid["reason"] == "JobRejected" and "spec.runPolicy.activeDeadlineSeconds" in valid["message"]


# --------------------------------------------------------------------------- through the operator process


def _loosened(crd: dict) -> dict:
    """The CRD as an older, schema-less version of it would have stored objects."""
    crd = copy.deepcopy(crd)
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    schema["properties"]["spec"] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    schema.pop("required", None)
    return crd


def sample(seed: int, count: int) -> list[tuple[str, str, dict, str | None]]:
    """(kind, name, spec, field) for `count` broken specs and a few good ones, from fixed seeds."""
    rng = random.Random(seed)
    base = {
        "GEMTraining": {"training": {"steps": 50, "learningRate": 0.01}, "parallelism": {"numNodes": 2},
                        "resources": {"nodeSelector": {"pool": "gpu"}, "tolerations": [{"key": "gpu", "operator": "Exists"}]},
                        "runPolicy": {"activeDeadlineSeconds": 600}, "scheduling": {"queueName": "ads"}},
        "LoopFMDistill": {"teacher": {"checkpoint": "/ckpt/x"}, "student": {"embeddingDim": 16},
                          "distillation": {"method": "loopfm"}},
    }
    out = []
    for i in range(count):
        kind = KIND_NAMES[i % 2]
        field, spec = rng.choice(mutations(spec_schema(kind), base[kind], rng))
        out.append((kind, f"bad-{i}", spec, field))
    out += [(kind, f"good-{kind.lower()}", base[kind], None) for kind in KIND_NAMES]
    return out


def test_the_operator_process_survives_fuzzed_objects(tmp_path):
    cases = sample(seed=7, count=16)
    with KubeAPIServer(executor=False, workdir=tmp_path / "kubeapi") as cluster:
        for kind in KIND_NAMES:
            cluster.apply_crd(_loosened(render_crd(kind)))
        op = OperatorProcess(cluster.kubeconfig_path, tmp_path / "operator.log").start()
        try:
            for kind, name, spec, _ in cases:
                cluster.create(API, kind, {"apiVersion": API, "kind": kind, "metadata": {"name": name}, "spec": spec})

            def settled() -> bool:
                return all(status_of(cluster, k, n).get("phase") in ("Invalid", "Created") for k, n, _, _ in cases)

            deadline = time.monotonic() + 60
            while not settled():
                assert time.monotonic() < deadline, {n: status_of(cluster, k, n).get("phase") for k, n, _, _ in cases}
                time.sleep(0.2)
            for kind, name, spec, field in cases:
                status = status_of(cluster, kind, name)
                if field is None:
                    assert status["phase"] == "Created", (name, status)
                    continue
                assert status["phase"] == "Invalid", (name, field, spec, status)
                valid = [c for c in status["conditions"] if c["type"] == "Valid"][0]
                assert valid["status"] == "False" and names_field(valid["message"], field), (field, valid["message"])
                assert any(e["reason"] == "InvalidSpec" for e in cluster.events(involved_name=name))
            jobs = sorted(j["metadata"]["name"] for j in cluster.list("kubeflow.org/v1", "PyTorchJob"))
            assert jobs == ["good-gemtraining-train", "good-loopfmdistill-distill"]
            assert op.alive
            log = Path(tmp_path / "operator.log").read_text()
            assert "Traceback" not in log, log[-3000:]
        finally:
            op.kill()

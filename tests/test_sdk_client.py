"""gem_sdk without a backend: public surface, backend contract, input forms, validation errors."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import textwrap

import pytest

import gem_sdk
from gem_sdk import (
    GEMClient,
    GEMError,
    GEMTraining,
    JobFailedError,
    LocalBackendConfig,
    NotFoundError,
    ValidationError,
    WaitTimeoutError,
    resolve_kind,
)
from gem_sdk._objects import failure_of, normalize_until, pod_name, to_model, wait_done
from gem_sdk.backends.local.selector import parse as parse_selector
from gem_sdk.backends.base import Backend
from gem_sdk.backends.kubernetes import KubernetesBackend
from gem_sdk.backends.local import LocalBackend
from gem_sdk.cli import exit_code

MANIFEST = textwrap.dedent(
    """\
    apiVersion: gem.dev/v1alpha1
    kind: GEMTraining
    metadata:
      name: quick
      labels: {team: ads}
    spec:
      training: {steps: 5}
    """
)


def test_public_surface_is_pinned():
    assert sorted(gem_sdk.__all__) == sorted([
        "TERMINAL_PHASES", "AlreadyExistsError", "BackendError", "Condition", "FieldError", "GEMClient", "GEMError",
        "GEMTraining", "JobFailedError", "KubernetesBackendConfig", "LocalBackendConfig", "LoopFMDistill",
        "MetricPoint", "NotFoundError", "ObjectInput", "Phase", "Ref", "ReplicaPod", "Resource", "Until",
        "ValidationError", "WaitTimeoutError", "resolve_kind",
    ])
    for name in gem_sdk.__all__:
        assert getattr(gem_sdk, name) is not None


@pytest.mark.parametrize("impl", [KubernetesBackend, LocalBackend, GEMClient])
def test_backends_keep_the_base_signatures(impl):
    methods = [n for n, f in inspect.getmembers(Backend, inspect.isfunction) if getattr(f, "__isabstractmethod__", False)]
    assert set(methods) == {"submit", "get", "list", "wait", "logs", "update", "pods", "metrics", "delete",
                            "_container_log", "_previous_log"}  # private: GEMClient.follow / logs(previous=True)
                                                                # are built on them, not delegates
    for name in methods:
        if impl is GEMClient and name.startswith("_"):
            continue
        sig = inspect.signature(getattr(impl, name))
        # GEMClient's own last parameters: metrics' timeout (it bounds the whole read itself, on both
        # backends), logs' previous (it reads the backend's _previous_log), delete's wait for the
        # job to be gone
        own = {"metrics": {"timeout": None}, "logs": {"previous": False},
               "delete": {"wait": False, "timeout": None}}.get(name, {}) if impl is GEMClient else {}
        if own:
            params = list(sig.parameters.values())
            assert {p.name: p.default for p in params[-len(own):]} == own, name
            sig = sig.replace(parameters=params[:-len(own)])
        assert sig == inspect.signature(getattr(Backend, name)), name


def test_public_methods_are_documented():
    public = [n for n, f in inspect.getmembers(GEMClient, inspect.isfunction) if not n.startswith("_")]
    assert {"suspend", "resume", "update", "get_conditions", "is_running", "is_succeeded", "is_failed", "pods",
            "pod_names", "all_logs", "metrics"} <= set(public)
    for name in ("submit", "get", "list", "wait", "logs", "delete", "update", "suspend", "resume", "get_conditions",
                 "pods", "all_logs", "metrics"):
        doc = getattr(GEMClient, name).__doc__
        assert "Args:" in doc and "Raises:" in doc, name


def test_client_rejects_unknown_config():
    with pytest.raises(ValueError, match="KubernetesBackendConfig or LocalBackendConfig"):
        GEMClient(object())  # type: ignore[arg-type]


def test_local_config_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("GEM_HOME", str(tmp_path / "home"))
    assert LocalBackendConfig().root == tmp_path / "home"
    monkeypatch.delenv("GEM_HOME")
    assert str(LocalBackendConfig().root).endswith(".gem")
    assert LocalBackendConfig(root=str(tmp_path)).root == tmp_path


def test_importing_the_sdk_and_cli_help_do_not_import_torch():
    code = (
        "import sys, gem_sdk, gem_sdk.cli\n"
        "from typer.testing import CliRunner\n"
        "r = CliRunner().invoke(gem_sdk.cli.app, ['--help'])\n"
        "assert r.exit_code == 0, r.output\n"
        "for sub in ('submit', 'list', 'logs'):\n"
        "    assert CliRunner().invoke(gem_sdk.cli.app, [sub, '--help']).exit_code == 0\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("alias,kind", [
    ("gemtraining", "GEMTraining"), ("gemtrainings", "GEMTraining"), ("gemt", "GEMTraining"), ("gt", "GEMTraining"),
    ("GEMTraining", "GEMTraining"), ("loopfmdistill", "LoopFMDistill"), ("lfd", "LoopFMDistill"),
    ("loopfmdistills.gem.dev", "LoopFMDistill"),
])
def test_kind_aliases(alias, kind):
    assert resolve_kind(alias) == kind


def test_unknown_kind_is_a_validation_error():
    with pytest.raises(ValidationError, match="unknown kind 'pods'"):
        resolve_kind("pods")


def test_exception_tree_and_exit_codes():
    assert issubclass(WaitTimeoutError, TimeoutError) and issubclass(WaitTimeoutError, GEMError)
    assert issubclass(ValidationError, ValueError) and issubclass(NotFoundError, LookupError)
    assert exit_code(JobFailedError(phase="Failed", reason="R", detail="d")) == 1
    assert exit_code(ValidationError("x")) == 2
    assert exit_code(NotFoundError("x")) == 3
    assert exit_code(WaitTimeoutError("x")) == 4
    assert exit_code(gem_sdk.BackendError("x")) == 5


# --------------------------------------------------------------------------- input forms


def test_every_input_form_gives_the_same_object(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(MANIFEST)
    import yaml

    as_dict = yaml.safe_load(MANIFEST)
    typed = GEMTraining.model_validate(as_dict)
    forms = [str(path), path, MANIFEST, as_dict, typed, json.dumps(as_dict)]
    objs = [to_model(f) for f in forms]
    assert all(o == objs[0] for o in objs)
    assert objs[0].spec.training.steps == 5 and objs[0].metadata.labels == {"team": "ads"}


def test_submit_drops_status_and_server_metadata_and_fills_kind():
    body = {"metadata": {"name": "x", "uid": "u", "resourceVersion": "9"}, "spec": {}, "status": {"phase": "Failed"}}
    obj = to_model(body, kind="gt", namespace="ns1")
    assert obj.kind == "GEMTraining" and obj.metadata.namespace == "ns1"
    assert obj.metadata.uid is None and obj.status is None


def test_mismatched_kind_or_namespace_is_refused():
    with pytest.raises(ValidationError, match="is a GEMTraining, but kind=LoopFMDistill"):
        to_model(MANIFEST, kind="lfd")
    with pytest.raises(ValidationError, match="does not match the namespace"):
        to_model({**to_model(MANIFEST, namespace="a").to_wire()}, namespace="b")


def test_validation_error_names_camelcase_paths_and_fixes():
    bad = {
        "kind": "GEMTraining",
        "metadata": {"name": "Bad_Name"},
        "spec": {
            "training": {"stpes": 3, "batchSize": 0, "precision": "fp16"},
            "model": {"embeddingDim": 30, "numHeads": 4},
            "data": {"source": "parquet"},
        },
    }
    with pytest.raises(ValidationError) as info:
        to_model(bad)
    err = info.value
    paths = {e.path: e.message for e in err.errors}
    assert "did you mean 'steps'" in paths["spec.training.stpes"]
    assert "greater than or equal to 1 (got 0)" in paths["spec.training.batchSize"]
    assert "'fp32', 'bf16' or 'mxfp8'" in paths["spec.training.precision"]
    assert "divisible by model.numHeads" in paths["spec.model"]
    assert "data.path is required" in paths["spec.data"]
    assert "lowercase" in paths["metadata.name"]
    assert "spec.training.stpes" in str(err)


@pytest.mark.parametrize("change,path,fix", [
    ({"metadata": ["name", "x"]}, "metadata", "must be a mapping"),
    ({"metadata": "x"}, "metadata", "must be a mapping"),
    ({"kind": ["GEMTraining"]}, "kind", "must be a string"),
    ({"kind": {"a": 1}}, "kind", "must be a string"),
    ({"metadata": {"name": "x", "namespace": ["a"]}}, "metadata.namespace", "must be a string"),
])
def test_a_misshapen_manifest_is_a_validation_error(change, path, fix):
    body = {"apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": "x"}, "spec": {}, **change}
    with pytest.raises(ValidationError) as info:
        to_model(body)
    assert [e.path for e in info.value.errors] == [path] and fix in info.value.errors[0].message


def test_missing_required_field_says_what_it_is():
    with pytest.raises(ValidationError, match=r"spec.teacher: required: set it \(The foundation model"):
        to_model({"kind": "LoopFMDistill", "metadata": {"name": "d"}, "spec": {}})


@pytest.mark.parametrize("source,match", [
    ("missing.yaml", "cannot read missing.yaml"),
    ("kind: [unclosed\n", "not valid YAML"),
    ("- a\n- b\n", "expected a GEMTraining or LoopFMDistill manifest"),
    (MANIFEST + "---\n" + MANIFEST, "exactly one manifest"),
    ("apiVersion: v1\nkind: Pod\nmetadata: {name: p}\n", "kind must be one of"),
])
def test_bad_inputs(source, match):
    with pytest.raises(ValidationError, match=match):
        to_model(source)


# --------------------------------------------------------------------------- helpers


@pytest.mark.parametrize("selector,ok", [
    ("team=ads", True), ("team==ads", True), ("team!=ads", False), ("team", True), ("!team", False),
    ("team in (ads, search)", True), ("team notin (ads)", False), ("team=ads,tier=gold", True),
    ("team=ads,tier=silver", False), ("missing notin (x)", True), ("", True),
])
def test_label_selectors(selector, ok):
    assert parse_selector(selector)({"team": "ads", "tier": "gold"}) is ok


def test_bad_label_selector():
    with pytest.raises(ValidationError, match="invalid label selector"):
        parse_selector("a=(b")


def test_pod_names():
    assert pod_name("GEMTraining", "q", "master", 0) == "q-train-master-0"
    assert pod_name("LoopFMDistill", "q", "Worker", 2) == "q-distill-worker-2"
    with pytest.raises(ValidationError):
        pod_name("GEMTraining", "q", "master", 1)
    with pytest.raises(ValidationError):
        pod_name("GEMTraining", "q", "chief", 0)


def _with_status(status):
    return GEMTraining.model_validate({**to_model(MANIFEST).to_wire(), "status": status})


def test_wait_outcomes():
    until = normalize_until(None)
    assert not wait_done(_with_status({"phase": "Running"}), until)
    assert wait_done(_with_status({"phase": "Succeeded"}), until)
    assert wait_done(_with_status({"phase": "Running"}), normalize_until("Running"))
    assert wait_done(_with_status({"phase": "Succeeded"}), normalize_until(["Running"]))  # terminal ends it
    failed = _with_status({"phase": "Failed", "message": "trainer failed: no data", "conditions": [
        {"type": "Failed", "status": "True", "reason": "PyTorchJobFailed", "message": "1 Master replica(s) failed"}]})
    with pytest.raises(JobFailedError) as info:
        wait_done(failed, until)
    assert info.value.reason == "PyTorchJobFailed" and info.value.detail == "trainer failed: no data"
    assert info.value.object is failed
    invalid = _with_status({"phase": "Invalid", "conditions": [
        {"type": "Valid", "status": "False", "reason": "InvalidSpec", "message": "spec.x: bad"}]})
    assert failure_of(invalid) == ("InvalidSpec", "spec.x: bad")
    with pytest.raises(ValidationError, match="unknown phase"):
        normalize_until(["Done"])

"""The SDK's Kubernetes backend against the API test server (tests/kubeapi): real HTTP, CRDs,
watches, the status subresource, fault injection and PyTorchJobs run as local processes."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from gem_sdk import (
    AlreadyExistsError,
    BackendError,
    GEMClient,
    GEMTraining,
    JobFailedError,
    KubernetesBackendConfig,
    LoopFMDistill,
    NotFoundError,
    ValidationError,
    WaitTimeoutError,
)
from gem_sdk.cli import app as gemctl_app

API = "gem.dev/v1alpha1"


def manifest(name: str = "quick", **labels: str) -> dict:
    return {
        "apiVersion": API,
        "kind": "GEMTraining",
        "metadata": {"name": name, "labels": labels},
        "spec": {"training": {"steps": 5}},
    }


@pytest.fixture
def client(kubeapi) -> GEMClient:
    return GEMClient(KubernetesBackendConfig(kubeconfig=str(kubeapi.kubeconfig_path)))


def set_status_later(kubeapi, name: str, statuses: list[dict], delay: float = 0.3, kind: str = "GEMTraining",
                     between=None) -> threading.Thread:
    def run() -> None:
        for status in statuses:
            time.sleep(delay)
            if between is not None:
                between()
            kubeapi.patch_status(API, kind, name, status)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


# --------------------------------------------------------------------------- CRUD


def test_config_namespace_comes_from_the_kubeconfig_context(client, kubeapi):
    assert client.default_namespace == "default"
    other = GEMClient(KubernetesBackendConfig(kubeconfig=str(kubeapi.kubeconfig_path), namespace="team-a"))
    assert other.default_namespace == "team-a"


def test_the_default_namespace_is_the_contexts_else_the_pods_service_account(tmp_path, monkeypatch):
    from kubernetes.config import incluster_config

    from gem_sdk.backends.kubernetes import utils
    from tests.kubeapi import write_kubeconfig

    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", "http://127.0.0.1:1", namespace="team-a")
    cfg = yaml.safe_load(kubeconfig.read_text())
    cfg["contexts"] += [{"name": "b", "context": {"cluster": "kubeapi", "user": "kubeapi", "namespace": "team-b"}},
                        {"name": "none", "context": {"cluster": "kubeapi", "user": "kubeapi"}}]
    kubeconfig.write_text(yaml.safe_dump(cfg))
    for context, namespace in ((None, "team-a"), ("b", "team-b"), ("none", "default")):
        assert GEMClient(KubernetesBackendConfig(kubeconfig=str(kubeconfig), context=context)).default_namespace \
            == namespace, context
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    assert GEMClient(KubernetesBackendConfig(context="b")).default_namespace == "team-b"

    # In a pod: no kubeconfig, the service account's namespace.
    for name, text in (("token", "t0ken"), ("ca.crt", "not checked until used"), ("namespace", "team-c\n")):
        (tmp_path / name).write_text(text)
    monkeypatch.delenv("KUBECONFIG")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(tmp_path / "token"))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(tmp_path / "ca.crt"))
    monkeypatch.setattr(utils, "_SA_NAMESPACE", tmp_path / "namespace")
    client = GEMClient(KubernetesBackendConfig())
    assert client.default_namespace == "team-c"
    assert client.backend.api_client.configuration.host == "https://10.0.0.1:443"
    assert GEMClient(KubernetesBackendConfig(namespace="mine")).default_namespace == "mine"


def test_missing_kubeconfig_is_a_backend_error(tmp_path):
    with pytest.raises(BackendError, match="no usable Kubernetes configuration"):
        GEMClient(KubernetesBackendConfig(kubeconfig=str(tmp_path / "nope")))


def test_a_kubeconfig_that_is_not_yaml_is_a_backend_error(tmp_path):
    # Before: yaml's ParserError, "a bug in gemctl" (exit 5 all the same, but no word of the file).
    bad = tmp_path / "config"
    bad.write_text("apiVersion: v1\nclusters: [\n  - {{{\n")
    with pytest.raises(BackendError, match=f"no usable Kubernetes configuration \\({bad}\\): while parsing"):
        GEMClient(KubernetesBackendConfig(kubeconfig=str(bad)))
    r = CliRunner().invoke(gemctl_app, ["list", "--kubeconfig", str(bad)])
    assert r.exit_code == 5 and f"Error: no usable Kubernetes configuration ({bad})" in r.output, r.output


def test_submit_each_input_form(client, kubeapi, tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest("from-file")))
    forms = {
        "from-file": str(path),
        "from-path": None,
        "from-yaml": yaml.safe_dump(manifest("from-yaml")),
        "from-dict": manifest("from-dict"),
        "from-model": GEMTraining.model_validate(manifest("from-model")),
    }
    forms["from-path"] = Path(tmp_path / "p.yaml")
    forms["from-path"].write_text(yaml.safe_dump(manifest("from-path")))
    for name, form in forms.items():
        obj = client.submit(form)
        assert isinstance(obj, GEMTraining)
        assert obj.metadata.name == name and obj.metadata.uid and obj.metadata.namespace == "default"
        stored = kubeapi.get(API, "GEMTraining", name)
        assert stored["spec"]["training"]["steps"] == 5


def test_submit_a_distillation_and_into_another_namespace(client, kubeapi):
    kubeapi.create("v1", "Namespace", {"metadata": {"name": "team-b"}})
    body = {"kind": "LoopFMDistill", "metadata": {"name": "student"}, "spec": {"teacher": {"gemTraining": "quick"}}}
    obj = client.submit(body, namespace="team-b")
    assert isinstance(obj, LoopFMDistill) and obj.metadata.namespace == "team-b"
    assert client.get("student", kind="lfd", namespace="team-b").spec.teacher.gem_training == "quick"
    with pytest.raises(NotFoundError):
        client.get("student", kind="lfd")  # default namespace


def test_get_and_list_with_selectors(client):
    client.submit(manifest("a", team="ads", tier="gold"))
    client.submit(manifest("b", team="ads"))
    client.submit(manifest("c", team="search"))
    client.submit({"kind": "LoopFMDistill", "metadata": {"name": "d", "labels": {"team": "ads"}},
                   "spec": {"teacher": {"checkpoint": "/ckpt"}}})
    assert client.get("a").metadata.labels == {"team": "ads", "tier": "gold"}
    assert [o.metadata.name for o in client.list(kind="gt")] == ["a", "b", "c"]
    assert [o.metadata.name for o in client.list(label_selector="team=ads")] == ["a", "b", "d"]
    assert [o.metadata.name for o in client.list(kind="gemtrainings", label_selector="team=ads,tier")] == ["a"]
    assert [o.kind for o in client.list(label_selector="team=ads")] == ["GEMTraining", "GEMTraining", "LoopFMDistill"]
    assert len(client.list(all_namespaces=True)) == 4


def test_validation_happens_before_sending(client, kubeapi):
    before = kubeapi.requests_served
    with pytest.raises(ValidationError) as info:
        client.submit({**manifest("bad"), "spec": {"training": {"steps": 0}}})
    assert info.value.errors[0].path == "spec.training.steps"
    assert kubeapi.requests_served == before
    assert kubeapi.get(API, "GEMTraining", "bad") is None


def test_server_side_422_is_a_validation_error(client, kubeapi, monkeypatch):
    # Skip the SDK's own check to see what the API server's CRD schema says.
    import gem_sdk.backends.kubernetes.backend as kb

    checked = kb.to_model

    def unchecked(obj, **kwargs):
        model = checked(obj, **kwargs)
        model.spec.training.steps = -1  # assignment is not validated
        return model

    monkeypatch.setattr(kb, "to_model", unchecked)
    with pytest.raises(ValidationError) as info:
        client.submit(manifest("srv"))
    assert "the API server rejected GEMTraining default/srv" in str(info.value)
    assert any("spec.training.steps" in e.path for e in info.value.errors)


def test_already_exists_and_not_found(client):
    client.submit(manifest("dup"))
    with pytest.raises(AlreadyExistsError, match="GEMTraining default/dup already exists"):
        client.submit(manifest("dup"))
    with pytest.raises(NotFoundError, match="GEMTraining default/ghost not found"):
        client.get("ghost")
    with pytest.raises(NotFoundError):
        client.delete("ghost")
    with pytest.raises(NotFoundError):
        client.wait("ghost", timeout=1)


def test_missing_namespace(client):
    with pytest.raises(NotFoundError, match="namespace nowhere not found"):
        client.submit(manifest("x"), namespace="nowhere")


def test_api_errors_never_leak(client, kubeapi):
    from kubernetes.client.rest import ApiException

    kubeapi.faults.add(path=r"/gemtrainings", status=500, message="etcd is sad", times=1)
    with pytest.raises(BackendError) as info:
        client.list(kind="gt")
    assert not isinstance(info.value, ApiException)
    assert info.value.status == 500 and "etcd is sad" in str(info.value)
    kubeapi.faults.add(path=r"/gemtrainings", status=403, message="no", times=1)
    with pytest.raises(BackendError, match="RBAC"):
        client.get("x")


def test_unreachable_api_is_a_backend_error(tmp_path):
    from tests.kubeapi import write_kubeconfig

    cfg = write_kubeconfig(tmp_path / "kc", "http://127.0.0.1:9")  # nothing listens on port 9
    client = GEMClient(KubernetesBackendConfig(kubeconfig=str(cfg)))
    client.backend.api_client.configuration.retries = 0
    with pytest.raises(BackendError, match="cannot reach the Kubernetes API"):
        client.get("x")


def test_missing_crds_are_explained(tmp_path):
    from tests.kubeapi import KubeAPIServer

    with KubeAPIServer(crd_paths=[], workdir=tmp_path / "bare") as bare:
        client = GEMClient(KubernetesBackendConfig(kubeconfig=str(bare.kubeconfig_path)))
        with pytest.raises(BackendError, match="CRDs installed"):
            client.submit(manifest())


def test_delete(client, kubeapi):
    client.submit(manifest("gone"))
    client.delete("gone")
    assert kubeapi.get(API, "GEMTraining", "gone") is None


def test_delete_takes_the_pytorchjob_and_its_pods_along(client, kubeapi):
    # What the operator creates is owned by the job (gem.api.render.owner_reference), and the pods
    # by the PyTorchJob: deleting the job with the SDK's propagation leaves nothing running.
    from tests.kubeapi.testing import pytorchjob, wait_for

    obj = client.submit(manifest("owner"))
    job = pytorchjob("owner-train", [sys.executable, "-c", "import time; time.sleep(60)"], workers=1)
    job["metadata"]["ownerReferences"] = [{"apiVersion": API, "kind": "GEMTraining", "name": "owner",
                                           "uid": obj.metadata.uid, "controller": True, "blockOwnerDeletion": True}]
    kubeapi.create("kubeflow.org/v1", "PyTorchJob", job)
    wait_for(lambda: [p.phase for p in client.pods("owner")] == ["Running", "Running"], what="both pods running")
    client.delete("owner", wait=True)
    assert kubeapi.get("kubeflow.org/v1", "PyTorchJob", "owner-train") is None
    assert kubeapi.list("v1", "Pod", label_selector="training.kubeflow.org/job-name=owner-train") == []


# --------------------------------------------------------------------------- wait


def test_wait_returns_when_the_status_turns_succeeded(client, kubeapi):
    job = client.submit(manifest("w"))
    before = kubeapi.requests_served
    set_status_later(kubeapi, "w", [
        {"phase": "Running", "progress": {"step": 2, "totalSteps": 5, "percent": 40}},
        {"phase": "Succeeded", "ne": 0.81, "metrics": {"ne/click": 0.8, "ne/conversion": 0.82}},
    ])
    final = client.wait(job, timeout=20)
    assert final.status.phase == "Succeeded" and final.status.ne == pytest.approx(0.81)
    assert final.status.metrics["ne/click"] == pytest.approx(0.8)
    # One list and one watch: no polling.
    assert kubeapi.requests_served - before <= 3


def test_wait_until_running(client, kubeapi):
    client.submit(manifest("r"))
    set_status_later(kubeapi, "r", [{"phase": "Created"}, {"phase": "Running"}])
    assert client.wait("r", until=["Running"], timeout=20).status.phase == "Running"


def test_wait_raises_job_failed_with_the_reason(client, kubeapi):
    client.submit(manifest("f"))
    set_status_later(kubeapi, "f", [{
        "phase": "Failed",
        "message": "trainer failed: data.path /nope does not exist",
        "conditions": [{"type": "Failed", "status": "True", "reason": "PyTorchJobFailed",
                        "message": "PyTorchJob f-train is failed because 1 Master replica(s) failed."}],
    }])
    with pytest.raises(JobFailedError) as info:
        client.wait("f", timeout=20)
    err = info.value
    assert err.reason == "PyTorchJobFailed" and "data.path /nope does not exist" in err.detail
    assert err.object.status.phase == "Failed"
    assert "GEMTraining default/f failed" in str(err)


def test_wait_on_invalid(client, kubeapi):
    client.submit(manifest("inv"))
    set_status_later(kubeapi, "inv", [{"phase": "Invalid", "message": "spec.x: bad", "conditions": [
        {"type": "Valid", "status": "False", "reason": "InvalidSpec", "message": "spec.x: bad"}]}])
    with pytest.raises(JobFailedError, match="InvalidSpec"):
        client.wait("inv", timeout=20)


def test_wait_times_out(client, kubeapi):
    client.submit(manifest("slow"))
    kubeapi.patch_status(API, "GEMTraining", "slow", {"phase": "Running"})
    start = time.monotonic()
    with pytest.raises(WaitTimeoutError) as info:
        client.wait("slow", timeout=1.5)
    assert time.monotonic() - start >= 1.4  # it waited the whole timeout (no upper bound: loaded CI)
    assert isinstance(info.value, TimeoutError) and info.value.object.status.phase == "Running"
    assert "phase Running" in str(info.value)


def test_wait_survives_dropped_watches(client, kubeapi):
    client.submit(manifest("drop"))
    set_status_later(kubeapi, "drop", [{"phase": "Running"}, {"phase": "Running", "message": "x"},
                                       {"phase": "Succeeded"}],
                     delay=0.4, between=kubeapi.faults.drop_watches)
    assert client.wait("drop", timeout=20).status.phase == "Succeeded"


def test_wait_relists_after_410_gone(client, kubeapi):
    client.submit(manifest("gone410"))
    kubeapi.faults.add(method="GET", path=r"gemtrainings.*watch=", status=410, message="too old resource version",
                       times=1)
    set_status_later(kubeapi, "gone410", [{"phase": "Succeeded"}], delay=0.5)
    assert client.wait("gone410", timeout=20).status.phase == "Succeeded"


def test_wait_notices_deletion(client, kubeapi):
    client.submit(manifest("del"))

    def delete_later() -> None:
        time.sleep(0.3)
        kubeapi.delete(API, "GEMTraining", "del")

    threading.Thread(target=delete_later, daemon=True).start()
    with pytest.raises(NotFoundError, match="deleted while waiting"):
        client.wait("del", timeout=20)


# --------------------------------------------------------------------------- logs


def _script_job(name: str, script: str, workers: int = 0) -> dict:
    container = {"name": "pytorch", "image": "python", "command": [sys.executable, "-c", script]}
    replica = {"replicas": 1, "restartPolicy": "Never", "template": {"spec": {"containers": [container]}}}
    specs = {"Master": replica}
    if workers:
        specs["Worker"] = {**replica, "replicas": workers}
    return {"metadata": {"name": name}, "spec": {"runPolicy": {"backoffLimit": 0}, "pytorchReplicaSpecs": specs}}


def test_logs_wait_for_the_pod_and_stream_it(client, kubeapi):
    client.submit(manifest("logs"))
    script = "import os,time\nfor i in range(3):\n    print('line', i, os.environ['HOSTNAME'], flush=True)\n    time.sleep(0.3)\n"

    def create_job_later() -> None:
        time.sleep(0.5)  # logs() must wait for the pod to exist
        kubeapi.create("kubeflow.org/v1", "PyTorchJob", _script_job("logs-train", script, workers=1))

    threading.Thread(target=create_job_later, daemon=True).start()
    lines = list(client.logs("logs", follow=True, timeout=30))
    assert lines == [f"line {i} logs-train-master-0" for i in range(3)]
    worker = list(client.logs("logs", replica="worker", index=0, follow=True, timeout=30))
    assert worker[-1] == "line 2 logs-train-worker-0"


def test_logs_of_a_missing_job_or_replica(client):
    with pytest.raises(NotFoundError):
        client.logs("ghost")
    client.submit(manifest("nolog"))
    with pytest.raises(ValidationError):
        client.logs("nolog", replica="master", index=3)
    with pytest.raises(WaitTimeoutError):
        client.logs("nolog", timeout=0.5)


def test_logs_of_a_replica_the_job_does_not_have(client):
    client.submit({**manifest("two"), "spec": {"training": {"steps": 5}, "parallelism": {"numNodes": 2}}})
    # Not a wait for a pod that can never exist (the timeout only bounds the wait for a real one).
    with pytest.raises(NotFoundError, match="has no pod two-train-worker-5: .* workers 0..0"):
        client.logs("two", replica="worker", index=5, timeout=5)
    with pytest.raises(NotFoundError, match="has no pod two-train-worker-1"):
        client.logs("two", replica="worker", index=1, timeout=5)


def test_logs_work_with_kubernetes_clients_before_35(client, kubeapi, monkeypatch):
    # kubernetes<35 has no Watch.stream(deserialize=...): it passes it on to the API call, which
    # raises ApiTypeError; and its events' `object` is a model, the JSON being in `raw_object`.
    import kubernetes

    stream = kubernetes.watch.Watch.stream

    def stream_before_35(self, func, *args, **kwargs):
        if "deserialize" in kwargs:
            func(*args, **kwargs)
        yield from stream(self, func, *args, **kwargs)

    monkeypatch.setattr(kubernetes.watch.Watch, "stream", stream_before_35)
    client.submit(manifest("old"))
    script = "print('hello', flush=True)\n"

    def create_job_later() -> None:
        time.sleep(0.5)  # logs() must watch for the pod
        kubeapi.create("kubeflow.org/v1", "PyTorchJob", _script_job("old-train", script))

    threading.Thread(target=create_job_later, daemon=True).start()
    assert list(client.logs("old", follow=True, timeout=30)) == ["hello"]


# --------------------------------------------------------------------------- review: configuration


def test_kubeconfig_env_set_after_import_is_used(kubeapi, tmp_path, monkeypatch):
    # The kubernetes client reads $KUBECONFIG once, when it is imported; a notebook or a test that
    # sets it later must still get that cluster, not ~/.kube/config or an error naming the wrong file.
    import kubernetes  # noqa: F401  (imported before the variable is set)

    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.kube/config to fall back on
    monkeypatch.setenv("KUBECONFIG", str(kubeapi.kubeconfig_path))
    client = GEMClient(KubernetesBackendConfig())
    client.submit(manifest("env"))
    assert [o.metadata.name for o in client.list()] == ["env"]


# --------------------------------------------------------------------------- review: auth errors


def test_unauthorized_says_to_renew_credentials(client, kubeapi):
    kubeapi.faults.add(path=r"/gemtrainings", status=401, message="Unauthorized", times=1)
    with pytest.raises(BackendError) as info:
        client.get("x")
    msg = str(info.value)
    assert info.value.status == 401 and "failed to get GEMTraining default/x" in msg
    assert "credentials" in msg and "RBAC" not in msg  # a 401 is not a missing permission


def test_forbidden_names_the_rbac_verb_and_resource(client, kubeapi):
    client.submit(manifest("rbac"))
    kubeapi.faults.add(method="PATCH", path=r"/gemtrainings", status=403, times=1, message=(
        'gemtrainings.gem.dev "rbac" is forbidden: User "bob" cannot patch resource "gemtrainings" '
        'in API group "gem.dev" in the namespace "default"'))
    with pytest.raises(BackendError) as info:
        client.update("rbac", labels={"a": "b"})
    msg = str(info.value)
    assert info.value.status == 403 and "cannot patch resource" in msg
    assert "kubectl auth can-i patch gemtrainings.gem.dev -n default" in msg
    # A 403 that is not RBAC's (an admission webhook, a namespace being deleted) gets no RBAC advice.
    kubeapi.faults.add(method="PATCH", path=r"/gemtrainings", status=403, times=1, message=(
        'admission webhook "validate.kyverno.svc" denied the request: team label required'))
    with pytest.raises(BackendError) as info:
        client.update("rbac", labels={"a": "b"})
    assert "team label required" in str(info.value) and "RBAC" not in str(info.value)
    # wait lists and watches: the permission to ask for is list/watch, not get.
    kubeapi.faults.add(method="GET", path=r"/gemtrainings\?", status=403, times=1, message=(
        'gemtrainings.gem.dev is forbidden: User "bob" cannot list resource "gemtrainings" in API group "gem.dev" '
        'in the namespace "default"'))
    with pytest.raises(BackendError, match="kubectl auth can-i list gemtrainings.gem.dev -n default"):
        client.wait("rbac", timeout=5)
    kubeapi.faults.add(method="GET", path=r"/pods/.*/log", status=403, times=1, message=(
        'pods "rbac-train-master-0" is forbidden: User "bob" cannot get resource "pods/log" in API group "" '
        'in the namespace "default"'))
    kubeapi.create("v1", "Pod", {"metadata": {"name": "rbac-train-master-0"}})
    kubeapi.patch_status("v1", "Pod", "rbac-train-master-0", {"phase": "Running"})
    with pytest.raises(BackendError, match="kubectl auth can-i get pods/log -n default"):
        client.logs("rbac", timeout=5)


# --------------------------------------------------------------------------- review: wait


def test_wait_without_any_status_says_the_operator_has_not_seen_it(client):
    client.submit(manifest("orphan"))
    with pytest.raises(WaitTimeoutError) as info:
        client.wait("orphan", timeout=0.5)
    assert "phase None" not in str(info.value)
    assert "no status yet" in str(info.value) and "gem operator" in str(info.value)


def test_wait_on_a_job_deleted_and_submitted_again_raises_not_found(client, kubeapi):
    client.submit(manifest("again"))

    def replace(obj) -> None:
        if obj.status is not None:
            return
        # Between the list and the watch: the job is deleted and submitted again (another uid,
        # already Succeeded), and the watch fails with 410 Gone, so wait lists again.
        kubeapi.faults.add(method="GET", path=r"gemtrainings.*watch=", status=410, times=1)
        kubeapi.delete(API, "GEMTraining", "again")
        kubeapi.create(API, "GEMTraining", manifest("again"))
        kubeapi.patch_status(API, "GEMTraining", "again", {"phase": "Succeeded"})

    with pytest.raises(NotFoundError, match="deleted while waiting"):
        client.wait("again", timeout=20, callback=replace)


def test_wait_lets_the_callbacks_own_errors_out(client, kubeapi):
    # An OSError of the callback (say, its progress file) is not a dropped watch to retry.
    client.submit(manifest("cb"))
    calls = []

    def callback(obj) -> None:
        calls.append(obj)
        if len(calls) == 2:
            raise FileNotFoundError("progress.txt")

    set_status_later(kubeapi, "cb", [{"phase": "Running"}, {"phase": "Succeeded"}])
    with pytest.raises(FileNotFoundError, match="progress.txt"):
        client.wait("cb", timeout=20, callback=callback)


# --------------------------------------------------------------------------- review: logs


def test_logs_of_a_suspended_job_without_pods_is_not_found_at_once(client, kubeapi):
    client.submit({**manifest("held"), "spec": {"training": {"steps": 5}, "suspend": True}})
    kubeapi.patch_status(API, "GEMTraining", "held", {"phase": "Suspended"})
    with pytest.raises(NotFoundError, match="Suspended"):
        client.logs("held", timeout=20)
    # Resumed, but the operator has not recreated the pods yet: that is worth waiting for.
    client.resume("held")
    with pytest.raises(WaitTimeoutError):
        client.logs("held", timeout=0.5)


def test_logs_of_a_pod_that_never_started_in_a_job_that_ended(client, kubeapi):
    # cleanPodPolicy None (the default) keeps a pod stuck in Pending after the job failed, e.g.
    # an image that cannot be pulled and activeDeadlineSeconds: there will never be a log.
    client.submit(manifest("stuck"))
    kubeapi.create("v1", "Pod", {"metadata": {"name": "stuck-train-master-0"},
                                 "spec": {"containers": [{"name": "pytorch", "image": "nope"}]}})
    kubeapi.patch_status("v1", "Pod", "stuck-train-master-0", {"phase": "Pending", "containerStatuses": [
        {"name": "pytorch", "restartCount": 0, "state": {"waiting": {"reason": "ImagePullBackOff"}}}]})
    kubeapi.patch_status(API, "GEMTraining", "stuck", {"phase": "Failed", "conditions": [
        {"type": "Failed", "status": "True", "reason": "DeadlineExceeded", "message": "deadline"}]})
    with pytest.raises(NotFoundError, match="never started and the job is Failed"):
        client.logs("stuck", follow=True, timeout=20)


def test_logs_of_a_pod_deleted_just_after_it_started(client, kubeapi, monkeypatch):
    # The pod goes (suspend, preemption, the job deleted) between seeing it start and reading its
    # log: that is a missing pod, not missing CRDs.
    client.submit(manifest("brief"))
    kubeapi.create("v1", "Pod", {"metadata": {"name": "brief-train-master-0"}})
    kubeapi.patch_status("v1", "Pod", "brief-train-master-0", {"phase": "Running"})
    wait_for_pod = client.backend._wait_for_pod

    def then_delete(*args, **kwargs):
        pod = wait_for_pod(*args, **kwargs)
        kubeapi.delete("v1", "Pod", "brief-train-master-0")
        return pod

    monkeypatch.setattr(client.backend, "_wait_for_pod", then_delete)
    with pytest.raises(NotFoundError, match="pod default/brief-train-master-0 of GEMTraining default/brief"):
        client.logs("brief", timeout=20)


def test_wait_rides_out_an_api_server_restart(client, kubeapi):
    # A control-plane restart: the watch drops and the API answers 503 (or nothing) for a moment.
    # The wait goes on once it is back, as kubectl's would, instead of failing a long training's wait.
    client.submit(manifest("blip"))

    def outage() -> None:
        if kubeapi.faults.rules:
            return  # one outage, during the first status change
        kubeapi.faults.add(method="GET", path=r"/gemtrainings", status=503, times=3, watch=False,
                           message="the server is currently unable to handle the request")
        kubeapi.faults.add(method="GET", path=r"/gemtrainings", status=503, times=1, watch=True)
        kubeapi.faults.drop_watches()

    set_status_later(kubeapi, "blip", [{"phase": "Running"}, {"phase": "Succeeded"}], between=outage)
    assert client.wait("blip", timeout=60).status.phase == "Succeeded"


# --------------------------------------------------------------------------- review 2: timeouts, outages, selectors


@pytest.fixture
def silent_api(tmp_path):
    """A kubeconfig for an API server that takes connections and never answers (hung, or
    blackholed behind a load balancer), and the connections it took."""
    from tests.kubeapi import write_kubeconfig

    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    taken: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                taken.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield write_kubeconfig(tmp_path / "silent", f"http://127.0.0.1:{server.getsockname()[1]}"), taken
    stop.set()
    thread.join()
    for conn in [server, *taken]:
        conn.close()


@pytest.mark.timeout(120)  # the guard: before, these calls never returned
def test_wait_and_logs_keep_to_their_timeout_when_the_api_never_answers(silent_api):
    kubeconfig, taken = silent_api
    client = GEMClient(KubernetesBackendConfig(kubeconfig=str(kubeconfig)))
    with pytest.raises(WaitTimeoutError, match=r"timed out after 1s .* \(no answer from the Kubernetes API\)") as info:
        client.wait("quick", timeout=1)
    assert isinstance(info.value, TimeoutError)
    assert len(taken) == 1  # not sent again: urllib3's default retries would make it 4 timeouts
    with pytest.raises(WaitTimeoutError, match="timed out waiting for pod default/quick-train-master-0 to start"):
        client.logs("quick", timeout=1)
    r = CliRunner().invoke(gemctl_app, ["wait", "gt", "quick", "--kubeconfig", str(kubeconfig), "--timeout", "1"])
    assert r.exit_code == 4, r.output


@pytest.mark.timeout(120)
def test_calls_without_a_timeout_give_up_on_an_api_that_never_answers(silent_api, monkeypatch):
    from gem_sdk.backends.kubernetes import backend

    monkeypatch.setattr(backend, "_READ_TIMEOUT_S", 0.5)  # the default, 60 s, is too long for a test
    kubeconfig, _ = silent_api
    client = GEMClient(KubernetesBackendConfig(kubeconfig=str(kubeconfig)))
    for call in (lambda: client.get("quick"), lambda: client.list(), lambda: client.wait("quick")):
        with pytest.raises(BackendError, match="cannot reach the Kubernetes API: .*Read timed out"):
            call()


def test_logs_ride_out_an_api_server_restart_while_waiting_for_the_pod(client, kubeapi):
    # As wait does: once logs has the job, 429 and 5xx answers of its lists, gets and watches are
    # waited out (before, the first one ended logs with BackendError).
    client.submit(manifest("outage"))
    job_get = r"/gemtrainings/outage$"
    rules = [
        kubeapi.faults.add(method="GET", path=job_get, times=1),  # logs' own get passes
        kubeapi.faults.add(method="GET", path=r"/pods\?", status=503, times=2, watch=False,
                           message="the server is currently unable to handle the request"),
        kubeapi.faults.add(method="GET", path=r"/pods\?", status=429, times=1, watch=False),
        kubeapi.faults.add(method="GET", path=job_get, status=500, times=1),
        kubeapi.faults.add(method="GET", path=r"/pods\?", status=503, times=1, watch=True),
    ]

    def create_job_after_the_outage() -> None:
        while rules[-1].hits == 0:  # the watch's 503, the last of them
            time.sleep(0.05)
        kubeapi.create("kubeflow.org/v1", "PyTorchJob", _script_job("outage-train", "print('back', flush=True)\n"))

    threading.Thread(target=create_job_after_the_outage, daemon=True).start()
    assert list(client.logs("outage", follow=True, timeout=60)) == ["back"]
    assert [r.hits for r in rules] == [1, 2, 1, 1, 1]


def test_list_with_a_malformed_selector_names_it(client, kubeapi):
    client.submit(manifest("sel", team="ads"))
    with pytest.raises(ValidationError) as info:
        client.list(label_selector="team in (ads")
    assert str(info.value) == ("invalid label selector 'team in (ads': unable to parse requirement: "
                               "found '', expected: ',' or ')'")
    assert [o.metadata.name for o in client.list(label_selector="team in (ads),!canary")] == ["sel"]
    r = CliRunner().invoke(gemctl_app, ["list", "-l", "team in (ads", "--kubeconfig", str(kubeapi.kubeconfig_path)])
    assert r.exit_code == 2 and "invalid label selector 'team in (ads'" in r.output, r.output


# --------------------------------------------------------------------------- review 3: dropped answers, metrics, previous logs


def test_pods_whose_answer_is_cut_off_is_a_backend_error(client, kubeapi):
    # The connection dropped halfway through the pod list's body: urllib3's ProtocolError
    # (IncompleteRead) leaked out of pods() before, past gemctl's error handling.
    client.submit(manifest("cut"))
    rule = kubeapi.faults.add(method="GET", path=r"/api/v1/namespaces/default/pods\?", truncate=True, times=1)
    with pytest.raises(BackendError, match="failed to list pods of GEMTraining default/cut: cannot reach the "
                                           "Kubernetes API: .*IncompleteRead"):
        client.pods("cut")
    assert rule.hits == 1
    assert client.pods("cut") == []  # the next answer is whole
    kubeapi.faults.add(method="GET", path=r"/api/v1/namespaces/default/pods\?", truncate=True, times=1)
    r = CliRunner().invoke(gemctl_app, ["pods", "gt", "cut", "--kubeconfig", str(kubeapi.kubeconfig_path)])
    assert r.exit_code == 5 and "Error: failed to list pods of GEMTraining default/cut" in r.output, r.output


@pytest.fixture
def trickling_mlflow():
    """The address of an MLflow that is alive but never done answering: it sends a byte of its
    answer every 0.2 s, so that no read ever times out."""
    import http.server

    stop = threading.Event()

    class Trickle(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "1000000")
            self.end_headers()
            while not stop.is_set():
                try:
                    self.wfile.write(b" ")
                    self.wfile.flush()
                except OSError:
                    return
                stop.wait(0.2)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    stop.set()
    server.shutdown()
    server.server_close()


@pytest.mark.timeout(120)  # the guard: before, metrics never returned
def test_metrics_keep_to_their_timeout_when_mlflow_never_finishes_answering(client, kubeapi, trickling_mlflow,
                                                                            monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    kubeapi.create(API, "GEMTraining", {"metadata": {"name": "slow"}, "spec": {
        "training": {"steps": 3}, "mlflow": {"trackingUri": trickling_mlflow}}})
    with pytest.raises(WaitTimeoutError) as info:
        client.metrics("slow", timeout=1)
    assert str(info.value) == ("timed out after 1s reading the metrics of GEMTraining default/slow from MLflow: "
                               "it is slow or not answering; pass a longer timeout (gemctl metrics --timeout)")
    with pytest.raises(WaitTimeoutError, match="timed out after -1s"):  # passed, as for wait (not a ValueError)
        client.metrics("slow", timeout=-1)
    r = CliRunner().invoke(gemctl_app, ["metrics", "gt", "slow", "--timeout", "1",
                                        "--kubeconfig", str(kubeapi.kubeconfig_path)])
    assert r.exit_code == 4 and "timed out after 1s reading the metrics of GEMTraining default/slow" in r.output, \
        r.output


def test_logs_previous_reads_the_container_before_a_restart(client, kubeapi, tmp_path):
    # What `kubectl logs --previous` is for: why the container of a crash loop died.
    from tests.kubeapi.testing import pytorchjob, wait_for

    go, ran = tmp_path / "go", tmp_path / "ran"
    script = (f"import os, sys, time\nfirst = not os.path.exists({str(ran)!r})\nopen({str(ran)!r}, 'a').close()\n"
              "print('first: out of memory' if first else 'second: done', flush=True)\n"
              f"while first and not os.path.exists({str(go)!r}): time.sleep(0.05)\n"
              "sys.exit(3 if first else 0)\n")
    client.submit(manifest("crashy"))
    with pytest.raises(NotFoundError, match="pod default/crashy-train-master-0 of GEMTraining default/crashy does "
                                            "not exist .*: it has no previous container"):
        client.logs("crashy", previous=True)
    kubeapi.create("kubeflow.org/v1", "PyTorchJob", pytorchjob("crashy-train", [sys.executable, "-c", script],
                                                                 run_policy={"backoffLimit": 3}))
    wait_for(lambda: list(client.logs("crashy", timeout=30)) == ["first: out of memory"], what="the first container")
    with pytest.raises(NotFoundError, match="pod default/crashy-train-master-0 of GEMTraining default/crashy has no "
                                            "previous container: it has not been restarted"):
        client.logs("crashy", previous=True)
    go.touch()

    def restarted_and_done():
        pod = kubeapi.get("v1", "Pod", "crashy-train-master-0")
        return pod["status"]["phase"] == "Succeeded" and pod["status"]["containerStatuses"][0]["restartCount"] == 1

    wait_for(restarted_and_done, what="the second container done")
    assert list(client.logs("crashy", previous=True)) == ["first: out of memory"]
    assert list(client.logs("crashy")) == ["second: done"]
    r = CliRunner().invoke(gemctl_app, ["logs", "gt", "crashy", "-p", "--kubeconfig", str(kubeapi.kubeconfig_path)])
    assert r.exit_code == 0 and r.stdout == "first: out of memory\n", r.output
    r = CliRunner().invoke(gemctl_app, ["logs", "gt", "crashy", "-p", "--all-replicas",
                                        "--kubeconfig", str(kubeapi.kubeconfig_path)])
    assert r.exit_code == 2 and "--previous reads one replica's log: drop --all-replicas" in r.output, r.output


@pytest.fixture
def web_page(tmp_path):
    """A kubeconfig whose server is a web page (a UI, an SSO proxy's sign-in page): 200, HTML."""
    import http.server

    from tests.kubeapi import write_kubeconfig

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            page = b"<html>\n<body>Sign in to continue</body>\n</html>\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        do_POST = do_PATCH = do_DELETE = do_GET

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield write_kubeconfig(tmp_path / "web", f"http://127.0.0.1:{server.server_address[1]}")
    server.shutdown()
    server.server_close()


def test_an_answer_that_is_not_the_kubernetes_api_is_a_backend_error(web_page):
    # Before: AttributeError ('str' object has no attribute 'get') from every call, and delete
    # reported success.
    client = GEMClient(KubernetesBackendConfig(kubeconfig=str(web_page)))
    host = client.backend.api_client.configuration.host
    calls = {"get": lambda: client.get("x"), "list": lambda: client.list(), "pods": lambda: client.pods("x"),
             "wait": lambda: client.wait("x", timeout=5), "logs": lambda: client.logs("x", timeout=5),
             "submit": lambda: client.submit(manifest("x")), "delete": lambda: client.delete("x"),
             "update": lambda: client.suspend("x")}
    for verb, call in calls.items():
        with pytest.raises(BackendError) as info:
            call()
        assert f"{host} answered with something other than the Kubernetes API's JSON " \
               "('<html> <body>Sign in to continue</body> </html>'); is it the cluster's API server?" in str(info.value), verb
    r = CliRunner().invoke(gemctl_app, ["delete", "gt", "x", "--kubeconfig", str(web_page)])
    assert r.exit_code == 5 and "answered with something other than the Kubernetes API's JSON" in r.output, r.output


KOPF_FINALIZER = "kopf.zalando.org/KopfFinalizerMarker"


def _set_finalizers(kubeapi, name: str, finalizers: list[str]) -> None:
    kubeapi.store.mutate(kubeapi.resource(API, "GEMTraining"), "default", name,
                         lambda o: o["metadata"].__setitem__("finalizers", finalizers))


def test_delete_waits_for_the_operators_finalizer_and_says_when_it_stays(client, kubeapi):
    # The operator's timers make kopf put a finalizer on every running job: a DELETE only marks it
    # (deletionTimestamp) until the operator removes it. Before, `gemctl delete` said "deleted" at
    # once, and a submit of the same name then failed with "already exists; delete it first".
    kc = str(kubeapi.kubeconfig_path)
    client.submit(manifest("held"))
    _set_finalizers(kubeapi, "held", [KOPF_FINALIZER])
    r = CliRunner().invoke(gemctl_app, ["delete", "gt", "held", "--timeout", "1", "--kubeconfig", kc])
    assert r.exit_code == 4, r.output
    assert (f"timed out after 1s waiting for GEMTraining default/held to be deleted: its finalizer {KOPF_FINALIZER} "
            "is still there; the gem operator removes it (is it running?)") in r.output
    assert kubeapi.get(API, "GEMTraining", "held")["metadata"]["deletionTimestamp"]
    with pytest.raises(AlreadyExistsError, match=f"GEMTraining default/held is still being deleted: its finalizer "
                                                 f"{KOPF_FINALIZER} is still there"):
        client.submit(manifest("held"))

    # The operator removes its finalizer once gemctl has seen the job still there: it waits for that.
    polled = kubeapi.faults.add(method="GET", path=r"/gemtrainings/held$")
    def operator() -> None:
        while polled.hits < 2:  # delete's own read of the job, then a look after the DELETE
            time.sleep(0.02)
        _set_finalizers(kubeapi, "held", [])

    threading.Thread(target=operator, daemon=True).start()
    r = CliRunner().invoke(gemctl_app, ["delete", "gt", "held", "--kubeconfig", kc])
    assert r.exit_code == 0 and 'gemtraining.gem.dev "held" deleted' in r.output, r.output
    assert kubeapi.get(API, "GEMTraining", "held") is None
    client.submit(manifest("held"))  # the name is free again

    _set_finalizers(kubeapi, "held", [KOPF_FINALIZER])
    r = CliRunner().invoke(gemctl_app, ["delete", "gt", "held", "--no-wait", "--kubeconfig", kc])
    assert r.exit_code == 0 and kubeapi.get(API, "GEMTraining", "held")["metadata"]["deletionTimestamp"]


# --------------------------------------------------------------------------- review 4: the recorded job name, paged lists

#: 47 characters: within the 54 an earlier operator release gave "<name>-train" unhashed, past the
#: 50 of render.job_name now, which shortens and hashes it.
LONG = "ads-ranking-experiment-with-a-long-descriptive1"
assert len(LONG) == 47


def test_pods_and_logs_follow_the_job_name_the_operator_recorded(client, kubeapi):
    # The operator keeps the PyTorchJob it made (status.pytorchJob) though render.job_name would now
    # name it otherwise; pods() and logs() looked for render.job_name's pods, which never come.
    from gem.api.render import job_name

    legacy = f"{LONG}-train"
    assert job_name("GEMTraining", LONG) != legacy
    client.submit({**manifest(LONG), "spec": {"training": {"steps": 5}, "parallelism": {"numNodes": 2}}})
    script = "import os\nprint('on', os.environ['HOSTNAME'], flush=True)\n"

    def operator_later() -> None:
        time.sleep(0.5)  # follow() waits for render.job_name's pod until the operator records its own
        kubeapi.patch_status(API, "GEMTraining", LONG, {"phase": "Running", "pytorchJob": legacy})
        kubeapi.create("kubeflow.org/v1", "PyTorchJob", _script_job(legacy, script, workers=1))

    threading.Thread(target=operator_later, daemon=True).start()
    assert list(client.follow(LONG, timeout=30)) == [f"on {legacy}-master-0"]
    assert list(client.logs(LONG, follow=True, timeout=30)) == [f"on {legacy}-master-0"]
    assert list(client.logs(LONG, replica="worker", follow=True, timeout=30)) == [f"on {legacy}-worker-0"]
    assert client.pod_names(LONG) == [f"{legacy}-master-0", f"{legacy}-worker-0"]
    with pytest.raises(NotFoundError, match=f"pod default/{legacy}-master-0 of .* has not been restarted"):
        client.logs(LONG, previous=True)
    with pytest.raises(NotFoundError, match=f"has no pod {legacy}-worker-1: "):
        client.logs(LONG, replica="worker", index=1)
    assert list(client.all_logs(LONG)) == [(f"{legacy}-master-0", f"on {legacy}-master-0"),
                                           (f"{legacy}-worker-0", f"on {legacy}-worker-0")]
    r = CliRunner().invoke(gemctl_app, ["logs", "gt", LONG, "--kubeconfig", str(kubeapi.kubeconfig_path)])
    assert r.exit_code == 0 and r.stdout == f"on {legacy}-master-0\n", r.output


def test_list_reads_in_pages_as_kubectl_does(client, kubeapi, monkeypatch):
    # One unbounded LIST before: thousands of jobs in one answer, which an API server may cut off
    # at its request timeout. Now pages of _LIST_CHUNK with `continue`, as kubectl's --chunk-size.
    from gem_sdk.backends.kubernetes import backend

    monkeypatch.setattr(backend, "_LIST_CHUNK", 2)
    names = [f"job-{i}" for i in range(5)]
    for name in names:
        client.submit(manifest(name, team="ads"))
    kubeapi.create("v1", "Namespace", {"metadata": {"name": "team-b"}})
    client.submit(manifest("elsewhere"), namespace="team-b")
    pages = kubeapi.faults.add(method="GET", path=r"/namespaces/default/gemtrainings\?.*limit=2")
    assert [o.metadata.name for o in client.list(kind="GEMTraining")] == names
    assert pages.hits == 3  # 2 + 2 + 1
    assert [o.metadata.name for o in client.list(kind="GEMTraining", label_selector="team=ads")] == names
    assert pages.hits == 6
    cluster = kubeapi.faults.add(method="GET", path=r"/apis/gem.dev/v1alpha1/gemtrainings\?.*limit=2")
    assert [o.metadata.name for o in client.list(kind="GEMTraining", all_namespaces=True)] == names + ["elsewhere"]
    assert cluster.hits == 3
    r = CliRunner().invoke(gemctl_app, ["list", "gt", "--kubeconfig", str(kubeapi.kubeconfig_path), "-o", "json"])
    assert r.exit_code == 0 and pages.hits == 9, r.output
    assert [o["metadata"]["name"] for o in json.loads(r.stdout)["items"]] == names


def test_list_whose_pages_expired_reads_it_whole(tmp_path, monkeypatch):
    # The first page's snapshot compacted before the next page is read: 410 Expired. A whole list
    # then, consistent, as client-go's pager does, rather than an error or a list of two moments.
    from gem_sdk.backends.kubernetes import backend
    from tests.kubeapi import KubeAPIServer

    monkeypatch.setattr(backend, "_LIST_CHUNK", 2)
    with KubeAPIServer(workdir=tmp_path / "kubeapi", history_size=3) as server:
        client = GEMClient(KubernetesBackendConfig(kubeconfig=str(server.kubeconfig_path)))
        for i in range(3):
            client.submit(manifest(f"job-{i}"))
        first_page = client.backend.custom.list_namespaced_custom_object

        def then_writes(*args, **kwargs):
            body = first_page(*args, **kwargs)
            if kwargs.get("limit") and "_continue" not in kwargs:  # more than the history keeps, between the pages
                for i in range(3, 7):
                    client.submit(manifest(f"job-{i}"))
            return body

        monkeypatch.setattr(client.backend.custom, "list_namespaced_custom_object", then_writes)
        expired = server.faults.add(method="GET", path=r"continue=")
        assert [o.metadata.name for o in client.list(kind="GEMTraining")] == [f"job-{i}" for i in range(7)]
        assert expired.hits == 1


def test_pods_and_logs_skip_the_pods_of_a_deleted_job_of_the_same_name(client, kubeapi):
    # Deleted, then submitted again at once: the first job's pods are still going (garbage
    # collection and their grace period take a while) and bear the same names and job-name label.
    # pods() listed them and logs() streamed the first job's log as the new one's.
    from tests.kubeapi.testing import wait_for

    first = client.submit(manifest("again"))
    job = _script_job("again-train", "import time\nprint('first run', flush=True)\ntime.sleep(60)\n")
    job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["metadata"] = {"labels": {"gem.dev/uid": first.metadata.uid}}
    kubeapi.create("kubeflow.org/v1", "PyTorchJob", job)
    wait_for(lambda: list(client.logs("again", timeout=30)) == ["first run"], what="the first job's log")
    client.delete("again", wait=True)
    client.submit(manifest("again"))
    assert client.pods("again") == []
    with pytest.raises(NotFoundError, match="pod default/again-train-master-0 of .* does not exist"):
        client.logs("again", previous=True)
    with pytest.raises(WaitTimeoutError, match="timed out waiting for pod default/again-train-master-0 to start"):
        client.logs("again", timeout=1)
    with pytest.raises(WaitTimeoutError):
        client.follow("again", timeout=1)


def test_wait_with_timeout_zero_answers_from_the_job_as_it_is(client, kubeapi):
    # As `kubectl wait --timeout=0`: one look. Before, it timed out before looking, saying the
    # Kubernetes API had not answered, even for a job that had long succeeded (gemctl exit 4).
    client.submit(manifest("done"))
    kubeapi.patch_status(API, "GEMTraining", "done", {"phase": "Succeeded"})
    assert client.wait("done", timeout=0).status.phase == "Succeeded"
    r = CliRunner().invoke(gemctl_app, ["wait", "gt", "done", "--timeout", "0", "--kubeconfig",
                                        str(kubeapi.kubeconfig_path)])
    assert r.exit_code == 0, r.output
    client.submit(manifest("busy"))
    kubeapi.patch_status(API, "GEMTraining", "busy", {"phase": "Running"})
    with pytest.raises(WaitTimeoutError, match=r"timed out after 0s .* \(phase Running\)"):
        client.wait("busy", timeout=0)
    with pytest.raises(NotFoundError):
        client.wait("ghost", timeout=0)


def test_logs_with_timeout_zero_read_a_started_pod(client, kubeapi):
    # timeout bounds the wait for the pod to start: none is needed for one that has. Before, the
    # deadline had passed before the job was read: "timed out waiting for pod ... to start".
    from tests.kubeapi.testing import wait_for

    client.submit({**manifest("ran"), "spec": {"training": {"steps": 5}, "parallelism": {"numNodes": 1}}})
    kubeapi.create("kubeflow.org/v1", "PyTorchJob", _script_job("ran-train", "print('hi', flush=True)\n"))
    wait_for(lambda: (kubeapi.get("v1", "Pod", "ran-train-master-0") or {}).get("status", {}).get("phase")
             == "Succeeded", what="the pod done")
    assert list(client.logs("ran", timeout=0)) == ["hi"]
    assert [line for _, line in client.all_logs("ran", timeout=0)] == ["hi"]
    r = CliRunner().invoke(gemctl_app, ["logs", "gt", "ran", "--timeout", "0", "--kubeconfig",
                                        str(kubeapi.kubeconfig_path)])
    assert r.exit_code == 0 and r.stdout == "hi\n", r.output
    with pytest.raises(WaitTimeoutError, match="timed out waiting for pod default/quick-train-master-0 to start"):
        client.logs(client.submit(manifest("quick")), timeout=0)


def test_delete_waits_out_an_api_server_restart(client, kubeapi):
    # The DELETE was accepted, then the API answered 503 for a moment (a control-plane restart):
    # `gemctl delete` failed with exit 5 though the job was on its way out. As wait, it waits it out.
    client.submit(manifest("blip"))
    _set_finalizers(kubeapi, "blip", [KOPF_FINALIZER])
    job_get = r"/gemtrainings/blip$"
    kubeapi.faults.add(method="GET", path=job_get, times=1)  # delete's own read of the job
    outage = kubeapi.faults.add(method="GET", path=job_get, status=503, times=2,
                                message="the server is currently unable to handle the request")

    def operator() -> None:
        while outage.hits < 2:
            time.sleep(0.02)
        _set_finalizers(kubeapi, "blip", [])

    threading.Thread(target=operator, daemon=True).start()
    r = CliRunner().invoke(gemctl_app, ["delete", "gt", "blip", "--timeout", "30", "--kubeconfig",
                                        str(kubeapi.kubeconfig_path)])
    assert r.exit_code == 0 and 'gemtraining.gem.dev "blip" deleted' in r.output, r.output
    assert kubeapi.get(API, "GEMTraining", "blip") is None and outage.hits == 2

    # Not every error is an outage: a refusal is no reason to wait.
    client.submit(manifest("blip"))
    _set_finalizers(kubeapi, "blip", [KOPF_FINALIZER])
    kubeapi.faults.add(method="GET", path=job_get, times=1)
    kubeapi.faults.add(method="GET", path=job_get, status=403, times=1)
    with pytest.raises(BackendError, match="403 Forbidden"):
        client.delete("blip", wait=True, timeout=30)


def test_logs_of_a_job_refused_before_it_ran_say_why(client, kubeapi):
    # Invalid (or a teacher that failed): the operator made no PyTorchJob, so no pod ever was.
    # Before: "its pods may have been cleaned up (runPolicy.cleanPodPolicy)", a wrong lead.
    client.submit(manifest("inv"))
    detail = "spec.data.path: /no/such/dir does not exist"
    kubeapi.patch_status(API, "GEMTraining", "inv", {"phase": "Invalid", "message": detail, "conditions": [
        {"type": "Valid", "status": "False", "reason": "InvalidSpec", "message": detail}]})
    with pytest.raises(NotFoundError) as info:
        client.logs("inv", timeout=20)
    assert str(info.value) == ("pod default/inv-train-master-0 of GEMTraining default/inv does not exist: the job is "
                               f"Invalid and never ran: InvalidSpec: {detail}")
    r = CliRunner().invoke(gemctl_app, ["logs", "gt", "inv", "--kubeconfig", str(kubeapi.kubeconfig_path)])
    assert r.exit_code == 3 and f"never ran: InvalidSpec: {detail}" in r.output, r.output

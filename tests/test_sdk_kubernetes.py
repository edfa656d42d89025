"""The SDK's Kubernetes backend against the API test server (tests/kubeapi): real HTTP, CRDs,
watches, the status subresource, fault injection and PyTorchJobs run as local processes."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

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


def test_missing_kubeconfig_is_a_backend_error(tmp_path):
    with pytest.raises(BackendError, match="no usable Kubernetes configuration"):
        GEMClient(KubernetesBackendConfig(kubeconfig=str(tmp_path / "nope")))


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

"""Fault injection: error statuses, counts, probability, latency, hangs, dropped watches."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from tests.kubeapi import KubeAPIServer
from tests.kubeapi.testing import wait_for


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with KubeAPIServer(crd_paths=[], workdir=tmp_path_factory.mktemp("kubeapi-faults")) as s:
        yield s


@pytest.fixture
def core(server):
    server.faults.clear()
    yield client.CoreV1Api(server.api_client())
    server.faults.clear()


def test_status_for_next_n_requests(server, core):
    server.faults.add(method="POST", path=r"/configmaps", status=409, times=2)
    for _ in range(2):
        with pytest.raises(ApiException) as e:
            core.create_namespaced_config_map("default", {"metadata": {"name": "n1"}})
        assert e.value.status == 409
    core.create_namespaced_config_map("default", {"metadata": {"name": "n1"}})
    # GETs were never affected
    core.read_namespaced_config_map("n1", "default")


@pytest.mark.parametrize("code", [500, 503, 429])
def test_error_codes_and_retry_after(server, core, code):
    rule = server.faults.add(path=r"/configmaps/target$", status=code)
    with pytest.raises(ApiException) as e:
        core.read_namespaced_config_map("target", "default")
    assert e.value.status == code
    if code == 429:
        assert e.value.headers["Retry-After"] == "1"
    assert rule.hits >= 1  # urllib3 retries 429 after Retry-After, like against a real server


def test_probability(server, core):
    server.faults.add(method="GET", path=r"/configmaps$", status=500, probability=0.5)
    failures = 0
    for _ in range(60):
        try:
            core.list_namespaced_config_map("default")
        except ApiException:
            failures += 1
    assert 5 < failures < 55


def test_latency_and_hang(server, core):
    server.faults.add(method="GET", path=r"/namespaces/default$", latency=0.3)
    t0 = time.monotonic()
    core.read_namespace("default")
    assert time.monotonic() - t0 >= 0.3
    server.faults.add(method="GET", path=r"/namespaces/kube-hang", hang=True, times=1)
    with pytest.raises(Exception):
        core.read_namespace("kube-hang", _request_timeout=(1, 1))  # a float is ignored by the client


def test_http_admin_endpoint(server, core):
    body = json.dumps({"method": "DELETE", "path": "/configmaps/", "status": 503, "times": 1}).encode()
    req = urllib.request.Request(server.url + "/_kubeapi/faults", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    rule = json.loads(urllib.request.urlopen(req).read())
    assert rule["status"] == 503
    listed = json.loads(urllib.request.urlopen(server.url + "/_kubeapi/faults").read())
    assert [r["id"] for r in listed] == [rule["id"]]
    core.create_namespaced_config_map("default", {"metadata": {"name": "del-me"}})
    with pytest.raises(ApiException) as e:
        core.delete_namespaced_config_map("del-me", "default")
    assert e.value.status == 503
    core.delete_namespaced_config_map("del-me", "default")
    urllib.request.urlopen(urllib.request.Request(server.url + "/_kubeapi/faults", method="DELETE"))
    assert server.faults.rules == []


def _watch_in_thread(core, done):
    events = []

    def run():
        for ev in watch.Watch().stream(core.list_namespaced_config_map, "default", timeout_seconds=30):
            events.append(ev["type"])
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return events


def test_drop_watches_now_and_at_a_rate(server, core):
    done = threading.Event()
    _watch_in_thread(core, done)
    wait_for(lambda: server.store.watchers and any(server.store.watchers.values()), what="watch open")
    assert server.faults.drop_watches() >= 1
    assert done.wait(5), "the watch stream should have ended"
    # over HTTP, at a rate: the stream ends well before its 30 s timeout
    req = urllib.request.Request(server.url + "/_kubeapi/faults/watch-drop-rate", data=b'{"rate": 1.0}', method="PUT",
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req)
    done2 = threading.Event()
    _watch_in_thread(core, done2)
    assert done2.wait(10)

"""The API test server's REST semantics, driven through the official `kubernetes` client."""

from __future__ import annotations

import threading

import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from tests.kubeapi import KubeAPIServer
from tests.kubeapi.testing import wait_for


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with KubeAPIServer(workdir=tmp_path_factory.mktemp("kubeapi-core")) as s:
        yield s


@pytest.fixture
def api(server):
    return server.api_client()


@pytest.fixture
def core(api):
    return client.CoreV1Api(api)


@pytest.fixture
def custom(api):
    return client.CustomObjectsApi(api)


@pytest.fixture
def ns(core, request):
    name = "t-" + request.node.name.lower().replace("_", "-")[:50]
    core.create_namespace({"metadata": {"name": name}})
    return name


def cm(name, labels=None, data=None):
    return {"metadata": {"name": name, "labels": labels or {}}, "data": data or {"k": "v"}}


def test_discovery_lists_core_and_crd_resources(server, api):
    groups = client.ApisApi(api).get_api_versions()
    names = {g.name for g in groups.groups}
    assert {"kubeflow.org", "apiextensions.k8s.io", "coordination.k8s.io", "events.k8s.io"} <= names
    res = api.call_api("/apis/kubeflow.org/v1", "GET", response_type="object", _return_http_data_only=True)
    by_name = {r["name"]: r for r in res["resources"]}
    assert by_name["pytorchjobs"]["kind"] == "PyTorchJob" and by_name["pytorchjobs"]["namespaced"] is True
    assert "pytorchjobs/status" in by_name
    core_res = {r.name: r for r in client.CoreV1Api(api).get_api_resources().resources}
    assert "pods/log" in core_res and core_res["pods"].short_names == ["po"]
    assert "watch" in core_res["configmaps"].verbs
    assert client.VersionApi(api).get_code().major == "1"


def test_create_get_list_conflict_and_metadata(core, ns):
    a = core.create_namespaced_config_map(ns, cm("a"))
    assert a.metadata.uid and a.metadata.resource_version and a.metadata.creation_timestamp
    with pytest.raises(ApiException) as e:
        core.create_namespaced_config_map(ns, cm("a"))
    assert e.value.status == 409 and '"AlreadyExists"' in e.value.body
    b = core.create_namespaced_config_map(ns, cm("b"))
    assert int(b.metadata.resource_version) > int(a.metadata.resource_version)
    got = core.read_namespaced_config_map("a", ns)
    assert got.metadata.uid == a.metadata.uid
    lst = core.list_namespaced_config_map(ns)
    assert [i.metadata.name for i in lst.items] == ["a", "b"]
    assert int(lst.metadata.resource_version) >= int(b.metadata.resource_version)
    with pytest.raises(ApiException) as e:
        core.read_namespaced_config_map("nope", ns)
    assert e.value.status == 404
    with pytest.raises(ApiException) as e:
        core.create_namespaced_config_map("no-such-namespace", cm("x"))
    assert e.value.status == 404
    with pytest.raises(ApiException) as e:
        core.create_namespaced_config_map(ns, cm("Bad_Name"))
    assert e.value.status == 422 and "RFC 1123 subdomain" in e.value.body
    gen = core.create_namespaced_config_map(ns, {"metadata": {"generateName": "gen-"}})
    assert gen.metadata.name.startswith("gen-") and len(gen.metadata.name) == 9


def test_replace_with_stale_resource_version_conflicts(core, ns):
    a = core.create_namespaced_config_map(ns, cm("a"))
    a.data = {"k": "v2"}
    a2 = core.replace_namespaced_config_map("a", ns, a)
    assert a2.data == {"k": "v2"} and a2.metadata.resource_version != a.metadata.resource_version
    a.data = {"k": "v3"}  # still carries the old resourceVersion
    with pytest.raises(ApiException) as e:
        core.replace_namespaced_config_map("a", ns, a)
    assert e.value.status == 409 and "the object has been modified" in e.value.body
    # a no-op write does not bump resourceVersion
    same = core.replace_namespaced_config_map("a", ns, a2)
    assert same.metadata.resource_version == a2.metadata.resource_version


def test_label_and_field_selectors(core, ns):
    core.create_namespaced_config_map(ns, cm("a", {"app": "x", "tier": "web"}))
    core.create_namespaced_config_map(ns, cm("b", {"app": "y", "tier": "db"}))
    core.create_namespaced_config_map(ns, cm("c", {"app": "x"}))

    def names(**kw):
        return [i.metadata.name for i in core.list_namespaced_config_map(ns, **kw).items]

    assert names(label_selector="app=x") == ["a", "c"]
    assert names(label_selector="app==x,tier") == ["a"]
    assert names(label_selector="app!=x") == ["b"]
    assert names(label_selector="tier in (web, db)") == ["a", "b"]
    assert names(label_selector="tier notin (web)") == ["b", "c"]
    assert names(label_selector="!tier") == ["c"]
    assert names(field_selector="metadata.name=b") == ["b"]
    assert names(field_selector="metadata.name!=b") == ["a", "c"]
    all_ns = core.list_config_map_for_all_namespaces(field_selector=f"metadata.namespace={ns}")
    assert len(all_ns.items) == 3


def test_patch_kinds(core, ns):
    core.create_namespaced_config_map(ns, cm("a", {"x": "1"}, {"k": "v", "drop": "me"}))
    merged = core.patch_namespaced_config_map("a", ns, {"data": {"k": "v2", "drop": None}})
    assert merged.data == {"k": "v2"}
    jp = core.patch_namespaced_config_map("a", ns, [{"op": "add", "path": "/data/n", "value": "1"},
                                                    {"op": "remove", "path": "/metadata/labels/x"}])
    assert jp.data == {"k": "v2", "n": "1"} and not jp.metadata.labels
    pod = {"metadata": {"name": "p"}, "spec": {"containers": [
        {"name": "a", "image": "i1", "env": [{"name": "A", "value": "1"}]}, {"name": "b", "image": "i2"}]}}
    core.create_namespaced_pod(ns, pod)
    api = core.api_client
    out = api.call_api(f"/api/v1/namespaces/{ns}/pods/p", "PATCH", header_params={"Content-Type": "application/strategic-merge-patch+json"},
                       body={"spec": {"containers": [{"name": "b", "image": "i3"}]}}, response_type="object",
                       _return_http_data_only=True)
    assert [(c["name"], c["image"]) for c in out["spec"]["containers"]] == [("a", "i1"), ("b", "i3")]


def test_watch_streams_and_resumes(core, ns):
    first = core.create_namespaced_config_map(ns, cm("a"))
    rv = first.metadata.resource_version
    core.patch_namespaced_config_map("a", ns, {"data": {"k": "2"}})
    core.create_namespaced_config_map(ns, cm("b"))
    core.delete_namespaced_config_map("a", ns)
    w = watch.Watch()
    seen = []
    for ev in w.stream(core.list_namespaced_config_map, ns, resource_version=rv, timeout_seconds=2):
        seen.append((ev["type"], ev["object"].metadata.name))
        if len(seen) == 3:
            w.stop()
    assert seen == [("MODIFIED", "a"), ("ADDED", "b"), ("DELETED", "a")]
    # without a resourceVersion: the current state first, then changes
    events = []

    def consume():
        w2 = watch.Watch()
        for ev in w2.stream(core.list_namespaced_config_map, ns, timeout_seconds=3):
            events.append((ev["type"], ev["object"].metadata.name))
            if len(events) == 2:
                w2.stop()

    t = threading.Thread(target=consume)
    t.start()
    wait_for(lambda: events, what="initial ADDED")
    core.create_namespaced_config_map(ns, cm("c"))
    t.join(5)
    assert events == [("ADDED", "b"), ("ADDED", "c")]


def test_watch_label_selector_transitions(server, core, ns):
    core.create_namespaced_config_map(ns, cm("a", {"sel": "no"}))
    rv = core.list_namespaced_config_map(ns).metadata.resource_version
    core.patch_namespaced_config_map("a", ns, {"metadata": {"labels": {"sel": "yes"}}})
    core.patch_namespaced_config_map("a", ns, {"metadata": {"labels": {"sel": "no"}}})
    seen = []
    w = watch.Watch()
    for ev in w.stream(core.list_namespaced_config_map, ns, label_selector="sel=yes", resource_version=rv, timeout_seconds=1):
        seen.append(ev["type"])
    assert seen == ["ADDED", "DELETED"]


def test_watch_too_old_resource_version_gets_410(tmp_path):
    with KubeAPIServer(crd_paths=[], history_size=5, workdir=tmp_path) as s:
        core = client.CoreV1Api(s.api_client())
        first = core.create_namespaced_config_map("default", cm("a0"))
        for i in range(1, 10):
            core.create_namespaced_config_map("default", cm(f"a{i}"))
        w = watch.Watch()
        with pytest.raises(ApiException) as e:
            for _ in w.stream(core.list_namespaced_config_map, "default", resource_version=first.metadata.resource_version,
                              timeout_seconds=2):
                pass
        assert e.value.status == 410
        # a recent one still works
        recent = core.list_namespaced_config_map("default").metadata.resource_version
        core.create_namespaced_config_map("default", cm("late"))
        got = [ev["object"].metadata.name for ev in watch.Watch().stream(
            core.list_namespaced_config_map, "default", resource_version=recent, timeout_seconds=1)]
        assert got == ["late"]


def test_watch_bookmarks_and_timeout(server, api, ns):
    resp = api.call_api(f"/api/v1/namespaces/{ns}/configmaps", "GET",
                        query_params=[("watch", "true"), ("allowWatchBookmarks", "true"), ("timeoutSeconds", "3"),
                                      ("resourceVersion", str(server.store.rv))],
                        _preload_content=False, _return_http_data_only=True)
    lines = [line for line in resp.read().decode().splitlines() if line]
    assert lines and all('"BOOKMARK"' in line for line in lines)


def test_status_subresource_and_generation(custom, ns):
    g, v, p = "kubeflow.org", "v1", "pytorchjobs"
    job = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "j"},
           "spec": {"pytorchReplicaSpecs": {"Master": {"replicas": 1, "template": {"spec": {"containers": [
               {"name": "pytorch", "image": "x"}]}}}}},
           "status": {"conditions": []}}
    created = custom.create_namespaced_custom_object(g, v, ns, p, job)
    assert "status" not in created and created["metadata"]["generation"] == 1
    # status on the main resource is ignored
    upd = custom.patch_namespaced_custom_object(g, v, ns, p, "j", {"status": {"startTime": "2024-01-01T00:00:00Z"}})
    assert "status" not in upd and upd["metadata"]["generation"] == 1
    # /status changes only status, no generation bump
    st = custom.patch_namespaced_custom_object_status(g, v, ns, p, "j", {
        "status": {"startTime": "2024-01-01T00:00:00Z"}, "spec": {"nprocPerNode": "9"}, "metadata": {"labels": {"x": "y"}}})
    assert st["status"]["startTime"] == "2024-01-01T00:00:00Z"
    assert "nprocPerNode" not in st["spec"] and not st["metadata"].get("labels")
    assert st["metadata"]["generation"] == 1
    # metadata-only changes keep the generation; spec changes bump it
    lab = custom.patch_namespaced_custom_object(g, v, ns, p, "j", {"metadata": {"labels": {"a": "b"}}})
    assert lab["metadata"]["generation"] == 1
    sp = custom.patch_namespaced_custom_object(g, v, ns, p, "j", {"spec": {"nprocPerNode": "2"}})
    assert sp["metadata"]["generation"] == 2 and sp["status"]["startTime"]
    # replace with a stale resourceVersion conflicts
    lab["spec"]["nprocPerNode"] = "3"
    with pytest.raises(ApiException) as e:
        custom.replace_namespaced_custom_object(g, v, ns, p, "j", lab)
    assert e.value.status == 409
    # strategic merge patch is refused for custom resources, like a real server
    with pytest.raises(ApiException) as e:
        custom.api_client.call_api(f"/apis/{g}/{v}/namespaces/{ns}/{p}/j", "PATCH", body={"spec": {}},
                                   header_params={"Content-Type": "application/strategic-merge-patch+json"})
    assert e.value.status == 415


def test_finalizers_delay_deletion(server, core, ns):
    core.create_namespaced_config_map(ns, {"metadata": {"name": "f", "finalizers": ["test/x", "test/y"]}})
    deleted = core.delete_namespaced_config_map("f", ns)
    cur = core.read_namespaced_config_map("f", ns)
    assert cur.metadata.deletion_timestamp is not None
    core.patch_namespaced_config_map("f", ns, {"metadata": {"finalizers": ["test/y"]}})
    assert core.read_namespaced_config_map("f", ns).metadata.deletion_timestamp
    core.patch_namespaced_config_map("f", ns, [{"op": "remove", "path": "/metadata/finalizers"}])
    with pytest.raises(ApiException) as e:
        core.read_namespaced_config_map("f", ns)
    assert e.value.status == 404
    assert deleted is not None


def _owned(core, ns, name, owner, kind="ConfigMap"):
    ref = {"apiVersion": "v1", "kind": kind, "name": owner.metadata.name, "uid": owner.metadata.uid}
    return core.create_namespaced_config_map(ns, {"metadata": {"name": name, "ownerReferences": [ref]}})


def test_garbage_collection_background_cascades(core, ns):
    root = core.create_namespaced_config_map(ns, cm("root"))
    child = _owned(core, ns, "child", root)
    _owned(core, ns, "grandchild", child)
    other = core.create_namespaced_config_map(ns, cm("other"))
    two = core.create_namespaced_config_map(ns, {"metadata": {"name": "two-owners", "ownerReferences": [
        {"apiVersion": "v1", "kind": "ConfigMap", "name": "root", "uid": root.metadata.uid},
        {"apiVersion": "v1", "kind": "ConfigMap", "name": "other", "uid": other.metadata.uid}]}})
    core.delete_namespaced_config_map("root", ns, propagation_policy="Background")
    names = [i.metadata.name for i in core.list_namespaced_config_map(ns).items]
    assert names == ["other", "two-owners"]
    left = core.read_namespaced_config_map("two-owners", ns)
    assert [r.name for r in left.metadata.owner_references] == ["other"] and two


def test_garbage_collection_orphan_and_foreground(core, ns):
    root = core.create_namespaced_config_map(ns, cm("root"))
    _owned(core, ns, "kept", root)
    core.delete_namespaced_config_map("root", ns, propagation_policy="Orphan")
    kept = core.read_namespaced_config_map("kept", ns)
    assert not kept.metadata.owner_references
    root = core.create_namespaced_config_map(ns, cm("root2"))
    dep = core.create_namespaced_config_map(ns, {"metadata": {"name": "blocker", "finalizers": ["test/hold"], "ownerReferences": [
        {"apiVersion": "v1", "kind": "ConfigMap", "name": "root2", "uid": root.metadata.uid, "blockOwnerDeletion": True}]}})
    core.delete_namespaced_config_map("root2", ns, propagation_policy="Foreground")
    owner = core.read_namespaced_config_map("root2", ns)
    assert "foregroundDeletion" in owner.metadata.finalizers and owner.metadata.deletion_timestamp
    assert core.read_namespaced_config_map("blocker", ns).metadata.deletion_timestamp
    core.patch_namespaced_config_map("blocker", ns, {"metadata": {"finalizers": None}})
    names = [i.metadata.name for i in core.list_namespaced_config_map(ns).items]
    assert names == ["kept"] and dep


def test_deletecollection_and_namespace_deletion(core, ns):
    for n in ("a", "b", "c"):
        core.create_namespaced_config_map(ns, cm(n, {"grp": "1" if n != "c" else "2"}))
    core.delete_collection_namespaced_config_map(ns, label_selector="grp=1")
    assert [i.metadata.name for i in core.list_namespaced_config_map(ns).items] == ["c"]
    core.delete_namespace(ns)
    with pytest.raises(ApiException) as e:
        core.read_namespace(ns)
    assert e.value.status == 404
    assert core.list_config_map_for_all_namespaces(field_selector=f"metadata.namespace={ns}").items == []


def test_core_kinds_events_leases_and_direct_helpers(server, api, ns):
    core = client.CoreV1Api(api)
    core.create_namespaced_event(ns, {"metadata": {"generateName": "e-"}, "involvedObject": {"kind": "Pod", "name": "p"},
                                      "reason": "Test", "message": "hello", "type": "Normal"})
    assert [e.message for e in core.list_namespaced_event(ns).items] == ["hello"]
    ev = client.EventsV1Api(api)
    ev.create_namespaced_event(ns, {"metadata": {"name": "e2"}, "eventTime": "2024-01-01T00:00:00.000000Z",
                                    "reportingController": "x", "reportingInstance": "y", "action": "A", "reason": "R"})
    assert len(ev.list_namespaced_event(ns).items) == 1
    co = client.CoordinationV1Api(api)
    co.create_namespaced_lease(ns, {"metadata": {"name": "l"}, "spec": {"holderIdentity": "me"}})
    assert co.read_namespaced_lease("l", ns).spec.holder_identity == "me"
    core.create_namespaced_secret(ns, {"metadata": {"name": "s"}, "data": {"a": "Yg=="}})
    core.create_namespaced_service_account(ns, {"metadata": {"name": "sa"}})
    core.create_namespaced_service(ns, {"metadata": {"name": "svc"}, "spec": {"ports": [{"port": 80}]}})
    assert server.get("v1", "Secret", "s", ns)["data"] == {"a": "Yg=="}
    assert [s["metadata"]["name"] for s in server.list("v1", "Service", ns)] == ["svc"]

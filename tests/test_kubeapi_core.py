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
    core.create_namespaced_event(ns, {"metadata": {"generateName": "e-"},
                                      "involvedObject": {"kind": "Pod", "name": "p", "namespace": ns},
                                      "reason": "Test", "message": "hello", "type": "Normal"})
    assert [e.message for e in core.list_namespaced_event(ns).items] == ["hello"]
    ev = client.EventsV1Api(api)
    ev.create_namespaced_event(ns, {"metadata": {"name": "e2"}, "eventTime": "2024-01-01T00:00:00.000000Z",
                                    "regarding": {"kind": "Pod", "name": "p", "namespace": ns}, "type": "Normal",
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


# --------------------------------------------------------------------------- what a real apiserver refuses


def _status(e):
    import json

    return json.loads(e.value.body)


def test_labels_annotations_owner_references_and_finalizers_are_validated(core, ns):
    """ObjectMeta validation (apimachinery objectmeta.go): 422 with one cause per bad field."""
    long_value = "x" * 64
    with pytest.raises(ApiException) as e:
        core.create_namespaced_config_map(ns, cm("a", {"gem.dev/name": long_value}))
    st = _status(e)
    assert e.value.status == 422 and st["reason"] == "Invalid"
    assert st["details"]["causes"] == [{"reason": "FieldValueInvalid", "field": "metadata.labels",
                                        "message": f'Invalid value: "{long_value}": must be no more than 63 characters'}]
    with pytest.raises(ApiException) as e:
        core.create_namespaced_config_map(ns, cm("a", {"bad key": "v"}))
    assert e.value.status == 422 and "name part must consist of alphanumeric characters" in _status(e)["message"]
    with pytest.raises(ApiException) as e:
        core.create_namespaced_config_map(ns, {"metadata": {"name": "a", "annotations": {"a/b/c": "v"}}})
    assert e.value.status == 422 and _status(e)["details"]["causes"][0]["field"] == "metadata.annotations"
    with pytest.raises(ApiException) as e:
        core.create_namespaced_config_map(ns, {"metadata": {"name": "a", "ownerReferences": [
            {"apiVersion": "v1", "kind": "ConfigMap", "name": "o1", "uid": "u1", "controller": True},
            {"apiVersion": "v1", "kind": "ConfigMap", "name": "o2", "uid": "", "controller": True}]}})
    fields = [c["field"] for c in _status(e)["details"]["causes"]]
    assert e.value.status == 422 and fields == ["metadata.ownerReferences.uid", "metadata.ownerReferences"]
    assert "Only one reference can have Controller set to true" in _status(e)["message"]
    with pytest.raises(ApiException) as e:
        core.create_namespaced_config_map(ns, {"metadata": {"name": "a", "finalizers": ["orphan", "foregroundDeletion"]}})
    assert e.value.status == 422 and "cannot be both set" in _status(e)["message"]
    # updates are validated too, and a deleting object takes no new finalizer
    core.create_namespaced_config_map(ns, {"metadata": {"name": "f", "finalizers": ["test.dev/hold"]}})
    with pytest.raises(ApiException) as e:
        core.patch_namespaced_config_map("f", ns, {"metadata": {"labels": {"k": "-bad-"}}})
    assert e.value.status == 422
    core.delete_namespaced_config_map("f", ns)
    with pytest.raises(ApiException) as e:
        core.patch_namespaced_config_map("f", ns, {"metadata": {"finalizers": ["test.dev/hold", "test.dev/new"]}})
    assert e.value.status == 422 and _status(e)["details"]["causes"][0]["message"] == (
        'Forbidden: no new finalizers can be added if the object is being deleted, found new finalizers '
        '[]string{"test.dev/new"}')
    core.patch_namespaced_config_map("f", ns, {"metadata": {"finalizers": None}})


def test_names_by_kind_and_generate_name(core, ns):
    """Services are DNS-1035 labels (no leading digit); generateName is cut to 58 characters + 5."""
    with pytest.raises(ApiException) as e:
        core.create_namespaced_service(ns, {"metadata": {"name": "1svc"}, "spec": {"ports": [{"port": 80}]}})
    assert e.value.status == 422 and "a DNS-1035 label must consist of" in _status(e)["message"]
    core.create_namespaced_config_map(ns, cm("1cm"))  # a subdomain may start with a digit
    gen = core.create_namespaced_config_map(ns, {"metadata": {"generateName": "g" * 70}})
    assert len(gen.metadata.name) == 63 and gen.metadata.name.startswith("g" * 58)
    assert not set(gen.metadata.name[58:]) & set("aeiou013")
    # core/v1 Event names only need to be path segments
    core.create_namespaced_event(ns, {"metadata": {"name": "Not_A.Subdomain"}, "involvedObject": {"namespace": ns},
                                      "reason": "R", "message": "m"})


def test_field_selectors_only_on_fields_the_kind_supports(core, custom, ns):
    core.create_namespaced_config_map(ns, cm("a"))
    with pytest.raises(ApiException) as e:
        core.list_namespaced_config_map(ns, field_selector="data.k=v")
    assert e.value.status == 400 and _status(e)["message"] == (
        '"data.k" is not a known field selector: only "metadata.name", "metadata.namespace"')
    with pytest.raises(ApiException) as e:
        custom.list_namespaced_custom_object("kubeflow.org", "v1", ns, "pytorchjobs", field_selector="spec.runPolicy=x")
    assert e.value.status == 400 and _status(e)["message"] == "field label not supported: spec.runPolicy"
    with pytest.raises(ApiException) as e:
        for _ in watch.Watch().stream(core.list_namespaced_config_map, ns, field_selector="data.k=v", timeout_seconds=1):
            pass
    assert e.value.status == 400
    with pytest.raises(ApiException) as e:
        core.delete_collection_namespaced_config_map(ns, field_selector="data.k=v")
    assert e.value.status == 400
    assert core.list_namespaced_pod(ns, field_selector="status.phase=Running,spec.nodeName=n").items == []
    core.create_namespaced_event(ns, {"metadata": {"name": "e"}, "involvedObject": {"namespace": ns, "name": "x"},
                                      "reason": "R", "message": "m", "source": {"component": "me"}})
    assert [x.metadata.name for x in core.list_namespaced_event(ns, field_selector="source=me,involvedObject.name=x").items] == ["e"]


def test_label_selector_values_are_validated(core, ns):
    with pytest.raises(ApiException) as e:
        core.list_namespaced_config_map(ns, label_selector="gem.dev/name=" + "x" * 64)
    assert e.value.status == 400 and _status(e)["message"].startswith(
        'unable to parse requirement: values[0][gem.dev/name]: Invalid value: "' + "x" * 64)


MALFORMED_SELECTORS = [
    # labels.Parse's own words (k8s.io/apimachinery/pkg/labels/selector.go).
    ("a in (b", "unable to parse requirement: found '', expected: ',' or ')'"),
    ("a in b)", "unable to parse requirement: found 'b' expected: '('"),
    ("a in (b c)", "unable to parse requirement: found 'c', expected: ',' or ')'"),
    ("a notin", "unable to parse requirement: found '' expected: '('"),
    ("a b", "unable to parse requirement: found 'b', expected: '=', '!=', '==', 'in', notin'"),
    ("a=(b)", "unable to parse requirement: found '(', expected: identifier"),
    ("!a=b", "found '=', expected: ',' or 'end of string'"),
    ("a=b=c", "found '=', expected: ',' or 'end of string'"),
    ("a,", "found '', expected: identifier after ','"),
    (",a", "found ',', expected: !, identifier, or 'end of string'"),
    ("a<x", "unable to parse requirement: values[0]: Invalid value: \"x\": for 'Gt', 'Lt' operators, "
            "the value must be an integer"),
    ("-a=b", "unable to parse requirement: <nil>: Invalid value: \"-a\": name part must consist of"),
]


def test_malformed_label_selectors_are_400(core, ns):
    for selector, message in MALFORMED_SELECTORS:
        with pytest.raises(ApiException) as e:
            core.list_namespaced_config_map(ns, label_selector=selector)
        status = _status(e)
        assert e.value.status == 400 and status["reason"] == "BadRequest" and status["kind"] == "Status", selector
        assert status["message"].startswith(message), (selector, status["message"])
    with pytest.raises(ApiException) as e:  # watches parse it the same way
        core.list_namespaced_config_map(ns, label_selector="a in (b", watch=True, timeout_seconds=1)
    assert e.value.status == 400 and "expected: ',' or ')'" in _status(e)["message"]


def test_label_selector_grammar_edges(core, ns):
    core.create_namespaced_config_map(ns, cm("a", {"app": "x", "n": "5"}))
    core.create_namespaced_config_map(ns, cm("b", {"app": "", "n": "12"}))
    core.create_namespaced_config_map(ns, cm("c", {"in": "in"}))

    def names(selector):
        return [i.metadata.name for i in core.list_namespaced_config_map(ns, label_selector=selector).items]

    assert names("app in (foo,,x)") == ["a", "b"]  # an empty value between the commas
    assert names("app notin ()") == ["a", "c"]  # () is the empty value; notin matches a missing key
    assert names("app==") == ["b"] and names("app=x,  n") == ["a"]
    assert names("n>6") == ["b"] and names("n<6") == ["a"]  # integers, not strings
    assert names("in in (in)") == ["c"]  # `in` is a value (and a key) where one is expected
    assert names("!app,!n") == ["c"] and names(" ") == ["a", "b", "c"]


def test_paginated_list_is_a_consistent_snapshot(core, ns):
    """etcd3 pagination: later pages come from the first page's snapshot, with its resourceVersion."""
    for n in ("a", "b", "c", "d", "e"):
        core.create_namespaced_config_map(ns, cm(n, data={"v": "1"}))
    p1 = core.list_namespaced_config_map(ns, limit=2)
    assert [i.metadata.name for i in p1.items] == ["a", "b"]
    assert p1.metadata.remaining_item_count == 3 and p1.metadata._continue
    core.create_namespaced_config_map(ns, cm("bb"))       # after the snapshot: not listed
    core.delete_namespaced_config_map("c", ns)            # listed as it was
    core.patch_namespaced_config_map("d", ns, {"data": {"v": "2"}})
    p2 = core.list_namespaced_config_map(ns, limit=2, _continue=p1.metadata._continue)
    assert [(i.metadata.name, i.data["v"]) for i in p2.items] == [("c", "1"), ("d", "1")]
    assert p2.metadata.resource_version == p1.metadata.resource_version
    p3 = core.list_namespaced_config_map(ns, limit=2, _continue=p2.metadata._continue)
    assert [i.metadata.name for i in p3.items] == ["e"] and not p3.metadata._continue
    with pytest.raises(ApiException) as e:
        core.list_namespaced_config_map(ns, limit=2, _continue="not-a-token")
    assert e.value.status == 400 and "invalid continue token" in _status(e)["message"]
    with pytest.raises(ApiException) as e:
        core.list_namespaced_config_map(ns, limit=2, _continue=p1.metadata._continue, resource_version="5")
    assert e.value.status == 400 and "not allowed when using continue" in _status(e)["message"]


def test_paginated_list_with_compacted_snapshot_gets_410(tmp_path):
    with KubeAPIServer(crd_paths=[], history_size=3, workdir=tmp_path) as s:
        core = client.CoreV1Api(s.api_client())
        for n in ("a", "b", "c"):
            core.create_namespaced_config_map("default", cm(n))
        p1 = core.list_namespaced_config_map("default", limit=1)
        for i in range(5):
            core.create_namespaced_config_map("default", cm(f"z{i}"))
        with pytest.raises(ApiException) as e:
            core.list_namespaced_config_map("default", limit=1, _continue=p1.metadata._continue)
        st = _status(e)
        assert e.value.status == 410 and st["reason"] == "Expired" and "too old to display a consistent list" in st["message"]
        # the Status carries a token that continues at the latest state
        rest = core.list_namespaced_config_map("default", _continue=st["metadata"]["continue"])
        assert [i.metadata.name for i in rest.items] == ["b", "c", "z0", "z1", "z2", "z3", "z4"]


def test_unconditional_updates_and_uid_preconditions(core, custom, ns):
    g, v, p = "kubeflow.org", "v1", "pytorchjobs"
    job = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "j"},
           "spec": {"pytorchReplicaSpecs": {"Master": {"replicas": 1, "template": {"spec": {"containers": [
               {"name": "pytorch", "image": "x"}]}}}}}}
    created = custom.create_namespaced_custom_object(g, v, ns, p, job)
    body = dict(created, metadata={"name": "j"})
    with pytest.raises(ApiException) as e:  # custom resources refuse a PUT without resourceVersion
        custom.replace_namespaced_custom_object(g, v, ns, p, "j", body)
    assert e.value.status == 422 and _status(e)["message"] == (
        'pytorchjobs.kubeflow.org "j" is invalid: metadata.resourceVersion: Invalid value: 0x0: must be specified for an update')
    core.create_namespaced_config_map(ns, cm("a"))
    core.replace_namespaced_config_map("a", ns, cm("a", data={"k": "2"}))  # built-in kinds allow it
    with pytest.raises(ApiException) as e:  # the body's uid is a precondition
        core.replace_namespaced_config_map("a", ns, {"metadata": {"name": "a", "uid": "other"}, "data": {}})
    assert e.value.status == 409 and "Precondition failed: UID in precondition: other" in _status(e)["message"]
    with pytest.raises(ApiException) as e:  # and immutable in a patch
        core.patch_namespaced_config_map("a", ns, {"metadata": {"uid": "other"}})
    assert e.value.status == 422 and "metadata.uid" in _status(e)["message"]


def test_terminating_namespace_refuses_new_objects(core, ns):
    core.create_namespaced_config_map(ns, {"metadata": {"name": "held", "finalizers": ["test.dev/hold"]}})
    core.delete_namespace(ns)
    assert core.read_namespace(ns).status.phase == "Terminating"
    with pytest.raises(ApiException) as e:
        core.create_namespaced_config_map(ns, cm("new"))
    st = _status(e)
    assert e.value.status == 403 and st["reason"] == "Forbidden"
    assert st["message"] == f'configmaps "new" is forbidden: unable to create new content in namespace {ns} because it is being terminated'
    assert st["details"]["causes"][0]["reason"] == "NamespaceTerminating"
    core.patch_namespaced_config_map("held", ns, {"metadata": {"finalizers": None}})
    with pytest.raises(ApiException) as e:
        core.read_namespace(ns)
    assert e.value.status == 404


def test_events_are_validated(api, core, ns):
    with pytest.raises(ApiException) as e:  # a legacy Event's namespace must be its object's
        core.create_namespaced_event(ns, {"metadata": {"name": "e1"}, "involvedObject": {"namespace": "other"},
                                          "reason": "R", "message": "m"})
    assert e.value.status == 422 and _status(e)["details"]["causes"][0]["field"] == "involvedObject.namespace"
    kopf_like = {"metadata": {"generateName": "kopf-event-"}, "involvedObject": {"namespace": ns, "name": "x"},
                 "reason": "Logging", "message": "m", "type": "Normal", "eventTime": "2024-01-01T00:00:00.000000Z",
                 "reportingComponent": "kopf", "reportingInstance": "dev", "source": {"component": "kopf"}}
    core.create_namespaced_event(ns, dict(kopf_like, action="Action?"))
    with pytest.raises(ApiException) as e:  # with eventTime: action, reason, reporting* are required
        core.create_namespaced_event(ns, dict(kopf_like, message="x" * 1025))
    fields = [c["field"] for c in _status(e)["details"]["causes"]]
    assert e.value.status == 422 and fields == ["action", "message"]
    with pytest.raises(ApiException) as e:  # events.k8s.io/v1: the strict rules
        client.EventsV1Api(api).create_namespaced_event(ns, {
            "metadata": {"name": "e2"}, "eventTime": "2024-01-01T00:00:00.000000Z", "regarding": {"namespace": ns},
            "reportingController": "x", "reportingInstance": "y", "action": "A", "reason": "R", "deprecatedCount": 1})
    fields = [c["field"] for c in _status(e)["details"]["causes"]]
    assert e.value.status == 422 and fields == ["type", "count"]


def test_request_options_are_validated(api, core, ns):
    with pytest.raises(ApiException) as e:
        core.create_namespaced_config_map(ns, cm("a"), dry_run="true")
    assert e.value.status == 422 and _status(e)["message"] == (
        'CreateOptions.meta.k8s.io "" is invalid: dryRun: Unsupported value: []string{"true"}: supported values: "All"')
    core.create_namespaced_config_map(ns, cm("a"), dry_run="All")
    assert core.list_namespaced_config_map(ns).items == []
    core.create_namespaced_config_map(ns, cm("a"))
    with pytest.raises(ApiException) as e:  # server-side apply needs a fieldManager
        api.call_api(f"/api/v1/namespaces/{ns}/configmaps/a", "PATCH", body={"data": {"k": "v"}},
                     header_params={"Content-Type": "application/apply-patch+yaml"})
    assert e.value.status == 422 and "fieldManager: Required value: is required for apply patch" in _status(e)["message"]
    with pytest.raises(ApiException) as e:
        core.delete_namespaced_config_map("a", ns, propagation_policy="Sideways")
    assert e.value.status == 422 and "propagationPolicy: Unsupported value" in _status(e)["message"]
    assert core.read_namespaced_config_map("a", ns)


def test_pytorchjob_admission_like_training_operator_webhook(custom, ns):
    """training-operator v1.9's validating webhook: job names are DNS-1035 labels, Master has 1 replica."""
    def job(name, master_replicas=1):
        return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": name},
                "spec": {"pytorchReplicaSpecs": {"Master": {"replicas": master_replicas, "template": {"spec": {
                    "containers": [{"name": "pytorch", "image": "x"}]}}}}}}

    with pytest.raises(ApiException) as e:
        custom.create_namespaced_custom_object("kubeflow.org", "v1", ns, "pytorchjobs", job("a.b-train"))
    st = _status(e)
    assert e.value.status == 403 and st["reason"] == "Forbidden"
    assert st["message"].startswith('admission webhook "validator.pytorchjob.training-operator.kubeflow.org" denied '
                                    'the request: metadata.name: Invalid value: "a.b-train": should match: a DNS-1035 label')
    with pytest.raises(ApiException) as e:
        custom.create_namespaced_custom_object("kubeflow.org", "v1", ns, "pytorchjobs", job("two", 2))
    assert e.value.status == 403 and "spec.pytorchReplicaSpecs[Master].replicas: Forbidden: must be 1" in _status(e)["message"]
    custom.create_namespaced_custom_object("kubeflow.org", "v1", ns, "pytorchjobs", job("ok"))
    with pytest.raises(ApiException) as e:  # updates too
        custom.patch_namespaced_custom_object("kubeflow.org", "v1", ns, "pytorchjobs", "ok",
                                              {"spec": {"pytorchReplicaSpecs": {"Master": {"replicas": 3}}}})
    assert e.value.status == 403


def test_watch_events_keep_resource_version_order_across_threads():
    """A write from another thread (a test, the executor's caller) and one on the server's loop
    reach a watch in resourceVersion order, and a BOOKMARK never runs ahead of the events sent:
    a client resuming from it would otherwise skip the event still in flight."""
    import asyncio

    from tests.kubeapi.store import Store

    store = Store()
    store.create(store.types[("", "namespaces")], "", {"metadata": {"name": "default"}})
    cms = store.types[("", "configmaps")]
    loop = asyncio.new_event_loop()
    try:
        w = store.watch(loop, cms, "default", str(store.rv), None, None)

        async def scenario():
            t = threading.Thread(target=lambda: store.create(cms, "default", {"metadata": {"name": "from-thread"}}))
            t.start()
            t.join()  # its event is scheduled on the loop, not queued yet
            store.create(cms, "default", {"metadata": {"name": "on-loop"}})
            store.bookmark(w)
            await asyncio.sleep(0.05)
            out = []
            while not w.queue.empty():
                etype, obj = w.queue.get_nowait()
                out.append((etype, obj if etype == "BOOKMARK" else obj["metadata"]["name"]))
            return out

        got = loop.run_until_complete(scenario())
    finally:
        loop.close()
    assert got == [("ADDED", "from-thread"), ("ADDED", "on-loop"), ("BOOKMARK", str(store.rv))]

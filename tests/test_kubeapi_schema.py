"""CRD structural schemas: validation errors like the real apiserver, pruning, defaulting."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from tests.kubeapi import PYTORCHJOB_CRD, KubeAPIServer
from tests.kubeapi.server import GEM_CRDS_DIR

ROOT = Path(__file__).resolve().parents[1]
SHARED_CRD = ROOT.parent / "shared" / "reference" / "kubeflow.org_pytorchjobs.yaml"
HAVE_GEM_CRDS = (GEM_CRDS_DIR / "gem.dev_gemtrainings.yaml").exists()

TEST_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.test.dev"},
    "spec": {"group": "test.dev", "scope": "Namespaced",
             "names": {"kind": "Widget", "plural": "widgets", "singular": "widget", "shortNames": ["wd"]},
             "versions": [{"name": "v1", "served": True, "storage": True, "subresources": {"status": {}},
                           "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                               "spec": {"type": "object", "required": ["size"], "properties": {
                                   "size": {"type": "integer", "minimum": 1, "maximum": 10},
                                   "color": {"type": "string", "enum": ["red", "blue"], "default": "red"},
                                   "name": {"type": "string", "minLength": 2, "maxLength": 5, "pattern": "^[a-z]+$"},
                                   "ratio": {"type": "number", "exclusiveMinimum": True, "minimum": 0},
                                   "opt": {"type": "string", "nullable": True},
                                   "nested": {"type": "object", "default": {}, "properties": {
                                       "depth": {"type": "integer", "default": 3}}},
                                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}},
                                   "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                                   "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                                   "port": {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}]},
                               }},
                               "status": {"type": "object", "properties": {"phase": {"type": "string"}}},
                           }}}}]},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with KubeAPIServer(workdir=tmp_path_factory.mktemp("kubeapi-schema")) as s:
        s.apply_crd(TEST_CRD)
        yield s


@pytest.fixture
def custom(server):
    return client.CustomObjectsApi(server.api_client())


def widget(obj_name, **spec):
    return {"apiVersion": "test.dev/v1", "kind": "Widget", "metadata": {"name": obj_name}, "spec": spec}


def create_error(custom, body, group="test.dev", plural="widgets"):
    with pytest.raises(ApiException) as e:
        custom.create_namespaced_custom_object(group, body["apiVersion"].split("/")[1], "default", plural, body)
    assert e.value.status == 422
    import json

    return json.loads(e.value.body)


def test_vendored_pytorchjob_crd_matches_shared_reference():
    if not SHARED_CRD.exists():
        pytest.skip("../shared/reference is not present in this checkout")
    assert PYTORCHJOB_CRD.read_bytes() == SHARED_CRD.read_bytes()


def test_defaults_and_pruning(custom):
    w = custom.create_namespaced_custom_object("test.dev", "v1", "default", "widgets", widget(
        "w1", size=2, unknown="dropped", free={"anything": {"goes": 1}}, labels={"a": "b"}, opt=None,
        nested={"extra": 1}))
    assert w["spec"]["color"] == "red"
    assert w["spec"]["nested"] == {"depth": 3}
    assert "unknown" not in w["spec"]
    assert w["spec"]["free"] == {"anything": {"goes": 1}}
    assert w["spec"]["opt"] is None  # nullable keeps null
    w2 = custom.create_namespaced_custom_object("test.dev", "v1", "default", "widgets", widget("w2", size=3, port="http"))
    assert w2["spec"]["port"] == "http" and w2["spec"]["nested"] == {"depth": 3}


def test_validation_messages_like_the_apiserver(custom):
    body = create_error(custom, widget("w3", size=0, color="green", name="ABCDEFG", ratio=0, tags=["long"], port=1.5))
    causes = {c["field"]: c["message"] for c in body["details"]["causes"]}
    assert causes["spec.size"] == "Invalid value: 0: spec.size in body should be greater than or equal to 1"
    assert causes["spec.color"] == 'Unsupported value: "green": supported values: "red", "blue"'
    assert "spec.name in body should be at most 5 chars long" in body["message"]
    assert "spec.name in body should match '^[a-z]+$'" in body["message"]
    assert causes["spec.ratio"] == "Invalid value: 0: spec.ratio in body should be greater than 0"
    assert causes["spec.tags[0]"].endswith("spec.tags[0] in body should be at most 3 chars long")
    assert "spec.port" in causes
    assert body["reason"] == "Invalid" and body["code"] == 422
    assert body["message"].startswith('Widget.test.dev "w3" is invalid: [')
    missing = create_error(custom, widget("w4"))
    assert missing["message"] == 'Widget.test.dev "w4" is invalid: spec.size: Required value'
    typed = create_error(custom, widget("w5", size="big"))
    assert typed["details"]["causes"][0]["message"] == 'Invalid value: "string": spec.size in body must be of type integer: "string"'
    bad_name = create_error(custom, widget("Bad.Name", size=1))
    assert bad_name["details"]["causes"][0]["field"] == "metadata.name"


def test_update_is_validated_too(custom):
    custom.create_namespaced_custom_object("test.dev", "v1", "default", "widgets", widget("w6", size=1))
    with pytest.raises(ApiException) as e:
        custom.patch_namespaced_custom_object("test.dev", "v1", "default", "widgets", "w6", {"spec": {"size": 11}})
    assert e.value.status == 422 and "should be less than or equal to 10" in e.value.body


def test_pytorchjob_bad_field_is_rejected(server, custom):
    job = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "bad"},
           "spec": {"runPolicy": {"backoffLimit": "three"},
                    "pytorchReplicaSpecs": {"Master": {"replicas": "one", "template": {"spec": {"containers": [
                        {"image": "x"}]}}}}}}
    body = create_error(custom, job, "kubeflow.org", "pytorchjobs")
    fields = {c["field"] for c in body["details"]["causes"]}
    assert "spec.runPolicy.backoffLimit" in fields
    assert "spec.pytorchReplicaSpecs.Master.replicas" in fields
    assert "spec.pytorchReplicaSpecs.Master.template.spec.containers[0].name: Required value" in body["message"]
    assert body["message"].startswith('PyTorchJob.kubeflow.org "bad" is invalid')
    # unknown fields are pruned from a PyTorchJob, known ones kept
    ok = dict(job, metadata={"name": "good"})
    ok["spec"] = {"pytorchReplicaSpecs": {"Master": {"replicas": 1, "bogus": True, "template": {"spec": {"containers": [
        {"name": "pytorch", "image": "x", "notAField": 1}]}}}}}
    made = custom.create_namespaced_custom_object("kubeflow.org", "v1", "default", "pytorchjobs", ok)
    master = made["spec"]["pytorchReplicaSpecs"]["Master"]
    assert "bogus" not in master and "notAField" not in master["template"]["spec"]["containers"][0]


def test_crd_lifecycle_serves_and_removes_kind(server, custom):
    ext = client.ApiextensionsV1Api(server.api_client())
    crd = yaml.safe_load(yaml.safe_dump(TEST_CRD))
    crd["metadata"]["name"] = "gadgets.test.dev"
    crd["spec"]["names"] = {"kind": "Gadget", "plural": "gadgets", "singular": "gadget"}
    ext.create_custom_resource_definition(crd)
    assert any(c.metadata.name == "gadgets.test.dev" for c in ext.list_custom_resource_definition().items)
    custom.create_namespaced_custom_object("test.dev", "v1", "default", "gadgets",
                                           {"apiVersion": "test.dev/v1", "kind": "Gadget", "metadata": {"name": "g"}, "spec": {"size": 1}})
    ext.delete_custom_resource_definition("gadgets.test.dev")
    with pytest.raises(ApiException) as e:
        custom.list_namespaced_custom_object("test.dev", "v1", "default", "gadgets")
    assert e.value.status == 404


@pytest.mark.skipif(not HAVE_GEM_CRDS, reason="manifests/crds not generated yet")
def test_gem_crds_validate_and_default(custom):
    base = {"apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": "g1"}, "spec": {}}
    made = custom.create_namespaced_custom_object("gem.dev", "v1alpha1", "default", "gemtrainings", base)
    assert made["spec"]["parallelism"]["numNodes"] == 2  # defaulted from the schema
    bad = {**base, "metadata": {"name": "g2"}, "spec": {"parallelism": {"numNodes": -1}}}
    body = create_error(custom, bad, "gem.dev", "gemtrainings")
    assert ("spec.parallelism.numNodes: Invalid value: -1: spec.parallelism.numNodes in body should be greater "
            "than or equal to 1") in body["message"]

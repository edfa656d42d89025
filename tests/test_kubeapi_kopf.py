"""kopf's discovery, watch and patch paths work against the API test server."""

from __future__ import annotations

import textwrap

import pytest

from tests.kubeapi import KubeAPIServer
from tests.kubeapi.testing import wait_for

OPERATOR = textwrap.dedent('''
    import os
    import kopf

    @kopf.on.startup()
    def configure(settings, **_):
        settings.watching.server_timeout = 10
        settings.posting.loggers = True
        settings.persistence.finalizer = "test.dev/finalizer"

    @kopf.on.login()
    def login(**_):
        return kopf.ConnectionInfo(server=os.environ["KUBEAPI_URL"], insecure=True, default_namespace="default")

    @kopf.on.create("test.dev", "v1", "widgets")
    def created(spec, patch, logger, **_):
        logger.info("widget created")
        patch.status["phase"] = "Ready"
        patch.status["size"] = spec["size"] * 2

    @kopf.on.update("test.dev", "v1", "widgets", field="spec.size")
    def resized(new, patch, **_):
        patch.status["size"] = new * 2

    @kopf.on.delete("test.dev", "v1", "widgets")
    def deleted(name, **_):
        with open(os.environ["KUBEAPI_MARKER"], "w") as f:
            f.write(name)
''')

CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition", "metadata": {"name": "widgets.test.dev"},
    "spec": {"group": "test.dev", "scope": "Namespaced", "names": {"kind": "Widget", "plural": "widgets", "singular": "widget"},
             "versions": [{"name": "v1", "served": True, "storage": True, "subresources": {"status": {}},
                           "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                               "spec": {"type": "object", "properties": {"size": {"type": "integer"}}},
                               "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}}}]},
}


def test_kopf_operator_handles_a_crd(tmp_path, monkeypatch):
    kopf_testing = pytest.importorskip("kopf.testing")
    op = tmp_path / "op.py"
    op.write_text(OPERATOR)
    marker = tmp_path / "deleted"
    with KubeAPIServer(crd_paths=[], workdir=tmp_path / "api") as s:
        s.apply_crd(CRD)
        monkeypatch.setenv("KUBEAPI_URL", s.url)
        monkeypatch.setenv("KUBEAPI_MARKER", str(marker))
        with kopf_testing.KopfRunner(["run", "-A", "--standalone", str(op)], timeout=60) as runner:
            s.create("test.dev/v1", "Widget", {"metadata": {"name": "w"}, "spec": {"size": 2}})
            w = wait_for(lambda: (s.get("test.dev/v1", "Widget", "w") or {}).get("status", {}).get("phase") == "Ready"
                         and s.get("test.dev/v1", "Widget", "w"), 30, what="kopf to patch status")
            assert w["status"]["size"] == 4
            assert "test.dev/finalizer" in w["metadata"]["finalizers"]
            from kubernetes import client

            custom = client.CustomObjectsApi(s.api_client())
            custom.patch_namespaced_custom_object("test.dev", "v1", "default", "widgets", "w", {"spec": {"size": 5}})
            wait_for(lambda: s.get("test.dev/v1", "Widget", "w")["status"].get("size") == 10, 30, what="update handler")
            wait_for(lambda: any(e["message"] == "widget created" for e in s.events()), 30, what="kopf's k8s event")
            custom.delete_namespaced_custom_object("test.dev", "v1", "default", "widgets", "w")
            wait_for(lambda: s.get("test.dev/v1", "Widget", "w") is None, 30, what="finalizer removed by kopf")
            assert marker.read_text() == "w"
        assert runner.exit_code == 0, runner.output
        assert runner.exception is None

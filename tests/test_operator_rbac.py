"""The operator under its own RBAC: every request it makes is granted, and every grant is used.

The API test server authorizes nobody (docs/kubeapi.md), so this test puts an authorizer in front
of it for the operator's token: each request is resolved to (API group, resource, verb) the way the
API server's RequestInfo does it and checked against `gem_operator.kube.RBAC_RULES`, which the
chart and manifests/rbac are checked to equal (tests/test_helm_chart.py). A request not granted is
answered 403, as a cluster would, and fails the test; a grant the operator (kopf included) never
made in a lifecycle that takes every path to the API fails it too, unless listed in NOT_EXERCISED.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from aiohttp import web
from kubernetes import client

from gem_operator.kube import RBAC_RULES
from tests.kubeapi import KubeAPIServer
from tests.kubeapi.server import write_kubeconfig
from tests.kubeapi.testing import wait_for
from tests.test_operator import GROUP, ROOT, VERSION, create, distill, finish_job, gemtraining, status_of, wait_phase
from tests.test_operator_placement import add_nodes, bind_pods, parallel_training
from tests.test_operator_reconcile import WORKLOAD_CRD, WORKLOADS, kueue_creates_workload

TOKEN = "gem-operator-serviceaccount"

#: Grants the lifecycle below cannot use: where they are needed and checked.
NOT_EXERCISED = {
    # The OwnerReferencesPermissionEnforcement admission plugin (OpenShift, hardened clusters) asks
    # for it when a child has blockOwnerDeletion; the test server has no admission plugins
    # (tests/test_helm_chart.py checks the plugin's rule against the chart).
    *{("gem.dev", f"{plural}/finalizers", "update") for plural in ("gemtrainings", "loopfmdistills")},
}
#: kopf's peering, only with --peering: KopfPeering for an operator limited to namespaces,
#: ClusterKopfPeering for -A (test_peering_stays_within_the_rbac).
PEERING = {("kopf.dev", plural, verb) for plural in ("kopfpeerings", "clusterkopfpeerings") for verb in ("list", "watch", "patch")}

#: Subresources of a namespace, which the API server does not take for a resource inside it.
_NAMESPACE_SUBRESOURCES = {"status", "finalize"}


def request_info(method: str, path: str, query: dict[str, str]) -> tuple[str, str, str] | None:
    """(group, resource[/subresource], verb) of a resource request, None for discovery and other
    non-resource paths (which every authenticated user may read): apiserver's RequestInfoFactory."""
    parts = [p for p in path.split("/") if p]
    if len(parts) >= 2 and parts[0] == "api":
        group, rest = "", parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        group, rest = parts[1], parts[3:]
    else:
        return None
    if not rest:
        return None
    if rest[0] == "namespaces" and len(rest) > 2 and rest[2] not in _NAMESPACE_SUBRESOURCES:
        rest = rest[2:]
    resource, name = rest[0], rest[1] if len(rest) > 1 else None
    if len(rest) > 2:
        resource = f"{resource}/{rest[2]}"
    if query.get("watch") in ("true", "1"):
        verb = "watch"
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method) or {
            "GET": "get" if name else "list", "HEAD": "get" if name else "list",
            "DELETE": "delete" if name else "deletecollection"}[method]
    return group, resource, verb


def triples(rules: list[dict]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


class Authorizer:
    """Checks the requests carrying TOKEN against `rules`; records what was asked and refused."""

    def __init__(self, rules: list[dict]):
        self.granted = triples(rules)
        self.used: set[tuple[str, str, str]] = set()
        self.refused: list[str] = []

    async def authorize(self, request: web.Request, handler):
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return await handler(request)  # the test itself, playing users and controllers
        info = request_info(request.method, request.path, dict(request.query))
        if info is None:
            return await handler(request)
        self.used.add(info)
        if info in self.granted:
            return await handler(request)
        group, resource, verb = info
        self.refused.append(f"{request.method} {request.path_qs}: {verb} {resource} in group {group!r}")
        message = f'{resource} is forbidden: User "system:serviceaccount:gem:gem-operator" cannot {verb} resource "{resource}" in API group "{group}"'
        body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
                "reason": "Forbidden", "code": 403}
        return web.Response(status=403, text=json.dumps(body), content_type="application/json")


@pytest.fixture
def authorized(tmp_path):
    """The API test server behind an Authorizer of RBAC_RULES, and a kubeconfig with TOKEN."""
    authorizer = Authorizer(RBAC_RULES)
    server = KubeAPIServer(executor=False, workdir=tmp_path / "kubeapi")
    # added before the server starts: aiohttp freezes its middlewares then
    server.app.app.middlewares.append(web.middleware(lambda request, handler: authorizer.authorize(request, handler)))
    with server:
        kubeconfig = write_kubeconfig(tmp_path / "operator-kubeconfig", server.url)
        kubeconfig.write_text(kubeconfig.read_text().replace("kubeapi-test-token", TOKEN))
        yield server, authorizer, kubeconfig


def start_operator(kubeconfig: Path, log: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "GEM_RESYNC_SECONDS": "2", "GEM_PEERING_LIFETIME": "5"}
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "gem_operator", "--kubeconfig", str(kubeconfig), *args],
                                stdout=out, stderr=subprocess.STDOUT, env=env)


@contextlib.contextmanager
def running(kubeconfig: Path, log: Path, *args: str):
    proc = start_operator(kubeconfig, log, *args)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(10)


def lifecycle(cluster, authorizer: Authorizer) -> None:
    """Every path to the API: created after a failed create, Running with pods on nodes, a queued
    job suspended through Kueue, a finished job's report read."""
    api = client.CustomObjectsApi(cluster.api_client())
    cluster.apply_crd(WORKLOAD_CRD)
    add_nodes(cluster, {"b0": ["n0", "n1"]})
    # The job's first create fails: the retry finds its ConfigMap (409), reads and updates it.
    cluster.faults.add(method="POST", path=r"/pytorchjobs$", status=503, times=1)
    create(api, parallel_training("t", num_nodes=2))  # unsized topology levels: the nodes are read
    create(api, distill("d", {"checkpoint": "/ckpt/teacher"}, scheduling={"queueName": "team-a"}))
    wait_phase(cluster, "GEMTraining", "t", "Created")
    wait_phase(cluster, "LoopFMDistill", "d", "Created")

    # Running: the job events read the resources back, the pods and their nodes are read for
    # status.placement, and the resync timer reads the master's log for progress.
    bind_pods(cluster, "t-train", ["n0", "n1"])
    wait_phase(cluster, "GEMTraining", "t", "Running")
    wait_for(lambda: ("", "pods/log", "get") in authorizer.used, what="a progress read")
    # A queued job is suspended through its Kueue Workload.
    workload = kueue_creates_workload(cluster, "d-distill")
    api.patch_namespaced_custom_object(GROUP, VERSION, "default", "loopfmdistills", "d", {"spec": {"suspend": True}})
    wait_for(lambda: cluster.get(WORKLOADS, "Workload", workload)["spec"]["active"] is False, what="workload deactivated")
    finish_job(cluster, "d-distill", {"metrics": {"ne/click": 0.8}, "ne": 0.8})
    wait_phase(cluster, "LoopFMDistill", "d", "Succeeded")
    wait_for(lambda: status_of(cluster, "GEMTraining", "t").get("placement"), what="status.placement")


def test_the_operator_uses_exactly_the_rbac_it_is_granted(authorized, tmp_path):
    cluster, authorizer, kubeconfig = authorized
    with running(kubeconfig, tmp_path / "operator.log", "-n", "default"):
        try:
            lifecycle(cluster, authorizer)
        finally:  # a refusal, if any, says more than the wait it made time out
            assert not authorizer.refused, "the operator made requests RBAC_RULES does not grant:\n" + "\n".join(authorizer.refused)
    unused = authorizer.granted - authorizer.used - NOT_EXERCISED - PEERING
    assert not unused, f"RBAC_RULES grants what the operator never asked for: {sorted(unused)}"
    assert NOT_EXERCISED | PEERING <= authorizer.granted


@pytest.mark.parametrize("scope", [["-n", "default"], []], ids=["namespaced", "cluster-wide"])
def test_peering_stays_within_the_rbac(authorized, tmp_path, scope):
    cluster, authorizer, kubeconfig = authorized
    for doc in yaml.safe_load_all((ROOT / "manifests/peering/kopf-peering.yaml").read_text()):
        if doc["kind"] == "CustomResourceDefinition":
            cluster.apply_crd(doc)
    kind, plural = ("KopfPeering", "kopfpeerings") if scope else ("ClusterKopfPeering", "clusterkopfpeerings")
    cluster.create("kopf.dev/v1", kind, {"metadata": {"name": "gem-operator"}}, namespace="default" if scope else None)
    with running(kubeconfig, tmp_path / "operator.log", *scope, "--peering", "gem-operator"):
        try:
            wait_for(lambda: (cluster.get("kopf.dev/v1", kind, "gem-operator", namespace="default" if scope else None)
                              or {}).get("status"), what="the replica announced in the peering object")
            create(client.CustomObjectsApi(cluster.api_client()), gemtraining("peered"))
            wait_phase(cluster, "GEMTraining", "peered", "Created")
        finally:
            assert not authorizer.refused, "the operator made requests RBAC_RULES does not grant:\n" + "\n".join(authorizer.refused)
    assert {t for t in PEERING if t[1] == plural} <= authorizer.used


@pytest.mark.parametrize("method, path, query, expected", [
    ("GET", "/api/v1/namespaces/default/pods", {}, ("", "pods", "list")),
    ("GET", "/api/v1/namespaces/default/pods/p/log", {"tailLines": "5"}, ("", "pods/log", "get")),
    ("GET", "/api/v1/namespaces", {"watch": "true"}, ("", "namespaces", "watch")),
    ("GET", "/api/v1/namespaces/default", {}, ("", "namespaces", "get")),
    ("PUT", "/api/v1/namespaces/default/finalize", {}, ("", "namespaces/finalize", "update")),
    ("PATCH", "/apis/gem.dev/v1alpha1/namespaces/a/gemtrainings/x/status", {}, ("gem.dev", "gemtrainings/status", "patch")),
    ("GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", {"watch": "1"}, ("apiextensions.k8s.io", "customresourcedefinitions", "watch")),
    ("DELETE", "/apis/kubeflow.org/v1/namespaces/a/pytorchjobs", {}, ("kubeflow.org", "pytorchjobs", "deletecollection")),
    ("POST", "/api/v1/namespaces/a/events", {}, ("", "events", "create")),
    ("GET", "/apis/gem.dev/v1alpha1", {}, None),
    ("GET", "/version", {}, None),
])
def test_requests_resolve_like_the_api_server(method, path, query, expected):
    assert request_info(method, path, query) == expected

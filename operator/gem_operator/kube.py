"""The few Kubernetes API calls the operator makes, through the official `kubernetes` client.

kopf brings no client of its own. Handlers are sync functions (kopf runs them in a thread pool),
so the sync client fits. Every verb used here is listed in `RBAC_RULES`, from which the
ClusterRole in manifests/ and the Helm chart are checked: nothing else may be called.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import kubernetes
from kubernetes.client.rest import ApiException

from gem.api.types import GROUP, KINDS, VERSION

#: Everything the operator's code does to the API (kopf's own needs included).
RBAC_RULES: list[dict[str, Any]] = [
    {"apiGroups": [GROUP], "resources": [k["plural"] for k in KINDS.values()], "verbs": ["get", "list", "watch", "patch", "update"]},
    {"apiGroups": [GROUP], "resources": [f"{k['plural']}/status" for k in KINDS.values()], "verbs": ["get", "patch", "update"]},
    {"apiGroups": ["kubeflow.org"], "resources": ["pytorchjobs"], "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "create", "patch", "delete"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    # the master's recent log lines carry the trainer's progress (see reconcile.progress_from_log)
    {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
    {"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
    # kopf: discovery of the resources it serves, and namespaces when running cluster-wide.
    {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get", "list", "watch"]},
    # kopf peering (--peering): replicas announce themselves so only one acts.
    {"apiGroups": ["kopf.dev"], "resources": ["kopfpeerings", "clusterkopfpeerings"], "verbs": ["get", "list", "watch", "patch"]},
]


class Conflict(Exception):
    """The object exists but belongs to someone else."""


@functools.cache
def _api_client() -> kubernetes.client.ApiClient:
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    return kubernetes.client.ApiClient()


def custom() -> kubernetes.client.CustomObjectsApi:
    return kubernetes.client.CustomObjectsApi(_api_client())


def core() -> kubernetes.client.CoreV1Api:
    return kubernetes.client.CoreV1Api(_api_client())


def plural_of(kind: str) -> str:
    return KINDS[kind]["plural"]


def get_resource(kind: str, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return custom().get_namespaced_custom_object(GROUP, VERSION, namespace, plural_of(kind), name)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def patch_status(kind: str, namespace: str, name: str, status: dict[str, Any]) -> None:
    """Merge-patch the status subresource; a resource deleted meanwhile is not an error."""
    try:
        custom().patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, plural_of(kind), name, {"status": status}
        )
    except ApiException as e:
        if e.status != 404:
            raise


def ensure_config_map(cm: dict[str, Any]) -> None:
    """Create the ConfigMap, or bring an existing one of ours up to date (idempotent)."""
    ns, name = cm["metadata"]["namespace"], cm["metadata"]["name"]
    try:
        core().create_namespaced_config_map(ns, cm)
    except ApiException as e:
        if e.status != 409:
            raise
        core().patch_namespaced_config_map(name, ns, {"data": cm["data"], "metadata": {"labels": cm["metadata"]["labels"]}})


def get_pytorchjob(namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return custom().get_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs", name)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def ensure_pytorchjob(job: dict[str, Any], owner_uid: str) -> tuple[dict[str, Any], bool]:
    """Create the PyTorchJob unless it exists; returns (job, created).

    The name is deterministic, so a retried handler or a restarted operator finds the job it
    created before (409) instead of making a second one. A job of the same name owned by another
    object (say, a deleted resource's job not yet garbage-collected) is a Conflict.
    """
    ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
    try:
        created = custom().create_namespaced_custom_object("kubeflow.org", "v1", ns, "pytorchjobs", job)
        return created, True
    except ApiException as e:
        if e.status != 409:
            raise
    existing = get_pytorchjob(ns, name)
    if existing is None:
        raise Conflict(f"PyTorchJob {ns}/{name} vanished right after a create conflict; retrying")
    owners = {ref.get("uid") for ref in existing["metadata"].get("ownerReferences", [])}
    if owner_uid not in owners:
        raise Conflict(
            f"PyTorchJob {ns}/{name} exists but is not owned by this resource (uid {owner_uid}); "
            "it is probably the job of a deleted resource of the same name and will be garbage-collected"
        )
    return existing, False


def patch_pytorchjob(namespace: str, name: str, patch: dict[str, Any]) -> None:
    custom().patch_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs", name, patch)


def list_job_pods(namespace: str, job_name: str) -> list[dict[str, Any]]:
    # Raw JSON, not the client's models: they reject pods that newer kubelets or other
    # runtimes report with fields they consider required (a known strictness of the client).
    resp = core().list_namespaced_pod(
        namespace, label_selector=f"training.kubeflow.org/job-name={job_name}", _preload_content=False
    )
    return json.loads(resp.data)["items"]


def pod_log_tail(namespace: str, pod: str, lines: int = 50) -> str | None:
    """The last `lines` lines of a pod's `pytorch` container, or None if it has none yet."""
    try:
        # Raw bytes: the client would turn log text that looks like JSON into a Python repr.
        resp = core().read_namespaced_pod_log(
            pod, namespace, container="pytorch", tail_lines=lines, _preload_content=False
        )
        return resp.data.decode("utf-8", errors="replace")
    except ApiException as e:
        if e.status in (400, 404):  # not started yet, or gone
            return None
        raise

"""The few Kubernetes API calls the operator makes, through the official `kubernetes` client.

kopf brings no client of its own. Handlers are sync functions (kopf runs them in a thread pool),
so the sync client fits. Every verb used here is listed in `RBAC_RULES`, from which the
ClusterRole in manifests/ and the Helm chart are checked: nothing else may be called.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import json
import os
import uuid
from typing import Any

import kubernetes
import urllib3
from kubernetes.client.rest import ApiException

from gem.api.types import GROUP, KINDS, VERSION
from gem_operator.settings import CONFIG

#: Everything the operator's code does to the API (kopf's own needs included), and nothing more:
#: tests/test_operator_rbac.py runs the operator under these rules, refusing anything else, and
#: fails on a grant it never used. Writes are patches (kopf's too): no update, and no delete:
#: children go by their ownerReferences.
RBAC_RULES: list[dict[str, Any]] = [
    # get: a teacher, a job's parent; list/watch: kopf; patch: kopf's finalizer and annotations
    {"apiGroups": [GROUP], "resources": [k["plural"] for k in KINDS.values()], "verbs": ["get", "list", "watch", "patch"]},
    {"apiGroups": [GROUP], "resources": [f"{k['plural']}/status" for k in KINDS.values()], "verbs": ["patch"]},
    # Children carry blockOwnerDeletion: true; where the OwnerReferencesPermissionEnforcement admission
    # plugin runs (OpenShift, hardened clusters) setting it needs update on the owner's finalizers.
    {"apiGroups": [GROUP], "resources": [f"{k['plural']}/finalizers" for k in KINDS.values()], "verbs": ["update"]},
    {"apiGroups": ["kubeflow.org"], "resources": ["pytorchjobs"], "verbs": ["get", "list", "watch", "create", "patch"]},
    # get: an existing one read back after a create's 409
    {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "create", "patch"]},
    # a job's pods: the trainer's report and where the ranks landed
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
    # the master's recent log lines carry the trainer's progress (see gem.api.status.progress_from_log)
    {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
    # node labels size the topology levels and say where each rank landed (gem_operator/parallel.py)
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]},
    # core/v1 Events, each created once under a derived name (post_event); kopf posts core/v1 too
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    # a Kueue-queued job is suspended and resumed through its Workload's spec.active (reconcile._pass_on_suspend)
    {"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloads"], "verbs": ["list", "patch"]},
    # kopf: new and deleted CRDs of the resources it serves, and (serving given namespaces) namespaces.
    {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"], "verbs": ["list", "watch"]},
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
    # kopf peering (--peering): replicas announce themselves so only one acts.
    {"apiGroups": ["kopf.dev"], "resources": ["kopfpeerings", "clusterkopfpeerings"], "verbs": ["list", "watch", "patch"]},
]


class Conflict(Exception):
    """The object exists but belongs to someone else."""


class Rejected(Exception):
    """The API server refused an object we rendered (400/422): retrying cannot help."""


class NotServed(Exception):
    """The resource cannot be used: its CRD (say Kueue's) is not installed, or RBAC does not allow it."""


#: HTTP statuses worth retrying: conflicts, throttling and server-side trouble.
TRANSIENT_STATUSES = frozenset({409, 429, 500, 502, 503, 504})


def is_transient(e: BaseException) -> bool:
    """Whether a failed API call may succeed when retried (the handler raises TemporaryError)."""
    if isinstance(e, ApiException):
        return e.status in TRANSIENT_STATUSES or e.status == 0  # 0: the client's own connection error
    return isinstance(e, (urllib3.exceptions.HTTPError, OSError))


@functools.cache
def _api_client() -> kubernetes.client.ApiClient:
    cfg = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=cfg)
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config(client_configuration=cfg)
    # No silent retries inside urllib3: a failed call surfaces at once and the handler is retried
    # by kopf with backoff, so one slow API cannot multiply each call's timeout.
    cfg.retries = False
    return kubernetes.client.ApiClient(cfg)


def _timeout() -> tuple[float, float]:
    """(connect, read) timeout of every call: a hung request never holds a handler thread."""
    return (min(10.0, CONFIG.api_timeout_seconds), CONFIG.api_timeout_seconds)


def custom() -> kubernetes.client.CustomObjectsApi:
    return kubernetes.client.CustomObjectsApi(_api_client())


def core() -> kubernetes.client.CoreV1Api:
    return kubernetes.client.CoreV1Api(_api_client())


def plural_of(kind: str) -> str:
    return KINDS[kind]["plural"]


def get_resource(kind: str, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return custom().get_namespaced_custom_object(
            GROUP, VERSION, namespace, plural_of(kind), name, _request_timeout=_timeout()
        )
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def patch_status(
    kind: str, namespace: str, name: str, status: dict[str, Any], resource_version: str | None = None
) -> None:
    """Merge-patch the status subresource; a resource deleted meanwhile is not an error.

    With `resource_version` (that of the body the status was computed from) the write only lands
    if nobody wrote in between, else 409 Conflict: status lists such as `conditions` are replaced
    whole by a merge patch, so a write computed from a stale body would drop what another writer
    (the job-event mirror, the timer, a handler) just added.
    """
    body: dict[str, Any] = {"status": status}
    if resource_version:
        body["metadata"] = {"resourceVersion": resource_version}
    try:
        custom().patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, plural_of(kind), name, body, _request_timeout=_timeout()
        )
    except ApiException as e:
        if e.status != 404:
            raise


def ensure_config_map(cm: dict[str, Any]) -> None:
    """Create the ConfigMap, or bring an existing one of ours up to date (idempotent).

    "Ours" is owned by the uid the ConfigMap was rendered for (its controller ownerReference).
    One of the same name owned by another object, say a deleted resource's that the garbage
    collector has not removed yet, is a Conflict, as in ensure_pytorchjob: adopting it would
    leave the new job's pods waiting for a ConfigMap the collector is about to delete.
    """
    ns, name = cm["metadata"]["namespace"], cm["metadata"]["name"]
    try:
        core().create_namespaced_config_map(ns, cm, _request_timeout=_timeout())
        return
    except ApiException as e:
        if e.status in (400, 422):
            raise Rejected(f"ConfigMap {ns}/{name}: {_reason(e)}") from None
        if e.status != 409 or _reason_code(e) != "AlreadyExists":
            raise
    _require_owned(_get_config_map(ns, name), _controller_uid(cm), "ConfigMap", ns, name, "ConfigMap")
    core().patch_namespaced_config_map(
        name, ns, {"data": cm["data"], "metadata": {"labels": cm["metadata"]["labels"]}}, _request_timeout=_timeout()
    )


def _get_config_map(namespace: str, name: str) -> dict[str, Any] | None:
    try:
        resp = core().read_namespaced_config_map(name, namespace, _preload_content=False, _request_timeout=_timeout())
    except ApiException as e:
        if e.status == 404:
            return None
        raise
    return json.loads(resp.data)


def _controller_uid(obj: dict[str, Any]) -> str | None:
    """The uid of `obj`'s controller ownerReference (the resource it was rendered for), if any."""
    refs = obj["metadata"].get("ownerReferences") or []
    return next((ref.get("uid") for ref in refs if ref.get("controller")), None)


def owned_by(obj: dict[str, Any], uid: str | None) -> bool:
    """Whether one of `obj`'s ownerReferences names the object with this uid."""
    return uid in {ref.get("uid") for ref in obj["metadata"].get("ownerReferences") or []}


def _require_owned(
    existing: dict[str, Any] | None, owner_uid: str | None, kind: str, ns: str, name: str, noun: str
) -> dict[str, Any]:
    """`existing` (read back after a 409 AlreadyExists on create), or Conflict unless `owner_uid` owns it.

    `noun` names the object in the message ("job", "ConfigMap").
    """
    if existing is None:
        raise Conflict(f"{kind} {ns}/{name} vanished right after a create conflict; retrying")
    if not owned_by(existing, owner_uid):
        raise Conflict(
            f"{kind} {ns}/{name} exists but is not owned by this resource (uid {owner_uid}); "
            f"it is probably the {noun} of a deleted resource of the same name and will be garbage-collected"
        )
    return existing


def get_pytorchjob(namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return custom().get_namespaced_custom_object(
            "kubeflow.org", "v1", namespace, "pytorchjobs", name, _request_timeout=_timeout()
        )
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
        created = custom().create_namespaced_custom_object(
            "kubeflow.org", "v1", ns, "pytorchjobs", job, _request_timeout=_timeout()
        )
        return created, True
    except ApiException as e:
        if e.status in (400, 422):
            raise Rejected(f"PyTorchJob {ns}/{name}: {_reason(e)}") from None
        # Only AlreadyExists means "it is there": any other 409 is a conflict worth retrying.
        if e.status != 409 or _reason_code(e) != "AlreadyExists":
            raise
    return _require_owned(get_pytorchjob(ns, name), owner_uid, "PyTorchJob", ns, name, "job"), False


def patch_pytorchjob(namespace: str, name: str, patch: dict[str, Any]) -> None:
    custom().patch_namespaced_custom_object(
        "kubeflow.org", "v1", namespace, "pytorchjobs", name, patch, _request_timeout=_timeout()
    )


KUEUE_WORKLOADS = ("kueue.x-k8s.io", "v1beta1", "workloads")
#: Kueue labels the Workload it creates for a job with the job's uid.
KUEUE_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"


def job_workload(namespace: str, job_uid: str) -> dict[str, Any] | None:
    """The Kueue Workload of a job, or None while Kueue has not created it.

    NotServed without Kueue (404) or without the RBAC rule for Workloads (403, an older install).
    """
    try:
        found = custom().list_namespaced_custom_object(
            *KUEUE_WORKLOADS[:2], namespace, KUEUE_WORKLOADS[2], label_selector=f"{KUEUE_JOB_UID_LABEL}={job_uid}",
            _request_timeout=_timeout(),
        )
    except ApiException as e:
        if e.status == 404:
            raise NotServed("workloads.kueue.x-k8s.io is not served (Kueue is not installed)") from None
        if e.status == 403:
            raise NotServed(f"listing workloads.kueue.x-k8s.io in {namespace} is forbidden (RBAC_RULES not applied)") from None
        raise
    items = found.get("items") or []
    return items[0] if items else None


def patch_workload(namespace: str, name: str, patch: dict[str, Any]) -> None:
    custom().patch_namespaced_custom_object(
        *KUEUE_WORKLOADS[:2], namespace, KUEUE_WORKLOADS[2], name, patch, _request_timeout=_timeout()
    )


def list_job_pods(namespace: str, job_name: str) -> list[dict[str, Any]]:
    # Raw JSON, not the client's models: they reject pods that newer kubelets or other
    # runtimes report with fields they consider required (a known strictness of the client).
    resp = core().list_namespaced_pod(
        namespace, label_selector=f"training.kubeflow.org/job-name={job_name}", _preload_content=False,
        _request_timeout=_timeout(),
    )
    return json.loads(resp.data)["items"]


def list_nodes(selector: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Nodes matching the label selector (the job's nodeSelector), as raw JSON like list_job_pods."""
    label_selector = ",".join(f"{k}={v}" for k, v in sorted((selector or {}).items())) or None
    resp = core().list_node(label_selector=label_selector, _preload_content=False, _request_timeout=_timeout())
    return json.loads(resp.data)["items"]


def pod_log_tail(namespace: str, pod: str, lines: int = 50) -> str | None:
    """The last `lines` lines of a pod's `pytorch` container, or None if it has none yet."""
    try:
        # Raw bytes: the client would turn log text that looks like JSON into a Python repr.
        resp = core().read_namespaced_pod_log(
            pod, namespace, container="pytorch", tail_lines=lines, _preload_content=False, _request_timeout=_timeout()
        )
        return resp.data.decode("utf-8", errors="replace")
    except ApiException as e:
        if e.status in (400, 404):  # not started yet, or gone
            return None
        raise


def post_event(obj: dict[str, Any], type_: str, reason: str, message: str, key: str | None = None) -> None:
    """Post a core/v1 Event about `obj`, synchronously, before the status change it announces.

    With a `key` (what makes this transition unique, e.g. the job's uid and the phase) the Event's
    name is derived from it, so a handler retried or rerun after a crash finds its Event already
    there (409) instead of posting a second one: each transition is announced exactly once.
    """
    meta = obj["metadata"]
    digest = hashlib.sha256(f"{meta.get('uid')}/{reason}/{key}".encode()).hexdigest()[:16] if key else uuid.uuid4().hex[:16]
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{meta['name']}.{digest}", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"), "name": meta["name"],
            "namespace": meta["namespace"], "uid": meta.get("uid"),
        },
        "type": type_,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": "gem-operator"},
        "reportingComponent": "gem-operator",
        "reportingInstance": os.environ.get("HOSTNAME", "gem-operator"),
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    try:
        core().create_namespaced_event(meta["namespace"], event, _request_timeout=_timeout())
    except ApiException as e:
        if e.status != 409 or _reason_code(e) != "AlreadyExists":
            raise


def _status_body(e: ApiException) -> dict[str, Any]:
    try:
        body = json.loads(e.body) if e.body else {}
    except (TypeError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


def _reason_code(e: ApiException) -> str:
    return str(_status_body(e).get("reason") or "")


def _reason(e: ApiException) -> str:
    """The API server's message, with each rejected field (its causes) spelled out."""
    body = _status_body(e)
    causes = (body.get("details") or {}).get("causes") or []
    fields = "; ".join(f"{c.get('field', '')}: {c.get('message', '')}".strip(": ") for c in causes)
    return fields or str(body.get("message") or e.reason or e.status)

"""Kubernetes client set-up and the mapping of API errors to SDK errors."""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import urllib3
import yaml
from kubernetes.client.rest import ApiException

from gem_sdk._exceptions import (
    AlreadyExistsError,
    BackendError,
    FieldError,
    GEMError,
    NotFoundError,
    ValidationError,
    describe,
)
from gem.api.types import GROUP, KINDS
from gem_sdk._types import KubernetesBackendConfig

_SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def make_api_client(cfg: KubernetesBackendConfig) -> tuple[kubernetes.client.ApiClient, str]:
    """An ApiClient of its own (the global kubernetes configuration is left alone) and the
    default namespace: the config's, else the context's, else the pod's, else `default`.

    Raises:
        BackendError: no usable kubeconfig or in-cluster configuration.
    """
    # Resolved here, not left to the kubernetes client: it reads $KUBECONFIG once, at import, so
    # a variable set later (a notebook, a test) would be ignored for ~/.kube/config.
    config_file = cfg.kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
    in_cluster = (
        cfg.kubeconfig is None
        and not os.environ.get("KUBECONFIG")
        and not Path("~/.kube/config").expanduser().exists()
        and bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    )
    try:
        conf = kubernetes.client.Configuration()
        if in_cluster:
            kubernetes.config.load_incluster_config(client_configuration=conf)
            namespace = _SA_NAMESPACE.read_text().strip() if _SA_NAMESPACE.exists() else None
        else:
            kubernetes.config.load_kube_config(config_file=config_file, context=cfg.context, client_configuration=conf)
            contexts, current = kubernetes.config.list_kube_config_contexts(config_file=config_file)
            chosen = next((c for c in contexts if c["name"] == cfg.context), None) if cfg.context else current
            namespace = ((chosen or {}).get("context") or {}).get("namespace")
    except (kubernetes.config.ConfigException, OSError, TypeError, ValueError, yaml.YAMLError) as e:
        raise BackendError(
            f"no usable Kubernetes configuration ({config_file}{', context ' + cfg.context if cfg.context else ''}): {e}; "
            "pass --kubeconfig/--context, or use the local backend (--local)"
        ) from None
    # urllib3 would try a request that timed out, or could not connect, 3 more times, each with the
    # whole timeout: 4x the caller's deadline. The backend retries itself, within the deadline.
    conf.retries = urllib3.Retry(total=3, connect=0, read=0)
    return kubernetes.client.ApiClient(conf), cfg.namespace or namespace or "default"


def _status_body(e: ApiException) -> dict[str, Any]:
    try:
        body = json.loads(e.body) if e.body else {}
    except (TypeError, ValueError):
        body = {}
    return body if isinstance(body, dict) else {}


def status_message(e: ApiException) -> str:
    """The message of the API server's Status (else the HTTP reason)."""
    return _status_body(e).get("message") or e.reason or ""


#: Answers of an API server that is restarting or overloaded, worth another try.
TRANSIENT = frozenset({429, 500, 502, 503, 504})

#: The RBAC verb and resource (when not the job's own) each `verb` of `api_error` needs.
_RBAC = {
    "update": ("patch", None),
    "list pods of": ("list", "pods"),
    "watch pods of": ("watch", "pods"),
    "read logs of": ("get", "pods/log"),
    "stream logs of": ("get", "pods/log"),
}


def api_error(
    e: Exception, verb: str, kind: str | None, namespace: str | None, name: str | None
) -> GEMError:
    """The SDK error for a failed API call `verb` on `kind namespace/name`."""
    what = describe(kind, namespace, name)
    ref = {"kind": kind, "namespace": namespace, "name": name}
    if not isinstance(e, ApiException):
        if isinstance(e, GEMError):
            return e
        return BackendError(f"failed to {verb} {what}: cannot reach the Kubernetes API: {e}", transient=True, **ref)
    body = _status_body(e)
    message = status_message(e)
    reason = body.get("reason") or e.reason or ""
    details = body.get("details") or {}
    if e.status == 404:
        if details.get("kind") == "namespaces" or message.startswith("namespaces "):
            return NotFoundError(f"namespace {namespace} not found (creating {what})", **ref)
        if details.get("kind") == "pods" or message.startswith("pods "):  # logs: the pod went meanwhile
            pod = details.get("name") or (message.split('"')[1] if '"' in message else "?")
            return NotFoundError(f"pod {namespace}/{pod} of {what} not found (it was deleted)", **ref)
        if name and (details.get("name") == name or f'"{name}" not found' in message):
            return NotFoundError(f"{what} not found", **ref)
        return BackendError(
            f"failed to {verb} {what}: {message or 'not found'}; are the gem CRDs installed? "
            "(kubectl apply -f manifests/crds/)",
            status=404, **ref,
        )
    if e.status == 409 and reason == "AlreadyExists":
        return AlreadyExistsError(f"{what} already exists; delete it first or pick another name", **ref)
    if e.status in (400, 422):
        causes = details.get("causes") or []
        errors = [FieldError(c.get("field", ""), c.get("message", "") or c.get("reason", "")) for c in causes]
        return ValidationError(
            f"the API server rejected {what}" + ("" if errors else f": {message}"), errors=errors, **ref
        )
    if e.status == 401:
        return BackendError(
            f"failed to {verb} {what}: 401 Unauthorized: the API server did not accept your credentials"
            f"{'' if message in ('', 'Unauthorized') else ' (' + message + ')'}; they may have expired: "
            "renew them (log in to the cluster again) or pick another --kubeconfig/--context",
            status=401, **ref,
        )
    if e.status == 403:
        hint = ""
        # An admission webhook's, a quota's or a terminating namespace's 403 is no missing
        # permission, and its message says what it is; RBAC's says `User "u" cannot VERB ...`.
        if not any(s in message for s in ("admission webhook", "exceeded quota", "being terminated")):
            rbac_verb, resource = _RBAC.get(verb, (verb, None))
            resource = resource or (f"{KINDS[kind]['plural']}.{GROUP}" if kind in KINDS else "the resource")
            scope = f"-n {namespace}" if namespace else "--all-namespaces"
            hint = (f"; this needs RBAC permission to {rbac_verb} {resource} (check with `kubectl auth can-i "
                    f"{rbac_verb} {resource} {scope}`; a Role or ClusterRole bound to you must grant it)")
        return BackendError(f"failed to {verb} {what}: 403 Forbidden: {message}{hint}", status=403, **ref)
    return BackendError(f"failed to {verb} {what}: {e.status} {reason}: {message}".rstrip(": "), status=e.status,
                        transient=e.status in TRANSIENT, **ref)


#: Errors of a dropped or unreachable connection (wrapped as BackendError, or retried by watches).
CONNECTION_ERRORS = (urllib3.exceptions.HTTPError, OSError)


def iter_lines(resp: Any) -> Iterator[str]:
    """Lines (without the newline) of a streamed urllib3 response; closes it at the end."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    buf = ""
    try:
        for chunk in resp.stream(None, decode_content=True):
            buf += decoder.decode(chunk)
            *lines, buf = buf.split("\n")
            yield from lines
        buf += decoder.decode(b"", final=True)
        if buf:
            yield buf
    finally:
        resp.close()
        resp.release_conn()

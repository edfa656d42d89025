"""kopf handlers: small functions that hand each cause to `reconcile`.

State lives in the resources' status (and an annotation on the PyTorchJob), never in the
operator process, so a restarted operator picks up where the last one stopped.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from gem.api.types import GROUP, KINDS, TERMINAL_PHASES, VERSION
from gem_operator import metrics, reconcile
from gem_operator.settings import CONFIG

GEMT = (GROUP, VERSION, KINDS["GEMTraining"]["plural"])
LFD = (GROUP, VERSION, KINDS["LoopFMDistill"]["plural"])
MANAGED = {"app.kubernetes.io/managed-by": "gem-operator"}


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Our CRDs prune unknown status fields, so kopf keeps its bookkeeping in annotations.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP, key="last-handled-configuration")
    # Events are posted explicitly at each transition; kopf's per-log-line events would be noise.
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 120
    settings.watching.client_timeout = 150
    settings.networking.request_timeout = 30
    settings.peering.lifetime = CONFIG.peering_lifetime
    metrics.serve(CONFIG.metrics_port)


def _reconcile(kind: str, body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger) -> None:
    try:
        status = reconcile.reconcile(kind, dict(body), logger)
    except kopf.TemporaryError:
        metrics.RECONCILES.labels(kind, "retry").inc()
        raise
    except Exception:
        metrics.RECONCILES.labels(kind, "error").inc()
        raise
    metrics.RECONCILES.labels(kind, "ok").inc()
    if status is not None:
        patch.status.update(status)


@kopf.on.resume(*GEMT)
@kopf.on.create(*GEMT)
@kopf.on.update(*GEMT)
def gemtraining_changed(body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger, **_: Any) -> None:
    _reconcile("GEMTraining", body, patch, logger)


@kopf.on.resume(*LFD)
@kopf.on.create(*LFD)
@kopf.on.update(*LFD)
def loopfmdistill_changed(body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger, **_: Any) -> None:
    _reconcile("LoopFMDistill", body, patch, logger)


@kopf.on.event(*GEMT)
@kopf.on.event(*LFD)
def count_phases(type: str, body: kopf.Body, **_: Any) -> None:
    metrics.observe_phase(body.get("kind", ""), body["metadata"].get("uid", ""), None if type == "DELETED" else (body.get("status") or {}).get("phase") or "Pending")


@kopf.on.event("kubeflow.org", "v1", "pytorchjobs", labels=MANAGED)
def pytorchjob_event(type: str, body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
    if type == "DELETED":
        return
    reconcile.sync_from_job(dict(body), logger)


def _not_terminal(status: kopf.Status, **_: Any) -> bool:
    return bool(status.get("pytorchJob")) and status.get("phase") not in TERMINAL_PHASES


# A safety net: a missed watch event (a dropped connection, an operator restart between two
# events) is corrected within one interval by re-reading the job.
@kopf.timer(*GEMT, interval=CONFIG.resync_seconds, when=_not_terminal)
@kopf.timer(*LFD, interval=CONFIG.resync_seconds, when=_not_terminal)
def resync(body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
    from gem_operator import kube

    job = kube.get_pytorchjob(body["metadata"]["namespace"], body["status"]["pytorchJob"])
    if job is not None:
        reconcile.sync_from_job(job, logger)
    reconcile.sync_progress(body["kind"], dict(body))

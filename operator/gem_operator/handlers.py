"""kopf handlers: small functions that hand each cause to `reconcile`.

State lives in the resources' status (and an annotation on the PyTorchJob), never in the
operator process, so a restarted operator picks up where the last one stopped. Retries are
kopf exceptions: a transient API error becomes `kopf.TemporaryError` with a backoff.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import kopf

from gem.api.types import GROUP, KINDS, TERMINAL_PHASES, VERSION
from gem_operator import kube, metrics, probes, reconcile
from gem_operator.settings import CONFIG

GEMT = (GROUP, VERSION, KINDS["GEMTraining"]["plural"])
LFD = (GROUP, VERSION, KINDS["LoopFMDistill"]["plural"])
MANAGED = {"app.kubernetes.io/managed-by": "gem-operator"}


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Our CRDs prune unknown status fields, so kopf keeps its bookkeeping in annotations.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP, key="last-handled-configuration")
    # Events are posted explicitly at each transition; kopf's per-log-line events would be noise.
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 120
    settings.watching.client_timeout = 150
    settings.networking.request_timeout = CONFIG.api_timeout_seconds
    settings.peering.lifetime = CONFIG.peering_lifetime
    metrics.serve(CONFIG.metrics_port)
    await probes.start()


@kopf.on.cleanup()
async def shutdown(**_: Any) -> None:
    await probes.stop()


def retry_delay(retry: int) -> float:
    """1 s, 2 s, 4 s, ... up to GEM_RETRY_MAX_SECONDS, with jitter so retries do not march in step."""
    return min(CONFIG.retry_max_seconds, 2.0 ** min(retry, 16)) * random.uniform(0.5, 1.0)


def _reconcile(kind: str, body: kopf.Body, logger: kopf.Logger, retry: int) -> dict[str, Any] | None:
    """Run one reconcile, count and time it, and write the status if it changed.

    The status is written here, through the operator's own client, not returned to kopf: a write
    that fails is then retried like any other API error, while a patch kopf applies itself and
    fails (say a 409) is dropped by kopf, and from a timer it would even end the timer for good.
    """
    start = time.monotonic()
    result = "ok"
    try:
        status = reconcile.reconcile(kind, dict(body), logger)
        if status is not None and status != (body.get("status") or {}):
            meta = body["metadata"]
            kube.patch_status(kind, meta["namespace"], meta["name"], status, meta.get("resourceVersion"))
        return status
    except kopf.TemporaryError:
        result = "retry"
        raise
    except Exception as e:
        if not kube.is_transient(e):
            result = "error"
            _report_error(body, e, logger)
            raise
        result = "retry"
        delay = retry_delay(retry)
        logger.warning("API trouble (%s); retrying in %.1fs", _short(e), delay)
        raise kopf.TemporaryError(f"API trouble: {_short(e)}", delay=delay) from None
    finally:
        metrics.observe_reconcile(kind, result, time.monotonic() - start)


def _report_error(body: kopf.Body, e: BaseException, logger: kopf.Logger) -> None:
    """Tell the resource's owner why it is stuck: a Warning Event on the resource.

    An error that is not an API hiccup (a 403 where RBAC lacks a rule, a bug) is retried by kopf
    every minute, but left nothing on the resource: no phase, no condition, no Event; only the
    operator's log said why. One Event per generation and error (a derived name), however
    often the handler and the timer hit it.
    """
    meta = body["metadata"]
    try:
        kube.post_event(
            dict(body), "Warning", "ReconcileError", f"reconcile failed, retried every minute: {_short(e)}",
            key=f"{meta.get('generation')}/{_short(e)}",
        )
    except Exception as post_error:  # best effort: the log line below still says it
        logger.warning("could not post the ReconcileError event: %s", _short(post_error))


def _short(e: BaseException) -> str:
    status = getattr(e, "status", None)
    return f"{status} {getattr(e, 'reason', '')}".strip() if status else f"{type(e).__name__}: {e}"[:200]


@kopf.on.resume(*GEMT)
@kopf.on.create(*GEMT)
@kopf.on.update(*GEMT)
def gemtraining_changed(body: kopf.Body, logger: kopf.Logger, retry: int, **_: Any) -> None:
    _reconcile("GEMTraining", body, logger, retry)


@kopf.on.resume(*LFD)
@kopf.on.create(*LFD)
@kopf.on.update(*LFD)
def loopfmdistill_changed(body: kopf.Body, logger: kopf.Logger, retry: int, **_: Any) -> None:
    _reconcile("LoopFMDistill", body, logger, retry)


@kopf.on.event(*GEMT)
@kopf.on.event(*LFD)
def count_phases(type: str, body: kopf.Body, **_: Any) -> None:
    phase = None if type == "DELETED" else (body.get("status") or {}).get("phase") or "Pending"
    metrics.observe_phase(body.get("kind", ""), body["metadata"].get("uid", ""), phase)


@kopf.on.event("kubeflow.org", "v1", "pytorchjobs", labels=MANAGED)
def pytorchjob_event(type: str, body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
    # Fire-and-forget: a failure here is corrected by the resync timer below.
    if type == "DELETED":
        reconcile.job_deleted(dict(body), logger)
    else:
        reconcile.sync_from_job(dict(body), logger)


def _not_terminal(status: kopf.Status, **_: Any) -> bool:
    return status.get("phase") not in TERMINAL_PHASES


# Level-triggered safety net: every resource that has not finished is reconciled again every
# GEM_RESYNC_SECONDS, so a lost watch event, a status patch that failed, or kopf's own bookkeeping
# lost to an API error can delay a resource by one interval but never strand it.
@kopf.timer(*GEMT, interval=CONFIG.resync_seconds, initial_delay=CONFIG.resync_seconds, when=_not_terminal)
@kopf.timer(*LFD, interval=CONFIG.resync_seconds, initial_delay=CONFIG.resync_seconds, when=_not_terminal)
def resync(body: kopf.Body, logger: kopf.Logger, retry: int, **_: Any) -> None:
    status = _reconcile(body["kind"], body, logger, retry)
    try:
        progress = reconcile.running_progress(body["metadata"]["namespace"], status or {})
        if progress:
            kube.patch_status(body["kind"], body["metadata"]["namespace"], body["metadata"]["name"], {"progress": progress})
    except Exception as e:  # progress is best effort: the next tick tries again
        if not kube.is_transient(e):
            raise

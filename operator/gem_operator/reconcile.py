"""What the handlers decide, separated from kopf: validate, render children, mirror job status.

Each function takes plain dicts (resource bodies) and talks to the API through `kube`; the
handlers in `handlers.py` only wire kopf's causes to these.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from typing import Any

import kopf

from gem.api import render, status as st
from gem.api.types import KINDS, TERMINAL_PHASES, Phase
from gem_operator import kube, metrics
from gem_operator.settings import CONFIG
from gem_operator.validation import InvalidSpec, parse_resource

ANNOTATION_SPEC_HASH = "gem.dev/spec-hash"
#: The spec.suspend the operator last applied to the job. Only a change of spec.suspend is passed
#: on, so a queue controller (Kueue) that suspends jobs until admission is never overridden.
ANNOTATION_REQUESTED_SUSPEND = "gem.dev/requested-suspend"
#: Spec fields that may change while the job runs; every other change is rejected.
MUTABLE_FIELDS = frozenset({"suspend"})

_KIND_BY_LABEL = {kind.lower(): kind for kind in KINDS}


def spec_hash(spec: dict[str, Any]) -> str:
    frozen = {k: v for k, v in spec.items() if k not in MUTABLE_FIELDS}
    return hashlib.sha256(json.dumps(frozen, sort_keys=True).encode()).hexdigest()[:16]


def _event(body: dict[str, Any], type_: str, reason: str, message: str) -> None:
    kopf.event(body, type=type_, reason=reason, message=message[:1024])


def _set_phase(status: dict[str, Any], phase: str, message: str) -> dict[str, Any]:
    return {**status, "phase": phase, "message": message}


def mark_invalid(kind: str, body: dict[str, Any], message: str, logger: logging.Logger) -> dict[str, Any]:
    """The status of a resource whose spec cannot run; the operator keeps serving the others."""
    logger.warning("invalid spec: %s", message)
    _event(body, "Warning", "InvalidSpec", message)
    status = dict(body.get("status") or {})
    status["conditions"] = st.set_condition(status.get("conditions", []), "Valid", "False", "InvalidSpec", message)
    status["observedGeneration"] = body["metadata"].get("generation")
    return _set_phase(status, Phase.invalid.value, message)


class TeacherNotReady(Exception):
    def __init__(self, reason: str, message: str, permanent: bool = False):
        super().__init__(message)
        self.reason, self.message, self.permanent = reason, message, permanent


def resolve_teacher(obj: Any, status: dict[str, Any] | None = None) -> render.TeacherMount | None:
    """A LoopFMDistill's teacher as a checkpoint path (and the claim holding it).

    `status` is the distillation's current status: a teacher seen before and gone now was
    deleted, which is final; one never seen may still be created.
    """
    teacher = obj.spec.teacher
    if teacher.checkpoint:
        return render.TeacherMount(checkpoint=teacher.checkpoint)
    if teacher.mlflow_model_uri:
        return None  # the trainer downloads it from MLflow itself
    ns, ref = obj.metadata.namespace, teacher.gem_training
    parent = kube.get_resource("GEMTraining", ns, ref)
    seen = (st.get_condition(status, "TeacherReady") or {}).get("reason") in ("TeacherNotSucceeded", "TeacherSucceeded")
    if parent is None and seen:
        raise TeacherNotReady(
            "TeacherDeleted", f"teacher GEMTraining {ns}/{ref} was deleted before it succeeded", permanent=True
        )
    if parent is None:
        raise TeacherNotReady(
            "TeacherNotFound",
            f"GEMTraining {ns}/{ref} named in spec.teacher.gemTraining does not exist; "
            "create it or fix the name (waiting for it)",
        )
    pstatus = parent.get("status") or {}
    phase = pstatus.get("phase")
    if phase in (Phase.failed.value, Phase.invalid.value):
        raise TeacherNotReady(
            "TeacherFailed", f"teacher GEMTraining {ns}/{ref} is {phase}: {pstatus.get('message', '')}", permanent=True
        )
    if phase != Phase.succeeded.value or not pstatus.get("latestCheckpoint"):
        raise TeacherNotReady(
            "TeacherNotSucceeded",
            f"waiting for teacher GEMTraining {ns}/{ref} to succeed (now {phase or 'Pending'})",
        )
    pspec = (parent.get("spec") or {}).get("checkpoint") or {}
    return render.TeacherMount(
        checkpoint=pstatus["latestCheckpoint"],
        claim_name=pspec.get("claimName"),
        mount_path=pspec.get("path"),
    )


def reconcile(kind: str, body: dict[str, Any], logger: logging.Logger) -> dict[str, Any] | None:
    """Bring the children of one resource in line with its spec. Returns the status to merge.

    Raises kopf.TemporaryError to be called again later (teacher not ready, API trouble).
    """
    meta = body["metadata"]
    ns, name, generation = meta["namespace"], meta["name"], meta.get("generation")
    status = dict(body.get("status") or {})
    try:
        obj = parse_resource(kind, body)
    except InvalidSpec as e:
        return mark_invalid(kind, body, str(e), logger)

    job_name = render.job_name(kind, name)
    existing = kube.get_pytorchjob(ns, job_name)
    if existing is not None and meta.get("uid") in {r.get("uid") for r in existing["metadata"].get("ownerReferences", [])}:
        return _reconcile_running(obj, body, existing, status, logger)

    teacher = None
    if kind == "LoopFMDistill":
        try:
            teacher = resolve_teacher(obj, status)
        except TeacherNotReady as e:
            status["conditions"] = st.set_condition(status.get("conditions", []), "TeacherReady", "False", e.reason, e.message)
            status["observedGeneration"] = generation
            if e.permanent:
                _event(body, "Warning", e.reason, e.message)
                return _set_phase(status, Phase.failed.value, e.message)
            if status.get("phase") != Phase.waiting_for_teacher.value:
                _event(body, "Normal", e.reason, e.message)
            kube.patch_status(kind, ns, name, _set_phase(status, Phase.waiting_for_teacher.value, e.message))
            raise kopf.TemporaryError(e.message, delay=CONFIG.teacher_poll_seconds)
        status["conditions"] = st.set_condition(
            status.get("conditions", []), "TeacherReady", "True", "TeacherSucceeded", "teacher checkpoint resolved"
        )

    cm = render.render_config_map(obj, teacher)
    job = render.render_pytorchjob(
        obj, mlflow_tracking_uri=CONFIG.mlflow_tracking_uri, teacher=teacher, defaults=CONFIG.platform_defaults()
    )
    job["metadata"].setdefault("annotations", {}).update(
        {ANNOTATION_SPEC_HASH: spec_hash(body["spec"]), ANNOTATION_REQUESTED_SUSPEND: str(bool(obj.spec.suspend)).lower()}
    )
    try:
        kube.ensure_config_map(cm)
        _, created = kube.ensure_pytorchjob(job, meta["uid"])
    except kube.Conflict as e:
        raise kopf.TemporaryError(str(e), delay=5) from None
    if created:
        logger.info("created PyTorchJob %s/%s", ns, job_name)
        _event(body, "Normal", "JobCreated", f"created PyTorchJob {job_name}")
    status["conditions"] = st.set_condition(status.get("conditions", []), "Valid", "True", "SpecValid", "spec is valid")
    status.update(pytorchJob=job_name, observedGeneration=generation)
    if status.get("phase") in (None, Phase.pending.value, Phase.waiting_for_teacher.value, Phase.invalid.value):
        status = _set_phase(status, Phase.created.value, f"PyTorchJob {job_name} created")
    return status


def _reconcile_running(obj: Any, body: dict[str, Any], job: dict[str, Any], status: dict[str, Any], logger: logging.Logger) -> dict[str, Any]:
    """The job exists: accept in-flight changes (suspend), reject the rest with a condition."""
    meta = body["metadata"]
    applied = job["metadata"].get("annotations", {}).get(ANNOTATION_SPEC_HASH)
    conds = status.get("conditions", [])
    if applied and applied != spec_hash(body["spec"]):
        msg = (
            "only spec.suspend may change while a job exists; other changes are ignored. "
            "Revert them, or create a new resource to train with the new spec"
        )
        if (st.get_condition(status, "SpecChangeAccepted") or {}).get("status") != "False":
            _event(body, "Warning", "SpecChangeRejected", msg)
        conds = st.set_condition(conds, "SpecChangeAccepted", "False", "ImmutableFieldChanged", msg)
    elif st.get_condition(status, "SpecChangeAccepted"):
        conds = st.set_condition(conds, "SpecChangeAccepted", "True", "SpecMatchesJob", "spec matches the running job")
    want = str(bool(obj.spec.suspend)).lower()
    requested = job["metadata"].get("annotations", {}).get(ANNOTATION_REQUESTED_SUSPEND)
    if requested != want and not (job.get("status") or {}).get("completionTime"):
        kube.patch_pytorchjob(
            meta["namespace"],
            job["metadata"]["name"],
            {
                "metadata": {"annotations": {ANNOTATION_REQUESTED_SUSPEND: want}},
                "spec": {"runPolicy": {"suspend": want == "true"}},
            },
        )
        _event(body, "Normal", "Suspended" if want == "true" else "Resumed", f"set runPolicy.suspend={want} on the PyTorchJob")
        logger.info("set suspend=%s on %s", want, job["metadata"]["name"])
    status = {**status, "conditions": conds, "pytorchJob": job["metadata"]["name"], "observedGeneration": meta.get("generation")}
    return {**status, **mirror_job(status, job, body, logger)}


def mirror_job(status: dict[str, Any], job: dict[str, Any], parent: dict[str, Any], logger: logging.Logger) -> dict[str, Any]:
    """The parent's status fields implied by its PyTorchJob (and, when it ended, the trainer's report)."""
    job_status = job.get("status") or {}
    out: dict[str, Any] = {"pytorchJob": job["metadata"]["name"], "replicas": st.replica_counts(job_status)}
    conds = list(status.get("conditions", []))
    for cond in job_status.get("conditions", []):
        if cond.get("type") in ("Created", "Running", "Restarting", "Suspended", "Succeeded", "Failed"):
            conds = st.set_condition(conds, cond["type"], cond.get("status", "Unknown"), cond.get("reason", ""), cond.get("message", ""))
    out["conditions"] = conds
    if job_status.get("startTime"):
        out["startTime"] = job_status["startTime"]
    if job_status.get("completionTime"):
        out["completionTime"] = job_status["completionTime"]

    phase, cond = st.phase_from_job(job_status)
    if phase is None or status.get("phase") == Phase.invalid.value:
        return out
    message = (cond or {}).get("message", "")
    if phase in TERMINAL_PHASES:
        ns = job["metadata"]["namespace"]
        report = st.master_report(kube.list_job_pods(ns, job["metadata"]["name"]))
        if report:
            out.update(st.apply_report({}, report))
            if report.get("error"):
                message = f"trainer failed: {report['error']}"
        if phase == Phase.succeeded.value and "metrics" not in out and "metrics" in status:
            out["metrics"] = status["metrics"]
    mlflow = out.get("mlflow") or status.get("mlflow")
    if mlflow and not mlflow.get("runUrl") and CONFIG.mlflow_ui_url and mlflow.get("experimentId"):
        mlflow = {**mlflow, "runUrl": f"{CONFIG.mlflow_ui_url.rstrip('/')}/#/experiments/{mlflow['experimentId']}/runs/{mlflow['runId']}"}
        out["mlflow"] = mlflow
    if status.get("phase") != phase:
        kind = parent.get("kind", "")
        _event(parent, "Warning" if phase == Phase.failed.value else "Normal", f"Job{phase}", message or f"{kind} is {phase}")
        logger.info("phase %s -> %s", status.get("phase"), phase)
        metrics.TRANSITIONS.labels(kind, phase).inc()
    out["phase"], out["message"] = phase, message
    return out


def sync_from_job(job: dict[str, Any], logger: logging.Logger) -> None:
    """A PyTorchJob changed: mirror it into its parent's status."""
    labels = job["metadata"].get("labels", {})
    kind = _KIND_BY_LABEL.get(labels.get(render.LABEL_KIND, ""))
    name = labels.get(render.LABEL_NAME)
    ns = job["metadata"].get("namespace")
    if not kind or not name:
        return
    parent = kube.get_resource(kind, ns, name)
    if parent is None or parent["metadata"].get("uid") not in {r.get("uid") for r in job["metadata"].get("ownerReferences", [])}:
        return
    status = dict(parent.get("status") or {})
    new = {**status, **mirror_job(status, job, parent, logger)}
    if new != status:
        kube.patch_status(kind, ns, name, new)


# The trainer's structured progress line (gem/train/trainer.py, docs/trainer.md):
#   ... step step=120 total_steps=400 lr=... loss=...
_PROGRESS = re.compile(r"\bstep step=(\d+) total_steps=(\d+)\b")


def progress_from_log(text: str | None) -> dict[str, int] | None:
    """The latest progress the trainer logged, as a status.progress dict."""
    matches = _PROGRESS.findall(text or "")
    if not matches:
        return None
    step, total = (int(x) for x in matches[-1])
    return {"step": step, "totalSteps": total, "percent": min(100, int(100 * step / total)) if total else 0}


def sync_progress(kind: str, body: dict[str, Any]) -> None:
    """Copy the running trainer's progress from its master pod's log tail into status.progress."""
    status = body.get("status") or {}
    if status.get("phase") != Phase.running.value:
        return
    ns, job_name = body["metadata"]["namespace"], status["pytorchJob"]
    progress = progress_from_log(kube.pod_log_tail(ns, f"{job_name}-master-0"))
    if progress and progress != status.get("progress"):
        kube.patch_status(kind, ns, body["metadata"]["name"], {"progress": progress})

"""What the handlers decide, separated from kopf: validate, render children, mirror job status.

Each function takes plain dicts (resource bodies) and talks to the API through `kube`; the
handlers in `handlers.py` only wire kopf's causes to these.
"""

from __future__ import annotations

import hashlib
import json
import logging
import posixpath
from pathlib import PurePosixPath
from typing import Any

import kopf
import pydantic

from gem.api import render, status as st
from gem.api.types import KINDS, TEACHER_MOUNT_PATH, TERMINAL_PHASES, CheckpointSpec, Phase
from gem.api.validation import RESERVED_MOUNTS, paths_overlap
from gem_operator import kube, parallel
from gem_operator.settings import CONFIG
from gem_operator.validation import InvalidSpec, parse_resource

#: What the spec the job was rendered from means: see spec_digest.
ANNOTATION_SPEC_DIGEST = "gem.dev/spec-digest"
#: The hash of the raw stored spec, the only record on jobs of operators before spec-digest; still
#: written so that an operator rolled back to one of those keeps comparing.
ANNOTATION_SPEC_HASH = "gem.dev/spec-hash"
#: The spec.suspend the operator last applied to the job (or, for a Kueue-queued job, to its
#: Workload). Only a change of spec.suspend is passed on, so the suspension a queue controller
#: (Kueue) holds a job in until admission is never undone.
ANNOTATION_REQUESTED_SUSPEND = "gem.dev/requested-suspend"
#: Spec fields that may change while the job runs; every other change is rejected.
MUTABLE_FIELDS = frozenset({"suspend"})

_KIND_BY_LABEL = {kind.lower(): kind for kind in KINDS}


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def spec_hash(spec: dict[str, Any]) -> str:
    """The legacy hash of the raw spec (ANNOTATION_SPEC_HASH): it changes when the API server fills
    in a default a newer CRD added, so it is only compared for jobs that carry nothing better."""
    return _digest({k: v for k, v in spec.items() if k not in MUTABLE_FIELDS})


def spec_digest(spec: pydantic.BaseModel) -> str:
    """What a parsed spec asks for, mutable fields aside, as a short hash (ANNOTATION_SPEC_DIGEST).

    Values equal to the typed API's defaults are left out: the CRD's defaults come from the same
    models, so a field a newer CRD adds (and the API server fills into stored objects on read)
    changes nothing here, while any value a user sets does.
    """
    meaning = spec.model_dump(by_alias=True, exclude_defaults=True, exclude=set(MUTABLE_FIELDS), mode="json")
    return _digest(meaning)


def _event(body: dict[str, Any], type_: str, reason: str, message: str, key: str) -> None:
    """Announce a transition: exactly once per `key` (see kube.post_event), before its status is written."""
    kube.post_event(body, type_, reason, message, key=key)


def _set_phase(status: dict[str, Any], phase: str, message: str) -> dict[str, Any]:
    return {**status, "phase": phase, "message": message}


def mark_invalid(
    kind: str, body: dict[str, Any], message: str, logger: logging.Logger, reason: str = "InvalidSpec"
) -> dict[str, Any]:
    """The status of a resource whose spec cannot run; the operator keeps serving the others."""
    status = dict(body.get("status") or {})
    if (st.get_condition(status, "Valid") or {}).get("message") != message:  # once per distinct problem
        logger.warning("invalid spec: %s", message)
        _event(body, "Warning", reason, message, key=f"{body['metadata'].get('generation')}/{message}")
    status["conditions"] = st.set_condition(status.get("conditions", []), "Valid", "False", reason, message)
    status["observedGeneration"] = body["metadata"].get("generation")
    return _set_phase(status, Phase.invalid.value, message)


class TeacherNotReady(Exception):
    def __init__(self, reason: str, message: str, permanent: bool = False):
        super().__init__(message)
        self.reason, self.message, self.permanent = reason, message, permanent


def resolve_teacher(obj: Any, status: dict[str, Any] | None = None) -> render.TeacherMount | None:
    """A LoopFMDistill's teacher as a checkpoint path (and the claim holding it).

    `status` is the distillation's current status: a teacher seen before and gone now was
    deleted, which is final; one never seen may still be created. Seen counts only for the spec
    the status was written for (observedGeneration): a distillation pointed at another teacher
    after the edit has not seen that one.
    """
    teacher = obj.spec.teacher
    if teacher.checkpoint:
        _check_not_in_own_job(obj, teacher.checkpoint)
        return render.TeacherMount(checkpoint=teacher.checkpoint)
    if teacher.mlflow_model_uri:
        return None  # the trainer downloads it from MLflow itself
    ns, ref = obj.metadata.namespace, teacher.gem_training
    parent = kube.get_resource("GEMTraining", ns, ref)
    seen = (
        (st.get_condition(status, "TeacherReady") or {}).get("reason") in ("TeacherNotSucceeded", "TeacherSucceeded")
        and (status or {}).get("observedGeneration") == obj.metadata.generation
    )
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
    pspec = (parent.get("spec") or {}).get("checkpoint") or {}
    if ref == obj.metadata.name and pspec.get("claimName") and pspec["claimName"] == obj.spec.checkpoint.claim_name:
        # the claim is mounted whole, at any path: both jobs' directories are <ns>/<name>/ on it
        raise InvalidSpec(
            f"spec.teacher.gemTraining: GEMTraining {ns}/{ref} has this distillation's name and keeps its checkpoints "
            f"on the same claim (claim {pspec['claimName']}), so both would use its {ns}/{ref}/ directory: the "
            "student would resume from the teacher's checkpoints. Create the distillation under another "
            "metadata.name, or give it another spec.checkpoint.claimName")
    pstatus = parent.get("status") or {}
    phase = pstatus.get("phase")
    if phase in (Phase.failed.value, Phase.invalid.value):
        raise TeacherNotReady(
            "TeacherFailed", f"teacher GEMTraining {ns}/{ref} is {phase}: {pstatus.get('message', '')}", permanent=True
        )
    if not pspec.get("claimName"):
        raise _checkpoint_not_shared(ns, ref)
    if phase != Phase.succeeded.value:
        raise TeacherNotReady(
            "TeacherNotSucceeded",
            f"waiting for teacher GEMTraining {ns}/{ref} to succeed (now {phase or 'Pending'})",
        )
    if not pstatus.get("latestCheckpoint"):
        raise _no_checkpoint(ns, ref, pspec["claimName"], pspec.get("path") or CheckpointSpec().path)
    return _teacher_mount(obj, pstatus["latestCheckpoint"], pspec["claimName"], pspec.get("path"))


def _check_not_in_own_job(obj: Any, path: str) -> None:
    """spec.teacher.checkpoint inside <spec.checkpoint.path>/<ns>/<name>/, where the student's checkpoints go."""
    job = posixpath.join(obj.spec.checkpoint.path, obj.metadata.namespace, obj.metadata.name)
    if PurePosixPath(posixpath.normpath(path)).is_relative_to(posixpath.normpath(job)):
        raise InvalidSpec(
            f"spec.teacher.checkpoint: {path} is in this distillation's own job directory {job}, where its student's "
            "checkpoints go: name the teacher's checkpoint elsewhere, or create the distillation under another "
            "metadata.name or with another spec.checkpoint.path")


#: How else a LoopFMDistill can name its teacher (gem.api.types.TeacherSpec).
_NAME_IT_OTHERWISE = (
    "set spec.teacher.mlflowModelUri to the teacher's MLflow model (e.g. models:/<name>/<version>) "
    "or spec.teacher.checkpoint to a checkpoint directory this job can read"
)


def _checkpoint_not_shared(ns: str, ref: str) -> TeacherNotReady:
    """A teacher without a checkpoint claim keeps its checkpoints in an emptyDir: gone with its pods."""
    return TeacherNotReady(
        "TeacherCheckpointNotShared",
        f"teacher GEMTraining {ns}/{ref} has no spec.checkpoint.claimName: its checkpoints live in its pods' "
        f"emptyDir and are gone with them, no other job can read them. Give the teacher a checkpoint claim "
        f"(a ReadWriteMany PersistentVolumeClaim) and train it again, or {_NAME_IT_OTHERWISE}",
        permanent=True,
    )


def _no_checkpoint(ns: str, ref: str, claim: str, path: str) -> TeacherNotReady:
    """status.latestCheckpoint comes only from the master pod's termination report: a teacher whose
    pods were gone before the operator read it (cleanPodPolicy, pod GC, operator down) never gets one."""
    return TeacherNotReady(
        "TeacherHasNoCheckpoint",
        f"teacher GEMTraining {ns}/{ref} succeeded but reported no checkpoint (status.latestCheckpoint is empty: "
        f"its pods were gone before the operator read the trainer's report); {_NAME_IT_OTHERWISE}, e.g. "
        f"{path.rstrip('/')}/{ns}/{ref} (its latest complete checkpoint), readable when the student's spec.checkpoint "
        f"mounts claim {claim} at {path}",
        permanent=True,
    )


def _teacher_mount(obj: Any, checkpoint: str, claim: str | None, path: str | None) -> render.TeacherMount:
    """The teacher's claim mounted read-only at its own path, or at TEACHER_MOUNT_PATH (with the
    checkpoint path rewritten) when that path is taken by one of the student's mounts."""
    spec = obj.spec
    if not claim or not path or (claim == spec.checkpoint.claim_name and path == spec.checkpoint.path):
        return render.TeacherMount(checkpoint=checkpoint, claim_name=claim, mount_path=path)
    taken = (spec.checkpoint.path, *RESERVED_MOUNTS, *(v.mount_path for v in spec.volumes))
    if any(paths_overlap(path, t) for t in taken) and paths_overlap(checkpoint, path):
        rest = checkpoint.rstrip("/")[len(path.rstrip("/")):].lstrip("/")
        checkpoint = f"{TEACHER_MOUNT_PATH}/{rest}" if rest else TEACHER_MOUNT_PATH
        path = TEACHER_MOUNT_PATH
    return render.TeacherMount(checkpoint=checkpoint, claim_name=claim, mount_path=path)


def reconcile(kind: str, body: dict[str, Any], logger: logging.Logger) -> dict[str, Any] | None:
    """Bring the children of one resource in line with its spec. Returns the status to merge.

    Level-triggered and idempotent: the handlers and the resync timer all call it, any number of
    times, from any state. Raises kopf.TemporaryError to be called again later (teacher not
    ready); API errors propagate for the handler to turn into retries.
    """
    meta = body["metadata"]
    ns, name, generation = meta["namespace"], meta["name"], meta.get("generation")
    if meta.get("deletionTimestamp"):
        return None  # going away: its children go with it (garbage collection), nothing to do
    status = dict(body.get("status") or {})
    try:
        obj, problem = parse_resource(kind, body), None
    except InvalidSpec as e:
        obj, problem = None, str(e)

    # The job's name as recorded: an operator of an earlier release may have named it otherwise
    # (render.job_name's budget for long names changed), and it must still be found.
    job_name = status.get("pytorchJob") or render.job_name(kind, name)
    existing = kube.get_pytorchjob(ns, job_name)
    if existing is not None and kube.owned_by(existing, meta.get("uid")):
        # A job runs: an invalid edit is a rejected change like any other, the job is left alone.
        return _reconcile_running(body, existing, status, logger, obj, problem)
    if status.get("pytorchJob") and status.get("phase") not in (None, Phase.pending.value, Phase.waiting_for_teacher.value):
        # Its job existed and is gone (deleted by hand): never run a second job for one resource.
        # Checked before the spec: an invalid edit made while the job ran must not hide this
        # behind phase Invalid, which a later fix of the spec could never leave.
        return _job_vanished(body, status, job_name)
    if obj is None:
        return mark_invalid(kind, body, str(problem), logger)

    teacher = None
    if kind == "LoopFMDistill":
        try:
            teacher = resolve_teacher(obj, status)
        except InvalidSpec as e:  # the teacher's own resource shows the spec cannot run
            return mark_invalid(kind, body, str(e), logger)
        except TeacherNotReady as e:
            if (st.get_condition(status, "TeacherReady") or {}).get("reason") != e.reason:
                _event(body, "Warning" if e.permanent else "Normal", e.reason, e.message, key=str(generation))
            status["conditions"] = st.set_condition(status.get("conditions", []), "TeacherReady", "False", e.reason, e.message)
            status["observedGeneration"] = generation
            if e.permanent:
                return _set_phase(status, Phase.failed.value, e.message)
            waiting = _set_phase(status, Phase.waiting_for_teacher.value, e.message)
            if waiting != body.get("status"):
                kube.patch_status(kind, ns, name, waiting, meta.get("resourceVersion"))
            raise kopf.TemporaryError(e.message, delay=CONFIG.teacher_poll_seconds)
        status["conditions"] = st.set_condition(
            status.get("conditions", []), "TeacherReady", "True", "TeacherSucceeded", "teacher checkpoint resolved"
        )

    defaults = CONFIG.platform_defaults()
    try:
        placement, _ = parallel.plan(kind, obj, defaults, logger)
    except parallel.InvalidPlan as e:
        return mark_invalid(kind, body, e.message, logger, reason=e.reason)
    cm = render.render_config_map(obj, teacher)
    job = render.render_pytorchjob(
        obj, mlflow_tracking_uri=CONFIG.mlflow_tracking_uri, teacher=teacher, defaults=defaults, placement=placement
    )
    # A queued job's suspension goes to its Workload, which Kueue has not created yet: recorded as
    # not applied, so that the first reconcile that finds the Workload deactivates it.
    suspend_applied = obj.spec.suspend and not _queued(job)
    job["metadata"].setdefault("annotations", {}).update({
        ANNOTATION_SPEC_DIGEST: spec_digest(obj.spec),
        ANNOTATION_SPEC_HASH: spec_hash(body["spec"]),
        ANNOTATION_REQUESTED_SUSPEND: str(suspend_applied).lower(),
    })
    try:
        kube.ensure_config_map(cm)
        child, created = kube.ensure_pytorchjob(job, meta["uid"])
    except kube.Conflict as e:
        raise kopf.TemporaryError(str(e), delay=5) from None
    except kube.Rejected as e:
        return mark_invalid(kind, body, f"the API server rejected the rendered {e}", logger, reason="JobRejected")
    if created:
        logger.info("created PyTorchJob %s/%s", ns, job_name)
        _event(body, "Normal", "JobCreated", f"created PyTorchJob {job_name}", key=child["metadata"].get("uid", job_name))
    status["conditions"] = st.set_condition(status.get("conditions", []), "Valid", "True", "SpecValid", "spec is valid")
    status.update(pytorchJob=job_name, observedGeneration=generation)
    # What the created job runs (an existing job keeps the plan it was rendered with).
    plan_status = parallel.plan_status(parallel.job_topology_info(child) or {})
    if plan_status:
        status["parallelPlan"] = plan_status
    if status.get("phase") in _BEFORE_JOB:
        status = _set_phase(status, Phase.created.value, f"PyTorchJob {job_name} created")
    return status


#: Phases a resource has before its job exists. Failed here is a teacher that could not be used (a
#: failure with a job never gets this far): the edited spec.teacher now runs.
_BEFORE_JOB = (None, Phase.pending.value, Phase.waiting_for_teacher.value, Phase.invalid.value, Phase.failed.value)


def _job_vanished(body: dict[str, Any], status: dict[str, Any], job_name: str) -> dict[str, Any]:
    if status.get("phase") in _FINISHED:
        # It ended, then its job was cleaned up: nothing to run, but an edit since is answered.
        edited = status.get("observedGeneration") not in (None, body["metadata"].get("generation"))
        return _reject_edit_of_finished(body, status, status["phase"]) if edited else status
    if status.get("phase") in TERMINAL_PHASES:
        return status
    msg = (
        f"PyTorchJob {job_name} was deleted while the {body.get('kind')} was {status.get('phase')}; "
        "the operator never starts a second job for one resource: delete and recreate the resource to train again"
    )
    _event(body, "Warning", "JobDeleted", msg, key=job_name)
    status["conditions"] = st.set_condition(status.get("conditions", []), "Failed", "True", "JobDeleted", msg)
    return _set_phase(status, Phase.failed.value, msg)


def _spec_matches_job(body: dict[str, Any], job: dict[str, Any], obj: Any) -> bool:
    """Whether the spec, mutable fields aside, is still the one the job was rendered from."""
    annotations = job["metadata"].get("annotations") or {}
    digest = spec_digest(obj.spec)
    if ANNOTATION_SPEC_DIGEST in annotations:
        return annotations[ANNOTATION_SPEC_DIGEST] == digest
    legacy = annotations.get(ANNOTATION_SPEC_HASH)
    if legacy is None:
        return True  # nothing recorded to compare with
    if legacy != spec_hash(body["spec"]):
        return False
    # A job of an operator before the digest, its spec unchanged: record the digest now, so that
    # a CRD that later adds a defaulted field does not turn into a rejected change.
    meta = job["metadata"]
    kube.patch_pytorchjob(meta["namespace"], meta["name"], {"metadata": {"annotations": {ANNOTATION_SPEC_DIGEST: digest}}})
    return True


def _reconcile_running(
    body: dict[str, Any], job: dict[str, Any], status: dict[str, Any], logger: logging.Logger,
    obj: Any, problem: str | None = None,
) -> dict[str, Any]:
    """The job exists: accept in-flight changes (suspend), reject the rest with a condition.

    `obj` is the parsed resource; `problem` says why the current spec does not even parse (then
    `obj` is None); the job keeps the spec it has.
    """
    meta = body["metadata"]
    spec = body.get("spec") if isinstance(body.get("spec"), dict) else {}
    if not status.get("pytorchJob"):
        # Created by an operator that died before it could record it.
        _event(body, "Normal", "JobCreated", f"created PyTorchJob {job['metadata']['name']}", key=job["metadata"]["uid"])
    conds = status.get("conditions", [])
    if problem is None:
        conds = st.set_condition(conds, "Valid", "True", "SpecValid", "spec is valid")
    if body.get("kind") == "LoopFMDistill":  # a job exists only once its teacher was resolved
        conds = st.set_condition(conds, "TeacherReady", "True", "TeacherSucceeded", "teacher checkpoint resolved")
    want = "true" if spec.get("suspend") is True else "false"
    requested = job["metadata"].get("annotations", {}).get(ANNOTATION_REQUESTED_SUSPEND)
    job_phase, _ = st.phase_from_job(job.get("status"))
    changed = problem is not None or not _spec_matches_job(body, job, obj)
    if job_phase in _FINISHED and (changed or requested != want):
        conds = _reject_edit_of_finished(body, {**status, "conditions": conds}, job_phase)["conditions"]
    elif changed:
        msg = (
            "only spec.suspend may change while a job exists; other changes are ignored. "
            "Revert them, or create a new resource to train with the new spec"
        )
        if problem is not None:
            msg = f"the edited spec is invalid ({problem}); {msg}"
        if (st.get_condition(status, "SpecChangeAccepted") or {}).get("message") != msg:
            _event(body, "Warning", "SpecChangeRejected", msg, key=f"{meta.get('generation')}/{msg}")
        reason = "InvalidSpec" if problem is not None else "ImmutableFieldChanged"
        conds = st.set_condition(conds, "SpecChangeAccepted", "False", reason, msg)
    elif st.get_condition(status, "SpecChangeAccepted"):
        conds = st.set_condition(conds, "SpecChangeAccepted", "True", "SpecMatchesJob", "spec matches the running job")
    if requested != want and job_phase not in _FINISHED and not (job.get("status") or {}).get("completionTime"):
        applied = _pass_on_suspend(job, want == "true", logger)
        if applied:
            _event(body, "Normal", "Suspended" if want == "true" else "Resumed", f"set {applied}",
                   key=f"{meta.get('generation')}/{want}")
            logger.info("set %s", applied)
        else:
            logger.info("suspend=%s waits for Kueue to create the Workload of %s", want, job["metadata"]["name"])
    status = {**status, "conditions": conds, "pytorchJob": job["metadata"]["name"], "observedGeneration": meta.get("generation")}
    mirrored = mirror_job(status, job, body, logger)
    status = {**status, **mirrored}
    if "phase" not in mirrored and status.get("phase") in _BEFORE_JOB:
        # The job has no condition yet and an operator that died right after creating it never
        # wrote Created: without this the resource would keep, say, WaitingForTeacher.
        status = _set_phase(status, Phase.created.value, f"PyTorchJob {job['metadata']['name']} created")
    return _observe_parallelism(body, job, status, logger)


#: Phases of a resource whose job ran and ended: its spec is never applied again.
_FINISHED = (Phase.succeeded.value, Phase.failed.value)


def _reject_edit_of_finished(body: dict[str, Any], status: dict[str, Any], phase: str) -> dict[str, Any]:
    """The status of a finished resource whose spec was edited: told once per edit, status kept.

    Like a finished Job or PyTorchJob, a finished resource is not run again (its checkpoints, metrics
    and MLflow run belong to the spec it ran); the edit is answered rather than ignored silently.
    """
    meta = body["metadata"]
    kind, plural = body.get("kind", ""), KINDS.get(body.get("kind", ""), {}).get("plural", "")
    msg = (
        f"this {kind} has finished ({phase}): spec changes are not applied. To train with the new spec, "
        f"delete and re-create it (kubectl delete {plural} {meta['name']}), or create one under a new name"
    )
    current = st.get_condition(status, "SpecChangeAccepted") or {}
    if current.get("message") != msg or status.get("observedGeneration") != meta.get("generation"):
        _event(body, "Warning", "SpecChangeRejected", msg, key=f"{meta.get('generation')}/finished")
    conds = st.set_condition(status.get("conditions", []), "SpecChangeAccepted", "False", "Finished", msg)
    return {**status, "conditions": conds, "observedGeneration": meta.get("generation")}


def _queued(job: dict[str, Any]) -> bool:
    """Whether the job carries a Kueue queue label (Kueue then decides when it runs)."""
    return CONFIG.kueue_queue_label in (job["metadata"].get("labels") or {})


def _pass_on_suspend(job: dict[str, Any], suspend: bool, logger: logging.Logger) -> str | None:
    """Apply spec.suspend to the job; what was set, or None when it cannot be yet.

    A queued job is suspended through its Kueue Workload (spec.active=false, the way Kueue
    supports): Kueue resumes an admitted job whose runPolicy.suspend anyone else sets.
    """
    if _queued(job):
        try:
            return _set_workload_active(job, not suspend)
        except kube.NotServed as e:
            # Without Kueue the queue label means nothing and runPolicy.suspend is what suspends.
            logger.warning("%s: setting runPolicy.suspend on %s instead", e, job["metadata"]["name"])
    meta = job["metadata"]
    kube.patch_pytorchjob(meta["namespace"], meta["name"], {**_suspend_record(suspend), "spec": {"runPolicy": {"suspend": suspend}}})
    return f"runPolicy.suspend={str(suspend).lower()} on the PyTorchJob"


def _set_workload_active(job: dict[str, Any], active: bool) -> str | None:
    meta = job["metadata"]
    workload = kube.job_workload(meta["namespace"], meta["uid"])
    if workload is None:
        return None  # Kueue has not created it yet: the next reconcile tries again
    name = workload["metadata"]["name"]
    kube.patch_workload(meta["namespace"], name, {"spec": {"active": active}})
    kube.patch_pytorchjob(meta["namespace"], meta["name"], _suspend_record(not active))
    return f"spec.active={str(active).lower()} on Kueue Workload {name}"


def _suspend_record(suspend: bool) -> dict[str, Any]:
    return {"metadata": {"annotations": {ANNOTATION_REQUESTED_SUSPEND: str(suspend).lower()}}}


def _observe_parallelism(body: dict[str, Any], job: dict[str, Any], status: dict[str, Any],
                         logger: logging.Logger) -> dict[str, Any]:
    """status.parallelPlan from the job (also after a crash before the first status write) and,
    while the job runs, status.placement: where its node ranks landed."""
    info = parallel.job_topology_info(job)
    if info is None:
        return status  # a job rendered before placement existed
    plan_status = parallel.plan_status(info)
    if plan_status and status.get("parallelPlan") != plan_status:
        status = {**status, "parallelPlan": plan_status}
    if status.get("phase") in TERMINAL_PHASES or not info.get("levels"):
        # ended: its pods may be gone, keep the last placement seen; no level above the node:
        # no domain to report and no group can leave its level (tp stays in a pod)
        return status
    placement = parallel.observe(job, info, logger, status.get("placement"))
    if placement is None:
        return status
    violations = placement.get("violations") or []
    if violations and violations != (status.get("placement") or {}).get("violations"):
        msg = "; ".join(violations)
        _event(body, "Warning", "PlacementViolation", msg, key=f"{job['metadata'].get('uid')}/{msg}")
    return {**status, "placement": placement}


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
    if phase is None:
        return out
    message = (cond or {}).get("message", "")
    if phase in TERMINAL_PHASES:
        if status.get("phase") == phase and (status.get("metrics") or status.get("message", "").startswith("trainer failed")):
            message = status.get("message", message)  # the report was applied already: no pod listing
        else:
            report = st.master_report(kube.list_job_pods(job["metadata"]["namespace"], job["metadata"]["name"]))
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
    uid = job["metadata"].get("uid")
    if phase == Phase.created.value:
        # The Created condition is the job's first; after a resume the condition that changed last
        # (Suspended=False, "... is resumed.") says why the job is back at Created.
        cond = max(job_status.get("conditions", []), key=lambda c: c.get("lastTransitionTime") or "")
        message = cond.get("message", "")
    if status.get("phase") != phase:
        kind = parent.get("kind", "")
        # The first Created is keyed like the creation's own Event: one per job, whichever path sees
        # it first. Any other change (back to Created included) by the time of the condition that made it.
        first = phase == Phase.created.value and status.get("phase") in _BEFORE_JOB
        key = uid if first else f"{uid}/{(cond or {}).get('lastTransitionTime')}"
        # Warning where replicas failed, as training-operator's own PyTorchJobFailed/Restarting Events
        warning = phase in (Phase.failed.value, Phase.restarting.value)
        _event(parent, "Warning" if warning else "Normal", f"Job{phase}", message or f"{kind} is {phase}", key=key)
        logger.info("phase %s -> %s", status.get("phase"), phase)
    out["phase"], out["message"] = phase, message
    return out


def _parent_ref(job: dict[str, Any]) -> tuple[str | None, str | None, str | None]:
    """(kind, name, namespace) of the resource a PyTorchJob was rendered for, from its labels."""
    labels = job["metadata"].get("labels", {})
    return _KIND_BY_LABEL.get(labels.get(render.LABEL_KIND, "")), labels.get(render.LABEL_NAME), job["metadata"].get("namespace")


def job_deleted(job: dict[str, Any], logger: logging.Logger) -> None:
    """A PyTorchJob is gone: a parent that had not finished fails (JobDeleted) now, not at the next resync."""
    kind, name, ns = _parent_ref(job)
    if not kind or not name:
        return
    parent = kube.get_resource(kind, ns, name)
    if parent is None or not kube.owned_by(job, parent["metadata"].get("uid")):
        return  # its resource is gone too (the usual way a job goes), or is another one of that name
    status = parent.get("status") or {}
    if status.get("pytorchJob") != job["metadata"]["name"] or status.get("phase") in TERMINAL_PHASES:
        return  # nothing recorded to lose, or it ended before (a cleanup): what a reconcile would find
    new = reconcile(kind, parent, logger)
    if new is not None and new != status:
        kube.patch_status(kind, ns, name, new, parent["metadata"].get("resourceVersion"))


def sync_from_job(job: dict[str, Any], logger: logging.Logger) -> None:
    """A PyTorchJob changed: bring its parent's status up to date (as a reconcile would)."""
    kind, name, ns = _parent_ref(job)
    if not kind or not name or not (job.get("status") or {}).get("conditions"):
        return  # not ours, or nothing to mirror yet (the create handler wrote the first status)
    parent = kube.get_resource(kind, ns, name)
    # The job read again, after its parent: the event's copy may be older than the job state another
    # writer (the timer, a handler) mirrored into the parent already, and would move it back.
    job = kube.get_pytorchjob(ns, job["metadata"]["name"]) if parent is not None else None
    if parent is None or job is None or not kube.owned_by(job, parent["metadata"].get("uid")):
        return  # gone: a deleted job is the next reconcile's (JobDeleted)
    try:
        obj, problem = parse_resource(kind, parent), None
    except InvalidSpec as e:
        obj, problem = None, str(e)
    # The same status a reconcile computes (not just the mirrored part): every writer writes all
    # of it, so whichever write lands last, nothing another one added is missing.
    status = dict(parent.get("status") or {})
    new = _reconcile_running(parent, job, status, logger, obj, problem)
    if new != status:
        kube.patch_status(kind, ns, name, new, parent["metadata"].get("resourceVersion"))


def running_progress(namespace: str, status: dict[str, Any]) -> dict[str, int] | None:
    """The running trainer's progress from its master pod's log tail, if it moved."""
    if status.get("phase") != Phase.running.value or not status.get("pytorchJob"):
        return None
    progress = st.progress_from_log(kube.pod_log_tail(namespace, f"{status['pytorchJob']}-master-0"))
    return progress if progress and progress != status.get("progress") else None

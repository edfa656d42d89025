"""Status bookkeeping shared by the operator and the SDK's local backend.

Both turn the same inputs (a PyTorchJob's conditions, the trainer's termination report) into the
same `status` of a GEMTraining or LoopFMDistill, so a job looks the same on a cluster and locally.
Pure functions over plain dicts; torch-free.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from typing import Any

from gem.api.types import Phase

#: PyTorchJob condition type -> our phase, in the order the training operator moves through them.
_JOB_PHASES = {
    "Created": Phase.created.value,
    "Running": Phase.running.value,
    "Restarting": Phase.restarting.value,
    "Suspended": Phase.suspended.value,
    "Succeeded": Phase.succeeded.value,
    "Failed": Phase.failed.value,
}


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_condition(
    conditions: list[dict[str, Any]], type_: str, status: str, reason: str, message: str = ""
) -> list[dict[str, Any]]:
    """Return conditions with `type_` set; lastTransitionTime moves only when status changes."""
    out = [dict(c) for c in conditions]
    for cond in out:
        if cond.get("type") == type_:
            if cond.get("status") != status:
                cond["lastTransitionTime"] = now()
            cond.update(status=status, reason=reason, message=message)
            return out
    out.append({"type": type_, "status": status, "reason": reason, "message": message, "lastTransitionTime": now()})
    return out


def get_condition(status: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    for cond in (status or {}).get("conditions", []):
        if cond.get("type") == type_:
            return cond
    return None


def phase_from_job(job_status: dict[str, Any] | None) -> tuple[str | None, dict[str, Any] | None]:
    """The phase a PyTorchJob's conditions imply, and the condition that decided it.

    A terminal condition wins; otherwise the most recent true condition does.
    """
    true_conds = [c for c in (job_status or {}).get("conditions", []) if c.get("status") == "True"]
    for terminal in ("Succeeded", "Failed"):
        for cond in true_conds:
            if cond.get("type") == terminal:
                return _JOB_PHASES[terminal], cond
    known = [c for c in true_conds if c.get("type") in _JOB_PHASES]
    if not known:
        return None, None
    latest = max(enumerate(known), key=lambda ic: (ic[1].get("lastTransitionTime") or "", ic[0]))[1]
    return _JOB_PHASES[latest["type"]], latest


def replica_counts(job_status: dict[str, Any] | None) -> dict[str, dict[str, int]]:
    counts = {}
    for rtype, rs in ((job_status or {}).get("replicaStatuses") or {}).items():
        counts[rtype] = {k: int(rs.get(k) or 0) for k in ("active", "succeeded", "failed")}
    return counts


def parse_report(message: str | None) -> dict[str, Any] | None:
    """The trainer's termination report (compact JSON), or None if there is none."""
    if not message:
        return None
    try:
        report = json.loads(message)
    except ValueError:
        return None
    return report if isinstance(report, dict) else None


def apply_report(status: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """Copy what the trainer reported (metrics, checkpoint, MLflow run, progress) into status."""
    out = dict(status)
    if "metrics" in report and isinstance(report["metrics"], dict):
        out["metrics"] = {k: float(v) for k, v in report["metrics"].items() if isinstance(v, (int, float))}
    if isinstance(report.get("ne"), (int, float)):
        out["ne"] = float(report["ne"])
    if report.get("checkpoint"):
        out["latestCheckpoint"] = str(report["checkpoint"])
    mlflow = {
        key: report[src]
        for key, src in (("runId", "mlflowRunId"), ("runUrl", "mlflowRunUrl"), ("experimentId", "mlflowExperimentId"))
        if report.get(src)
    }
    if mlflow:
        out["mlflow"] = mlflow
    plan = plan_status(report.get("parallelPlan"))
    if plan:
        out["parallelPlan"] = plan
    if isinstance(report.get("step"), int) and isinstance(report.get("totalSteps"), int) and report["totalSteps"] > 0:
        step, total = report["step"], report["totalSteps"]
        out["progress"] = {"step": step, "totalSteps": total, "percent": min(100, int(100 * step / total))}
    return out


#: The keys of status.parallelPlan (gem.api.types.ParallelPlanStatus).
PLAN_STATUS_KEYS = ("dpReplicate", "dpShard", "ep", "cp", "tp", "sparseShard", "zeroStage", "chosen", "reason",
                    "groupLevels")


def plan_status(plan: Any) -> dict[str, Any] | None:
    """status.parallelPlan from a plan as the trainer reports it or the operator renders it
    (GEM_TOPOLOGY): the degrees, chosen, reason and groupLevels; None if it is not one."""
    if not isinstance(plan, dict) or "dpShard" not in plan:
        return None
    out = {k: plan[k] for k in PLAN_STATUS_KEYS if k in plan}
    if out.get("chosen") not in ("auto", "spec"):
        out.pop("chosen", None)
    return out


def master_report(pods: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The termination report of the master pod's `pytorch` container, if it has ended."""
    for pod in pods:
        labels = pod.get("metadata", {}).get("labels", {})
        if labels.get("training.kubeflow.org/replica-type", "").lower() != "master":
            continue
        for cs in pod.get("status", {}).get("containerStatuses", []) or []:
            if cs.get("name") != "pytorch":
                continue
            terminated = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated")
            if terminated:
                return parse_report(terminated.get("message"))
    return None


# The trainer's structured progress line (gem/train/trainer.py, docs/trainer.md), logged by the master
# every 10 steps:  ... step step=120 total_steps=400 lr=... loss=...
_PROGRESS = re.compile(r"\bstep step=(\d+) total_steps=(\d+)\b")


def progress_from_log(text: str | None) -> dict[str, int] | None:
    """The latest progress a running trainer logged (the tail of its master's log), as status.progress.
    The operator reads it from the master pod's log, the local backend from the master's log file."""
    matches = _PROGRESS.findall(text or "")
    if not matches:
        return None
    step, total = (int(x) for x in matches[-1])
    return {"step": step, "totalSteps": total, "percent": min(100, int(100 * step / total)) if total else 0}

"""Shared pieces of the reliability tests (tests/test_reliability_*.py); no tests of its own.

* `OperatorProcess`: `gem-operator` as a child process that can be killed with SIGKILL and started
  again, as a crashing pod would be.
* `TrainingOperatorSim`: plays the Kubeflow training operator and the kubelet for every
  PyTorchJob, fast and deterministically: Created -> Running -> (master pod terminates with the
  trainer's report) -> Succeeded. It honours runPolicy.suspend. It works on the test server's store
  directly, so injected API faults hit only the operator.
* `OneJobGuard`: a watcher thread that records every PyTorchJob it ever sees and flags a resource
  that gets a second one.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tests.kubeapi.errors import ApiError

API = "gem.dev/v1alpha1"
PYTORCHJOB = "kubeflow.org/v1"


# --------------------------------------------------------------------------- the operator


class OperatorProcess:
    """`python -m gem_operator` against a test server; kill() is SIGKILL, start() starts a new one."""

    def __init__(self, kubeconfig: Path, log: Path, **env: str):
        self.kubeconfig, self.log, self.proc = kubeconfig, log, None
        self.env = {
            "GEM_RESYNC_SECONDS": "1",
            "GEM_TEACHER_POLL_SECONDS": "0.3",
            "GEM_API_TIMEOUT_SECONDS": "3",
            "GEM_RETRY_MAX_SECONDS": "2",
            "GEM_MLFLOW_TRACKING_URI": "http://mlflow.test:5000",
            **env,
        }
        self.starts = 0

    def start(self, *args: str) -> "OperatorProcess":
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gem_operator", "--kubeconfig", str(self.kubeconfig), "-n", "default", *args],
                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **self.env},
            )
        self.starts += 1
        return self

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


# --------------------------------------------------------------------------- resources


def gemtraining(name: str, **spec: Any) -> dict:
    return {"apiVersion": API, "kind": "GEMTraining", "metadata": {"name": name},
            "spec": {"checkpoint": {"claimName": f"{name}-ckpt"}, **spec}}


def distill(name: str, teacher: str, **spec: Any) -> dict:
    return {"apiVersion": API, "kind": "LoopFMDistill", "metadata": {"name": name},
            "spec": {"teacher": {"gemTraining": teacher}, **spec}}


def report_for(resource: str) -> dict:
    """The final report the simulated trainer of `resource` writes: deterministic per name."""
    h = int(hashlib.sha256(resource.encode()).hexdigest()[:6], 16) / 0xFFFFFF
    return {
        "metrics": {"ne/click": round(0.8 + 0.1 * h, 6), "auc/click": round(0.7 + 0.1 * h, 6)},
        "ne": round(0.8 + 0.1 * h, 6),
        "step": 20,
        "totalSteps": 20,
        "checkpoint": f"/var/lib/gem/checkpoints/default/{resource}/step-00000020",
        "mlflowRunId": f"run-{resource}",
        "mlflowExperimentId": "1",
    }


# --------------------------------------------------------------------------- the training operator


def _cond(type_: str, reason: str, message: str, status: str = "True") -> dict:
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "lastUpdateTime": _now(), "lastTransitionTime": _now()}


def _now() -> str:
    # Sub-second precision keeps "the latest condition" unambiguous for jobs that move fast.
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"


class TrainingOperatorSim(threading.Thread):
    """Moves every PyTorchJob through its life on the store: no HTTP, no processes.

    A job is Created when first seen, Running `start_s` later and finishes `run_s` after that
    (time while suspended does not count): its master pod is written with the trainer's report
    in the termination message, then the job's Succeeded condition, as the training operator does.
    """

    def __init__(self, server, *, start_s: float = 0.2, run_s: float = 1.0, tick_s: float = 0.05):
        super().__init__(name="training-operator-sim", daemon=True)
        self.server, self.start_s, self.run_s, self.tick_s = server, start_s, run_s, tick_s
        self._halt = threading.Event()
        self._clock: dict[str, float] = {}  # job uid -> seconds of (unsuspended) life so far
        self.errors: list[str] = []

    def stop(self) -> None:
        self._halt.set()
        self.join(10)

    def run(self) -> None:
        last = time.monotonic()
        while not self._halt.wait(self.tick_s):
            now = time.monotonic()
            for job in self.server.list(PYTORCHJOB, "PyTorchJob"):
                try:
                    self.step(job, now - last)
                except ApiError as e:  # the job was deleted meanwhile
                    if e.code != 404:
                        self.errors.append(f"{job['metadata']['name']}: {e}")
                except Exception as e:  # a broken simulator must fail the test, not hang it
                    self.errors.append(f"{job['metadata']['name']}: {e!r}")
            last = now

    def step(self, job: dict, dt: float) -> None:
        name, uid = job["metadata"]["name"], job["metadata"]["uid"]
        status = job.get("status") or {}
        types = {c["type"] for c in status.get("conditions", []) if c["status"] == "True"}
        if "Succeeded" in types or "Failed" in types:
            return
        if ((job.get("spec") or {}).get("runPolicy") or {}).get("suspend"):
            if "Suspended" not in types:  # pods deleted, the clock stops
                self._set(name, status, _cond("Suspended", "PyTorchJobSuspended", f"PyTorchJob {name} is suspended."),
                          {"replicaStatuses": {"Master": {}}}, false=("Running",))
            return
        life = self._clock[uid] = self._clock.get(uid, 0.0) + dt
        if not types:
            self._set(name, status, _cond("Created", "PyTorchJobCreated", f"PyTorchJob {name} is created."))
        elif life >= self.start_s + self.run_s:
            resource = job["metadata"]["labels"]["gem.dev/name"]
            self._master_pod(job, report_for(resource))
            self._set(name, status, _cond("Succeeded", "PyTorchJobSucceeded", f"PyTorchJob default/{name} successfully completed."),
                      {"replicaStatuses": {"Master": {"succeeded": 1}}, "completionTime": _now()}, false=("Running",))
        elif life >= self.start_s and ("Running" not in types or "Suspended" in types):
            reason = "PyTorchJobResumed" if "Suspended" in types else "PyTorchJobRunning"
            self._set(name, status, _cond("Running", reason, f"PyTorchJob default/{name} is running."),
                      {"replicaStatuses": {"Master": {"active": 1}}, "startTime": status.get("startTime") or _now()},
                      false=("Suspended",))

    def _set(self, name: str, status: dict, cond: dict, extra: dict | None = None, false: tuple[str, ...] = ()) -> None:
        conds = {c["type"]: c for c in status.get("conditions", [])}
        for t in false:
            if t in conds and conds[t]["status"] == "True":
                conds[t] = {**conds[t], "status": "False", "lastTransitionTime": _now()}
        conds[cond["type"]] = cond
        self.server.patch_status(PYTORCHJOB, "PyTorchJob", name, {**status, **(extra or {}), "conditions": list(conds.values())})

    def _master_pod(self, job: dict, report: dict) -> None:
        name = f"{job['metadata']['name']}-master-0"
        if self.server.get("v1", "Pod", name) is not None:
            return
        pod = {
            "metadata": {
                "name": name,
                "labels": {"training.kubeflow.org/job-name": job["metadata"]["name"],
                           "training.kubeflow.org/replica-type": "master",
                           "training.kubeflow.org/replica-index": "0"},
                "ownerReferences": [{"apiVersion": PYTORCHJOB, "kind": "PyTorchJob", "name": job["metadata"]["name"],
                                     "uid": job["metadata"]["uid"], "controller": True}],
            },
            "spec": {"containers": [{"name": "pytorch", "image": "trainer"}]},
        }
        self.server.create("v1", "Pod", pod)
        self.server.patch_status("v1", "Pod", name, {
            "phase": "Succeeded",
            "containerStatuses": [{"name": "pytorch", "image": "trainer", "imageID": "", "ready": False, "restartCount": 0,
                                   "state": {"terminated": {"exitCode": 0, "reason": "Completed",
                                                            "message": json.dumps(report)}}}],
        })


# --------------------------------------------------------------------------- the invariant


class OneJobGuard(threading.Thread):
    """Records every PyTorchJob ever seen (by uid) per owning resource uid, every `tick_s`."""

    def __init__(self, server, tick_s: float = 0.02):
        super().__init__(name="one-job-guard", daemon=True)
        self.server, self.tick_s = server, tick_s
        self._halt = threading.Event()
        self.jobs: dict[str, set[str]] = {}  # resource uid -> job uids
        self.violations: list[str] = []

    def stop(self) -> None:
        self._halt.set()
        self.join(10)
        self.check()

    def run(self) -> None:
        while not self._halt.wait(self.tick_s):
            self.check()

    def check(self) -> None:
        owners: dict[str, list[str]] = {}
        for job in self.server.list(PYTORCHJOB, "PyTorchJob"):
            meta = job["metadata"]
            for ref in meta.get("ownerReferences", []):
                owners.setdefault(ref["uid"], []).append(meta["name"])
                seen = self.jobs.setdefault(ref["uid"], set())
                seen.add(meta["uid"])
                if len(seen) > 1:
                    self.violations.append(f"resource {ref['name']} ({ref['uid']}) had PyTorchJobs {sorted(seen)}")
        self.violations += [f"resource {uid} has jobs {names} at once" for uid, names in owners.items() if len(names) > 1]


# --------------------------------------------------------------------------- checks


def status_of(server, kind: str, name: str) -> dict:
    return ((server.get(API, kind, name) or {}).get("status")) or {}


def unmet(server, kind: str, name: str) -> list[str]:
    """What keeps a resource from having converged: Succeeded, with everything the trainer
    reported and the job's conditions mirrored (empty when it has)."""
    obj = server.get(API, kind, name) or {}
    status = obj.get("status") or {}
    report = report_for(name)
    conds = {c["type"]: c["status"] for c in status.get("conditions", [])}
    checks = {
        "phase": status.get("phase") == "Succeeded",
        "metrics": status.get("metrics") == report["metrics"],
        "ne": status.get("ne") == report["ne"],
        "latestCheckpoint": status.get("latestCheckpoint") == report["checkpoint"],
        "mlflow": (status.get("mlflow") or {}).get("runId") == report["mlflowRunId"],
        "progress": (status.get("progress") or {}).get("percent") == 100,
        "observedGeneration": status.get("observedGeneration") == (obj.get("metadata") or {}).get("generation"),
        "Valid": conds.get("Valid") == "True",
        "Succeeded": conds.get("Succeeded") == "True",
        "pytorchJob": status.get("pytorchJob") is not None,
    }
    return [k for k, ok in checks.items() if not ok]


def converged(server, kind: str, name: str) -> bool:
    return not unmet(server, kind, name)


def explain(server, names: list[tuple[str, str]]) -> str:
    """What each resource that has not converged lacks, and its status, for an assertion message."""
    lines = []
    for kind, name in names:
        missing = unmet(server, kind, name)
        if missing:
            lines.append(f"{kind} {name} lacks {missing}: {status_of(server, kind, name)}")
    return "\n".join(lines)


def wait_converged(server, resources: list[tuple[str, str]], timeout: float, context: str = "") -> None:
    """Wait until every resource converged; on timeout, fail with what each status says now."""
    deadline = time.monotonic() + timeout
    while not all(converged(server, k, n) for k, n in resources):
        if time.monotonic() > deadline:
            raise AssertionError(f"not converged after {timeout}s {context}\n" + explain(server, resources))
        time.sleep(0.2)

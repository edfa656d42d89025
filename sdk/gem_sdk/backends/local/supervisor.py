"""The detached process that runs one local job: `python -m gem_sdk.backends.local.supervisor JOBDIR`.

`LocalBackend.submit` starts it with `--detach` (it forks, so it outlives gemctl and is not left
a zombie of the submitting process). It runs the job's PyTorchJob with `gem.launcher.local`,
and keeps on disk, like the training operator and the gem operator do on a cluster:

* `pytorchjob.yaml` status: training-operator conditions (Created, Running, Restarting,
  Succeeded, Failed), replicaStatuses, startTime, completionTime;
* `pods.yaml`: the pods as Pod-like objects (phase, container state, termination message);
* `object.yaml` status: mirrored from the two above with `gem.api.status`, the trainer's
  termination report applied when the job ends (metrics, ne, latestCheckpoint, mlflow, progress).

A failed replica restarts the whole gang (every replica, in place), so the trainers meet afresh at
the local c10d rendezvous; whether it may is `LocalPyTorchJob.restart_blocked`'s decision, the
launcher's training-operator v1.9 rule: only the replicas that failed count a restart (their
restartCount goes up; the others are restarted without counting, as on a cluster they would have
kept running), and the job fails instead of restarting once the replicas' summed restartCount
would reach `runPolicy.backoffLimit` (is > 0 for 0): a limit of n allows n - 1 restarts, none for
0 or 1; no limit when it is unset (GEM resources always set it, default 3). Never, and ExitCode
under 128, fail at once; ExitCode restarts are counted apart, up to `backoffLimit` of them.
A restart waits out the launcher's back-off (`RestartBackOff`, the kubelet's CrashLoopBackOff:
10 s, 20 s, ... up to 5 min; `GEM_LOCAL_RESTART_BACKOFF_S` sets the first): the gang is stopped at
once, the job is Restarting and the failed containers stay terminated, their logs in place.
`activeDeadlineSeconds` is enforced. SIGTERM (sent by `delete`) stops every replica and exits
without writing.

Suspension follows `spec.suspend` of `object.yaml` (set by `LocalBackend.update`): the supervisor
stops every replica (the checkpoints stay in the job's claim), records Suspended and exits;
`update(suspend=False)` starts a new supervisor, whose trainers resume from their latest complete
checkpoint by themselves. Every read-modify-write of `object.yaml` holds `store.locked`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gem.api import status as st
from gem.api.types import TERMINAL_PHASES
from gem.launcher.local import LocalPyTorchJob, decode_configmap
from gem_sdk.backends.local import store

#: How often the supervisor looks at its processes (they are children: polling is cheap).
POLL_S = 0.2
#: How long workers may keep running after the master succeeded before they are stopped.
WORKER_GRACE_S = 10.0
#: How long the other replicas may keep running after one failed for good, to report their error.
FAILURE_GRACE_S = 5.0
LABEL_JOB = "training.kubeflow.org/job-name"
LABEL_REPLICA_TYPE = "training.kubeflow.org/replica-type"
LABEL_REPLICA_INDEX = "training.kubeflow.org/replica-index"
ANNOTATION_PID = store.ANNOTATION_PID


class _Stop(Exception):
    pass


#: While > 0, SIGTERM/SIGINT only mark a stop as pending (see `_signals_deferred`).
_deferring = 0
_stop_pending = False


def _on_signal(signum: int, _frame: Any) -> None:
    global _stop_pending
    if _deferring:
        _stop_pending = True
        return
    raise _Stop()


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold a stop back while replicas are stopped and started, and raise it after. Raised inside
    `subprocess.Popen`, it would leave a started replica its `LocalPod` never learnt the process
    of, which nothing would stop then (`delete` right after `submit` left such orphans)."""
    global _deferring, _stop_pending
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1
    if not _deferring and _stop_pending:
        _stop_pending = False
        raise _Stop()


class Supervisor:
    def __init__(self, job_dir: Path, root: Path) -> None:
        self.dir = job_dir
        self.root = root
        self.job = store.read_yaml(job_dir / store.PYTORCHJOB_FILE) or {}
        cm = store.read_yaml(job_dir / store.CONFIGMAP_FILE) or {}
        self.name = self.job["metadata"]["name"]
        self.namespace = self.job["metadata"].get("namespace", "default")
        self.run = LocalPyTorchJob(
            self.job,
            workdir=job_dir,
            configmaps={cm["metadata"]["name"]: decode_configmap(cm)},
            claims_dir=store.claims_dir(root),
        )
        run_policy = self.job["spec"].get("runPolicy") or {}
        self.deadline_s = run_policy.get("activeDeadlineSeconds")
        self.job_status: dict[str, Any] = dict(self.job.get("status") or {})
        self.started = 0.0
        self.restart_at: float | None = None  # while the gang waits out its back-off: when it restarts
        self.restart_counted: set[str] = set()  # the replicas whose restartCount that restart counts
        self.suspended = False  # pods are gone while suspended, as on a cluster
        self._written: tuple[Any, ...] | None = None

    # ------------------------------------------------------------------ job status

    def _cond(self, type_: str, status: str, reason: str, message: str) -> None:
        self.job_status["conditions"] = st.set_condition(
            self.job_status.get("conditions", []), type_, status, reason, message
        )

    def _replica_statuses(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for info in self.run.replicas.values():
            counts = out.setdefault(info.replica_type, {"active": 0, "succeeded": 0, "failed": 0})
            phase = info.pod.state.phase
            key = {"Running": "active", "Succeeded": "succeeded", "Failed": "failed"}.get(phase)
            if key:
                counts[key] += 1
        return out

    def pods(self) -> list[dict[str, Any]]:
        """The replicas as Pod-like objects (what `gem.api.status.master_report` reads)."""
        out = []
        for name, info in self.run.replicas.items():
            s = info.pod.state
            if s.phase == "Running":
                state = {"running": {"startedAt": s.started_at}}
            elif s.done:
                state = {"terminated": {"exitCode": s.exit_code, "reason": s.reason, "message": s.message,
                                        "startedAt": s.started_at, "finishedAt": s.finished_at}}
            else:
                state = {"waiting": {"reason": "ContainerCreating"}}
            try:
                inode = str(os.stat(info.pod.log_path).st_ino)
            except OSError:
                inode = ""
            out.append({
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": name,
                    "namespace": self.namespace,
                    "labels": {LABEL_JOB: self.name, LABEL_REPLICA_TYPE: info.replica_type.lower(),
                               LABEL_REPLICA_INDEX: str(info.index)},
                    "annotations": {ANNOTATION_PID: str(s.pid or ""), store.ANNOTATION_LOG_INODE: inode},
                },
                "status": {
                    "phase": s.phase,
                    "containerStatuses": [{"name": "pytorch", "state": state, "restartCount": s.restart_count,
                                           "ready": s.phase == "Running"}],
                },
            })
        return out

    # ------------------------------------------------------------------ resource status

    def _progress_while_running(self) -> dict[str, Any]:
        """Progress of the running master: its termination report if it wrote one, else the progress
        line the trainer logs every 10 steps (read from the log's tail, as the operator reads the pod's)."""
        for info in self.run.replicas.values():
            if info.replica_type == "Master" and info.pod.state.phase == "Running":
                try:
                    report = st.parse_report(info.pod.local_termination_path.read_text()[:4096])
                except OSError:
                    report = None
                if report:
                    return {k: v for k, v in st.apply_report({}, report).items() if k == "progress"}
                progress = st.progress_from_log(info.pod.log_tail())
                return {"progress": progress} if progress else {}
        return {}

    @staticmethod
    def _any_error_report(pods: list[dict[str, Any]]) -> dict[str, Any] | None:
        """Without a master report, the first replica's report that carries an error."""
        for pod in pods:
            for cs in pod["status"]["containerStatuses"]:
                report = st.parse_report(((cs.get("state") or {}).get("terminated") or {}).get("message"))
                if report and report.get("error"):
                    return {"error": report["error"]}
        return None

    def write(self) -> None:
        """Mirror the PyTorchJob into the resource's status (as the gem operator does) and save all
        three files, if anything changed."""
        try:
            with store.locked(self.dir):
                self._write_locked()
        except FileNotFoundError:
            raise _Stop() from None  # the job directory was deleted under us

    def _write_locked(self) -> None:
        self.job_status["replicaStatuses"] = {} if self.suspended else self._replica_statuses()
        pods = [] if self.suspended else self.pods()
        obj = store.read_yaml(self.dir / store.OBJECT_FILE)
        if obj is None:
            raise _Stop()  # deleted under us
        status = dict(obj.get("status") or {})
        out: dict[str, Any] = {**status, "pytorchJob": self.name, "replicas": st.replica_counts(self.job_status)}
        conds = list(status.get("conditions", []))
        for cond in self.job_status.get("conditions", []):
            conds = st.set_condition(conds, cond["type"], cond["status"], cond.get("reason", ""), cond.get("message", ""))
        out["conditions"] = conds
        for key in ("startTime", "completionTime"):
            if self.job_status.get(key):
                out[key] = self.job_status[key]
        phase, cond = st.phase_from_job(self.job_status)
        if phase is not None:
            message = (cond or {}).get("message", "")
            if phase in TERMINAL_PHASES:
                report = st.master_report(pods) or self._any_error_report(pods)
                if report:
                    out.update(st.apply_report({}, report))
                    if report.get("error"):
                        message = f"trainer failed: {report['error']}"
            else:
                out.update(self._progress_while_running())
            out["phase"], out["message"] = phase, message
        key = (repr(out), repr(pods))
        if key == self._written:
            return
        self._written = key
        store.write_yaml(self.dir / store.PODS_FILE, {"items": pods})
        store.write_yaml(self.dir / store.PYTORCHJOB_FILE, {**self.job, "status": self.job_status})
        meta = dict(obj.get("metadata") or {})
        meta["resourceVersion"] = str(int(meta.get("resourceVersion") or 0) + 1)
        store.write_yaml(self.dir / store.OBJECT_FILE, {**obj, "metadata": meta, "status": out})

    # ------------------------------------------------------------------ suspension

    def suspend_requested(self) -> bool:
        """Whether the resource's spec.suspend is set (what `LocalBackend.update` changes)."""
        obj = store.read_yaml(self.dir / store.OBJECT_FILE)
        if obj is None:
            raise _Stop()
        return bool((obj.get("spec") or {}).get("suspend"))

    def _mark_suspended(self) -> None:
        self.suspended = True
        self.job.setdefault("spec", {}).setdefault("runPolicy", {})["suspend"] = True
        msg = f"PyTorchJob {self.name} is suspended."
        if any(c.get("type") == "Running" for c in self.job_status.get("conditions", [])):
            self._cond("Running", "False", "PyTorchJobSuspended", msg)
        self._cond("Suspended", "True", "PyTorchJobSuspended", msg)

    def suspend(self) -> bool:
        """Stop the gang and record Suspended; False if a resume came in meanwhile (keep running)."""
        self.run.stop()
        try:
            with store.locked(self.dir):
                if self.suspend_requested():
                    self._mark_suspended()
                    self._write_locked()
                    return True
        except FileNotFoundError:
            raise _Stop() from None
        self._restart_gang()  # resumed while stopping: start the gang again
        return False

    # ------------------------------------------------------------------ lifecycle

    def _failed_replicas(self) -> str:
        failed: dict[str, int] = {}
        for info in self.run.replicas.values():
            if info.pod.state.phase == "Failed":
                failed[info.replica_type] = failed.get(info.replica_type, 0) + 1
        return ", ".join(f"{n} {t} replica(s) failed" for t, n in sorted(failed.items()))

    def _finish(self, type_: str, reason: str, message: str) -> None:
        if type_ == "Failed":
            self.run.stop()
        self._cond("Running", "False", reason, message)
        self._cond(type_, "True", reason, message)
        self.job_status["completionTime"] = st.now()
        self.write()

    def start(self) -> None:
        self.started = time.monotonic()
        self.job_status["startTime"] = st.now()
        if any(c.get("type") == "Suspended" and c.get("status") == "True" for c in self.job_status.get("conditions", [])):
            self._cond("Suspended", "False", "PyTorchJobResumed", f"PyTorchJob {self.name} is resumed.")
        for info in self.run.replicas.values():
            # Resumed pods are new pods: keep the old log as a restart does, and start a new file,
            # which tells a follower (GEMClient.follow) the new container from the old one.
            if info.pod.log_path.exists():
                os.replace(info.pod.log_path, f"{info.pod.log_path}.previous")
        with _signals_deferred():
            self.run.start()
        self._cond("Running", "True", "PyTorchJobRunning", f"PyTorchJob {self.namespace}/{self.name} is running.")
        self.write()

    def _settle(self, grace: float) -> None:
        end = time.monotonic() + grace
        while any(i.pod.poll().phase == "Running" for i in self.run.replicas.values()) and time.monotonic() < end:
            time.sleep(POLL_S)

    def step(self) -> bool:
        """One look at the replicas; True once the job has ended (or was suspended)."""
        if self.suspend_requested() and self.suspend():
            return True
        states = {n: info.pod.poll() for n, info in self.run.replicas.items()}
        masters = [i for i in self.run.replicas.values() if i.replica_type == "Master"] or list(self.run.replicas.values())
        if all(i.pod.state.phase == "Succeeded" for i in masters):
            self._settle(WORKER_GRACE_S)
            self.run.stop()
            self._finish("Succeeded", "PyTorchJobSucceeded",
                         f"PyTorchJob {self.namespace}/{self.name} successfully completed.")
            return True
        if self.deadline_s and time.monotonic() - self.started > float(self.deadline_s):
            self._finish("Failed", "DeadlineExceeded",
                         f"PyTorchJob {self.name} has failed because it was active longer than specified deadline")
            return True
        if self.restart_at is not None:  # the gang is down, waiting out its back-off
            if time.monotonic() >= self.restart_at:
                self._restart_gang()
            self.write()
            return False
        failed = {n for n, s in states.items() if s.phase == "Failed"}
        if failed:
            # The launcher's rule (training-operator v1.9's PastBackoffLimit) decides, with every
            # failed replica counted: the others are restarted below only for the gang's sake.
            blocked = self.run.restart_blocked(self.run.replicas[n] for n in failed)
            if blocked is not None:
                # The other replicas usually fail too in a moment: let them, so their own
                # termination reports (the trainer's error) are kept rather than killed.
                self._settle(FAILURE_GRACE_S)
                self._finish("Failed", "PyTorchJobFailed",
                             f"PyTorchJob {self.name} is failed because {self._failed_replicas()} "
                             f"({blocked.message}).")
                return True
            why = self._failed_replicas()
            limit = self.run.backoff_limit
            counted = self.run.restarts + len(failed)
            # The back-off of the replica that has failed most often (the gang restarts together).
            delay = max(self.run.restart_delay(n) for n in failed)
            self._cond("Running", "False", "PyTorchJobRestarting", why)
            self._cond("Restarting", "True", "PyTorchJobRestarting",
                       f"PyTorchJob {self.name} is restarting because {why} ({counted} restart(s) counted, "
                       + (f"backoffLimit {limit}" if limit is not None else "no backoffLimit")
                       + f"); back-off {delay:g}s before the restart.")
            with _signals_deferred():
                self.run.stop()  # gang restart: every replica, so the rendezvous starts afresh
            self.restart_at, self.restart_counted = time.monotonic() + delay, failed
            self.write()
            if delay <= 0:
                self._restart_gang()
        self.write()
        return False

    def _restart_gang(self) -> None:
        """Start every replica again, in place (the previous logs kept as `<log>.previous`); only
        the replicas that failed count it (no failure: a resume while stopping, new pods)."""
        pending = self.restart_at is not None
        with _signals_deferred():
            self.run.stop()
            for n, info in self.run.replicas.items():
                info.pod.restart(count=n in self.restart_counted)
        self.restart_at, self.restart_counted = None, set()
        if pending:
            self._cond("Restarting", "False", "PyTorchJobRestarting", "")
            self._cond("Running", "True", "PyTorchJobRunning", f"PyTorchJob {self.namespace}/{self.name} is running.")

    def main(self) -> int:
        try:
            with store.locked(self.dir):  # submitted suspended, or suspended before we started
                if self.suspend_requested():
                    self._mark_suspended()
                    self._write_locked()
                    return 0
            self.start()
            while not self.step():
                time.sleep(POLL_S)
            return 0
        except _Stop:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            self.run.stop()
            return 0
        except BaseException as e:  # anything unexpected: stop the processes and say why
            self.run.stop()
            sys.stderr.write(traceback.format_exc())
            try:
                self._finish("Failed", "LocalSupervisorError", f"the local supervisor failed: {e!r}")
            except BaseException:
                pass
            return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gem_sdk.backends.local.supervisor")
    parser.add_argument("job_dir", type=Path)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--detach", action="store_true", help="fork, write the child's pid and return at once")
    args = parser.parse_args(argv)
    pid_file = args.job_dir / store.PID_FILE
    if args.detach:
        pid = os.fork()
        if pid > 0:
            pid_file.write_text(f"{pid}\n")
            os._exit(0)
        os.setsid()
    else:
        pid_file.write_text(f"{os.getpid()}\n")
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    print(f"{dt.datetime.now().isoformat()} supervising {args.job_dir} (pid {os.getpid()})", flush=True)
    code = Supervisor(args.job_dir, args.root).main()
    print(f"{dt.datetime.now().isoformat()} done (exit {code})", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())

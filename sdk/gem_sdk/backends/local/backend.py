"""Jobs as local processes: the same ConfigMap and PyTorchJob a cluster would run, no cluster.

`submit` renders the resource with `gem.api.render` (exactly what the operator applies), saves
it under the root (layout in `store`) and starts a detached supervisor process that runs the
PyTorchJob with `gem.launcher.local` and keeps the status on disk. Every process pointing at the
same root sees the same jobs; the submitting process may exit.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from gem.api.render import TeacherMount, job_name, render_config_map, render_pytorchjob
from gem.api.types import KINDS, TERMINAL_PHASES, LoopFMDistill, Phase
from gem.api.validation import runnable_field_problems
from gem.launcher.local import gpu_pool, gpu_shortage, pod_processes, restart_backoff_from_env, total_gpus
from gem_sdk._exceptions import (
    AlreadyExistsError,
    BackendError,
    FieldError,
    NotFoundError,
    ValidationError,
    WaitTimeoutError,
    describe,
)
from gem_sdk._mlflow import metric_history
from gem_sdk._objects import (
    check_replica_exists,
    check_suspendable,
    describe_until,
    from_wire,
    normalize_until,
    phase_of,
    pod_from_wire,
    pod_name,
    pod_order,
    pod_selector,
    resolve_ref,
    to_model,
    wait_done,
)
from gem_sdk._types import (
    LocalBackendConfig,
    MetricPoint,
    ObjectInput,
    Ref,
    ReplicaPod,
    Resource,
    Until,
    resolve_kind,
)
from gem_sdk.backends.base import Backend
from gem_sdk.backends.local import selector, store

#: Marks a checkpoint claim the local backend made up (no spec.checkpoint.claimName); it is
#: deleted with the job, like a PVC owned by it.
ANNOTATION_LOCAL_CLAIM = "gem.dev/local-claim"
#: Local state is a few small files: polling one of them this often is simpler and more portable
#: than inotify, and cheap.
POLL_S = 0.2
#: How long `delete` lets the supervisor stop its processes before killing everything.
STOP_GRACE_S = 15.0
_SUPERVISOR_MODULE = "gem_sdk.backends.local.supervisor"


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _alive(pid: int) -> bool:
    """Whether the process exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _supervisor_running(pid: int | None, d: Path) -> bool:
    """Whether pid is the live supervisor of the job in `d`: after a crash or reboot supervisor.pid
    may name an unrelated process that reuses the pid, or another job's supervisor, which must not
    count as this job running (nor be stopped by its `delete`)."""
    return pid is not None and _alive(pid) and _is_supervisor(pid, d)


def _is_supervisor(pid: int, d: Path) -> bool:
    """Whether pid is the supervisor of the job in `d` (its command line names the module and the
    directory: guards against a recycled pid), where /proc tells."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
    except FileNotFoundError:
        return False if os.path.isdir("/proc") else _alive(pid)
    except OSError:
        return _alive(pid)
    if _SUPERVISOR_MODULE.encode() not in args:
        return False
    # Another process may name the same root otherwise (a symlink): compare where they lead.
    job = os.path.realpath(d)
    return any(os.path.realpath(os.fsdecode(a)) == job for a in args if a.startswith(b"/"))


class LocalBackend(Backend):
    """Runs jobs as processes under `root` (see `store` for the layout)."""

    def __init__(self, cfg: LocalBackendConfig) -> None:
        self.cfg = cfg
        self.root = Path(cfg.root).expanduser().absolute()
        self.default_namespace = cfg.namespace

    #: Test hook: rewrites the rendered PyTorchJob before it runs (e.g. another command). Set it
    #: on an instance, or on the class as a staticmethod.
    _patch_job: Callable[[dict[str, Any]], dict[str, Any]] | None = None

    # ------------------------------------------------------------------ helpers

    def _dir(self, kind: str, namespace: str, name: str) -> Path:
        return store.job_dir(self.root, kind, namespace, name)

    def _read(self, kind: str, namespace: str, name: str) -> Resource:
        """The job's resource.

        Raises:
            NotFoundError: there is no such job.
            BackendError: its object.yaml cannot be read (`delete` still removes the job).
        """
        ref = {"kind": kind, "namespace": namespace, "name": name}
        try:
            body = store.read_yaml(self._dir(kind, namespace, name) / store.OBJECT_FILE)
            if body is None:
                raise NotFoundError(f"{describe(kind, namespace, name)} not found (local root {self.root})", **ref)
            return from_wire(body)
        except NotFoundError:
            raise
        except BackendError as e:
            raise BackendError(f"{describe(kind, namespace, name)} cannot be read: {e}; `delete` removes it",
                               **ref) from None

    def _supervisor_pid(self, d: Path) -> int | None:
        try:
            return int((d / store.PID_FILE).read_text().strip())
        except (OSError, ValueError):
            return None

    def _no_status(self, d: Path) -> str:
        """Why a job has no phase yet (submit writes one; its supervisor keeps it), and what to check."""
        pid = self._supervisor_pid(d)
        if pid is None:
            return (f"no status yet: no local supervisor was started for it ({d / store.PID_FILE} is missing); "
                    "delete it and submit it again")
        running = "is running" if _supervisor_running(pid, d) else "is not running"
        return (f"no status yet: its local supervisor (pid {pid}, {running}) has not written one; "
                f"check its log, {d / store.SUPERVISOR_LOG}")

    def _supervisor_log_tail(self, d: Path, lines: int = 15) -> str:
        try:
            return "\n".join((d / store.SUPERVISOR_LOG).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def _resolve_teacher(self, model: Resource, namespace: str) -> TeacherMount | None:
        """The checkpoint of a LoopFMDistill's `teacher.gemTraining`, which must have succeeded.

        Locally there is no operator to wait for the teacher, so a teacher that is not done is
        an error now rather than a WaitingForTeacher phase.
        """
        if not isinstance(model, LoopFMDistill) or not model.spec.teacher.gem_training:
            return None
        ref = model.spec.teacher.gem_training
        me = describe(model.kind, namespace, model.metadata.name)
        try:
            teacher = self._read("GEMTraining", namespace, ref)
        except NotFoundError:
            raise NotFoundError(
                f"teacher GEMTraining {namespace}/{ref} of {me} not found: submit and finish it first "
                "(locally the teacher must have succeeded before its distillation is submitted)",
                kind=model.kind, namespace=namespace, name=model.metadata.name,
            ) from None
        phase = phase_of(teacher)
        ckpt = teacher.status.latest_checkpoint if teacher.status else None
        if phase != Phase.succeeded.value or not ckpt:
            raise ValidationError(
                f"teacher GEMTraining {namespace}/{ref} of {me} is {phase or 'Pending'}"
                f"{'' if phase != Phase.succeeded.value else ' but reported no checkpoint'}: "
                f"it must have succeeded; wait for it (gemctl wait gt {ref} --local) and submit again",
                kind=model.kind, namespace=namespace, name=model.metadata.name,
            )
        path = Path(ckpt)
        if not path.exists():
            # A path inside the teacher's pod: map its checkpoint mount to the claim's host dir.
            mount = teacher.spec.checkpoint.path.rstrip("/")
            claim = teacher.spec.checkpoint.claim_name
            if claim and (ckpt == mount or ckpt.startswith(mount + "/")):
                path = store.claims_dir(self.root) / claim / ckpt[len(mount):].lstrip("/")
        if not path.exists():
            raise ValidationError(
                f"the checkpoint {ckpt} of teacher GEMTraining {namespace}/{ref} no longer exists on this "
                "machine; retrain the teacher or name a checkpoint with teacher.checkpoint",
                kind=model.kind, namespace=namespace, name=model.metadata.name,
            )
        # The host path is readable as is: no teacher volume is needed locally.
        return TeacherMount(checkpoint=str(path))

    def _mlflow_uri(self, model: Resource) -> str | None:
        if model.spec.mlflow.tracking_uri:
            return None  # the renderer uses the spec's
        return (self.cfg.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
                or f"sqlite:///{self.root / store.MLFLOW_DB}")

    @staticmethod
    def _check_environment(job: dict[str, Any], **ref: str) -> None:
        """A supervisor inherits this environment: refuse what it would fail on, before it starts."""
        try:
            restart_backoff_from_env()
        except ValueError as e:
            raise ValidationError(str(e), **ref) from None
        pool = gpu_pool()
        if pool and total_gpus(job) > len(pool):
            raise ValidationError(f"{describe(ref['kind'], ref['namespace'], ref['name'])} cannot run here",
                                  errors=[FieldError("spec.resources.gpusPerNode",
                                                     gpu_shortage(total_gpus(job), len(pool)))], **ref)

    def _spawn(self, d: Path) -> None:
        with open(d / store.SUPERVISOR_LOG, "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", _SUPERVISOR_MODULE, str(d), "--root", str(self.root), "--detach"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, close_fds=True,
            )
        # The first process only forks the supervisor, writes its pid and exits.
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = -1
        if code != 0 or self._supervisor_pid(d) is None:
            raise BackendError(
                f"could not start the local supervisor (exit {code}):\n{self._supervisor_log_tail(d)}"
            )

    # ------------------------------------------------------------------ CRUD

    def submit(self, obj: ObjectInput, *, kind: str | None = None, namespace: str | None = None) -> Resource:
        model = to_model(obj, kind=kind, namespace=namespace or None)
        ns = model.metadata.namespace or self.default_namespace
        name, kind = model.metadata.name, model.kind
        model.metadata.namespace = ns
        ref = {"kind": kind, "namespace": ns, "name": name}
        # What the operator refuses with Valid=False (gem.api.validation), refused here before
        # anything runs, in the operator's words: the spec is meant to run on a cluster later.
        problems = runnable_field_problems(model)
        if problems:
            raise ValidationError(f"invalid {describe(kind, ns, name)}",
                                  errors=[FieldError(path, problem) for path, problem in problems], **ref)
        teacher = self._resolve_teacher(model, ns)
        d = self._dir(kind, ns, name)
        d.parent.mkdir(parents=True, exist_ok=True)
        try:
            d.mkdir()  # atomic: of two concurrent submits of one name, one wins
        except FileExistsError:
            raise AlreadyExistsError(f"{describe(kind, ns, name)} already exists; delete it first or pick another name",
                                     **ref) from None
        try:
            meta = model.metadata
            meta.uid, meta.generation, meta.creation_timestamp, meta.resource_version = str(uuid.uuid4()), 1, _now(), "1"
            if not model.spec.checkpoint.claim_name:
                # Without a claim, checkpoints would die with the pod's sandbox; a claim of the
                # job's own keeps them (and lets a LoopFMDistill use them as its teacher).
                claim = f"{job_name(kind, name)}-{meta.uid[:8]}"
                model.spec.checkpoint.claim_name = claim
                meta.annotations[ANNOTATION_LOCAL_CLAIM] = claim
            cm = render_config_map(model, teacher)
            job = render_pytorchjob(model, mlflow_tracking_uri=self._mlflow_uri(model), teacher=teacher)
            if self._patch_job is not None:
                job = self._patch_job(job)
            self._check_environment(job, **ref)
            created = f"PyTorchJob {job['metadata']['name']} is created."
            job["status"] = {"conditions": [
                {"type": "Created", "status": "True", "reason": "PyTorchJobCreated", "message": created,
                 "lastTransitionTime": _now()}]}
            body = model.to_wire()
            body["status"] = {
                "phase": Phase.created.value,
                "message": f"PyTorchJob {job['metadata']['name']} created",
                "conditions": [
                    {"type": "Valid", "status": "True", "reason": "SpecValid", "message": "spec is valid",
                     "lastTransitionTime": _now()},
                    {"type": "Created", "status": "True", "reason": "PyTorchJobCreated", "message": created,
                     "lastTransitionTime": _now()},
                ],
                "observedGeneration": 1,
                "pytorchJob": job["metadata"]["name"],
            }
            store.write_yaml(d / store.CONFIGMAP_FILE, cm)
            store.write_yaml(d / store.PYTORCHJOB_FILE, job)
            store.write_yaml(d / store.OBJECT_FILE, body)  # last: from now on the job is listed
            self._spawn(d)
        except BaseException:
            self._stop(d)
            shutil.rmtree(d, ignore_errors=True)
            raise
        return from_wire(body)

    def get(self, name: Ref, *, kind: str | None = None, namespace: str | None = None) -> Resource:
        kind, ns, name = resolve_ref(name, kind, namespace, self.default_namespace)
        return self._read(kind, ns, name)

    def list(
        self,
        *,
        kind: str | None = None,
        namespace: str | None = None,
        label_selector: str | None = None,
        all_namespaces: bool = False,
    ) -> list[Resource]:
        kinds = [resolve_kind(kind)] if kind else list(KINDS)
        ns = None if all_namespaces else (namespace or self.default_namespace)
        out = []
        matches = selector.parse(label_selector)  # a bad selector fails even when there are no jobs
        for k in kinds:
            for d in store.iter_job_dirs(self.root, k, ns):
                try:
                    body = store.read_yaml(d / store.OBJECT_FILE)
                    if body is None:  # deleted meanwhile
                        continue
                    obj = from_wire(body)
                except BackendError as e:  # one unreadable job must not hide the others
                    warnings.warn(f"skipping the local job in {d}: {e}; `delete` removes it", stacklevel=2)
                    continue
                if matches((body.get("metadata") or {}).get("labels") or {}):
                    out.append(obj)
        return sorted(out, key=lambda o: (o.metadata.namespace or "", o.kind, o.metadata.name))

    def _stop(self, d: Path) -> None:
        """Stop the job's supervisor (which stops its replicas); kill what is left."""
        pid = self._supervisor_pid(d)
        if pid is not None and _supervisor_running(pid, d):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            end = time.monotonic() + STOP_GRACE_S
            while _alive(pid) and time.monotonic() < end:
                time.sleep(0.05)
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        # Replicas the supervisor could not stop (it was killed or had crashed): each runs in its
        # own process group, named by its pid in pods.yaml, plus what started sessions of its own
        # (torchrun's workers). After a crash or reboot that pid may lead another process group:
        # it is killed only while it is the pod's (gem.launcher.local.pod_processes).
        try:
            pods = (store.read_yaml(d / store.PODS_FILE) or {}).get("items") or []
        except store.UnreadableFileError:
            pods = []
        for pod in pods:
            pod_pid = ((pod.get("metadata") or {}).get("annotations") or {}).get(store.ANNOTATION_PID)
            state = ((pod.get("status") or {}).get("containerStatuses") or [{}])[0].get("state") or {}
            name = (pod.get("metadata") or {}).get("name") or ""
            if not (pod_pid and "running" in state and name and pod_pid.isdigit()):
                continue
            procs = pod_processes(d / store.PODS_DIR / name, name)
            if int(pod_pid) in procs or not os.path.isdir("/proc"):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(int(pod_pid), signal.SIGKILL)
            for pid in procs:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)

    def delete(self, name: Ref, *, kind: str | None = None, namespace: str | None = None) -> None:
        kind, ns, name = resolve_ref(name, kind, namespace, self.default_namespace)
        d = self._dir(kind, ns, name)
        try:
            obj: Resource | None = self._read(kind, ns, name)
        except NotFoundError:
            if not d.is_dir():
                raise
            obj = None  # no object.yaml: what a submit killed half-way left, which holds the name
        except BackendError:
            obj = None  # unreadable: removed all the same (a claim of its own cannot be named, and stays)
        self._stop(d)
        shutil.rmtree(d, ignore_errors=True)
        claim = obj.metadata.annotations.get(ANNOTATION_LOCAL_CLAIM) if obj is not None else None
        if claim:
            shutil.rmtree(store.claims_dir(self.root) / claim, ignore_errors=True)

    # ------------------------------------------------------------------ wait

    def wait(
        self,
        name: Ref,
        *,
        kind: str | None = None,
        namespace: str | None = None,
        timeout: float | None = None,
        until: Until = TERMINAL_PHASES,
        callback: Callable[[Resource], None] | None = None,
    ) -> Resource:
        kind, ns, name = resolve_ref(name, kind, namespace, self.default_namespace)
        phases = normalize_until(until)
        d = self._dir(kind, ns, name)
        path = d / store.OBJECT_FILE
        deadline = None if timeout is None else time.monotonic() + timeout
        seen: tuple[int, int] | None = None
        obj = self._read(kind, ns, name)
        uid = obj.metadata.uid
        gone = NotFoundError(f"{describe(kind, ns, name)} was deleted while waiting", kind=kind, namespace=ns, name=name)
        while True:
            try:
                s = path.stat()
                stamp = (s.st_mtime_ns, s.st_ino)
            except FileNotFoundError:
                raise gone from None
            if stamp != seen:
                seen = stamp
                try:
                    obj = self._read(kind, ns, name)
                except NotFoundError:
                    raise gone from None
                if obj.metadata.uid != uid:  # deleted and submitted again: another job
                    raise gone
                if callback is not None:
                    callback(obj)
                if wait_done(obj, phases):
                    return obj
            else:
                pid = self._supervisor_pid(d)
                if pid is not None and not _supervisor_running(pid, d) and phase_of(obj) != Phase.suspended.value:
                    final = self._read(kind, ns, name)  # it may have written just before exiting
                    if final.metadata.uid != uid:
                        raise gone
                    if wait_done(final, phases):
                        return final
                    raise BackendError(
                        f"the local supervisor of {describe(kind, ns, name)} (pid {pid}) exited without "
                        f"finishing the job; its log ({d / store.SUPERVISOR_LOG}) ends:\n{self._supervisor_log_tail(d)}",
                        kind=kind, namespace=ns, name=name,
                    )
            if deadline is not None and time.monotonic() >= deadline:
                state = f"phase {phase_of(obj)}" if phase_of(obj) else self._no_status(d)
                raise WaitTimeoutError(
                    f"timed out after {timeout:g}s waiting for {describe(kind, ns, name)} to reach "
                    f"{describe_until(phases)} ({state})",
                    object=obj, kind=kind, namespace=ns, name=name,
                )
            time.sleep(POLL_S)

    # ------------------------------------------------------------------ update, suspend, resume

    def update(
        self,
        name: Ref,
        *,
        kind: str | None = None,
        namespace: str | None = None,
        suspend: bool | None = None,
        labels: Mapping[str, str | None] | None = None,
        annotations: Mapping[str, str | None] | None = None,
    ) -> Resource:
        kind, ns, name = resolve_ref(name, kind, namespace, self.default_namespace)
        self._read(kind, ns, name)
        d = self._dir(kind, ns, name)
        resume = False
        try:
            with store.locked(d):  # the supervisor writes object.yaml under the same lock
                body = store.read_yaml(d / store.OBJECT_FILE)
                if body is None:
                    raise FileNotFoundError(d)
                obj = from_wire(body)
                meta, changed = body.setdefault("metadata", {}), False
                for field, changes in (("labels", labels), ("annotations", annotations)):
                    if changes:
                        new = {k: v for k, v in {**(meta.get(field) or {}), **changes}.items() if v is not None}
                        changed |= new != (meta.get(field) or {})
                        meta[field] = new
                if suspend is not None and bool(body["spec"].get("suspend")) != suspend:
                    check_suspendable(obj, suspend)
                    body["spec"]["suspend"] = suspend
                    meta["generation"] = int(meta.get("generation") or 1) + 1
                    # A supervisor that recorded Suspended has exited (or is exiting): start a new one.
                    resume = not suspend and phase_of(obj) == Phase.suspended.value
                    if resume:  # refused before anything changes: the new supervisor would fail
                        self._check_environment(store.read_yaml(d / store.PYTORCHJOB_FILE) or {},
                                                kind=kind, namespace=ns, name=name)
                    changed = True
                if changed:
                    meta["resourceVersion"] = str(int(meta.get("resourceVersion") or 0) + 1)
                    store.write_yaml(d / store.OBJECT_FILE, body)
        except FileNotFoundError:
            raise NotFoundError(f"{describe(kind, ns, name)} not found (local root {self.root})",
                                kind=kind, namespace=ns, name=name) from None
        if suspend:
            self._await_suspended(d, kind, ns, name)
        if resume:
            self._resume(d)
        return self._read(kind, ns, name)

    def _await_suspended(self, d: Path, kind: str, ns: str, name: str) -> None:
        """Wait for the supervisor to stop the replicas and record Suspended; if it is gone (it
        crashed, or was killed), stop what is left and record it here."""
        deadline = time.monotonic() + STOP_GRACE_S + 15
        while time.monotonic() < deadline:
            phase = phase_of(self._read(kind, ns, name))
            if phase == Phase.suspended.value or phase in TERMINAL_PHASES:
                return
            pid = self._supervisor_pid(d)
            if not _supervisor_running(pid, d):
                break
            time.sleep(POLL_S)
        self._stop(d)
        with store.locked(d):
            body = store.read_yaml(d / store.OBJECT_FILE)
            if body is None or not body["spec"].get("suspend") or phase_of(from_wire(body)) in TERMINAL_PHASES:
                return
            job = store.read_yaml(d / store.PYTORCHJOB_FILE) or {}
            job.setdefault("spec", {}).setdefault("runPolicy", {})["suspend"] = True
            msg = f"PyTorchJob {job.get('metadata', {}).get('name', name)} is suspended."
            cond = {"type": "Suspended", "status": "True", "reason": "PyTorchJobSuspended", "message": msg,
                    "lastTransitionTime": _now()}
            job_status = job.setdefault("status", {})
            job_status["conditions"] = [c for c in job_status.get("conditions", []) if c.get("type") != "Suspended"] + [cond]
            status = body.setdefault("status", {})
            status["conditions"] = [c for c in status.get("conditions", []) if c.get("type") != "Suspended"] + [cond]
            status.update(phase=Phase.suspended.value, message=msg)
            store.write_yaml(d / store.PYTORCHJOB_FILE, job)
            store.write_yaml(d / store.PODS_FILE, {"items": []})
            store.write_yaml(d / store.OBJECT_FILE, body)

    def _resume(self, d: Path) -> None:
        """Start a new supervisor for a suspended job (after the old one has exited)."""
        pid = self._supervisor_pid(d)
        end = time.monotonic() + STOP_GRACE_S
        while _supervisor_running(pid, d) and time.monotonic() < end:
            time.sleep(0.05)
        self._stop(d)
        job = store.read_yaml(d / store.PYTORCHJOB_FILE) or {}
        job.setdefault("spec", {}).setdefault("runPolicy", {})["suspend"] = False
        store.write_yaml(d / store.PYTORCHJOB_FILE, job)
        self._spawn(d)

    # ------------------------------------------------------------------ pods, metrics

    def pods(
        self,
        name: Ref,
        *,
        kind: str | None = None,
        namespace: str | None = None,
        replica: str | None = None,
        index: int | None = None,
    ) -> list[ReplicaPod]:
        kind, ns, name = resolve_ref(name, kind, namespace, self.default_namespace)
        pod_selector(kind, name, replica, index)  # checks replica and index
        self._read(kind, ns, name)
        items = (store.read_yaml(self._dir(kind, ns, name) / store.PODS_FILE) or {}).get("items") or []
        out = [pod_from_wire(item) for item in items]
        out = [p for p in out if (replica is None or p.replica_type == replica.lower()) and (index is None or p.index == index)]
        return sorted(out, key=pod_order)

    def metrics(
        self,
        name: Ref,
        *,
        kind: str | None = None,
        namespace: str | None = None,
        keys: Iterable[str] | None = None,
    ) -> dict[str, list[MetricPoint]]:
        obj = self.get(name, kind=kind, namespace=namespace)
        return metric_history(obj, self._job_mlflow_uri(obj), keys)

    def _job_mlflow_uri(self, obj: Resource) -> str | None:
        """The tracking URI the job's trainers were given (it is in the rendered PyTorchJob)."""
        job = store.read_yaml(self._dir(obj.kind, obj.metadata.namespace or self.default_namespace,
                                        obj.metadata.name) / store.PYTORCHJOB_FILE) or {}
        for rs in ((job.get("spec") or {}).get("pytorchReplicaSpecs") or {}).values():
            for ctr in rs["template"]["spec"]["containers"]:
                for env in ctr.get("env") or []:
                    if env.get("name") == "MLFLOW_TRACKING_URI":
                        return env.get("value")
        return obj.spec.mlflow.tracking_uri or self._mlflow_uri(obj)

    # ------------------------------------------------------------------ logs

    def logs(
        self,
        name: Ref,
        *,
        kind: str | None = None,
        namespace: str | None = None,
        replica: str = "master",
        index: int = 0,
        follow: bool = False,
        timeout: float | None = None,
    ) -> Iterator[str]:
        kind, ns, name = resolve_ref(name, kind, namespace, self.default_namespace)
        pod = pod_name(kind, name, replica, index)
        check_replica_exists(self._read(kind, ns, name), replica, index)
        d = self._dir(kind, ns, name)
        log = d / store.LOGS_DIR / f"{pod}.log"
        deadline = None if timeout is None else time.monotonic() + timeout
        while not log.exists():
            obj = self._read(kind, ns, name)
            if phase_of(obj) in TERMINAL_PHASES | {Phase.suspended.value}:
                raise NotFoundError(f"pod {pod} of {describe(kind, ns, name)} never started (job is {phase_of(obj)})",
                                    kind=kind, namespace=ns, name=name)
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeoutError(f"timed out waiting for pod {pod} to start", kind=kind, namespace=ns, name=name)
            time.sleep(POLL_S)
        return self._tail(d, pod, log, follow)

    def _previous_log(self, name: Ref, *, kind: str | None = None, namespace: str | None = None,
                      replica: str = "master", index: int = 0) -> Iterator[str]:
        """The log of the replica's last terminated container, as `kubectl logs --previous` reads it.
        A restart moves the old container's log to `<log>.previous`; while the gang waits out its
        back-off (Restarting, the container terminated) the container that just failed is the last
        terminated one, as in CrashLoopBackOff, and its log is still `<log>`."""
        kind, ns, name = resolve_ref(name, kind, namespace, self.default_namespace)
        pod = pod_name(kind, name, replica, index)
        obj = self._read(kind, ns, name)
        check_replica_exists(obj, replica, index)
        d = self._dir(kind, ns, name)
        item = self._pod_item(d, pod)
        ref = {"kind": kind, "namespace": ns, "name": name}
        if item is None:
            raise NotFoundError(f"pod {pod} of {describe(kind, ns, name)} does not exist (not started yet, or the "
                                "job was suspended): it has no previous container", **ref)
        state = (item["status"].get("containerStatuses") or [{}])[0].get("state") or {}
        in_back_off = phase_of(obj) == Phase.restarting.value and "terminated" in state
        log = d / store.LOGS_DIR / (f"{pod}.log" if in_back_off else f"{pod}.log.previous")
        try:
            text = log.read_text(errors="replace")
        except FileNotFoundError:
            raise NotFoundError(f"pod {pod} of {describe(kind, ns, name)} has no previous container: it has not "
                                "been restarted", **ref) from None
        return iter(text.splitlines())

    def _container_log(
        self,
        name: Ref,
        *,
        kind: str | None = None,
        namespace: str | None = None,
        replica: str = "master",
        index: int = 0,
        after: Any = None,
        timeout: float | None = None,
    ) -> tuple[Any, ReplicaPod, Iterator[str]] | None:
        """The followed log of the replica's container, once one other than `after` (a key this
        returned before; None: any) has started: (its key, the pod, its lines). None when no other
        will come (the job ended, or the pod succeeded). What `GEMClient.follow` is built on; the
        same contract as the Kubernetes backend's.

        A container here is its log file: every start (a restart, a resume) moves the old log to
        `<log>.previous` and writes a new file, so the inode tells one container from the next,
        exactly. pods.yaml names it too (`store.ANNOTATION_LOG_INODE`).
        """
        kind, ns, name = resolve_ref(name, kind, namespace, self.default_namespace)
        if after is None:
            # As logs: the replica checked, the log waited for, NotFoundError if it never comes.
            self.logs(name, kind=kind, namespace=ns, replica=replica, index=index, timeout=timeout)
        pod = pod_name(kind, name, replica, index)
        d = self._dir(kind, ns, name)
        log = d / store.LOGS_DIR / f"{pod}.log"
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            phase = phase_of(self._read(kind, ns, name))  # first: pods.yaml and the log are newer
            try:
                f = open(log, "rb")
            except FileNotFoundError:
                f = None
            if f is not None:
                key = str(os.fstat(f.fileno()).st_ino)
                if key != after:
                    item = self._pod_item(d, pod, key, kind, ns, name)
                    return key, pod_from_wire(item or {}), self._tail(d, pod, log, True, f=f, key=key)
                f.close()
            item = self._pod_item(d, pod)
            if phase in TERMINAL_PHASES or (item is not None and item["status"].get("phase") == "Succeeded"):
                return None  # no container starts after these
            if phase != Phase.suspended.value and not _supervisor_running(self._supervisor_pid(d), d):
                return None  # it died: the wait that comes next says so (BackendError)
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeoutError(f"timed out waiting for pod {pod} to start again", kind=kind, namespace=ns,
                                       name=name)
            time.sleep(POLL_S)

    def _pod_item(self, d: Path, pod: str, inode: str | None = None, *ref: str) -> dict[str, Any] | None:
        """The pod in pods.yaml; with `inode`, once it describes the container writing that log
        (the supervisor records a container just after starting it), or that one is gone."""
        while True:
            items = (store.read_yaml(d / store.PODS_FILE) or {}).get("items") or []
            item = next((i for i in items if i["metadata"]["name"] == pod), None)
            if inode is None or _log_inode(item) in (inode, ""):
                return item
            try:
                replaced = str(os.stat(d / store.LOGS_DIR / f"{pod}.log").st_ino) != inode
            except FileNotFoundError:
                replaced = True
            if replaced or phase_of(self._read(*ref)) in TERMINAL_PHASES \
                    or not _supervisor_running(self._supervisor_pid(d), d):
                return item
            time.sleep(POLL_S / 4)

    def _pod_running(self, d: Path, pod: str, inode: str | None = None) -> bool:
        """Whether the pod's container still runs; with `inode`, the container writing that log:
        pods.yaml describing another one (recorded late, or after it) says nothing of it."""
        items = (store.read_yaml(d / store.PODS_FILE) or {}).get("items")
        if items is None:
            return (d / store.OBJECT_FILE).exists()  # not written yet: still starting
        for item in items:
            if item["metadata"]["name"] == pod:
                if inode is not None and _log_inode(item) not in (inode, ""):
                    return True  # the log being moved away tells when it ends
                state = (item["status"].get("containerStatuses") or [{}])[0].get("state") or {}
                return "terminated" not in state
        return False

    def _tail(self, d: Path, pod: str, log: Path, follow: bool, *, f: Any = None,
              key: str | None = None) -> Iterator[str]:
        """The lines of the container writing `log` (`f`: that log, opened already); with `follow`,
        until that container exits, as `kubectl logs -f` does: its pod is terminated in pods.yaml
        (with `key`, its log's inode, only if pods.yaml describes that container), or the log was
        moved away (a restart moves it to `<log>.previous` once its process has exited; the job
        deleted). What the container wrote is read to the end first. A restarted container is a
        new one: calling `logs` again reads it."""
        f = f if f is not None else open(log, "rb")
        inode = os.fstat(f.fileno()).st_ino
        buf = b""
        ending = False
        try:
            while True:
                chunk = f.read(65536)
                if chunk:
                    buf += chunk
                    *lines, buf = buf.split(b"\n")
                    for line in lines:
                        yield line.decode(errors="replace")
                    continue
                if not follow or ending:
                    break
                try:
                    moved = os.stat(log).st_ino != inode
                except FileNotFoundError:
                    moved = True
                if moved or not self._pod_running(d, pod, key):
                    ending = True  # it has exited: read what it left, then stop
                    continue
                time.sleep(POLL_S / 2)
            if buf:
                yield buf.decode(errors="replace")
        finally:
            f.close()


def _log_inode(item: dict[str, Any] | None) -> str:
    """The inode of the log of the container a pods.yaml entry describes ("" if not recorded)."""
    return (((item or {}).get("metadata") or {}).get("annotations") or {}).get(store.ANNOTATION_LOG_INODE) or ""

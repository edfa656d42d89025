"""GEMClient: the one entry point of the SDK, a thin facade over a backend."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping

from gem.api.types import Condition, Phase
from gem_sdk._exceptions import BackendError, GEMError, NotFoundError, WaitTimeoutError, describe
from gem_sdk._objects import finalizers_left, job_of, phase_of, pod_name, resolve_ref
from gem_sdk._types import (
    FAILED_PHASES,
    TERMINAL_PHASES,
    KubernetesBackendConfig,
    LocalBackendConfig,
    MetricPoint,
    ObjectInput,
    Ref,
    ReplicaPod,
    Resource,
    Until,
)
from gem_sdk.backends.base import OUTAGE_S, Backend

__all__ = ["GEMClient"]


class GEMClient:
    """Submit, inspect, wait for, stream and delete GEMTraining and LoopFMDistill jobs.

    The backend is chosen by the type of `backend_config`:

    * `KubernetesBackendConfig` (the default): custom resources on a cluster running the gem
      operator, through your kubeconfig or the in-cluster service account.
    * `LocalBackendConfig`: the same PyTorchJob run as processes on this machine, no cluster.

    Example:
        >>> client = GEMClient(LocalBackendConfig())
        >>> job = client.submit("examples/quickstart.yaml")
        >>> client.wait(job).status.metrics["ne/click"]

    Args:
        backend_config: Which backend to use and how to reach it.

    Raises:
        ValueError: `backend_config` is not a known backend config.
        BackendError: the backend cannot be set up (e.g. no kubeconfig).
    """

    def __init__(self, backend_config: KubernetesBackendConfig | LocalBackendConfig | None = None) -> None:
        if backend_config is None:
            backend_config = KubernetesBackendConfig()
        self.backend: Backend
        if isinstance(backend_config, KubernetesBackendConfig):
            from gem_sdk.backends.kubernetes import KubernetesBackend

            self.backend = KubernetesBackend(backend_config)
        elif isinstance(backend_config, LocalBackendConfig):
            from gem_sdk.backends.local import LocalBackend

            self.backend = LocalBackend(backend_config)
        else:
            raise ValueError(
                f"backend_config must be a KubernetesBackendConfig or LocalBackendConfig, "
                f"got {type(backend_config).__name__}"
            )

    @property
    def default_namespace(self) -> str:
        """The namespace used when a call names none."""
        return self.backend.default_namespace

    def submit(self, obj: ObjectInput, *, kind: str | None = None, namespace: str | None = None) -> Resource:
        """Validate a job and create it.

        Args:
            obj: A path to a YAML/JSON manifest, a YAML string, a dict, or a typed
                `GEMTraining`/`LoopFMDistill`. Status and server-owned metadata are ignored.
            kind: Kind to submit as when the manifest has no `kind` (any spelling, e.g. `gt`).
                Default: the object's kind.
            namespace: Namespace to create it in. Default: the object's, else the backend's.

        Returns:
            The created object as stored (uid, creationTimestamp, defaults filled in).

        Raises:
            ValidationError: the spec is invalid, before anything is sent or as answered by the
                API server; each error names the field path (camelCase) and the fix.
            AlreadyExistsError: a job of that kind and name exists in the namespace.
            NotFoundError: (local backend) a LoopFMDistill's teacher GEMTraining does not exist.
            BackendError: the API or the local runtime failed.
        """
        return self.backend.submit(obj, kind=kind, namespace=namespace)

    def get(self, name: Ref, *, kind: str | None = None, namespace: str | None = None) -> Resource:
        """Read a job with its current status.

        Args:
            name: The job's name, or a typed object (its kind and namespace become the defaults).
            kind: Any spelling of GEMTraining or LoopFMDistill. Default: the object's kind, else
                GEMTraining.
            namespace: Default: the object's, else the backend's.

        Returns:
            The typed object; `.status` has phase, conditions, progress, metrics, ne, ...

        Raises:
            NotFoundError: no such job.
            BackendError: the API or the local runtime failed.
        """
        return self.backend.get(name, kind=kind, namespace=namespace)

    def list(
        self,
        *,
        kind: str | None = None,
        namespace: str | None = None,
        label_selector: str | None = None,
        all_namespaces: bool = False,
    ) -> list[Resource]:
        """List jobs.

        Args:
            kind: One kind (any spelling). Default: both kinds.
            namespace: Default: the backend's.
            label_selector: A Kubernetes label selector, e.g. `team=ads,tier in (a,b),!canary`.
            all_namespaces: List across every namespace (ignores `namespace`).

        Returns:
            Typed objects sorted by namespace, kind and name.

        Raises:
            ValidationError: the kind or label selector is invalid.
            BackendError: the API or the local runtime failed.
        """
        return self.backend.list(
            kind=kind, namespace=namespace, label_selector=label_selector, all_namespaces=all_namespaces
        )

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
        """Block until the job reaches a phase in `until`, or any terminal phase.

        On Kubernetes this is a watch on the one object (resumed from its resourceVersion and
        re-listed after 410 Gone or a dropped connection), not a polling loop.

        Args:
            name: The job's name, or a typed object (e.g. what `submit` returned).
            kind: Default: the object's kind, else GEMTraining.
            namespace: Default: the object's, else the backend's.
            timeout: Seconds to wait at most. Default: forever.
            until: Phases that end the wait (names or `Phase` values), or a predicate on the
                object, e.g. `lambda job: bool(job.status.progress and job.status.progress.percent >= 50)`
                (progress is unset until the trainer logs its first step). Default: Succeeded,
                Failed, Invalid. A terminal phase always ends it.
            callback: Called with the object each time a new version of it is seen (the first
                one included), e.g. to show progress.

        Returns:
            The typed object in its final state.

        Raises:
            JobFailedError: the job reached Failed or Invalid; carries `.reason`, `.detail`
                (from its conditions) and `.object`.
            WaitTimeoutError: `timeout` passed first (also a `TimeoutError`); `.object` is the
                last state seen.
            NotFoundError: no such job, or it was deleted while waiting.
            BackendError: the API or the local runtime failed.
        """
        return self.backend.wait(name, kind=kind, namespace=namespace, timeout=timeout, until=until, callback=callback)

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
        previous: bool = False,
    ) -> Iterator[str]:
        """Stream the log of one trainer pod, waiting for the pod to start first.

        Pods are `<job>-master-0` and `<job>-worker-<index>`, where `<job>` is the PyTorchJob
        the resource runs as: the one the operator recorded (`status.pytorchJob`), else, before
        it has one, `gem.api.render.job_name`'s name.

        Args:
            name: The job's name, or a typed object.
            kind: Default: the object's kind, else GEMTraining.
            namespace: Default: the object's, else the backend's.
            replica: `master` or `worker`.
            index: Replica index (0 for the master; 0..numNodes-2 for workers).
            follow: Keep streaming until the pod's container exits.
            timeout: Seconds to wait at most for the pod to start. Default: forever (but a job
                that ended without the pod raises NotFoundError).
            previous: The log of the pod's last terminated container instead, as
                `kubectl logs --previous` (why a crash-looping container died): nothing is waited
                for, and `follow` and `timeout` do not apply.

        Returns:
            An iterator of log lines, without their newlines.

        Raises:
            NotFoundError: no such job, it has no such replica (one master, workers
                0..numNodes-2), or it ended without that pod; with `previous`, the pod does not
                exist or its container has not been restarted.
            ValidationError: bad replica or index.
            WaitTimeoutError: the pod did not start within `timeout`.
            BackendError: the API or the local runtime failed.
        """
        if previous:
            return self.backend._previous_log(name, kind=kind, namespace=namespace, replica=replica, index=index)
        return self.backend.logs(
            name, kind=kind, namespace=namespace, replica=replica, index=index, follow=follow, timeout=timeout
        )

    def follow(
        self,
        name: Ref,
        *,
        kind: str | None = None,
        namespace: str | None = None,
        replica: str = "master",
        index: int = 0,
        timeout: float | None = None,
    ) -> Iterator[str | ReplicaPod]:
        """Stream one trainer pod's log until the job is done with it, across container restarts.

        `logs(follow=True)` ends with the container, as `kubectl logs -f` does. This goes on: when
        the container ends while the job runs, it waits for the next one (a restart under
        restartPolicy OnFailure, a recreated pod, a resume) and streams that one from its start,
        never a line of the previous one again; it ends when no other container will come (the job
        ended, or the pod succeeded). The next container is read only once the pod's status shows
        it started (another containerID and restartCount): before that a log request would read the
        old one again. `gemctl submit --follow` uses it.

        Args:
            name: The job's name, or a typed object.
            kind: Default: the object's kind, else GEMTraining.
            namespace: Default: the object's, else the backend's.
            replica: `master` or `worker`.
            index: Replica index (0 for the master; 0..numNodes-2 for workers).
            timeout: Seconds to wait at most for each container to start (the first, and each
                next one). Default: forever.

        Returns:
            An iterator of log lines (`str`, without their newlines) and, before the lines of each
            new container, that pod as a `ReplicaPod` (its `restart_count`, `started_at`).

        Raises:
            NotFoundError: as `logs`: no such job or replica, or it ended without that pod; or the
                job was deleted meanwhile.
            ValidationError: bad replica or index.
            WaitTimeoutError: a container did not start within `timeout`.
            BackendError: the API or the local runtime failed.
        """
        where = {"kind": kind, "namespace": namespace, "replica": replica, "index": index, "timeout": timeout}
        # The first container is waited for now, so that NotFoundError comes from this call, as from logs.
        return self._follow(name, self.backend._container_log(name, **where), where)

    def _follow(self, name: Ref, opened: tuple | None, where: dict) -> Iterator[str | ReplicaPod]:
        while opened is not None:
            key, _, lines = opened
            yield from lines
            opened = self.backend._container_log(name, after=key, **where)
            if opened is not None:
                yield opened[1]  # announces the next container, before its lines

    def delete(self, name: Ref, *, kind: str | None = None, namespace: str | None = None, wait: bool = False,
               timeout: float | None = None) -> None:
        """Delete a job; its PyTorchJob, pods (or local processes) and config go with it.

        On Kubernetes a running job carries the gem operator's finalizer: the API only marks it
        deleted (`deletionTimestamp`) until the operator has removed it, and the name is taken
        until then. `wait` waits for that, as `kubectl delete` does (`gemctl delete` by default).

        Args:
            name: The job's name, or a typed object.
            kind: Default: the object's kind, else GEMTraining.
            namespace: Default: the object's, else the backend's.
            wait: Return once the job is gone, not once its deletion was accepted.
            timeout: With `wait`, seconds to wait at most. Default: forever.

        Raises:
            NotFoundError: no such job.
            WaitTimeoutError: with `wait`, the job was still there after `timeout` (its message
                names the finalizers left).
            BackendError: the API or the local runtime failed.
        """
        if not wait:
            return self.backend.delete(name, kind=kind, namespace=namespace)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            uid = self.get(name, kind=kind, namespace=namespace).metadata.uid
        except GEMError:  # delete says what is wrong, or removes it all the same (a local job half made)
            uid = None
        self.backend.delete(name, kind=kind, namespace=namespace)
        pause, outage_ends = 0.05, None
        while True:
            try:
                obj = self.get(name, kind=kind, namespace=namespace)
            except NotFoundError:
                return None
            except BackendError as e:
                # The deletion was accepted: an API server briefly away (a control-plane restart) is
                # waited out, as by wait, for at most OUTAGE_S; at the timeout its error goes out.
                outage_ends = outage_ends or time.monotonic() + OUTAGE_S
                if not e.transient or time.monotonic() >= outage_ends or _time_left(deadline) == 0:
                    raise
                obj = None
            else:
                outage_ends = None
                if uid is not None and obj.metadata.uid != uid:  # gone, and another of the name submitted meanwhile
                    return None
            left = _time_left(deadline)
            if left == 0 and obj is not None:
                what = describe(obj.kind, obj.metadata.namespace, obj.metadata.name)
                raise WaitTimeoutError(f"timed out after {timeout:g}s waiting for {what} to be deleted: "
                                       f"{finalizers_left(obj)}", object=obj, kind=obj.kind,
                                       namespace=obj.metadata.namespace, name=obj.metadata.name)
            time.sleep(pause if left is None else min(pause, left))
            pause = min(2 * pause, 1.0)

    # ------------------------------------------------------------------ in-flight changes

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
        """Change what may change while a job exists: `spec.suspend`, labels and annotations.

        Every other spec field is fixed once submitted (the operator answers a change with the
        condition `SpecChangeAccepted=False`): delete and submit again to train with another spec.

        Args:
            name: The job's name, or a typed object.
            kind: Default: the object's kind, else GEMTraining.
            namespace: Default: the object's, else the backend's.
            suspend: True suspends the job, False resumes it (see `suspend`, `resume`).
            labels: Labels to set; a None value removes the label.
            annotations: Annotations to set; a None value removes the annotation.

        Returns:
            The object after the change.

        Raises:
            NotFoundError: no such job.
            ValidationError: suspending or resuming a job that has ended.
            BackendError: the API or the local runtime failed.
        """
        return self.backend.update(
            name, kind=kind, namespace=namespace, suspend=suspend, labels=labels, annotations=annotations
        )

    def suspend(self, name: Ref, *, kind: str | None = None, namespace: str | None = None) -> Resource:
        """Suspend a job: its pods (or local processes) are stopped; its checkpoints are kept.

        On Kubernetes this sets `spec.suspend`; the operator sets the PyTorchJob's
        `runPolicy.suspend` and the training operator deletes the pods: wait for it with
        `wait(name, until="Suspended")`. Locally it returns once the processes have stopped.

        Args:
            name: The job's name, or a typed object.
            kind: Default: the object's kind, else GEMTraining.
            namespace: Default: the object's, else the backend's.

        Returns:
            The object after the change.

        Raises:
            NotFoundError: no such job.
            ValidationError: the job has already ended.
            BackendError: the API or the local runtime failed.
        """
        return self.backend.update(name, kind=kind, namespace=namespace, suspend=True)

    def resume(self, name: Ref, *, kind: str | None = None, namespace: str | None = None) -> Resource:
        """Resume a suspended job: its pods start again and the trainer continues from its latest
        complete checkpoint.

        Args:
            name: The job's name, or a typed object.
            kind: Default: the object's kind, else GEMTraining.
            namespace: Default: the object's, else the backend's.

        Returns:
            The object after the change (it may still say Suspended for a moment).

        Raises:
            NotFoundError: no such job.
            ValidationError: the job has already ended.
            BackendError: the API or the local runtime failed.
        """
        return self.backend.update(name, kind=kind, namespace=namespace, suspend=False)

    # ------------------------------------------------------------------ conditions

    def get_conditions(self, name: Ref, *, kind: str | None = None, namespace: str | None = None) -> list[Condition]:
        """The job's conditions (Valid, TeacherReady, Created, Running, Suspended, Succeeded, ...).

        Args:
            name: The job's name, or a typed object.
            kind: Default: the object's kind, else GEMTraining.
            namespace: Default: the object's, else the backend's.

        Returns:
            Its conditions, each with type, status, reason, message and lastTransitionTime
            (empty before the operator has seen the job).

        Raises:
            NotFoundError: no such job.
            BackendError: the API or the local runtime failed.
        """
        obj = self.get(name, kind=kind, namespace=namespace)
        return list(obj.status.conditions) if obj.status else []

    def _phase(self, name: Ref, kind: str | None, namespace: str | None) -> str | None:
        return phase_of(self.get(name, kind=kind, namespace=namespace))

    def is_created(self, name: Ref, *, kind: str | None = None, namespace: str | None = None) -> bool:
        """Whether the job's PyTorchJob exists (it is past Pending, WaitingForTeacher and Invalid)."""
        return self._phase(name, kind, namespace) not in (None, Phase.pending.value, Phase.waiting_for_teacher.value,
                                                          Phase.invalid.value)

    def is_running(self, name: Ref, *, kind: str | None = None, namespace: str | None = None) -> bool:
        """Whether the job is in phase Running."""
        return self._phase(name, kind, namespace) == Phase.running.value

    def is_restarting(self, name: Ref, *, kind: str | None = None, namespace: str | None = None) -> bool:
        """Whether the job is in phase Restarting (its gang restarts from the latest checkpoint)."""
        return self._phase(name, kind, namespace) == Phase.restarting.value

    def is_suspended(self, name: Ref, *, kind: str | None = None, namespace: str | None = None) -> bool:
        """Whether the job is in phase Suspended."""
        return self._phase(name, kind, namespace) == Phase.suspended.value

    def is_succeeded(self, name: Ref, *, kind: str | None = None, namespace: str | None = None) -> bool:
        """Whether the job is in phase Succeeded."""
        return self._phase(name, kind, namespace) == Phase.succeeded.value

    def is_failed(self, name: Ref, *, kind: str | None = None, namespace: str | None = None) -> bool:
        """Whether the job is in phase Failed or Invalid (see `wait`'s JobFailedError for why)."""
        return self._phase(name, kind, namespace) in FAILED_PHASES

    # ------------------------------------------------------------------ pods, logs, metrics

    def pods(
        self,
        name: Ref,
        *,
        kind: str | None = None,
        namespace: str | None = None,
        replica: str | None = None,
        index: int | None = None,
    ) -> list[ReplicaPod]:
        """The job's pods that exist now: master first, then workers by index.

        Args:
            name: The job's name, or a typed object.
            kind: Default: the object's kind, else GEMTraining.
            namespace: Default: the object's, else the backend's.
            replica: Only `master` or only `worker` pods.
            index: Only the pod of this replica index.

        Returns:
            One ReplicaPod each (name, replica type, index, phase, restarts, exit code, message);
            empty before the pods exist, while suspended, or after a cleanPodPolicy removed them.

        Raises:
            NotFoundError: no such job.
            ValidationError: bad replica or index.
            BackendError: the API or the local runtime failed.
        """
        return self.backend.pods(name, kind=kind, namespace=namespace, replica=replica, index=index)

    def pod_names(
        self,
        name: Ref,
        *,
        kind: str | None = None,
        namespace: str | None = None,
        replica: str | None = None,
        index: int | None = None,
    ) -> list[str]:
        """The names of `pods(...)`, e.g. `["quick-train-master-0", "quick-train-worker-0"]`."""
        return [p.name for p in self.pods(name, kind=kind, namespace=namespace, replica=replica, index=index)]

    def all_logs(
        self,
        name: Ref,
        *,
        kind: str | None = None,
        namespace: str | None = None,
        follow: bool = False,
        timeout: float | None = None,
    ) -> Iterator[tuple[str, str]]:
        """The logs of every replica (master, then workers), each line with its pod's name.

        Without `follow`, each pod's log is read in turn; with it, the replicas are streamed at
        once and their lines interleaved as they come, until every container has exited.

        Args:
            name: The job's name, or a typed object.
            kind: Default: the object's kind, else GEMTraining.
            namespace: Default: the object's, else the backend's.
            follow: Stream until the pods exit.
            timeout: Seconds to wait at most for each pod to start (see `logs`).

        Returns:
            An iterator of (pod name, line).

        Raises:
            NotFoundError: no such job, or it ended without one of its pods.
            WaitTimeoutError: a pod did not start within `timeout`.
            BackendError: the API or the local runtime failed.
        """
        obj = self.get(name, kind=kind, namespace=namespace)
        replicas = [("master", 0)] + [("worker", i) for i in range(obj.spec.parallelism.num_nodes - 1)]
        ref = {"kind": obj.kind, "namespace": obj.metadata.namespace}
        job = job_of(obj)
        if not follow:
            for replica, index in replicas:
                pod = pod_name(obj.kind, obj.metadata.name, replica, index, job=job)
                for line in self.logs(obj, **ref, replica=replica, index=index, timeout=timeout):
                    yield pod, line
            return
        yield from _interleave(
            [(pod_name(obj.kind, obj.metadata.name, r, i, job=job),
              lambda r=r, i=i: self.logs(obj, **ref, replica=r, index=i, follow=True, timeout=timeout))
             for r, i in replicas]
        )

    def metrics(
        self,
        name: Ref,
        *,
        kind: str | None = None,
        namespace: str | None = None,
        keys: Iterable[str] | None = None,
        timeout: float | None = None,
    ) -> dict[str, list[MetricPoint]]:
        """The history of the job's metrics from its MLflow run (loss, lr, eval NE/AUC per task, ...).

        The run is `status.mlflow.runId` once the trainer reported it, else the run the trainer
        tagged with the job's uid when it started. The tracking URI is the backend config's
        `mlflow_tracking_uri`, else the job's `spec.mlflow.trackingUri`, else
        `$MLFLOW_TRACKING_URI` (locally: the URI the job was started with). Needs `mlflow`.

        Args:
            name: The job's name, or a typed object.
            kind: Default: the object's kind, else GEMTraining.
            namespace: Default: the object's, else the backend's.
            keys: Metric keys to read, e.g. `["loss", "ne/click"]`. Default: every metric of the run.
            timeout: Seconds to take at most, the whole read included (MLflow bounds each request,
                not a tracking server that answers slowly forever). Default: no limit. The read
                that ran out is left to a background thread, which ends with it.

        Returns:
            {key: [MetricPoint(step, value, timestamp), ...]} ordered by step.

        Raises:
            NotFoundError: no such job, or it has no MLflow run yet.
            ValidationError: the job does not log to MLflow, or no tracking URI is known.
            WaitTimeoutError: `timeout` passed first.
            BackendError: mlflow is not installed or the tracking server failed.
        """
        if timeout is None:
            return self.backend.metrics(name, kind=kind, namespace=namespace, keys=keys)
        done: queue.Queue = queue.Queue(maxsize=1)

        def run() -> None:
            try:
                done.put((True, self.backend.metrics(name, kind=kind, namespace=namespace, keys=keys)))
            except BaseException as e:  # handed to the caller
                done.put((False, e))

        threading.Thread(target=run, daemon=True, name="metrics").start()
        try:
            ok, value = done.get(timeout=max(0.0, timeout))  # a negative one has passed, as for wait
        except queue.Empty:
            kind, namespace, name = resolve_ref(name, kind, namespace, self.default_namespace)
            raise WaitTimeoutError(
                f"timed out after {timeout:g}s reading the metrics of {describe(kind, namespace, name)} from MLflow: "
                "it is slow or not answering; pass a longer timeout (gemctl metrics --timeout)",
                kind=kind, namespace=namespace, name=name,
            ) from None
        if not ok:
            raise value
        return value


def _interleave(
    sources: list[tuple[str, Callable[[], Iterator[str]]]], *, deadline: float | None = None
) -> Iterator[tuple[str, str]]:
    """Lines of several streams, each read by its own thread, in the order they arrive.

    An error of any stream is raised once the others are done with what they had. With a
    `deadline` (a `time.monotonic()` value), WaitTimeoutError is raised when it passes, even while
    every stream is blocked. Once the consumer stops, the readers stop at their next line.
    """
    lines: queue.Queue = queue.Queue(maxsize=1000)
    done = object()
    stopped = threading.Event()

    def hand_over(item: tuple[str, object]) -> None:
        while not stopped.is_set():  # a full queue nobody reads any more must not block forever
            try:
                lines.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def pump(pod: str, open_stream: Callable[[], Iterator[str]]) -> None:
        try:
            for line in open_stream():
                if stopped.is_set():
                    return
                hand_over((pod, line))
        except BaseException as e:  # handed to the consumer
            hand_over((pod, e))
        finally:
            hand_over((pod, done))

    threads = [threading.Thread(target=pump, args=src, daemon=True, name=f"logs-{src[0]}") for src in sources]
    for t in threads:
        t.start()
    open_streams, error = len(threads), None
    try:
        while open_streams:
            try:
                pod, item = lines.get(timeout=_time_left(deadline, raise_when_over=True))
            except queue.Empty:
                continue  # the deadline has passed: the next _time_left raises
            if item is done:
                open_streams -= 1
            elif isinstance(item, BaseException):
                error = error or item
            else:
                yield pod, item
    finally:
        stopped.set()
    if error is not None:
        raise error


def _time_left(deadline: float | None, *, raise_when_over: bool = False) -> float | None:
    """Seconds until `deadline` (a `time.monotonic()` value; None: no limit), at least 0.

    Raises:
        WaitTimeoutError: it has passed and `raise_when_over` is set.
    """
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0 and raise_when_over:
        raise WaitTimeoutError("timed out streaming the logs")
    return max(0.0, left)

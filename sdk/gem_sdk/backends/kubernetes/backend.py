"""GEMTraining/LoopFMDistill as custom resources; the gem operator on the cluster runs them."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NoReturn, TypeVar

import kubernetes
from kubernetes.client.rest import ApiException

from gem.api.render import CONTAINER_NAME, LABEL_UID
from gem.api.types import GROUP, KINDS, TERMINAL_PHASES, VERSION, Phase
from gem_sdk._exceptions import (
    AlreadyExistsError,
    BackendError,
    GEMError,
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
    failure_of,
    finalizers_left,
    from_wire,
    job_of,
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
    FAILED_PHASES,
    KubernetesBackendConfig,
    MetricPoint,
    ObjectInput,
    Ref,
    ReplicaPod,
    Resource,
    Until,
    resolve_kind,
)
from gem_sdk.backends.base import OUTAGE_S, Backend
from gem_sdk.backends.kubernetes.utils import (
    CONNECTION_ERRORS,
    TRANSIENT,
    api_error,
    iter_lines,
    make_api_client,
    status_message,
)

T = TypeVar("T")

#: Longest single watch request; the server closes it after this and the watch resumes.
_WATCH_SEGMENT_S = 300
#: Pause before re-listing after a dropped watch, so a flapping API is not hammered.
_RELIST_PAUSE_S = 0.2
#: The longest pause between tries while `wait` re-lists through an API that is away (for at most
#: OUTAGE_S); it doubles up to this.
_OUTAGE_PAUSE_MAX_S = 10.0
#: Objects per list request, as kubectl's --chunk-size: a namespace with thousands of jobs is read
#: in pages the API server can answer within its request timeout, not in one unbounded answer.
_LIST_CHUNK = 500
#: (connect, read) seconds of one request when no deadline is nearer: an API server that takes the
#: connection and never answers must not hang a call forever.
_CONNECT_TIMEOUT_S, _READ_TIMEOUT_S = 10.0, 60.0


def _timeouts(deadline: float | None) -> tuple[float, float]:
    """The `_request_timeout` of one request: the defaults, cut to what is left until `deadline`.

    A tuple, as the client ignores a lone float; a floor, as urllib3 reads 0 as "no timeout".
    """
    if deadline is None:
        return (_CONNECT_TIMEOUT_S, _READ_TIMEOUT_S)
    left = max(deadline - time.monotonic(), 0.01)
    return (min(_CONNECT_TIMEOUT_S, left), min(_READ_TIMEOUT_S, left))


def _first_look(deadline: float | None) -> float | None:
    """The deadline of a call's first request: none once `deadline` has passed (the request has its
    own timeouts then), so that a timeout of 0 looks once, as `kubectl wait --timeout=0` does,
    instead of timing out without having asked."""
    return None if deadline is not None and deadline <= time.monotonic() else deadline


def _watch_timeouts(segment: float, deadline: float | None) -> tuple[float, float]:
    """The `_request_timeout` of a watch the server ends after `segment` s: reads may wait that
    long and a margin, but not past `deadline`."""
    read = segment + 10
    if deadline is not None:
        read = min(read, max(deadline - time.monotonic(), 0.01))
    return (min(_CONNECT_TIMEOUT_S, read), read)


def _plural(kind: str) -> str:
    return KINDS[kind]["plural"]


class KubernetesBackend(Backend):
    """Talks to the Kubernetes API through the official `kubernetes` client.

    Every API error is mapped by `utils.api_error`: nothing from `kubernetes` leaks.
    """

    def __init__(self, cfg: KubernetesBackendConfig) -> None:
        self.cfg = cfg
        self.api_client, self.default_namespace = make_api_client(cfg)
        self.custom = kubernetes.client.CustomObjectsApi(self.api_client)
        self.core = kubernetes.client.CoreV1Api(self.api_client)

    def _call(self, verb: str, kind: str | None, namespace: str | None, name: str | None,
              fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        kwargs.setdefault("_request_timeout", _timeouts(None))
        try:
            answer = fn(*args, **kwargs)
        except (ApiException, *CONNECTION_ERRORS) as e:
            raise api_error(e, verb, kind, namespace, name) from None
        return self._parsed(answer, verb, kind, namespace, name)

    def _parsed(self, answer: T, verb: str, kind: str | None, ns: str | None, name: str | None) -> T:
        """`answer`, unless it is a text: the client hands back, as it was, a body that is not JSON,
        which only something other than the API server sends (a wrong address, a sign-in page)."""
        if isinstance(answer, str):
            text = " ".join(answer.split())
            raise BackendError(
                f"failed to {verb} {describe(kind, ns, name)}: {self.api_client.configuration.host} answered with "
                f"something other than the Kubernetes API's JSON ({text[:80]!r}); is it the cluster's API server? "
                "Check the server of your kubeconfig's context, or pick another with --kubeconfig/--context",
                kind=kind, namespace=ns, name=name,
            )
        return answer

    def _ride_out(self, request: Callable[[tuple[float, float]], T], verb: str, kind: str, ns: str, name: str,
                  *, deadline: float | None, timed_out: Callable[[], NoReturn], retry: bool = True) -> T:
        """`request(_request_timeout)`, its timeouts cut to `deadline`; past it, `timed_out()` raises.

        With `retry`, an API server that is briefly away (a control-plane restart: refused or
        dropped connections, 429, 5xx) is waited out, the pause doubling up to _OUTAGE_PAUSE_MAX_S,
        for at most OUTAGE_S. Any other error is mapped by `api_error` at once.
        """
        pause, given_up = _RELIST_PAUSE_S, time.monotonic() + OUTAGE_S
        while True:
            if deadline is not None and time.monotonic() >= deadline:
                timed_out()
            try:
                answer = request(_timeouts(deadline))
            except (ApiException, *CONNECTION_ERRORS) as e:
                error = e
            else:
                return self._parsed(answer, verb, kind, ns, name)
            if isinstance(error, ApiException) and error.status not in TRANSIENT:
                raise api_error(error, verb, kind, ns, name) from None
            if deadline is not None and time.monotonic() >= deadline:
                timed_out()  # the request was cut short by the caller's deadline: its timeout, not an outage
            if not retry or time.monotonic() >= given_up:
                raise api_error(error, verb, kind, ns, name) from None
            time.sleep(pause if deadline is None else min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(2 * pause, _OUTAGE_PAUSE_MAX_S)

    def _paged(self, request: Callable[..., Any], verb: str, kind: str, ns: str | None) -> list[dict[str, Any]]:
        """Every item of a list, read in pages of _LIST_CHUNK (`limit` and `continue`) as kubectl does.

        A 410 Expired on a later page (the first page's snapshot was compacted meanwhile) gets one
        whole, consistent list instead, as client-go's pager falls back to (FullListIfExpired).
        """
        items: list[dict[str, Any]] = []
        token = None
        while True:
            try:
                body = self._parsed(request(limit=_LIST_CHUNK, **({"_continue": token} if token else {})),
                                    verb, kind, ns, None)
            except ApiException as e:
                if e.status == 410 and token:
                    return self._parsed(request(), verb, kind, ns, None).get("items") or []
                raise
            items += body.get("items") or []
            token = (body.get("metadata") or {}).get("continue")
            if not token:
                return items

    # ------------------------------------------------------------------ CRUD

    def submit(self, obj: ObjectInput, *, kind: str | None = None, namespace: str | None = None) -> Resource:
        model = to_model(obj, kind=kind, namespace=namespace or None)
        ns = model.metadata.namespace or self.default_namespace
        model.metadata.namespace = ns
        body = model.to_wire()
        body.pop("status", None)
        try:
            created = self._call(
                "create", model.kind, ns, model.metadata.name,
                self.custom.create_namespaced_custom_object, GROUP, VERSION, ns, _plural(model.kind), body,
            )
        except AlreadyExistsError as e:
            # A job deleted a moment ago stays until its finalizers are removed: say so, not "delete it first".
            try:
                existing = self.get(model.metadata.name, kind=model.kind, namespace=ns)
            except GEMError:
                raise e from None
            if not (existing.metadata.model_extra or {}).get("deletionTimestamp"):
                raise
            raise AlreadyExistsError(
                f"{describe(model.kind, ns, model.metadata.name)} is still being deleted: {finalizers_left(existing)}; "
                "submit it again once it is gone (gemctl delete waits for that)",
                kind=model.kind, namespace=ns, name=model.metadata.name,
            ) from None
        return from_wire(created)

    def get(self, name: Ref, *, kind: str | None = None, namespace: str | None = None) -> Resource:
        kind, ns, name = resolve_ref(name, kind, namespace, self.default_namespace)
        body = self._call("get", kind, ns, name, self.custom.get_namespaced_custom_object,
                          GROUP, VERSION, ns, _plural(kind), name)
        return from_wire(body)

    def list(
        self,
        *,
        kind: str | None = None,
        namespace: str | None = None,
        label_selector: str | None = None,
        all_namespaces: bool = False,
    ) -> list[Resource]:
        kinds = [resolve_kind(kind)] if kind else list(KINDS)
        ns = namespace or self.default_namespace
        selector = {"label_selector": label_selector} if label_selector else {}
        out: list[Resource] = []
        for k in kinds:
            where = None if all_namespaces else ns
            args = (GROUP, VERSION, _plural(k)) if all_namespaces else (GROUP, VERSION, ns, _plural(k))
            fn = self.custom.list_cluster_custom_object if all_namespaces else self.custom.list_namespaced_custom_object
            try:
                items = self._paged(lambda **kw: fn(*args, **selector, **kw, _request_timeout=_timeouts(None)),
                                    "list", k, where)
            except ApiException as e:
                if e.status == 400 and label_selector:  # a list's 400 is its selector's: name the selector
                    raise ValidationError(f"invalid label selector {label_selector!r}: {status_message(e)}",
                                          kind=k, namespace=where) from None
                raise api_error(e, "list", k, where, None) from None
            except CONNECTION_ERRORS as e:
                raise api_error(e, "list", k, where, None) from None
            out.extend(from_wire(item) for item in items)
        return sorted(out, key=lambda o: (o.metadata.namespace or "", o.kind, o.metadata.name))

    def delete(self, name: Ref, *, kind: str | None = None, namespace: str | None = None) -> None:
        kind, ns, name = resolve_ref(name, kind, namespace, self.default_namespace)
        # Background propagation: the PyTorchJob and ConfigMap go with it through ownerReferences.
        self._call("delete", kind, ns, name, self.custom.delete_namespaced_custom_object,
                   GROUP, VERSION, ns, _plural(kind), name, propagation_policy="Background")

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
        seen: list[str | None] = [None]

        def observe(obj: Resource) -> bool:
            if callback is not None and obj.metadata.resource_version != seen[0]:
                seen[0] = obj.metadata.resource_version
                callback(obj)
            return wait_done(obj, phases)

        deadline = None if timeout is None else time.monotonic() + timeout
        plural, selector = _plural(kind), f"metadata.name={name}"
        ref = {"kind": kind, "namespace": ns, "name": name}
        gone = NotFoundError(f"{describe(kind, ns, name)} was deleted while waiting", **ref)
        last: Resource | None = None
        uid: str | None = None

        def timed_out() -> NoReturn:
            if last is None:  # the first list did not answer in time
                state = "no answer from the Kubernetes API"
            elif last.status is None:
                state = "no status yet: the gem operator has not picked it up; is it running?"
            else:
                state = f"phase {phase_of(last)}"
            raise WaitTimeoutError(
                f"timed out after {timeout:g}s waiting for {describe(kind, ns, name)} to reach "
                f"{describe_until(phases)} ({state})",
                object=last, **ref,
            )

        def remaining() -> float:
            if deadline is None:
                return float(_WATCH_SEGMENT_S)
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out()
            return min(left, _WATCH_SEGMENT_S)

        def list_job() -> dict[str, Any]:
            # Once the wait is under way (the job was found), an API that is briefly away is waited out.
            # The first look is made even with no time left: timeout 0 answers from the job as it is.
            first = uid is None
            until = _first_look(deadline) if first else deadline
            return self._ride_out(
                lambda t: self.custom.list_namespaced_custom_object(
                    GROUP, VERSION, ns, plural, field_selector=selector, _request_timeout=t),
                "list", kind, ns, name, deadline=until, timed_out=timed_out, retry=not first,
            )

        while True:
            # List, then watch from the list's resourceVersion: the start, and the recovery after a
            # 410 Gone (history compacted) or a dropped connection. Between these, no polling.
            listing = list_job()
            items = listing.get("items") or []
            if not items:
                raise NotFoundError(f"{describe(kind, ns, name)} not found", **ref) if uid is None else gone
            last = from_wire(items[0])
            if uid is None:
                uid = last.metadata.uid
            elif last.metadata.uid != uid:  # deleted and submitted again while we re-listed: another job
                raise gone
            if observe(last):
                return last
            rv = (listing.get("metadata") or {}).get("resourceVersion") or last.metadata.resource_version
            relist = False
            while not relist:
                segment = remaining()
                w = kubernetes.watch.Watch()
                events = w.stream(
                    self.custom.list_namespaced_custom_object, GROUP, VERSION, ns, plural,
                    field_selector=selector, resource_version=rv, allow_watch_bookmarks=True,
                    timeout_seconds=max(1, math.ceil(segment)),
                    _request_timeout=_watch_timeouts(segment, deadline),
                )
                try:
                    while True:
                        # Only reading the stream is guarded: the callback's own errors (even an
                        # OSError) and our WaitTimeoutError (a TimeoutError, so an OSError) go out.
                        try:
                            event = next(events)
                        except StopIteration:
                            break  # the server's timeoutSeconds: resume from rv
                        except ApiException as e:
                            if e.status != 410 and e.status not in TRANSIENT:
                                raise api_error(e, "watch", kind, ns, name) from None
                            # 410: our resourceVersion is too old; else the API is briefly away.
                            relist = True
                            if e.status != 410:
                                time.sleep(_RELIST_PAUSE_S)
                            break
                        except CONNECTION_ERRORS:
                            relist = True  # the watch dropped (or read timed out): list again
                            time.sleep(_RELIST_PAUSE_S)
                            break
                        raw = event.get("raw_object") or {}
                        rv = (raw.get("metadata") or {}).get("resourceVersion") or rv
                        if event["type"] == "BOOKMARK":
                            continue
                        if event["type"] == "DELETED":
                            raise gone
                        last = from_wire(raw)
                        if last.metadata.uid != uid:
                            raise gone
                        if observe(last):
                            return last
                        remaining()
                finally:
                    w.stop()
                    events.close()

    # ------------------------------------------------------------------ update, pods, metrics

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
        patch: dict[str, Any] = {}
        if labels:
            patch.setdefault("metadata", {})["labels"] = dict(labels)
        if annotations:
            patch.setdefault("metadata", {})["annotations"] = dict(annotations)
        if suspend is not None:
            current = self.get(name, kind=kind, namespace=ns)
            check_suspendable(current, suspend)
            patch["spec"] = {"suspend": bool(suspend)}
        if not patch:
            return self.get(name, kind=kind, namespace=ns)
        # A JSON merge patch: only these fields change, whatever else others changed meanwhile.
        body = self._call("update", kind, ns, name, self.custom.patch_namespaced_custom_object,
                          GROUP, VERSION, ns, _plural(kind), name, patch)
        return from_wire(body)

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
        pod_selector(kind, name, replica, index)  # ValidationError before any request
        job = self.get(name, kind=kind, namespace=ns)  # NotFoundError for a job that does not exist
        selector = pod_selector(kind, name, replica, index, job=job_of(job))
        # The body is read inside _call: a connection dropped halfway through it is a BackendError too.
        body = self._call("list pods of", kind, ns, name,
                          lambda **kw: _json(self.core.list_namespaced_pod(ns, label_selector=selector,
                                                                           _preload_content=False, **kw)))
        pods = (p for p in body.get("items") or [] if not _of_another_job(p, job))
        return sorted((pod_from_wire(p) for p in pods), key=pod_order)

    def metrics(
        self,
        name: Ref,
        *,
        kind: str | None = None,
        namespace: str | None = None,
        keys: Iterable[str] | None = None,
    ) -> dict[str, list[MetricPoint]]:
        obj = self.get(name, kind=kind, namespace=namespace)
        uri = self.cfg.mlflow_tracking_uri or obj.spec.mlflow.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        hint = ""
        if not self.cfg.mlflow_tracking_uri and uri == obj.spec.mlflow.tracking_uri:
            # The address the trainer uses is often an in-cluster one (a Service name).
            hint = ("; that is the job's spec.mlflow.trackingUri, where the trainer reaches MLflow, which may not "
                    "be reachable from here: pass the address you reach it at (gemctl --mlflow-tracking-uri, "
                    "KubernetesBackendConfig(mlflow_tracking_uri=...)), e.g. through kubectl port-forward")
        return metric_history(obj, uri, keys, hint=hint)

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
        deadline = None if timeout is None else time.monotonic() + timeout
        job = self._check_replica(kind, ns, name, replica, index, deadline)
        pod = self._wait_for_pod(kind, ns, name, replica, index, deadline, job=job)["metadata"]["name"]
        return self._lines(self._read_log(kind, ns, name, pod, follow), kind, ns, name)

    def _previous_log(self, name: Ref, *, kind: str | None = None, namespace: str | None = None,
                      replica: str = "master", index: int = 0) -> Iterator[str]:
        """The log of the replica's last terminated container, as `kubectl logs --previous` reads it:
        in CrashLoopBackOff the one that just exited, after a restart the one before the current."""
        kind, ns, name = resolve_ref(name, kind, namespace, self.default_namespace)
        job = self._check_replica(kind, ns, name, replica, index, None)
        pod = pod_name(kind, name, replica, index, job=job_of(job))
        ref = {"kind": kind, "namespace": ns, "name": name}
        missing = NotFoundError(f"pod {ns}/{pod} of {describe(kind, ns, name)} does not exist (not created yet, "
                                "or cleaned up): it has no previous container", **ref)
        listed = self._list_pod(kind, ns, name, pod, None, retry=False)
        if any(_of_another_job(p, job) for p in listed.get("items") or []):
            raise missing
        try:
            resp = self.core.read_namespaced_pod_log(pod, ns, container=CONTAINER_NAME, previous="true",
                                                     _preload_content=False, _request_timeout=_timeouts(None))
        except ApiException as e:
            if e.status == 404:  # the job exists (checked above): it is the pod's
                raise missing from None
            if e.status == 400 and "previous terminated container" in status_message(e):
                raise NotFoundError(f"pod {ns}/{pod} of {describe(kind, ns, name)} has no previous container: it "
                                    "has not been restarted", **ref) from None
            raise api_error(e, "read logs of", kind, ns, name) from None
        except CONNECTION_ERRORS as e:
            raise api_error(e, "read logs of", kind, ns, name) from None
        return self._lines(resp, kind, ns, name)

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
        will come (the job ended, or the pod succeeded). What `GEMClient.follow` is built on.

        A log request reads the pod's current container, or its last terminated one until the
        kubelet has started the next: so a restarted container is read only once the pod's status
        shows it (another containerID and restartCount, running or terminated).
        """
        kind, ns, name = resolve_ref(name, kind, namespace, self.default_namespace)
        deadline = None if timeout is None else time.monotonic() + timeout
        if after is None:
            job = self._check_replica(kind, ns, name, replica, index, deadline)
        else:
            timed_out = self._pod_timed_out(ns, pod_name(kind, name, replica, index), kind, name)
            job = self._get_riding_out(kind, ns, name, deadline, timed_out)
        while True:
            seen = self._wait_for_pod(kind, ns, name, replica, index, deadline, job=job, after=after)
            if seen is None:
                return None
            pod = seen["metadata"]["name"]
            resp = self._read_log(kind, ns, name, pod, follow=True)
            try:
                # Not cut to the deadline: the log is open, the wait for it is over.
                items = self._list_pod(kind, ns, name, pod, None).get("items") or []
            except BaseException:
                resp.close()
                raise
            if items and _container_key(items[0]) == _container_key(seen):
                return _container_key(seen), pod_from_wire(seen), self._lines(resp, kind, ns, name)
            # The container changed around the request: which one answered is unknown. Ask again.
            resp.close()
            resp.release_conn()

    def _get_riding_out(self, kind: str, ns: str, name: str, deadline: float | None,
                        timed_out: Callable[[], NoReturn], retry: bool = True) -> Resource:
        """The job, read through _ride_out (API outages ridden out until `deadline`)."""
        return from_wire(self._ride_out(
            lambda t: self.custom.get_namespaced_custom_object(GROUP, VERSION, ns, _plural(kind), name,
                                                               _request_timeout=t),
            "get", kind, ns, name, deadline=deadline, timed_out=timed_out, retry=retry,
        ))

    def _check_replica(self, kind: str, ns: str, name: str, replica: str, index: int,
                       deadline: float | None) -> Resource:
        """The job, once it is known to have this replica (ValidationError for an impossible one)."""
        pod = pod_name(kind, name, replica, index)  # the job is not read yet: the name it gets by default
        # NotFoundError now, not at the first next(); within the timeout even if the API never answers.
        job = self._get_riding_out(kind, ns, name, _first_look(deadline), self._pod_timed_out(ns, pod, kind, name),
                                   retry=False)
        check_replica_exists(job, replica, index)  # else we would wait for a pod that never comes
        return job

    def _read_log(self, kind: str, ns: str, name: str, pod: str, follow: bool) -> Any:
        # follow as kubectl sends it ("true"); the client would send Python's "True", which a
        # strict server (e.g. the test API server) does not take for true. The timeout bounds the
        # wait for the pod, not its log: this request has the defaults.
        resp = self._call("read logs of", kind, ns, name, self.core.read_namespaced_pod_log,
                          pod, ns, container=CONTAINER_NAME, follow="true" if follow else "false",
                          _preload_content=False)
        if follow:
            # The read timeout was for the answer: a followed container may then be quiet for long
            # (a checkpoint, an evaluation) without anything being wrong.
            sock = getattr(getattr(resp, "connection", None), "sock", None)
            if sock is not None:
                sock.settimeout(None)
        return resp

    def _list_pod(self, kind: str, ns: str, name: str, pod: str, deadline: float | None,
                  retry: bool = True) -> dict[str, Any]:
        """The pod as a list of at most one (no 404 for a pod that is gone); with `retry`, an API
        server that is briefly away is waited out."""
        return self._ride_out(
            # The body is read inside: a connection dropped while it is read is retried too.
            lambda t: _json(self.core.list_namespaced_pod(ns, field_selector=f"metadata.name={pod}",
                                                          _preload_content=False, _request_timeout=t)),
            "list pods of", kind, ns, name, deadline=deadline, timed_out=self._pod_timed_out(ns, pod, kind, name),
            retry=retry,
        )

    @staticmethod
    def _pod_timed_out(ns: str, pod: str, kind: str, name: str) -> Callable[[], NoReturn]:
        def timed_out() -> NoReturn:
            raise WaitTimeoutError(f"timed out waiting for pod {ns}/{pod} to start",
                                   kind=kind, namespace=ns, name=name)
        return timed_out

    def _lines(self, resp: Any, kind: str, ns: str, name: str) -> Iterator[str]:
        try:
            yield from iter_lines(resp)
        except CONNECTION_ERRORS as e:
            raise api_error(e, "stream logs of", kind, ns, name) from None

    def _pod_started(self, pod: dict[str, Any] | None) -> bool:
        status = (pod or {}).get("status") or {}
        if status.get("phase") in ("Running", "Succeeded", "Failed"):
            return True
        return any(
            (cs.get("state") or {}).get("running") or (cs.get("state") or {}).get("terminated")
            for cs in status.get("containerStatuses") or []
        )

    def _wait_for_pod(self, kind: str, ns: str, name: str, replica: str, index: int, deadline: float | None,
                      job: Resource, after: Any = None) -> dict[str, Any] | None:
        """Watch the replica's pod until its container has started (its log exists), until `deadline`;
        the pod.

        The pod is named after the job that `job` (the resource, read before) records, else after the
        name the operator gives it by default; once the operator records another, that one's pod. A
        pod of another resource of the same name (deleted, its pods still going) is no pod of its.

        Each watch lasts a few seconds so that a job that ended without ever starting this pod,
        or is suspended without it, is noticed (NotFoundError) instead of waiting forever. The
        job exists (logs got it), so an API server that is briefly away is waited out, as by wait.

        With `after` (a `_container_key`), until a container other than that one has started
        (a restart, a recreated pod, a resume), or None once none will: the pod succeeded or the
        job ended. A suspended job is waited through (its pods come back on resume).
        """
        ref = {"kind": kind, "namespace": ns, "name": name}
        pod = pod_name(kind, name, replica, index, job=job_of(job))
        timed_out = self._pod_timed_out(ns, pod, kind, name)

        def verdict(p: dict[str, Any] | None) -> tuple[bool, dict[str, Any] | None]:
            if p is None or _of_another_job(p, job):
                return False, None
            if after is None:
                return (True, p) if self._pod_started(p) else (False, None)
            if _new_container(p, after):
                return True, p
            # A succeeded pod's containers are not restarted: nothing more comes from it.
            return ((p.get("status") or {}).get("phase") == "Succeeded"), None

        look = _first_look(deadline)  # even with no time left: timeout 0 reads the log of a started pod
        while True:
            body = self._list_pod(kind, ns, name, pod, look, retry=look == deadline)
            look = deadline
            items = [p for p in body.get("items") or [] if not _of_another_job(p, job)]
            done, found = verdict(items[0] if items else None)
            if done:
                return found
            job = self._get_riding_out(kind, ns, name, deadline, timed_out)
            recorded = pod_name(kind, name, replica, index, job=job_of(job))
            if recorded != pod:  # the operator's job is another than the one looked for: its pod, at once
                pod, timed_out = recorded, self._pod_timed_out(ns, recorded, kind, name)
                continue
            if phase_of(job) in TERMINAL_PHASES:
                if after is not None:
                    return None
                if items:  # kept by cleanPodPolicy None, but it will not start now (e.g. ImagePullBackOff)
                    raise NotFoundError(
                        f"pod {ns}/{pod} of {describe(kind, ns, name)} never started and the job is "
                        f"{phase_of(job)}: it has no log", **ref,
                    )
                if phase_of(job) in FAILED_PHASES and not job.status.pytorch_job:
                    # Refused before the operator made a PyTorchJob (an invalid spec, a teacher that
                    # failed): no pod ever was; say why, not that one was cleaned up.
                    reason, message = failure_of(job)
                    raise NotFoundError(
                        f"pod {ns}/{pod} of {describe(kind, ns, name)} does not exist: the job is {phase_of(job)} "
                        f"and never ran: {reason}: {message}".rstrip(": "), **ref,
                    )
                raise NotFoundError(
                    f"pod {ns}/{pod} of {describe(kind, ns, name)} does not exist and the job is "
                    f"{phase_of(job)}; its pods may have been cleaned up (runPolicy.cleanPodPolicy)",
                    **ref,
                )
            if not items and after is None:
                # Suspended stays so until a resume (spec.suspend false; the pods come back then),
                # as the local backend says too.
                if phase_of(job) == Phase.suspended.value and job.spec.suspend:
                    raise NotFoundError(
                        f"pod {ns}/{pod} of {describe(kind, ns, name)} does not exist: the job is Suspended "
                        "(resume it first)",
                        **ref,
                    )
            # Between containers the job is not watched: look at it every second, so that its end
            # is seen soon after its last container's.
            segment = 5.0 if after is None else 1.0
            if deadline is not None:
                segment = min(segment, deadline - time.monotonic())
                if segment <= 0:
                    timed_out()
            w = kubernetes.watch.Watch()
            try:
                for event in w.stream(
                    self.core.list_namespaced_pod, ns, field_selector=f"metadata.name={pod}",
                    resource_version=(body.get("metadata") or {}).get("resourceVersion"),
                    timeout_seconds=max(1, math.ceil(segment)),
                    _request_timeout=_watch_timeouts(segment, deadline),
                ):
                    # raw_object, the pod as JSON, is in every client version's events; `object`
                    # is a V1Pod unless deserialize=False, which clients before 35 do not accept.
                    if event.get("type") in ("ADDED", "MODIFIED"):
                        done, found = verdict(event.get("raw_object"))
                        if done:
                            return found
            except ApiException as e:
                if e.status != 410 and e.status not in TRANSIENT:
                    raise api_error(e, "watch pods of", kind, ns, name) from None
                if e.status != 410:  # the API is briefly away: the next list waits it out
                    time.sleep(_RELIST_PAUSE_S)
            except CONNECTION_ERRORS:
                time.sleep(_RELIST_PAUSE_S)
            finally:
                w.stop()


def _of_another_job(pod: dict[str, Any], job: Resource) -> bool:
    """Whether the pod was made for another resource of the job's name: one deleted a moment ago,
    whose pods go some time after it (garbage collection, their grace period) with the same names
    and job-name label. The operator labels every pod with its resource's uid."""
    uid = ((pod.get("metadata") or {}).get("labels") or {}).get(LABEL_UID)
    return uid is not None and uid != job.metadata.uid


def _container_status(pod: dict[str, Any]) -> dict[str, Any]:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return next((c for c in statuses if c.get("name") == CONTAINER_NAME), statuses[0] if statuses else {})


def _container_key(pod: dict[str, Any]) -> tuple[Any, ...]:
    """Which container a log request for the pod reads now: the pod's uid, the containerID (in
    CrashLoopBackOff, the terminated container's) and the restartCount."""
    cs = _container_status(pod)
    last = (cs.get("lastState") or {}).get("terminated") or {}
    cid = cs.get("containerID") or ((cs.get("state") or {}).get("terminated") or {}).get("containerID") \
        or last.get("containerID")
    return ((pod.get("metadata") or {}).get("uid"), cid, int(cs.get("restartCount") or 0))


def _new_container(pod: dict[str, Any], after: tuple[Any, ...]) -> bool:
    """Whether the pod runs (or ran) a container other than `after`: a waiting one has no log yet,
    and a request now would read the old one."""
    state = _container_status(pod).get("state") or {}
    return bool(state.get("running") or state.get("terminated")) and _container_key(pod) != after


def _json(resp: Any) -> Any:
    """The JSON of a raw answer; its text when it is not JSON, as the client's own deserializer
    gives it (`KubernetesBackend._parsed` tells what that means)."""
    import json

    try:
        data = resp.data
    finally:
        resp.release_conn()
    try:
        return json.loads(data)
    except ValueError:
        return data.decode("utf-8", "replace")

"""Loading, validating and reading resources; logic shared by every backend."""

from __future__ import annotations

import difflib
import os
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pydantic
import yaml

from gem.api.render import CONTAINER_NAME, job_name
from gem.api.types import API_VERSION, KINDS, JobStatus, Phase, parse_object
from gem_sdk._exceptions import (
    BackendError,
    FieldError,
    JobFailedError,
    NotFoundError,
    ValidationError,
    describe,
)
from gem_sdk._types import FAILED_PHASES, TERMINAL_PHASES, ObjectInput, Ref, ReplicaPod, Resource, resolve_kind

#: The training operator's pod labels.
LABEL_JOB_NAME = "training.kubeflow.org/job-name"
LABEL_REPLICA_TYPE = "training.kubeflow.org/replica-type"
LABEL_REPLICA_INDEX = "training.kubeflow.org/replica-index"

#: Metadata the API server owns; dropped from an object before it is submitted.
_SERVER_METADATA = ("uid", "resourceVersion", "creationTimestamp", "generation", "managedFields", "selfLink")

_NAME_HINT = (
    "names are at most 63 lowercase letters, digits and '-', starting and ending with a letter or digit"
)


# --------------------------------------------------------------------------- input


def load_documents(source: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The manifests in a YAML/JSON file or string (`---`-separated documents allowed).

    Raises:
        ValidationError: the file is missing or not YAML, or a document is not a mapping.
    """
    text: str
    if isinstance(source, os.PathLike) or (
        isinstance(source, str) and "\n" not in source and not source.lstrip().startswith("{")
        and (source.endswith((".yaml", ".yml", ".json")) or os.path.exists(source))
    ):
        path = Path(source).expanduser()
        try:
            text = path.read_text()
        except OSError as e:
            raise ValidationError(f"cannot read {path}: {e.strerror or e}") from None
    else:
        text = str(source)
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as e:
        raise ValidationError(f"not valid YAML: {e}") from None
    for doc in docs:
        if not isinstance(doc, dict):
            raise ValidationError(
                f"expected a GEMTraining or LoopFMDistill manifest (a mapping), got {type(doc).__name__}: "
                f"{str(doc)[:80]!r}; pass a file path, a YAML string, a dict or a typed object"
            )
    return docs


def to_model(obj: ObjectInput, *, kind: str | None = None, namespace: str | None = None) -> Resource:
    """Validate what `submit` was given into a typed object ready to send.

    Server-owned metadata and status are dropped; a missing apiVersion, kind or namespace is
    filled in from the arguments.

    Raises:
        ValidationError: naming each bad field (camelCase path) and the fix.
    """
    if isinstance(obj, pydantic.BaseModel):
        body = obj.model_dump(by_alias=True, exclude_none=True, mode="json")
    elif isinstance(obj, dict):
        body = dict(obj)
    elif isinstance(obj, (str, os.PathLike)):
        docs = load_documents(obj)
        if len(docs) != 1:
            raise ValidationError(
                f"expected exactly one manifest, found {len(docs)}; submit each document separately"
            )
        body = docs[0]
    else:
        raise ValidationError(
            f"cannot submit a {type(obj).__name__}: pass a file path, a YAML string, a dict, "
            "or a GEMTraining/LoopFMDistill object"
        )

    body.pop("status", None)
    _check_shape(body)
    meta = dict(body.get("metadata") or {})
    for key in _SERVER_METADATA:
        meta.pop(key, None)
    name = meta.get("name") if isinstance(meta.get("name"), str) else None

    if kind is not None:
        kind = resolve_kind(kind)
        if body.get("kind") not in (None, kind):
            raise ValidationError(
                f"the object is a {body.get('kind')}, but kind={kind} was asked for; drop one of them",
                kind=kind, name=name,
            )
        body["kind"] = kind
    if body.get("kind") not in KINDS:
        raise ValidationError(
            f"kind must be one of {', '.join(sorted(KINDS))}, got {body.get('kind')!r}: set `kind:` in the manifest"
        )
    kind = body["kind"]
    body.setdefault("apiVersion", API_VERSION)
    if namespace is not None:
        if meta.get("namespace") not in (None, namespace):
            raise ValidationError(
                f"the object's namespace {meta['namespace']!r} does not match the namespace {namespace!r} "
                "asked for; drop one of them",
                kind=kind, namespace=namespace, name=name,
            )
        meta["namespace"] = namespace
    body["metadata"] = meta
    try:
        return parse_object(body)
    except pydantic.ValidationError as e:
        raise ValidationError(
            f"invalid {describe(kind, meta.get('namespace'), name)}",
            errors=field_errors(e, KINDS[kind]["model"]),
            kind=kind, namespace=meta.get("namespace"), name=name,
        ) from None


def _check_shape(body: dict[str, Any]) -> None:
    """The fields `to_model` reads itself, before pydantic sees the body, must have the right
    type: a list where a mapping belongs would otherwise escape as a TypeError or ValueError.

    Raises:
        ValidationError: naming each misshapen field and the fix.
    """
    errors = []
    kind, meta = body.get("kind"), body.get("metadata")
    if kind is not None and not isinstance(kind, str):
        errors.append(FieldError("kind", f"must be a string, e.g. `kind: GEMTraining`; got a {_yaml_type(kind)}"))
    if meta is not None and not isinstance(meta, dict):
        errors.append(FieldError("metadata", "must be a mapping, e.g. `metadata: {name: quick}` (keys indented "
                                             f"under it, no leading '-'); got a {_yaml_type(meta)}"))
    elif meta is not None and meta.get("namespace") is not None and not isinstance(meta["namespace"], str):
        errors.append(FieldError("metadata.namespace", f"must be a string; got a {_yaml_type(meta['namespace'])}"))
    if errors:
        raise ValidationError("invalid manifest", errors=errors)


def _yaml_type(value: Any) -> str:
    """What YAML calls a value's type, for messages about a manifest."""
    if isinstance(value, dict):
        return "mapping"
    if isinstance(value, list):
        return "list"
    return type(value).__name__


def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for item in loc:
        out += f"[{item}]" if isinstance(item, int) else (f".{item}" if out else str(item))
    return out


def _model_at(model: type[pydantic.BaseModel], loc: tuple[Any, ...]) -> type[pydantic.BaseModel] | None:
    """The pydantic model a location points into (for suggestions), if it is a model."""
    current: Any = model
    for item in loc:
        if isinstance(item, int) or not (isinstance(current, type) and issubclass(current, pydantic.BaseModel)):
            if isinstance(item, int):
                continue
            return None
        field = next(
            (f for n, f in current.model_fields.items() if item in (n, f.alias)), None
        )
        if field is None:
            return None
        current = field.annotation
        # Unwrap Optional[X] / list[X] to X.
        for _ in range(3):
            args = [a for a in typing.get_args(current) if a is not type(None)]
            if typing.get_origin(current) is not None and args and not (
                isinstance(current, type) and issubclass(current, pydantic.BaseModel)
            ):
                current = args[-1]
    return current if isinstance(current, type) and issubclass(current, pydantic.BaseModel) else None


def field_errors(error: pydantic.ValidationError, model: type[pydantic.BaseModel]) -> list[FieldError]:
    """pydantic's errors as (camelCase path, message with the fix)."""
    out = []
    for err in error.errors(include_url=False):
        loc = tuple(err["loc"])
        path = _path(loc)
        msg = err["msg"].removeprefix("Value error, ")
        kind = err["type"]
        if kind == "extra_forbidden":
            parent = _model_at(model, loc[:-1])
            known = sorted(f.alias or n for n, f in parent.model_fields.items()) if parent else []
            close = difflib.get_close_matches(str(loc[-1]), known, n=1)
            msg = "unknown field: " + (f"did you mean {close[0]!r}?" if close else "remove it") + (
                f" (fields here: {', '.join(known)})" if known else ""
            )
        elif kind == "missing":
            parent = _model_at(model, loc[:-1])
            field = next((f for n, f in (parent.model_fields.items() if parent else []) if loc[-1] in (n, f.alias)), None)
            msg = "required: set it" + (f" ({field.description})" if field and field.description else "")
        elif kind == "string_pattern_mismatch" and loc[-1] == "name":
            msg = f"invalid name {err.get('input')!r}: {_NAME_HINT}"
        elif kind == "literal_error" and loc == ("apiVersion",):
            msg = f"must be {API_VERSION} (got {err.get('input')!r})"
        elif kind != "value_error" and "input" in err and not isinstance(err["input"], (dict, list)):
            msg = f"{msg} (got {err['input']!r})"
        out.append(FieldError(path, msg))
    return out


# --------------------------------------------------------------------------- output


def from_wire(body: dict[str, Any]) -> Resource:
    """The typed object of a resource read back from a backend.

    A status field this SDK does not know (a newer operator) is dropped rather than failing.

    Raises:
        BackendError: the body is not a readable GEMTraining/LoopFMDistill.
    """
    try:
        return parse_object(body)
    except (pydantic.ValidationError, ValueError) as first:
        status = body.get("status")
        if isinstance(status, dict):
            known = {f.alias or n for n, f in JobStatus.model_fields.items()}
            try:
                return parse_object({**body, "status": {k: v for k, v in status.items() if k in known}})
            except (pydantic.ValidationError, ValueError):
                pass
        meta = body.get("metadata") or {}
        raise BackendError(
            f"cannot read {describe(body.get('kind'), meta.get('namespace'), meta.get('name'))}: {first}",
            kind=body.get("kind"), namespace=meta.get("namespace"), name=meta.get("name"),
        ) from None


def phase_of(obj: Resource) -> str | None:
    return obj.status.phase if obj.status else None


# --------------------------------------------------------------------------- references


def resolve_ref(ref: Ref, kind: str | None, namespace: str | None, default_namespace: str) -> tuple[str, str, str]:
    """(kind, namespace, name) of a name or typed object.

    A typed object supplies the kind and namespace unless they are given; a bare name defaults
    to kind GEMTraining and the backend's namespace.
    """
    if isinstance(ref, pydantic.BaseModel):
        obj_kind = getattr(ref, "kind", None)
        name = ref.metadata.name  # type: ignore[attr-defined]
        kind = resolve_kind(kind) if kind else obj_kind
        namespace = namespace or ref.metadata.namespace  # type: ignore[attr-defined]
    elif isinstance(ref, str) and ref:
        name = ref
        kind = resolve_kind(kind) if kind else "GEMTraining"
    else:
        raise ValidationError(f"expected a resource name or object, got {ref!r}")
    return kind, namespace or default_namespace, name  # type: ignore[return-value]


def job_of(obj: Resource) -> str:
    """The PyTorchJob the resource runs as: the name the operator recorded (status.pytorchJob), else,
    before it has made one, the name it will give it (`render.job_name`).

    The recorded name comes first: an operator of an earlier release may have named the job
    otherwise (render.job_name's budget for long names changed), and the operator keeps that job.
    """
    recorded = obj.status.pytorch_job if obj.status is not None else None
    return recorded or job_name(obj.kind, obj.metadata.name)


def pod_name(kind: str, name: str, replica: str, index: int, *, job: str | None = None) -> str:
    """The pod the training operator creates for one replica: `<job>-master-0`, `<job>-worker-<i>`,
    where `<job>` is `job` (see `job_of`), else `render.job_name`'s.

    Raises:
        ValidationError: replica is not master/worker, or the index is impossible.
    """
    replica = replica.lower()
    if replica not in ("master", "worker"):
        raise ValidationError(f"replica must be master or worker, got {replica!r}")
    if index < 0 or (replica == "master" and index != 0):
        raise ValidationError(f"there is one master (index 0) and workers 0..numNodes-2; got {replica} {index}")
    return f"{job or job_name(kind, name)}-{replica}-{index}"


def check_replica_exists(obj: Resource, replica: str, index: int) -> None:
    """That the job has this replica: one master and spec.parallelism.numNodes-1 workers, so a
    pod that can never exist is an error now rather than a wait for it.

    Raises:
        NotFoundError: the index is past the job's last worker (or master).
    """
    nodes = obj.spec.parallelism.num_nodes
    count = 1 if replica.lower() == "master" else nodes - 1
    if index >= count:
        workers = f"workers 0..{nodes - 2}" if nodes > 1 else "no worker"
        raise NotFoundError(
            f"{describe(obj.kind, obj.metadata.namespace, obj.metadata.name)} has no pod "
            f"{pod_name(obj.kind, obj.metadata.name, replica, index, job=job_of(obj))}: spec.parallelism.numNodes is {nodes}, "
            f"so it has one master and {workers}",
            kind=obj.kind, namespace=obj.metadata.namespace, name=obj.metadata.name,
        )


# --------------------------------------------------------------------------- waiting


def failure_of(obj: Resource) -> tuple[str, str]:
    """(reason, message) explaining why a job is Failed or Invalid, from its conditions."""
    status = obj.status
    if status is None:
        return "Unknown", ""
    conds = {c.type: c for c in status.conditions}
    for ctype, want in (("Failed", "True"), ("Invalid", "True"), ("Valid", "False")):
        cond = conds.get(ctype)
        if cond is not None and cond.status == want:
            # status.message carries the trainer's own error when it reported one.
            return cond.reason or ctype, status.message or cond.message or ""
    return str(status.phase), status.message or ""


def wait_done(obj: Resource, until: frozenset[str] | Callable[[Resource], bool]) -> bool:
    """Whether `wait` is over: a phase in `until` (or `until(obj)` is true), or any terminal phase.

    Raises:
        JobFailedError: the phase is Failed or Invalid.
    """
    phase = phase_of(obj)
    if phase in FAILED_PHASES:
        reason, message = failure_of(obj)
        raise JobFailedError(
            phase=phase, reason=reason, detail=message, object=obj,
            kind=obj.kind, namespace=obj.metadata.namespace, name=obj.metadata.name,
        )
    if callable(until):
        return bool(until(obj)) or phase in TERMINAL_PHASES
    return phase in until or phase in TERMINAL_PHASES


def normalize_until(until: Any) -> frozenset[str] | Callable[[Resource], bool]:
    """`until` as a set of phase names (accepts Phase values, strings, one or many), or the
    predicate it is."""
    if until is None:
        return TERMINAL_PHASES
    if callable(until) and not isinstance(until, (str, Phase)):
        return until
    if isinstance(until, (str, Phase)):
        until = [until]
    phases = frozenset(p.value if isinstance(p, Phase) else str(p) for p in until)
    known = {p.value for p in Phase}
    bad = sorted(phases - known)
    if bad:
        raise ValidationError(f"unknown phase(s) {', '.join(bad)} in until: use {', '.join(sorted(known))}")
    return phases


def describe_until(until: frozenset[str] | Callable[[Resource], bool]) -> str:
    """For messages: `Running/Succeeded`, or the predicate's name."""
    if callable(until):
        return f"{getattr(until, '__name__', 'the condition')}()"
    return "/".join(sorted(until))


def check_suspendable(obj: Resource, suspend: bool) -> None:
    """Suspending or resuming a job that has ended is a mistake worth saying.

    Raises:
        ValidationError: the job has Succeeded, Failed or is Invalid.
    """
    phase = phase_of(obj)
    if phase in TERMINAL_PHASES and bool(obj.spec.suspend) != suspend:
        raise ValidationError(
            f"{describe(obj.kind, obj.metadata.namespace, obj.metadata.name)} has ended ({phase}): there is nothing to "
            f"{'suspend' if suspend else 'resume'}; submit it again under a new name to train again",
            kind=obj.kind, namespace=obj.metadata.namespace, name=obj.metadata.name,
        )


def pod_from_wire(pod: dict[str, Any]) -> ReplicaPod:
    """A Pod (raw JSON, or the local backend's Pod-like dict) as a ReplicaPod."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    status = pod.get("status") or {}
    cs = next((c for c in status.get("containerStatuses") or [] if c.get("name") == CONTAINER_NAME),
              (status.get("containerStatuses") or [{}])[0])
    state = cs.get("state") or {}
    terminated = state.get("terminated") or {}
    started = (state.get("running") or {}).get("startedAt") or terminated.get("startedAt")
    return ReplicaPod(
        name=meta.get("name", ""),
        replica_type=str(labels.get(LABEL_REPLICA_TYPE, "")).lower(),
        index=int(labels.get(LABEL_REPLICA_INDEX) or 0),
        phase=status.get("phase") or "Unknown",
        restart_count=int(cs.get("restartCount") or 0),
        started_at=started,
        exit_code=terminated.get("exitCode"),
        message=terminated.get("message") or None,
    )


def pod_order(pod: ReplicaPod) -> tuple[int, int, str]:
    return (0 if pod.replica_type == "master" else 1, pod.index, pod.name)


def pod_selector(kind: str, name: str, replica: str | None, index: int | None, *, job: str | None = None) -> str:
    """The label selector of a job's pods (the training operator's labels); `job` as for `pod_name`.

    Raises:
        ValidationError: replica is not master/worker, or the index is negative.
    """
    selector = f"{LABEL_JOB_NAME}={job or job_name(kind, name)}"
    if replica is not None:
        if replica.lower() not in ("master", "worker"):
            raise ValidationError(f"replica must be master or worker, got {replica!r}")
        selector += f",{LABEL_REPLICA_TYPE}={replica.lower()}"
    if index is not None:
        if index < 0:
            raise ValidationError(f"index must be >= 0, got {index}")
        selector += f",{LABEL_REPLICA_INDEX}={index}"
    return selector


def finalizers_left(obj: Any) -> str:
    """What keeps a deleted object (deletionTimestamp set) from going, for a message: its finalizers."""
    finalizers = list((obj.metadata.model_extra or {}).get("finalizers") or [])
    if not finalizers:
        return "it is still there"
    if len(finalizers) == 1:
        return f"its finalizer {finalizers[0]} is still there; the gem operator removes it (is it running?)"
    return f"its finalizers {', '.join(finalizers)} are still there; the gem operator removes its own (is it running?)"

"""The errors the SDK raises. Nothing else escapes it: Kubernetes and I/O errors are wrapped.

    GEMError                      base of everything below; .kind, .namespace, .name
    ├── NotFoundError             (also LookupError) the resource, its teacher or its pod does not exist
    ├── AlreadyExistsError        submit of a name that is taken
    ├── ValidationError           (also ValueError) a bad spec, before sending or from the API (422);
    │                             .errors lists (field path in camelCase, what to do)
    ├── JobFailedError            wait saw phase Failed or Invalid; .reason, .message, .object
    ├── WaitTimeoutError          (also TimeoutError) wait ran out of time; .object is the last seen
    └── BackendError              the cluster or the local runtime failed (unreachable API,
                                  forbidden, CRDs missing, supervisor crashed); .status is the HTTP code

`gemctl` maps them to exit codes: JobFailedError 1, ValidationError 2, NotFoundError 3,
WaitTimeoutError 4, any other GEMError 5.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gem_sdk._types import Resource

__all__ = [
    "AlreadyExistsError",
    "BackendError",
    "FieldError",
    "GEMError",
    "JobFailedError",
    "NotFoundError",
    "ValidationError",
    "WaitTimeoutError",
]


def describe(kind: str | None, namespace: str | None, name: str | None) -> str:
    """`GEMTraining default/ctr` (the parts that are known)."""
    ref = "/".join(p for p in (namespace, name) if p)
    return " ".join(p for p in (kind, ref) if p) or "resource"


class GEMError(Exception):
    """Base class of every SDK error.

    Attributes:
        kind: The resource kind involved (GEMTraining or LoopFMDistill), if known.
        namespace: Its namespace, if known.
        name: Its name, if known.
    """

    def __init__(
        self,
        message: str,
        *,
        kind: str | None = None,
        namespace: str | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.namespace = namespace
        self.name = name

    def __str__(self) -> str:
        return self.message


class NotFoundError(GEMError, LookupError):
    """The resource (or the teacher, or the pod) does not exist."""


class AlreadyExistsError(GEMError):
    """A resource of that kind and name already exists in the namespace."""


@dataclass(frozen=True)
class FieldError:
    """One problem of a spec: where (camelCase path, e.g. `spec.training.steps`) and what to do."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class ValidationError(GEMError, ValueError):
    """The object is not a valid GEMTraining/LoopFMDistill (found by the SDK or by the API server).

    Attributes:
        errors: One FieldError per problem, each naming the field path and the fix.
    """

    def __init__(self, message: str, *, errors: list[FieldError] | None = None, **ref: Any) -> None:
        self.errors = list(errors or [])
        if self.errors:
            message = message + ":\n" + "\n".join(f"  - {e}" for e in self.errors)
        super().__init__(message, **ref)


class JobFailedError(GEMError):
    """The job ended in phase Failed or Invalid.

    Attributes:
        phase: Failed or Invalid.
        reason: The CamelCase reason of the deciding condition (e.g. BackoffLimitExceeded).
        detail: That condition's message (what happened and how to fix it).
        object: The final typed resource, status included.
    """

    def __init__(
        self, *, phase: str, reason: str, detail: str, object: "Resource | None" = None, **ref: Any
    ) -> None:
        self.phase = phase
        self.reason = reason
        self.detail = detail
        self.object = object
        what = describe(ref.get("kind"), ref.get("namespace"), ref.get("name"))
        super().__init__(f"{what} {phase.lower()}: {reason}: {detail}".rstrip(": "), **ref)


class WaitTimeoutError(GEMError, TimeoutError):
    """`wait` (or `logs` waiting for a pod) ran out of time.

    Attributes:
        object: The last state seen before the timeout, if any.
    """

    def __init__(self, message: str, *, object: "Resource | None" = None, **ref: Any) -> None:
        self.object = object
        super().__init__(message, **ref)


class BackendError(GEMError):
    """The backend failed: API unreachable or refusing, CRDs not installed, local runtime broken.

    Attributes:
        status: The HTTP status of the API's answer, if there was one.
        transient: The API was briefly away (no connection, 429, 5xx): the same call may work later.
    """

    def __init__(self, message: str, *, status: int | None = None, transient: bool = False, **ref: Any) -> None:
        self.status = status
        self.transient = transient
        super().__init__(message, **ref)

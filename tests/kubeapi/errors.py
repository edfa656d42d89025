"""Kubernetes `Status` errors, shaped like the real kube-apiserver's."""

from __future__ import annotations

from typing import Any

REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    406: "NotAcceptable",
    409: "Conflict",
    410: "Expired",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


class ApiError(Exception):
    """An error answered as a `Status` object with an HTTP code."""

    def __init__(
        self,
        code: int,
        message: str,
        reason: str | None = None,
        details: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason or REASONS.get(code, "Unknown")
        self.details = details
        self.metadata = metadata

    def status(self) -> dict[str, Any]:
        return status_body(self.code, self.message, self.reason, self.details, self.metadata)


def status_body(code: int, message: str, reason: str | None = None, details: dict | None = None,
                metadata: dict | None = None) -> dict:
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": dict(metadata or {}),
        "status": "Failure",
        "message": message,
        "reason": reason or REASONS.get(code, "Unknown"),
        "code": code,
    }
    if details is not None:
        body["details"] = details
    return body


def not_found(resource: str, name: str, group: str = "") -> ApiError:
    qual = f"{resource}.{group}" if group else resource
    return ApiError(404, f'{qual} "{name}" not found', "NotFound", {"name": name, "group": group, "kind": resource})


def already_exists(resource: str, name: str, group: str = "") -> ApiError:
    qual = f"{resource}.{group}" if group else resource
    return ApiError(
        409, f'{qual} "{name}" already exists', "AlreadyExists", {"name": name, "group": group, "kind": resource}
    )


def conflict(resource: str, name: str, group: str = "") -> ApiError:
    qual = f"{resource}.{group}" if group else resource
    return ApiError(
        409,
        f'Operation cannot be fulfilled on {qual} "{name}": the object has been modified; '
        "please apply your changes to the latest version and try again",
        "Conflict",
        {"name": name, "group": group, "kind": resource},
    )


def invalid(kind: str, group: str, name: str, causes: list[tuple[str, str, str]]) -> ApiError:
    """422 Invalid. `causes` are (field, reason, message-without-field) triples."""
    qual = f"{kind}.{group}" if group else kind
    rendered = [f"{field}: {msg}" if field else msg for field, _reason, msg in causes]
    joined = rendered[0] if len(rendered) == 1 else "[" + ", ".join(rendered) + "]"
    return ApiError(
        422,
        f'{qual} "{name}" is invalid: {joined}',
        "Invalid",
        {
            "name": name,
            "group": group,
            "kind": kind,
            "causes": [{"reason": r, "message": m, "field": f} for f, r, m in causes],
        },
    )


def precondition_failed(resource: str, group: str, ns: str, name: str, what: str, wanted: str, actual: str) -> ApiError:
    """A failed uid / resourceVersion precondition: storage's InvalidObj error, answered as a 409 Conflict."""
    qual = f"{resource}.{group}" if group else resource
    key = "/registry/" + (f"{group}/" if group else "") + resource + (f"/{ns}" if ns else "") + f"/{name}"
    return ApiError(
        409,
        f'Operation cannot be fulfilled on {qual} "{name}": StorageError: invalid object, Code: 4, Key: {key}, '
        f"ResourceVersion: 0, AdditionalErrorMsg: Precondition failed: {what} in precondition: {wanted}, "
        f"{what} in object meta: {actual}",
        "Conflict",
        {"name": name, "group": group, "kind": resource},
    )

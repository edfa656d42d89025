"""Turn a resource body into its typed model, or into a message a user can act on."""

from __future__ import annotations

from typing import Any

import pydantic

from gem.api.types import KINDS

# The checks themselves live with the API types (torch- and kopf-free), so the SDK's local backend
# refuses the same specs with the same words.
from gem.api.validation import runnable_problems


class InvalidSpec(Exception):
    """The spec cannot run; the message names each field and what to do."""


def _field_path(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts[-1:] = [f"{parts[-1]}[{item}]"] if parts else [f"[{item}]"]
        else:
            parts.append(str(item))
    return ".".join(parts)


def describe_errors(error: pydantic.ValidationError) -> str:
    lines = []
    for err in error.errors():
        path = _field_path(err["loc"]) or "spec"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            msg = "field required: set it"
        elif err["type"] == "extra_forbidden":
            msg = "unknown field: remove it or check its spelling"
        elif "input" in err and err["type"] not in ("value_error",):
            msg = f"{msg} (got {err['input']!r})"
        lines.append(f"{path}: {msg}")
    return "; ".join(lines)


def parse_resource(kind: str, body: dict[str, Any]) -> Any:
    """Validate `body` as `kind`; raise InvalidSpec naming the fields on failure."""
    obj = {
        "apiVersion": body.get("apiVersion"),
        "kind": kind,
        "metadata": dict(body.get("metadata", {})),
        "spec": body.get("spec"),
    }
    if obj["spec"] is None:
        raise InvalidSpec("spec: field required: set it")
    try:
        model = KINDS[kind]["model"].model_validate(obj)
    except pydantic.ValidationError as e:
        # Errors come back with paths from the top of the object: spec.x.y.
        raise InvalidSpec(describe_errors(e)) from None
    problems = runnable_problems(model)
    if problems:
        raise InvalidSpec("; ".join(problems))
    return model

"""Render the CustomResourceDefinitions from the pydantic models.

`make crds` runs `python -m gem.api.crds manifests/crds`; `tests/test_crds.py` fails when the
checked-in YAML drifts from what this module renders.

Pydantic emits JSON Schema 2020-12; Kubernetes wants a *structural* OpenAPI v3.0 subset:
every node typed, no $ref, `nullable` instead of `anyOf [.., null]`, boolean `exclusiveMinimum`,
free-form maps marked `x-kubernetes-preserve-unknown-fields`. No library does this translation
for pydantic v2 (crd generators exist for Go types, not Python), so it is written here.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml

from gem.api.types import GROUP, KINDS, VERSION, JobStatus

_DROP_KEYS = {"title", "$defs", "discriminator"}


def _inline_refs(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        if "$ref" in node:
            target = copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]])
            extra = {k: v for k, v in node.items() if k != "$ref"}
            return _inline_refs({**target, **extra}, defs)
        return {k: _inline_refs(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline_refs(v, defs) for v in node]
    return node


def _structural(node: dict[str, Any]) -> dict[str, Any]:
    """Turn one inlined JSON-Schema node into a structural OpenAPI v3 node."""
    node = {k: v for k, v in node.items() if k not in _DROP_KEYS}

    # Optional[X]: anyOf [X, {type: null}] -> X with nullable.
    if "anyOf" in node:
        options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(f"cannot express a union of {len(options)} types structurally: {options}")
        merged = {**options[0], **node}
        merged["nullable"] = True
        if merged.get("default", "absent") is None:
            merged.pop("default")
        return _structural(merged)

    if node.get("x-kubernetes-int-or-string"):
        node.pop("type", None)  # int-or-string: a structural schema gives it no type
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if isinstance(node.get("exclusiveMinimum"), (int, float)) and not isinstance(node["exclusiveMinimum"], bool):
        node["minimum"] = node.pop("exclusiveMinimum")
        node["exclusiveMinimum"] = True
    if isinstance(node.get("exclusiveMaximum"), (int, float)) and not isinstance(node["exclusiveMaximum"], bool):
        node["maximum"] = node.pop("exclusiveMaximum")
        node["exclusiveMaximum"] = True

    if node.get("type") == "object" or "properties" in node:
        node["type"] = "object"
        props = node.get("properties")
        if props is not None:
            node["properties"] = {k: _structural(v) for k, v in props.items()}
        add = node.get("additionalProperties")
        if add is True or (add is None and props is None and not node.get("x-kubernetes-preserve-unknown-fields")):
            # A free-form map (dict[str, Any]): keep whatever the user wrote.
            node.pop("additionalProperties", None)
            node["x-kubernetes-preserve-unknown-fields"] = True
        elif isinstance(add, dict):
            node["additionalProperties"] = _structural(add)
        elif add is False:
            node.pop("additionalProperties")  # the API server prunes unknown fields anyway
    if node.get("type") == "array" and isinstance(node.get("items"), dict):
        node["items"] = _structural(node["items"])
    return node


def _add_object_defaults(node: dict[str, Any], model_cls: Any) -> None:
    """Give nested objects `default: {}` so the API server defaults their fields too.

    Structural defaulting only descends into objects that exist; a sub-object created by a
    pydantic default_factory has no JSON-Schema default, so an absent `spec.training` would
    otherwise stay absent and its fields undefaulted.
    """
    props = node.get("properties", {})
    for name, field in getattr(model_cls, "model_fields", {}).items():
        key = field.alias or name
        sub = props.get(key)
        annotation = field.annotation
        if sub is None or not isinstance(annotation, type):
            continue
        if hasattr(annotation, "model_fields"):
            if field.default_factory is not None and "default" not in sub:
                sub["default"] = {}
            _add_object_defaults(sub, annotation)


def schema_for(model_cls: Any) -> dict[str, Any]:
    raw = model_cls.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    node = _structural(_inline_refs(raw, defs))
    _add_object_defaults(node, model_cls)
    return node


# What `kubectl explain <kind>` shows for apiVersion and kind (the wording of Kubernetes' own types;
# metadata's description comes from ObjectMeta).
_API_VERSION_DOC = (
    "APIVersion defines the versioned schema of this representation of an object. Servers should convert "
    "recognized schemas to the latest internal value, and may reject unrecognized values."
)
_KIND_DOC = (
    "Kind is a string value representing the REST resource this object represents. Servers may infer this "
    "from the endpoint the client submits requests to. In CamelCase."
)

#: metadata.name as the operator takes it (ObjectMeta's 63 characters, and a letter first: the
#: PyTorchJob's Services are DNS-1035 labels, gem.api.validation): refused at apply, not marked
#: Invalid afterwards.
_NAME_SCHEMA = {"type": "string", "maxLength": 63, "pattern": "^[a-z]([-a-z0-9]*[a-z0-9])?$"}


def _status_schema() -> dict[str, Any]:
    schema = schema_for(JobStatus)
    schema["description"] = "Observed state, written by the operator: phase, conditions, progress, metrics."
    conditions = schema["properties"]["conditions"]
    # One condition per type, merged by type (what `kubectl` and server-side apply expect).
    conditions["x-kubernetes-list-type"] = "map"
    conditions["x-kubernetes-list-map-keys"] = ["type"]
    conditions["items"]["required"] = ["type", "status"]
    return schema


PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "description": "Where the job is in its life."},
    {
        "name": "Progress",
        "type": "integer",
        "jsonPath": ".status.progress.percent",
        "description": "Percent of training steps done.",
    },
    {"name": "NE", "type": "number", "jsonPath": ".status.ne", "description": "Headline normalized entropy."},
    {
        "name": "Job",
        "type": "string",
        "jsonPath": ".status.pytorchJob",
        "priority": 1,
        "description": "The child PyTorchJob.",
    },
    {
        "name": "Message",
        "type": "string",
        "jsonPath": ".status.message",
        "priority": 1,
        "description": "The latest condition's message.",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def render_crd(kind: str) -> dict[str, Any]:
    info = KINDS[kind]
    spec_schema = schema_for(info["spec"])
    spec_schema["description"] = (info["model"].__doc__ or kind).strip()
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{info['plural']}.{GROUP}",
            "labels": {"app.kubernetes.io/part-of": "gem-platform"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": info["plural"],
                "singular": info["singular"],
                "shortNames": info["short_names"],
                "categories": ["gem", "all"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": (info["model"].__doc__ or kind).strip(),
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string", "description": _API_VERSION_DOC},
                                "kind": {"type": "string", "description": _KIND_DOC},
                                # only type and restrictions of name / generateName allowed here: the API
                                # server refuses a CRD whose metadata schema says more, a description too
                                "metadata": {"type": "object", "properties": {"name": _NAME_SCHEMA}},
                                "spec": spec_schema,
                                "status": _status_schema(),
                            },
                        }
                    },
                }
            ],
        },
    }


def crd_file_name(kind: str) -> str:
    return f"{GROUP}_{KINDS[kind]['plural']}.yaml"


def render_all() -> dict[str, str]:
    """File name -> YAML text for every CRD."""
    header = "# Generated by `make crds` from gem/api/types.py. Do not edit by hand.\n"
    return {
        crd_file_name(kind): header + yaml.safe_dump(render_crd(kind), sort_keys=False, width=120)
        for kind in KINDS
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0] if argv else "manifests/crds")
    out.mkdir(parents=True, exist_ok=True)
    for name, text in render_all().items():
        (out / name).write_text(text)
        print(f"wrote {out / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

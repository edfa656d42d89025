"""Structural-schema pruning, defaulting and validation of custom objects.

Follows the order of apiextensions-apiserver: unknown fields are pruned (unless
`x-kubernetes-preserve-unknown-fields`), `null` in non-nullable fields is dropped, defaults
are applied, then the object is validated. Messages copy kube-openapi's wording
(`spec.x in body should be greater than or equal to 1`) so tests and users see what a real
cluster would answer. CEL rules (`x-kubernetes-validations`) are not evaluated.
"""

from __future__ import annotations

import copy
import json
import re
from functools import lru_cache
from typing import Any

import jsonschema

_META_KEYS = ("apiVersion", "kind", "metadata")


def _go_value(v: Any) -> str:
    """Render a value the way Go's %v / field.Invalid renders it."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if v is None:
        return "null"
    return json.dumps(v, separators=(",", ":"))


def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def _type_ok(t: str, v: Any) -> bool:
    if t == "object":
        return isinstance(v, dict)
    if t == "array":
        return isinstance(v, list)
    if t == "string":
        return isinstance(v, str)
    if t == "boolean":
        return isinstance(v, bool)
    if t == "integer":
        return isinstance(v, int) and not isinstance(v, bool)
    if t == "number":
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    return True


@lru_cache(maxsize=4096)
def _regex(pattern: str) -> re.Pattern:
    return re.compile(pattern)


# --------------------------------------------------------------------------- pruning


def prune(obj: Any, schema: dict | None, root: bool = False) -> Any:
    """Drop unknown fields and non-nullable nulls in place; returns obj."""
    if schema is None:
        return obj
    if isinstance(obj, dict):
        props = schema.get("properties")
        preserve = schema.get("x-kubernetes-preserve-unknown-fields", False)
        addl = schema.get("additionalProperties")
        embedded = schema.get("x-kubernetes-embedded-resource", False)
        for key in list(obj):
            val = obj[key]
            if (root or embedded) and key in _META_KEYS:
                continue
            sub = None
            if props is not None and key in props:
                sub = props[key]
            elif isinstance(addl, dict):
                sub = addl
            elif addl is True or preserve:
                continue
            else:
                del obj[key]
                continue
            if val is None and not sub.get("nullable", False):
                del obj[key]
                continue
            prune(val, sub)
    elif isinstance(obj, list):
        items = schema.get("items")
        if isinstance(items, dict):
            for it in obj:
                prune(it, items)
    return obj


def apply_defaults(obj: Any, schema: dict | None) -> Any:
    """Structural defaulting, in place: a missing property with a default gets it."""
    if schema is None:
        return obj
    if isinstance(obj, dict):
        props = schema.get("properties") or {}
        for key, sub in props.items():
            if key not in obj and "default" in sub:
                obj[key] = copy.deepcopy(sub["default"])
            if key in obj:
                apply_defaults(obj[key], sub)
        addl = schema.get("additionalProperties")
        if isinstance(addl, dict):
            for key, val in obj.items():
                if key not in props:
                    apply_defaults(val, addl)
    elif isinstance(obj, list):
        items = schema.get("items")
        if isinstance(items, dict):
            for it in obj:
                apply_defaults(it, items)
    return obj


# --------------------------------------------------------------------------- validation


def validate(obj: Any, schema: dict | None, path: str = "", root: bool = False) -> list[tuple[str, str, str]]:
    """Return (field, reason, message) triples; empty when valid."""
    errs: list[tuple[str, str, str]] = []
    if schema is not None:
        _validate(obj, schema, path, errs, root)
    return errs


def _field(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _validate(v: Any, s: dict, path: str, errs: list, root: bool = False) -> None:
    name = path or "body"
    if v is None:
        if not s.get("nullable", False) and "type" in s:
            errs.append((path, "FieldValueTypeInvalid", f'Invalid value: "null": {name} in body must be of type {s["type"]}: "null"'))
        return
    int_or_string = s.get("x-kubernetes-int-or-string", False)
    t = s.get("type")
    if int_or_string:
        if not (isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool))):
            errs.append((path, "FieldValueTypeInvalid", f'Invalid value: "{_type_name(v)}": {name} in body must be of type int-or-string: "{_type_name(v)}"'))
            return
    elif t and not _type_ok(t, v):
        tn = _type_name(v)
        errs.append((path, "FieldValueTypeInvalid", f'Invalid value: "{tn}": {name} in body must be of type {t}: "{tn}"'))
        return

    if "enum" in s and v not in s["enum"]:
        supported = ", ".join(_go_value(e) for e in s["enum"])
        errs.append((path, "FieldValueNotSupported", f"Unsupported value: {_go_value(v)}: supported values: {supported}"))

    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if "minimum" in s:
            m = s["minimum"]
            if s.get("exclusiveMinimum") is True:
                if not v > m:
                    errs.append((path, "FieldValueInvalid", f"Invalid value: {_go_value(v)}: {name} in body should be greater than {_go_value(m)}"))
            elif v < m:
                errs.append((path, "FieldValueInvalid", f"Invalid value: {_go_value(v)}: {name} in body should be greater than or equal to {_go_value(m)}"))
        if "maximum" in s:
            m = s["maximum"]
            if s.get("exclusiveMaximum") is True:
                if not v < m:
                    errs.append((path, "FieldValueInvalid", f"Invalid value: {_go_value(v)}: {name} in body should be less than {_go_value(m)}"))
            elif v > m:
                errs.append((path, "FieldValueInvalid", f"Invalid value: {_go_value(v)}: {name} in body should be less than or equal to {_go_value(m)}"))
        if "multipleOf" in s and s["multipleOf"]:
            q = v / s["multipleOf"]
            if abs(q - round(q)) > 1e-9:
                errs.append((path, "FieldValueInvalid", f"Invalid value: {_go_value(v)}: {name} in body should be a multiple of {_go_value(s['multipleOf'])}"))

    if isinstance(v, str):
        if "minLength" in s and len(v) < s["minLength"]:
            errs.append((path, "FieldValueInvalid", f"Invalid value: {_go_value(v)}: {name} in body should be at least {s['minLength']} chars long"))
        if "maxLength" in s and len(v) > s["maxLength"]:
            errs.append((path, "FieldValueInvalid", f"Invalid value: {_go_value(v)}: {name} in body should be at most {s['maxLength']} chars long"))
        if "pattern" in s and not _regex(s["pattern"]).search(v):
            errs.append((path, "FieldValueInvalid", f"Invalid value: {_go_value(v)}: {name} in body should match '{s['pattern']}'"))

    if isinstance(v, list):
        if "minItems" in s and len(v) < s["minItems"]:
            errs.append((path, "FieldValueInvalid", f"Invalid value: {len(v)}: {name} in body should have at least {s['minItems']} items"))
        if "maxItems" in s and len(v) > s["maxItems"]:
            errs.append((path, "FieldValueTooMany", f"Too many: {len(v)}: must have at most {s['maxItems']} items"))
        items = s.get("items")
        if isinstance(items, dict):
            for i, it in enumerate(v):
                _validate(it, items, f"{path}[{i}]", errs)

    if isinstance(v, dict):
        for req in s.get("required", ()) or ():
            if req not in v:
                errs.append((_field(path, req), "FieldValueRequired", "Required value"))
        if "minProperties" in s and len(v) < s["minProperties"]:
            errs.append((path, "FieldValueInvalid", f"Invalid value: {len(v)}: {name} in body should have at least {s['minProperties']} properties"))
        if "maxProperties" in s and len(v) > s["maxProperties"]:
            errs.append((path, "FieldValueTooMany", f"Too many: {len(v)}: must have at most {s['maxProperties']} properties"))
        props = s.get("properties") or {}
        addl = s.get("additionalProperties")
        for key, val in v.items():
            if root and key in _META_KEYS:
                continue
            if key in props:
                _validate(val, props[key], _field(path, key), errs)
            elif isinstance(addl, dict):
                _validate(val, addl, _field(path, key), errs)

    # Combinators are rare in CRDs; jsonschema decides them (int-or-string handled above).
    if not int_or_string:
        for comb in ("allOf", "anyOf", "oneOf", "not"):
            if comb in s:
                sub = {comb: s[comb]}
                try:
                    jsonschema.validate(v, sub)
                except jsonschema.ValidationError as e:
                    errs.append((path, "FieldValueInvalid", f"Invalid value: {_go_value(v)}: {name} in body must validate {comb}: {e.message}"))


# --------------------------------------------------------------------------- names


def name_errors(name: str, label: bool = False) -> list[tuple[str, str, str]]:
    """metadata.name as a DNS-1123 subdomain (or label); see validation.name_errors for every kind."""
    from . import validation

    return validation.name_errors("", "namespaces" if label else "configmaps", name)

"""JSON merge patch (RFC 7386), JSON patch (RFC 6902) and a strategic-merge approximation."""

from __future__ import annotations

import copy
from typing import Any

from .errors import ApiError


def merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            result.pop(k, None)
        else:
            result[k] = merge_patch(result.get(k), v)
    return result


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """Merge patch, except lists of objects that all carry `name` merge item by item by name
    (how containers, env, volumes, ports... merge); `$patch: delete` removes an item and
    `$patch: replace` replaces a map."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    result = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if k.startswith("$"):
            continue
        if v is None:
            result.pop(k, None)
            continue
        cur = result.get(k)
        if (
            isinstance(v, list)
            and isinstance(cur, list)
            and v
            and all(isinstance(i, dict) and "name" in i for i in v)
            and all(isinstance(i, dict) and "name" in i for i in cur)
        ):
            merged = [dict(i) for i in cur]
            index = {i["name"]: n for n, i in enumerate(merged)}
            for item in v:
                if item.get("$patch") == "delete":
                    if item["name"] in index:
                        merged[index[item["name"]]] = None  # type: ignore[call-overload]
                    continue
                if item["name"] in index:
                    merged[index[item["name"]]] = strategic_merge_patch(merged[index[item["name"]]], item)
                else:
                    index[item["name"]] = len(merged)
                    merged.append(strategic_merge_patch({}, item))
            result[k] = [i for i in merged if i is not None]
        else:
            result[k] = strategic_merge_patch(cur, v)
    return result


def _decode_pointer(ptr: str) -> list[str]:
    if ptr == "":
        return []
    if not ptr.startswith("/"):
        raise ApiError(422, f"invalid JSON pointer {ptr!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in ptr[1:].split("/")]


def _walk(doc: Any, parts: list[str]) -> Any:
    for p in parts:
        if isinstance(doc, list):
            doc = doc[int(p)]
        elif isinstance(doc, dict):
            doc = doc[p]
        else:
            raise KeyError(p)
    return doc


def json_patch(doc: Any, ops: list[dict]) -> Any:
    doc = copy.deepcopy(doc)
    if not isinstance(ops, list):
        raise ApiError(400, "json patch must be a list of operations")
    for op in ops:
        try:
            kind = op["op"]
            parts = _decode_pointer(op["path"])
            if kind == "test":
                if _walk(doc, parts) != op.get("value"):
                    raise ApiError(422, f"testing value {op['path']} failed")
                continue
            if kind in ("move", "copy"):
                src = _decode_pointer(op["from"])
                value = copy.deepcopy(_walk(doc, src))
                if kind == "move":
                    doc = _remove(doc, src)
                doc = _add(doc, parts, value)
                continue
            if kind == "remove":
                doc = _remove(doc, parts)
            elif kind == "add":
                doc = _add(doc, parts, copy.deepcopy(op.get("value")))
            elif kind == "replace":
                _walk(doc, parts)  # must exist
                doc = _remove(doc, parts)
                doc = _add(doc, parts, copy.deepcopy(op.get("value")))
            else:
                raise ApiError(422, f"unexpected op {kind!r}")
        except ApiError:
            raise
        except (KeyError, IndexError, ValueError, TypeError) as e:
            raise ApiError(422, f"the server rejected our request due to an error in our request: {op!r}: {e}")
    return doc


def _add(doc: Any, parts: list[str], value: Any) -> Any:
    if not parts:
        return value
    parent = _walk(doc, parts[:-1])
    last = parts[-1]
    if isinstance(parent, list):
        if last == "-":
            parent.append(value)
        else:
            i = int(last)
            if i > len(parent):
                raise IndexError(last)
            parent.insert(i, value)
    elif isinstance(parent, dict):
        parent[last] = value
    else:
        raise KeyError(last)
    return doc


def _remove(doc: Any, parts: list[str]) -> Any:
    if not parts:
        return None
    parent = _walk(doc, parts[:-1])
    last = parts[-1]
    if isinstance(parent, list):
        del parent[int(last)]
    else:
        del parent[last]
    return doc

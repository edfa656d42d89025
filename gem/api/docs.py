"""Render docs/api.md (the field reference) from the same schemas as the CRDs.

`make crds` runs it; `tests/test_api.py` fails when the checked-in page drifts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from gem.api.crds import render_crd
from gem.api.types import GROUP, KINDS, VERSION

INTRO = f"""# API reference: GEMTraining and LoopFMDistill

Both resources live in the API group `{GROUP}`, version `{VERSION}`. The pydantic models in
`gem/api/types.py` are the single source of truth: the CRDs in `manifests/crds/` and this page are
generated from them by `make crds` (a test fails when either drifts). `kubectl explain
gemtraining.spec.training` shows the same descriptions. Field names are the camelCase ones below
(`batchSize`, not `batch_size`): the API server drops or refuses a field the CRD does not have, so
`gemctl` and `gem train --config` refuse it too, as an unknown field. `metadata.name` is at most 63
lowercase letters, digits and `-`, starting with a letter and ending with a letter or digit (the
job's Services are named after it); the CRD refuses other names.

Rules the schema cannot express are checked by the operator, which reports them as a `Valid=False`
condition and a Warning Event naming the field: `model.embeddingDim` divisible by `model.numHeads`;
`data.path` required for `data.source: parquet`; no credentials inside `mlflow.trackingUri`, and no MLflow file store there; exactly one
of `teacher.gemTraining`, `teacher.checkpoint`, `teacher.mlflowModelUri`.

While a job exists only `spec.suspend` may change; other changes are rejected with the condition
`SpecChangeAccepted=False` (create a new resource to train with a new spec).
"""


def _type_of(node: dict[str, Any]) -> str:
    if node.get("x-kubernetes-int-or-string"):
        return "int \\| string"
    t = node.get("type", "object")
    if t == "array":
        return f"[]{_type_of(node.get('items', {}))}"
    if t == "object" and isinstance(node.get("additionalProperties"), dict):
        return f"map[string]{_type_of(node['additionalProperties'])}"
    if node.get("enum"):
        return " \\| ".join(f"`{v}`" for v in node["enum"])
    return t


def _bounds(node: dict[str, Any]) -> str:
    parts = []
    if "minimum" in node:
        parts.append(f"{'>' if node.get('exclusiveMinimum') else '>='} {node['minimum']}")
    if "maximum" in node:
        parts.append(f"<= {node['maximum']}")
    if "pattern" in node:
        parts.append(f"pattern `{node['pattern']}`")
    return ", ".join(parts)


def _rows(node: dict[str, Any], path: str, required: set[str]) -> list[str]:
    rows = []
    for key, sub in (node.get("properties") or {}).items():
        here = f"{path}.{key}"
        default = sub.get("default")
        default_text = "" if default in (None, {}) else f"`{json.dumps(default)}`"
        if key in required:
            default_text = "required"
        desc = (sub.get("description") or "").replace("|", "\\|")
        rows.append(f"| `{here}` | {_type_of(sub)} | {default_text} | {_bounds(sub)} | {desc} |")
        inner = sub.get("items") if sub.get("type") == "array" else sub
        if isinstance(inner, dict) and inner.get("properties"):
            rows += _rows(inner, here + ("[]" if sub.get("type") == "array" else ""), set(inner.get("required", [])))
    return rows


def render_page() -> str:
    out = [INTRO]
    for kind in KINDS:
        schema = render_crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        out.append(f"## {kind}\n\n{schema['description']}\n")
        for part in ("spec", "status"):
            node = schema["properties"][part]
            out.append(f"### {kind}.{part}\n")
            out.append("| field | type | default | bounds | description |")
            out.append("|---|---|---|---|---|")
            out += _rows(node, part, set(node.get("required", [])))
            out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path = Path(argv[0] if argv else "docs/api.md")
    path.write_text(render_page())
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

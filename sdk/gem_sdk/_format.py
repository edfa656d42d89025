"""How gemctl shows objects: kubectl-like tables, YAML and JSON. Presentation only."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import yaml
from rich.table import Table

from gem_sdk._types import Resource

__all__ = ["age", "metrics_table", "objects_table", "to_json", "to_yaml"]


def age(timestamp: str | None, now: dt.datetime | None = None) -> str:
    """kubectl's AGE: `42s`, `5m`, `3h`, `2d` (`<unknown>` without a timestamp)."""
    if not timestamp:
        return "<unknown>"
    try:
        created = dt.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)
    except ValueError:
        return "<unknown>"
    seconds = max(0, int(((now or dt.datetime.now(dt.timezone.utc)) - created).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * size or (unit == "m" and seconds >= 120):
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _row(obj: Resource) -> dict[str, str]:
    status = obj.status
    progress = status.progress if status else None
    return {
        "NAMESPACE": obj.metadata.namespace or "",
        "KIND": obj.kind,
        "NAME": obj.metadata.name,
        "PHASE": (status.phase if status and status.phase else "Pending"),
        "PROGRESS": f"{progress.percent}%" if progress and progress.total_steps else "-",
        "NE": f"{status.ne:.4f}" if status and status.ne is not None else "-",
        "AGE": age(obj.metadata.creation_timestamp),
    }


def objects_table(objs: list[Resource], *, show_namespace: bool = False, show_kind: bool = False) -> Table:
    """NAME, PHASE, PROGRESS, NE, AGE (after NAMESPACE and KIND when asked), like kubectl get."""
    columns = ["NAMESPACE"] * show_namespace + ["KIND"] * show_kind + ["NAME", "PHASE", "PROGRESS", "NE", "AGE"]
    table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold", padding=(0, 3, 0, 0))
    for col in columns:
        table.add_column(col, no_wrap=True, justify="right" if col == "NE" else "left")
    for obj in objs:
        row = _row(obj)
        table.add_row(*(row[c] for c in columns))
    return table


def metrics_table(obj: Resource) -> Table | None:
    """Final metrics per task: one column per task (`ne/click` -> row ne, column click), then
    the task-independent ones (`loss`, `ne`) in a last `overall` column."""
    status = obj.status
    if status is None or not status.metrics:
        return None
    cells: dict[tuple[str, str], float] = {}
    metrics: list[str] = []
    tasks: list[str] = []
    for key, value in status.metrics.items():
        metric, _, task = key.partition("/")
        task = task or "overall"
        cells[(metric, task)] = value
        metrics += [metric] if metric not in metrics else []
        tasks += [task] if task not in tasks else []
    tasks.sort(key=lambda t: (t == "overall", t))
    title = f"{obj.kind} {obj.metadata.name}: final metrics"
    if status.ne is not None:
        title += f" (NE {status.ne:.4f}, lower is better)"
    table = Table(title=title, title_justify="left", header_style="bold")
    table.add_column("METRIC")
    for task in tasks:
        table.add_column(task, justify="right")
    for metric in metrics:
        table.add_row(metric, *(_num(cells[(metric, t)]) if (metric, t) in cells else "-" for t in tasks))
    return table


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and abs(value) >= 1 else f"{value:.4f}"


def _ordered(obj: Resource) -> dict[str, Any]:
    """The wire form in kubectl's order: apiVersion, kind, metadata, spec, status."""
    wire = obj.to_wire()
    keys = ["apiVersion", "kind", "metadata", "spec", "status"]
    return {k: wire[k] for k in keys if k in wire} | {k: v for k, v in wire.items() if k not in keys}


def _wire(objs: list[Resource], single: bool) -> dict[str, Any]:
    if single:
        return _ordered(objs[0])
    return {"apiVersion": "v1", "kind": "List", "items": [_ordered(o) for o in objs]}


def to_yaml(objs: list[Resource], *, single: bool) -> str:
    return yaml.safe_dump(_wire(objs, single), sort_keys=False)


def to_json(objs: list[Resource], *, single: bool) -> str:
    return json.dumps(_wire(objs, single), indent=2)

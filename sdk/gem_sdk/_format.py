"""How gemctl shows objects: kubectl-like tables, YAML and JSON. Presentation only."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from typing import Any

import yaml
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn
from rich.table import Table

from gem_sdk._types import MetricPoint, ReplicaPod, Resource

__all__ = [
    "ProgressReporter",
    "age",
    "history_table",
    "history_to_wire",
    "metrics_table",
    "objects_table",
    "pods_table",
    "pods_to_wire",
    "to_json",
    "to_yaml",
]


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


# --------------------------------------------------------------------------- pods


def pods_table(pods: list[ReplicaPod]) -> Table:
    """NAME, REPLICA, INDEX, PHASE, RESTARTS, EXIT, AGE (since the container started)."""
    table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold", padding=(0, 3, 0, 0))
    for col in ("NAME", "REPLICA", "INDEX", "PHASE", "RESTARTS", "EXIT", "AGE"):
        table.add_column(col, no_wrap=True)
    for p in pods:
        started = (p.started_at or "").split(".")[0].rstrip("Z") + "Z" if p.started_at else None
        table.add_row(p.name, p.replica_type, str(p.index), p.phase, str(p.restart_count),
                      "-" if p.exit_code is None else str(p.exit_code), age(started) if started else "-")
    return table


def pods_to_wire(pods: list[ReplicaPod]) -> list[dict[str, Any]]:
    """camelCase dicts, for -o yaml|json."""
    out = []
    for p in pods:
        d = dataclasses.asdict(p)
        out.append({"".join(w.capitalize() if i else w for i, w in enumerate(k.split("_"))): v for k, v in d.items()})
    return out


# --------------------------------------------------------------------------- metric history


def history_table(history: dict[str, list[MetricPoint]], title: str) -> Table:
    """One row per metric: POINTS, LAST STEP, LAST, MIN, MAX."""
    table = Table(title=title, title_justify="left", header_style="bold")
    for col in ("METRIC", "POINTS", "LAST STEP", "LAST", "MIN", "MAX"):
        table.add_column(col, justify="left" if col == "METRIC" else "right")
    for key, points in history.items():
        if not points:
            table.add_row(key, "0", "-", "-", "-", "-")
            continue
        values = [p.value for p in points]
        table.add_row(key, str(len(points)), str(points[-1].step), _num(values[-1]), _num(min(values)), _num(max(values)))
    return table


def history_to_wire(history: dict[str, list[MetricPoint]]) -> dict[str, list[dict[str, Any]]]:
    return {k: [{"step": p.step, "value": p.value, "timestamp": p.timestamp} for p in v] for k, v in history.items()}


# --------------------------------------------------------------------------- progress while waiting


class ProgressReporter:
    """Shows a job's phase and progress while `gemctl` waits: a live bar on a terminal, else one
    line per change (so CI logs show it too). Feed it `update(obj)` (GEMClient.wait's callback)."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.live = console.is_terminal
        self._last: tuple[Any, ...] | None = None
        self._progress: Progress | None = None
        self._task: Any = None

    @staticmethod
    def _describe(obj: Resource) -> tuple[str, int | None, int | None]:
        status = obj.status
        phase = (status.phase if status and status.phase else "Pending")
        progress = status.progress if status else None
        if progress and progress.total_steps:
            return phase, progress.step, progress.total_steps
        return phase, None, None

    def update(self, obj: Resource) -> None:
        phase, step, total = self._describe(obj)
        if (phase, step, total) == self._last:
            return
        self._last = (phase, step, total)
        what = f"{obj.kind.lower()}.gem.dev/{obj.metadata.name}"
        if not self.live:
            done = f" {step}/{total} steps ({int(100 * step / total)}%)" if step is not None and total else ""
            self.console.print(f"{what} {phase}{done}", markup=False, highlight=False)
            return
        if self._progress is None:
            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                                      TextColumn("{task.fields[steps]}"), console=self.console, transient=True)
            self._progress.start()
            self._task = self._progress.add_task(what, total=total or 100, steps="")
        self._progress.update(self._task, description=f"{what} {phase}", total=total or 100,
                              completed=step or 0, steps=f"{step}/{total} steps" if total else "")

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

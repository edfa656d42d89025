"""Prometheus metrics of the operator, served on $GEM_METRICS_PORT at /metrics."""

from __future__ import annotations

import threading

from prometheus_client import REGISTRY, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

RECONCILES = Counter("gem_operator_reconciles_total", "Reconciles of a resource, by kind and result.", ["kind", "result"])
RECONCILE_SECONDS = Histogram(
    "gem_operator_reconcile_duration_seconds",
    "Time one reconcile of a resource took, API calls included, by kind.",
    ["kind"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 7.5, 10, 20, 30, 60),
)
TRANSITIONS = Counter("gem_operator_phase_transitions_total", "Phase changes of resources, by kind and new phase.", ["kind", "phase"])

_phases: dict[str, tuple[str, str]] = {}  # uid -> (kind, phase), fed by watch events
_lock = threading.Lock()


def observe_reconcile(kind: str, result: str, seconds: float) -> None:
    """One reconcile ended with `result` (ok, retry, error) after `seconds`."""
    RECONCILES.labels(kind, result).inc()
    RECONCILE_SECONDS.labels(kind).observe(seconds)


def observe_phase(kind: str, uid: str, phase: str | None) -> None:
    """Record a resource's phase as the watch reports it; None forgets a deleted resource.

    A change from the phase last seen counts one transition: the watch sees each stored change
    once, whichever writer made it and however often a reconcile computed it (retries, the job
    event and the timer at once). The first sighting of a resource is no transition.
    """
    with _lock:
        if phase is None:
            _phases.pop(uid, None)
            return
        last = _phases.get(uid)
        _phases[uid] = (kind, phase)
    if last is not None and last[1] != phase:
        TRANSITIONS.labels(kind, phase).inc()


class _PhaseCollector:
    """`gem_operator_resources{kind,phase}`: resources now in each phase (a gauge computed at scrape)."""

    def collect(self):
        gauge = GaugeMetricFamily("gem_operator_resources", "Resources by kind and phase.", labels=["kind", "phase"])
        counts: dict[tuple[str, str], int] = {}
        with _lock:
            for key in _phases.values():
                counts[key] = counts.get(key, 0) + 1
        for (kind, phase), n in sorted(counts.items()):
            gauge.add_metric([kind, phase], n)
        yield gauge


REGISTRY.register(_PhaseCollector())


_serving = False


def serve(port: int) -> None:
    global _serving
    if port and not _serving:  # once per process, even if the reactor is started again
        start_http_server(port)
        _serving = True

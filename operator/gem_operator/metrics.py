"""Prometheus metrics of the operator, served on $GEM_METRICS_PORT at /metrics."""

from __future__ import annotations

import threading

from prometheus_client import REGISTRY, Counter, start_http_server
from prometheus_client.core import GaugeMetricFamily

RECONCILES = Counter("gem_operator_reconciles_total", "Reconciles of a resource, by kind and result.", ["kind", "result"])
TRANSITIONS = Counter("gem_operator_phase_transitions_total", "Phase changes of resources, by kind and new phase.", ["kind", "phase"])

_phases: dict[str, tuple[str, str]] = {}  # uid -> (kind, phase), fed by watch events
_lock = threading.Lock()


def observe_phase(kind: str, uid: str, phase: str | None) -> None:
    """Record a resource's phase as the watch reports it; None forgets a deleted resource."""
    with _lock:
        if phase is None:
            _phases.pop(uid, None)
        else:
            _phases[uid] = (kind, phase)


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


def serve(port: int) -> None:
    if port:
        start_http_server(port)

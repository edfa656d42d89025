"""Prometheus metrics of the operator, served on $GEM_METRICS_PORT at /metrics."""

from __future__ import annotations

from prometheus_client import Counter, start_http_server

RECONCILES = Counter("gem_operator_reconciles_total", "Reconciles of a resource, by kind and result.", ["kind", "result"])
TRANSITIONS = Counter("gem_operator_phase_transitions_total", "Phase changes of resources, by kind and new phase.", ["kind", "phase"])


def serve(port: int) -> None:
    if port:
        start_http_server(port)

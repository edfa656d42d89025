"""The operator under a hostile API: injected 409/429/500/503, slow and hung requests, and watches
dropped at a high rate. Every resource must still converge, with one PyTorchJob each.

Only the operator's requests go through HTTP (the test and the simulated training operator use
the test server's store directly), so every fault lands on the operator: on kopf's own watches,
lists and patches, and on the operator's reads, creates, status patches and Events.
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.kubeapi import KubeAPIServer
from tests.test_reliability_support import (
    API,
    OneJobGuard,
    OperatorProcess,
    TrainingOperatorSim,
    distill,
    gemtraining,
    wait_converged,
)


@pytest.fixture
def cluster(tmp_path):
    with KubeAPIServer(executor=False, workdir=tmp_path / "kubeapi") as server:
        yield server


def hostile(server) -> None:
    """Faults on roughly a third of the operator's requests, plus dropped watches."""
    f = server.faults
    writes = r"^/(api|apis)/"
    # Requests that never answer: the operator's client and kopf's must time out
    # (GEM_API_TIMEOUT_SECONDS=3) and retry. The first two reads of a job and one of kopf's patches
    # hang for sure; more may later.
    f.add(method="GET", path=r"/pytorchjobs/[^?]+$", hang=True, times=2, watch=False)
    f.add(method="PATCH", path=r"/gemtrainings/", hang=True, times=1)
    # A conflict answers a write that raced another writer, or a create of a taken name (the
    # operator never PUTs: kopf and the operator patch).
    f.add(method="POST", path=writes, status=409, probability=0.1)
    f.add(method="PATCH", path=writes, status=409, probability=0.1)
    f.add(path=writes, status=500, probability=0.08, watch=False)
    f.add(path=writes, status=503, probability=0.08, watch=False)
    f.add(path=writes, status=429, probability=0.03, watch=False)  # with Retry-After: 1
    f.add(path=writes, latency=0.4, probability=0.1, watch=False)
    f.add(path=writes, hang=True, probability=0.01, times=10, watch=False)
    f.add(path=writes, status=500, probability=0.05, watch=True)  # a watch that cannot start
    f.watch_drop_rate = 0.3  # each idle watch is dropped with p=0.3 every second


def test_every_resource_converges_under_injected_api_faults(cluster, tmp_path):
    bodies = [gemtraining("teacher"), distill("student", "teacher")] + [gemtraining(f"gt-{i}") for i in range(6)]
    resources = [(b["kind"], b["metadata"]["name"]) for b in bodies]
    sim = TrainingOperatorSim(cluster, start_s=0.3, run_s=1.5)
    guard = OneJobGuard(cluster)
    op = OperatorProcess(cluster.kubeconfig_path, tmp_path / "operator.log").start()
    stop = threading.Event()

    def drop_all_watches() -> None:  # and, on top of the rate, every watch at once now and then
        while not stop.wait(2.0):
            cluster.faults.drop_watches()

    dropper = threading.Thread(target=drop_all_watches, daemon=True)
    hostile(cluster)
    sim.start()
    guard.start()
    dropper.start()
    try:
        for body in bodies:
            cluster.create(API, body["kind"], body)
            time.sleep(0.3)
        wait_converged(cluster, resources, timeout=120, context="under faults")
        hits = {f"{r.method} {r.path} {r.status or ('hang' if r.hang else 'latency')}{' watch' if r.watch else ''}": r.hits
                for r in cluster.faults.rules if not (r.hang and r.probability < 1)}
        assert op.alive, "the operator process died"
    finally:
        stop.set()
        cluster.faults.clear()
        op.kill()
        sim.stop()
        guard.stop()
    assert not guard.violations, guard.violations[:5]
    assert not sim.errors, sim.errors[:5]
    # The faults really fired, on every kind of rule.
    assert all(n > 0 for n in hits.values()), hits
    assert sorted(j["metadata"]["name"] for j in cluster.list("kubeflow.org/v1", "PyTorchJob")) == sorted(
        f"{n}-train" if k == "GEMTraining" else f"{n}-distill" for k, n in resources
    )

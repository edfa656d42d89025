"""The operator killed (SIGKILL) and restarted at 30 random points in the lives of a few resources.

A simulated training operator (tests/test_reliability_support.py) moves every PyTorchJob through
Created -> Running -> Succeeded on its own clock, whether the gem operator is up or not, so the
kills land before, during and after every step of a resource's life: during start-up and the
initial listing, between creating the ConfigMap and the PyTorchJob, between creating the job and
recording it, while mirroring, while a distillation waits for its teacher. Throughout, a watcher
checks that no resource ever has a second PyTorchJob; at the end every status must be complete
and stay so. The seed is fixed (GEM_RELIABILITY_SEED overrides it) and printed on failure.
"""

from __future__ import annotations

import os
import random
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
    report_for,
    status_of,
    wait_converged,
)

SEED = int(os.environ.get("GEM_RELIABILITY_SEED", "20240611"))
KILLS = 30


@pytest.fixture
def cluster(tmp_path):
    with KubeAPIServer(executor=False, workdir=tmp_path / "kubeapi") as server:
        yield server


def test_operator_killed_at_random_points_never_duplicates_a_job_and_converges(cluster, tmp_path):
    rng = random.Random(SEED)
    # The teacher and its student come first, so the student waits across many restarts.
    plan = [gemtraining("teacher"), distill("student", "teacher")] + [gemtraining(f"gt-{i}") for i in range(7)]
    resources = [(body["kind"], body["metadata"]["name"]) for body in plan]
    sim = TrainingOperatorSim(cluster, start_s=0.3, run_s=3.0)
    guard = OneJobGuard(cluster)
    op = OperatorProcess(cluster.kubeconfig_path, tmp_path / "operator.log")
    sim.start()
    guard.start()
    kill_points = []
    try:
        for i in range(KILLS):
            op.start()
            if i % 3 == 0 and plan:
                cluster.create(API, plan[0]["kind"], plan.pop(0))
            up = rng.uniform(0.2, 3.0)
            time.sleep(up)
            op.kill()
            down = rng.choice([0.0, 0.0, rng.uniform(0.0, 1.5)])  # sometimes jobs move on while it is down
            kill_points.append((round(up, 2), round(down, 2)))
            time.sleep(down)
        assert not plan
        op.start()
        wait_converged(cluster, resources, timeout=90, context=f"(seed {SEED}, kill points {kill_points})")
        # Converged means stable: two more resync periods change nothing.
        before = {n: status_of(cluster, k, n) for k, n in resources}
        time.sleep(2.5)
        assert {n: status_of(cluster, k, n) for k, n in resources} == before
    finally:
        op.kill()
        sim.stop()
        guard.stop()

    assert not guard.violations, (SEED, guard.violations[:5])
    assert not sim.errors, sim.errors[:5]
    jobs = cluster.list("kubeflow.org/v1", "PyTorchJob")
    assert sorted(j["metadata"]["name"] for j in jobs) == sorted(
        f"{n}-train" if k == "GEMTraining" else f"{n}-distill" for k, n in resources
    )
    for kind, name in resources:
        obj = cluster.get(API, kind, name)
        job = next(j for j in jobs if j["metadata"]["labels"]["gem.dev/name"] == name)
        assert job["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
        assert job["metadata"]["labels"]["gem.dev/generation"] == str(obj["metadata"]["generation"])
        assert cluster.get("v1", "ConfigMap", f"{job['metadata']['name']}-config") is not None
        # Each transition is announced once, however often the operator died around it.
        reasons = [e["reason"] for e in cluster.events(involved_name=name)]
        assert reasons.count("JobCreated") == 1 and reasons.count("JobSucceeded") == 1, (name, reasons)
    # The student ran on the checkpoint its teacher reported: the teacher's claim is mounted
    # read-only beside the student's own checkpoint volume (both use the default path).
    student = cluster.get("kubeflow.org/v1", "PyTorchJob", "student-distill")
    pod = student["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert {"name": "teacher", "persistentVolumeClaim": {"claimName": "teacher-ckpt", "readOnly": True}} in pod["volumes"]
    cm = cluster.get("v1", "ConfigMap", "student-distill-config")
    ckpt = report_for("teacher")["checkpoint"].replace("/var/lib/gem/checkpoints", "/var/lib/gem/teacher")
    assert f"checkpoint: {ckpt}" in cm["data"]["config.yaml"]
    assert [c for c in status_of(cluster, "LoopFMDistill", "student")["conditions"] if c["type"] == "TeacherReady"][0]["status"] == "True"
    assert op.starts == KILLS + 1

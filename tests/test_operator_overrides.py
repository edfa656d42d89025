"""spec.training.deepspeed overrides that contradict the spec, refused by the operator (Valid=False and
an Event naming the key, no PyTorchJob) instead of a pod that fails at trainer setup with exit 2.

In-process reconcile against the API test server, as in tests/test_operator_reconcile.py.
"""

from __future__ import annotations

import pytest

from gem.api import render
from gem_operator import kube, reconcile
from tests.test_operator_reconcile import API, JOBS, LOG, cluster, condition, stored  # noqa: F401 (cluster: a fixture)


@pytest.mark.parametrize(("kind", "extra"), [
    ("GEMTraining", {}),
    ("LoopFMDistill", {"teacher": {"checkpoint": "/ckpt/teacher"}}),
])
@pytest.mark.parametrize(("training", "key"), [
    ({"batchSize": 8, "deepspeed": {"gradient_accumulation_steps": 4}}, "gradient_accumulation_steps"),
    ({"batchSize": 8, "deepspeed": {"train_batch_size": 20}}, "train_batch_size"),
    ({"precision": "bf16", "deepspeed": {"bf16": {"enabled": False}}}, "bf16"),
])
def test_a_contradicting_deepspeed_override_is_invalid_and_gets_no_job(cluster, kind, extra, training, key):
    name = f"ds-{kind.lower()}-{key.replace('_', '-')}"[:40].rstrip("-")
    body = stored(cluster, kind, name, training=training, parallelism={"numNodes": 2}, **extra)
    status = reconcile.reconcile(kind, body, LOG)
    assert status["phase"] == "Invalid", status
    valid = condition(status, "Valid")
    assert valid["status"] == "False" and valid["reason"] == "InvalidSpec"
    assert valid["message"].startswith(f"spec.training.deepspeed.{key}: "), valid["message"]
    events = [e for e in cluster.events(involved_name=name) if e["type"] == "Warning"]
    assert any(e["reason"] == "InvalidSpec" and f"spec.training.deepspeed.{key}" in e["message"] for e in events), events
    assert cluster.get(JOBS, "PyTorchJob", render.job_name(kind, name)) is None


def test_fixing_the_override_makes_the_resource_valid_and_creates_its_job(cluster):
    training = {"batchSize": 8, "precision": "bf16",
                "deepspeed": {"train_batch_size": 12, "bf16": {"enabled": True}, "wall_clock_breakdown": True}}
    body = stored(cluster, "GEMTraining", "ds-fixed", parallelism={"numNodes": 2}, training=training)
    status = reconcile.reconcile("GEMTraining", body, LOG)
    assert status["phase"] == "Invalid" and "spec.training.deepspeed.train_batch_size: 12" in status["message"]
    cluster.patch_status(API, "GEMTraining", "ds-fixed", status)
    # the agreeing value (2 ranks x 8) next to the agreeing bf16 section: valid, the job is created
    body = kube.custom().patch_namespaced_custom_object(
        "gem.dev", "v1alpha1", "default", "gemtrainings", "ds-fixed",
        {"spec": {"training": {"deepspeed": {"train_batch_size": 16}}}})
    status = reconcile.reconcile("GEMTraining", body, LOG)
    assert status["phase"] == "Created", status.get("message")
    assert condition(status, "Valid")["status"] == "True"
    assert cluster.get(JOBS, "PyTorchJob", render.job_name("GEMTraining", "ds-fixed")) is not None

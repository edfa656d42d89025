"""Shared pytest fixtures. Keep each section small; add yours in its own section."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:  # `import tests.kubeapi` under plain `pytest` too
    sys.path.insert(0, _ROOT)

# --------------------------------------------------------------------------- xdist
# `make test` runs the suite on two pytest-xdist workers. Each worker (and every process it starts:
# trainers, ranks, the operator) gets its own share of the cores, so that torch, which sizes its
# thread pool from the CPU affinity (gem.train.dist too), never runs two workers' threads on one
# core: oversubscribed OpenMP threads spin, and made some tests ten times slower.


def pytest_configure(config):
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker or count < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= count:
        os.sched_setaffinity(0, cpus[int(worker.removeprefix("gw")) % count::count])


# --------------------------------------------------------------------------- kubeapi
# The Kubernetes API test server (tests/kubeapi, docs/kubeapi.md).


@pytest.fixture
def kubeapi(tmp_path):
    """A fresh API test server with the PyTorchJob executor, the vendored PyTorchJob CRD
    and manifests/crds/*.yaml installed; `kubeapi.kubeconfig_path` points clients at it."""
    from tests.kubeapi import KubeAPIServer

    with KubeAPIServer(executor=True, workdir=tmp_path / "kubeapi", restart_backoff=0.2) as server:
        yield server


# --------------------------------------------------------------------------- trainer
# `gem train` / `gem distill` called in this process (gem.cli.main), as one pod would run it alone.

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "MLFLOW_TRACKING_URI", "GEM_FAULT_AT_STEP", "GEM_REGISTERED_MODEL_NAME")


@pytest.fixture
def trainer_env(tmp_path, monkeypatch):
    """No torchrun / MLflow variables from the caller, the termination message in tmp_path, and
    tmp_path as the working directory (a relative sqlite store, and its artifacts, land there). The
    trainer sets variables of its own (MASTER_PORT, ...), so the whole environment is restored after."""
    saved = dict(os.environ)
    for var in _LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("GEM_TERMINATION_MESSAGE_PATH", str(tmp_path / "termination-log"))
    monkeypatch.chdir(tmp_path)
    yield
    os.environ.clear()
    os.environ.update(saved)

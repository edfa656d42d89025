"""Shared pytest fixtures. Keep each section small; add yours in its own section."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:  # `import tests.kubeapi` under plain `pytest` too
    sys.path.insert(0, _ROOT)

# --------------------------------------------------------------------------- kubeapi
# The Kubernetes API test server (tests/kubeapi, docs/kubeapi.md).


@pytest.fixture
def kubeapi(tmp_path):
    """A fresh API test server with the PyTorchJob executor, the vendored PyTorchJob CRD
    and manifests/crds/*.yaml installed; `kubeapi.kubeconfig_path` points clients at it."""
    from tests.kubeapi import KubeAPIServer

    with KubeAPIServer(executor=True, workdir=tmp_path / "kubeapi", restart_backoff=0.2) as server:
        yield server

"""A Kubernetes API test server for gem-platform's operator and SDK tests.

Real HTTP (aiohttp), an indexed in-memory store, watches, CRDs with structural-schema
validation, garbage collection, fault injection, and an optional PyTorchJob executor that
runs pods as local processes. See docs/kubeapi.md.

    from tests.kubeapi import KubeAPIServer
    with KubeAPIServer(executor=True) as server:
        server.url, server.kubeconfig_path, server.faults, server.get(...), server.list(...)
"""

from .errors import ApiError
from .faults import FaultRule, Faults
from .server import PYTORCHJOB_CRD, KubeAPIServer, default_crd_paths, write_kubeconfig

__all__ = ["ApiError", "FaultRule", "Faults", "KubeAPIServer", "PYTORCHJOB_CRD", "default_crd_paths", "write_kubeconfig"]

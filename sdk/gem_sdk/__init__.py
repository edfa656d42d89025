"""gem_sdk: the Python SDK of gem-platform, and the `gemctl` CLI built on it.

    from gem_sdk import GEMClient, LocalBackendConfig

    client = GEMClient(LocalBackendConfig())          # or GEMClient() for your kubeconfig's cluster
    job = client.submit("examples/quickstart.yaml")
    job = client.wait(job, timeout=600)
    print(job.status.ne, job.status.metrics)

Importing it never imports torch.
"""

from gem.api.types import TERMINAL_PHASES, Condition, GEMTraining, LoopFMDistill, Phase
from gem_sdk._client import GEMClient
from gem_sdk._exceptions import (
    AlreadyExistsError,
    BackendError,
    FieldError,
    GEMError,
    JobFailedError,
    NotFoundError,
    ValidationError,
    WaitTimeoutError,
)
from gem_sdk._types import (
    KubernetesBackendConfig,
    LocalBackendConfig,
    MetricPoint,
    ObjectInput,
    Ref,
    ReplicaPod,
    Resource,
    Until,
    resolve_kind,
)

__version__ = "0.1.0"

__all__ = [
    "TERMINAL_PHASES",
    "AlreadyExistsError",
    "BackendError",
    "Condition",
    "FieldError",
    "GEMClient",
    "GEMError",
    "GEMTraining",
    "JobFailedError",
    "KubernetesBackendConfig",
    "LocalBackendConfig",
    "LoopFMDistill",
    "MetricPoint",
    "NotFoundError",
    "ObjectInput",
    "Phase",
    "Ref",
    "ReplicaPod",
    "Resource",
    "Until",
    "ValidationError",
    "WaitTimeoutError",
    "resolve_kind",
]

"""Run PyTorchJobs as local processes (torch-free).

`gem.launcher.env` computes the environment Kubeflow training-operator v1.9 injects;
`gem.launcher.local` runs pods/jobs as local process groups with kubelet-like mount
emulation. Used by the SDK's local backend and by the test API server's executor.
"""

from .env import container_env, replica_name, training_operator_env
from .local import ContainerState, JobFailure, LocalPod, LocalPyTorchJob, RestartBackOff, backoff_exhausted, free_port

__all__ = [
    "ContainerState",
    "JobFailure",
    "LocalPod",
    "LocalPyTorchJob",
    "RestartBackOff",
    "backoff_exhausted",
    "container_env",
    "free_port",
    "replica_name",
    "training_operator_env",
]

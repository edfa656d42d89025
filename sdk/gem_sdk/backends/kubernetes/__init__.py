"""The Kubernetes backend: custom resources on a cluster where the gem operator runs."""

from gem_sdk.backends.kubernetes.backend import KubernetesBackend

__all__ = ["KubernetesBackend"]

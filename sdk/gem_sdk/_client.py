"""GEMClient: the one entry point of the SDK, a thin facade over a backend."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from gem_sdk._types import (
    TERMINAL_PHASES,
    KubernetesBackendConfig,
    LocalBackendConfig,
    ObjectInput,
    Ref,
    Resource,
)
from gem_sdk.backends.base import Backend

__all__ = ["GEMClient"]


class GEMClient:
    """Submit, inspect, wait for, stream and delete GEMTraining and LoopFMDistill jobs.

    The backend is chosen by the type of `backend_config`:

    * `KubernetesBackendConfig` (the default): custom resources on a cluster running the gem
      operator, through your kubeconfig or the in-cluster service account.
    * `LocalBackendConfig`: the same PyTorchJob run as processes on this machine, no cluster.

    Example:
        >>> client = GEMClient(LocalBackendConfig())
        >>> job = client.submit("examples/quickstart.yaml")
        >>> client.wait(job).status.metrics["ne/click"]

    Args:
        backend_config: Which backend to use and how to reach it.

    Raises:
        ValueError: `backend_config` is not a known backend config.
        BackendError: the backend cannot be set up (e.g. no kubeconfig).
    """

    def __init__(self, backend_config: KubernetesBackendConfig | LocalBackendConfig | None = None) -> None:
        if backend_config is None:
            backend_config = KubernetesBackendConfig()
        self.backend: Backend
        if isinstance(backend_config, KubernetesBackendConfig):
            from gem_sdk.backends.kubernetes import KubernetesBackend

            self.backend = KubernetesBackend(backend_config)
        elif isinstance(backend_config, LocalBackendConfig):
            from gem_sdk.backends.local import LocalBackend

            self.backend = LocalBackend(backend_config)
        else:
            raise ValueError(
                f"backend_config must be a KubernetesBackendConfig or LocalBackendConfig, "
                f"got {type(backend_config).__name__}"
            )

    @property
    def default_namespace(self) -> str:
        """The namespace used when a call names none."""
        return self.backend.default_namespace

    def submit(self, obj: ObjectInput, *, kind: str | None = None, namespace: str | None = None) -> Resource:
        """Validate a job and create it.

        Args:
            obj: A path to a YAML/JSON manifest, a YAML string, a dict, or a typed
                `GEMTraining`/`LoopFMDistill`. Status and server-owned metadata are ignored.
            kind: Kind to submit as when the manifest has no `kind` (any spelling, e.g. `gt`).
                Default: the object's kind.
            namespace: Namespace to create it in. Default: the object's, else the backend's.

        Returns:
            The created object as stored (uid, creationTimestamp, defaults filled in).

        Raises:
            ValidationError: the spec is invalid, before anything is sent or as answered by the
                API server; each error names the field path (camelCase) and the fix.
            AlreadyExistsError: a job of that kind and name exists in the namespace.
            NotFoundError: (local backend) a LoopFMDistill's teacher GEMTraining does not exist.
            BackendError: the API or the local runtime failed.
        """
        return self.backend.submit(obj, kind=kind, namespace=namespace)

    def get(self, name: Ref, *, kind: str | None = None, namespace: str | None = None) -> Resource:
        """Read a job with its current status.

        Args:
            name: The job's name, or a typed object (its kind and namespace become the defaults).
            kind: Any spelling of GEMTraining or LoopFMDistill. Default: the object's kind, else
                GEMTraining.
            namespace: Default: the object's, else the backend's.

        Returns:
            The typed object; `.status` has phase, conditions, progress, metrics, ne, ...

        Raises:
            NotFoundError: no such job.
            BackendError: the API or the local runtime failed.
        """
        return self.backend.get(name, kind=kind, namespace=namespace)

    def list(
        self,
        *,
        kind: str | None = None,
        namespace: str | None = None,
        label_selector: str | None = None,
        all_namespaces: bool = False,
    ) -> list[Resource]:
        """List jobs.

        Args:
            kind: One kind (any spelling). Default: both kinds.
            namespace: Default: the backend's.
            label_selector: A Kubernetes label selector, e.g. `team=ads,tier in (a,b),!canary`.
            all_namespaces: List across every namespace (ignores `namespace`).

        Returns:
            Typed objects sorted by namespace, kind and name.

        Raises:
            ValidationError: the kind or label selector is invalid.
            BackendError: the API or the local runtime failed.
        """
        return self.backend.list(
            kind=kind, namespace=namespace, label_selector=label_selector, all_namespaces=all_namespaces
        )

    def wait(
        self,
        name: Ref,
        *,
        kind: str | None = None,
        namespace: str | None = None,
        timeout: float | None = None,
        until: Iterable[str] = TERMINAL_PHASES,
    ) -> Resource:
        """Block until the job reaches a phase in `until`, or any terminal phase.

        On Kubernetes this is a watch on the one object (resumed from its resourceVersion and
        re-listed after 410 Gone or a dropped connection), not a polling loop.

        Args:
            name: The job's name, or a typed object (e.g. what `submit` returned).
            kind: Default: the object's kind, else GEMTraining.
            namespace: Default: the object's, else the backend's.
            timeout: Seconds to wait at most. Default: forever.
            until: Phases that end the wait (names or `Phase` values). Default: Succeeded,
                Failed, Invalid. A terminal phase always ends it.

        Returns:
            The typed object in its final state.

        Raises:
            JobFailedError: the job reached Failed or Invalid; carries `.reason`, `.detail`
                (from its conditions) and `.object`.
            WaitTimeoutError: `timeout` passed first (also a `TimeoutError`); `.object` is the
                last state seen.
            NotFoundError: no such job, or it was deleted while waiting.
            BackendError: the API or the local runtime failed.
        """
        return self.backend.wait(name, kind=kind, namespace=namespace, timeout=timeout, until=until)

    def logs(
        self,
        name: Ref,
        *,
        kind: str | None = None,
        namespace: str | None = None,
        replica: str = "master",
        index: int = 0,
        follow: bool = False,
        timeout: float | None = None,
    ) -> Iterator[str]:
        """Stream the log of one trainer pod, waiting for the pod to start first.

        Pods are `<job>-master-0` and `<job>-worker-<index>`, where `<job>` is the PyTorchJob
        the resource runs as (`gem.api.render.job_name`).

        Args:
            name: The job's name, or a typed object.
            kind: Default: the object's kind, else GEMTraining.
            namespace: Default: the object's, else the backend's.
            replica: `master` or `worker`.
            index: Replica index (0 for the master; 0..numNodes-2 for workers).
            follow: Keep streaming until the pod's container exits.
            timeout: Seconds to wait at most for the pod to start. Default: forever (but a job
                that ended without the pod raises NotFoundError).

        Returns:
            An iterator of log lines, without their newlines.

        Raises:
            NotFoundError: no such job, or it ended without that pod.
            ValidationError: bad replica or index.
            WaitTimeoutError: the pod did not start within `timeout`.
            BackendError: the API or the local runtime failed.
        """
        return self.backend.logs(
            name, kind=kind, namespace=namespace, replica=replica, index=index, follow=follow, timeout=timeout
        )

    def delete(self, name: Ref, *, kind: str | None = None, namespace: str | None = None) -> None:
        """Delete a job; its PyTorchJob, pods (or local processes) and config go with it.

        Args:
            name: The job's name, or a typed object.
            kind: Default: the object's kind, else GEMTraining.
            namespace: Default: the object's, else the backend's.

        Raises:
            NotFoundError: no such job.
            BackendError: the API or the local runtime failed.
        """
        return self.backend.delete(name, kind=kind, namespace=namespace)

"""The contract every backend implements; GEMClient delegates each method to it unchanged.

`tests/test_sdk_client.py` checks that both implementations keep these exact signatures.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from gem_sdk._types import TERMINAL_PHASES, MetricPoint, ObjectInput, Ref, ReplicaPod, Resource, Until

#: How long a wait (`wait`, `delete(wait=True)`) rides out an API server that is away (a
#: control-plane restart) before its error goes out.
OUTAGE_S = 300.0


class Backend(abc.ABC):
    """Where jobs run. See GEMClient for the meaning of each method and argument."""

    #: The namespace used when a call names none.
    default_namespace: str

    @abc.abstractmethod
    def submit(self, obj: ObjectInput, *, kind: str | None = None, namespace: str | None = None) -> Resource:
        """Validate and create the resource; return it as stored."""

    @abc.abstractmethod
    def get(self, name: Ref, *, kind: str | None = None, namespace: str | None = None) -> Resource:
        """The resource with its current status."""

    @abc.abstractmethod
    def list(
        self,
        *,
        kind: str | None = None,
        namespace: str | None = None,
        label_selector: str | None = None,
        all_namespaces: bool = False,
    ) -> list[Resource]:
        """Resources of one kind (or both), sorted by namespace and name."""

    @abc.abstractmethod
    def wait(
        self,
        name: Ref,
        *,
        kind: str | None = None,
        namespace: str | None = None,
        timeout: float | None = None,
        until: Until = TERMINAL_PHASES,
        callback: Callable[[Resource], None] | None = None,
    ) -> Resource:
        """Block until a phase in `until` (or any terminal phase); raise on Failed/Invalid."""

    @abc.abstractmethod
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
        """Lines of one trainer pod's log, once the pod exists."""

    @abc.abstractmethod
    def _previous_log(
        self,
        name: Ref,
        *,
        kind: str | None = None,
        namespace: str | None = None,
        replica: str = "master",
        index: int = 0,
    ) -> Iterator[str]:
        """Lines of the replica's last terminated container's log, as `kubectl logs --previous` reads
        it: in CrashLoopBackOff the one that just exited, otherwise the one before the current.
        What `GEMClient.logs(previous=True)` reads."""

    @abc.abstractmethod
    def _container_log(
        self,
        name: Ref,
        *,
        kind: str | None = None,
        namespace: str | None = None,
        replica: str = "master",
        index: int = 0,
        after: Any = None,
        timeout: float | None = None,
    ) -> tuple[Any, ReplicaPod, Iterator[str]] | None:
        """The followed log of the replica's container once one other than `after` (a key this returned
        before; None: any) has started, as (its key, the pod, its lines); None when no other will come.
        What `GEMClient.follow` is built on."""

    @abc.abstractmethod
    def update(
        self,
        name: Ref,
        *,
        kind: str | None = None,
        namespace: str | None = None,
        suspend: bool | None = None,
        labels: Mapping[str, str | None] | None = None,
        annotations: Mapping[str, str | None] | None = None,
    ) -> Resource:
        """Change what may change while a job exists: spec.suspend, labels, annotations."""

    @abc.abstractmethod
    def pods(
        self,
        name: Ref,
        *,
        kind: str | None = None,
        namespace: str | None = None,
        replica: str | None = None,
        index: int | None = None,
    ) -> list[ReplicaPod]:
        """The job's pods that exist now (master first, then workers by index)."""

    @abc.abstractmethod
    def metrics(
        self,
        name: Ref,
        *,
        kind: str | None = None,
        namespace: str | None = None,
        keys: Iterable[str] | None = None,
    ) -> dict[str, list[MetricPoint]]:
        """The history of each metric of the job's MLflow run, ordered by step."""

    @abc.abstractmethod
    def delete(self, name: Ref, *, kind: str | None = None, namespace: str | None = None) -> None:
        """Delete the resource and everything it runs."""

"""The contract every backend implements; GEMClient delegates each method to it unchanged.

`tests/test_sdk_client.py` checks that both implementations keep these exact signatures.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator

from gem_sdk._types import TERMINAL_PHASES, ObjectInput, Ref, Resource


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
        until: Iterable[str] = TERMINAL_PHASES,
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
    def delete(self, name: Ref, *, kind: str | None = None, namespace: str | None = None) -> None:
        """Delete the resource and everything it runs."""

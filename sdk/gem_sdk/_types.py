"""Input type aliases, kind names and the backend configurations."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field

from gem.api.types import KINDS, TERMINAL_PHASES, GEMTraining, LoopFMDistill, Phase

__all__ = [
    "FAILED_PHASES",
    "KIND_ALIASES",
    "TERMINAL_PHASES",
    "KubernetesBackendConfig",
    "LocalBackendConfig",
    "MetricPoint",
    "ObjectInput",
    "Ref",
    "ReplicaPod",
    "Resource",
    "Until",
    "resolve_kind",
]

#: A typed GEMTraining or LoopFMDistill (what every method returns).
Resource = Union[GEMTraining, LoopFMDistill]
#: What `submit` accepts: a path to a YAML/JSON file, a YAML string, a dict or a typed object.
ObjectInput = Union[str, "os.PathLike[str]", dict[str, Any], GEMTraining, LoopFMDistill]
#: What `get`/`wait`/`logs`/`delete` accept: a name, or a typed object (its kind and namespace
#: then default from it, so `client.wait(client.submit(obj))` works).
Ref = Union[str, GEMTraining, LoopFMDistill]

#: What `wait` waits for: phases (names or `Phase` values), or a predicate on the object.
Until = Union[Iterable[str], str, Callable[[Union[GEMTraining, LoopFMDistill]], bool]]

#: Phases in which a job has failed; `wait` raises JobFailedError when it sees one.
FAILED_PHASES = frozenset({Phase.failed.value, Phase.invalid.value})

#: Every spelling of a kind the SDK and gemctl accept (lowercase), to the canonical kind.
KIND_ALIASES: dict[str, str] = {
    alias: kind
    for kind, info in KINDS.items()
    for alias in (kind.lower(), info["plural"], info["singular"], *info["short_names"])
}


def resolve_kind(kind: str) -> str:
    """The canonical kind (GEMTraining or LoopFMDistill) of any accepted spelling.

    Args:
        kind: e.g. `GEMTraining`, `gemtrainings`, `gt`, `lfd`, `loopfmdistill.gem.dev`.

    Returns:
        `GEMTraining` or `LoopFMDistill`.

    Raises:
        ValidationError: the kind is not one of ours.
    """
    from gem_sdk._exceptions import ValidationError

    key = kind.strip().lower().removesuffix(".gem.dev")
    if key in KIND_ALIASES:
        return KIND_ALIASES[key]
    accepted = "|".join(sorted(KIND_ALIASES))
    raise ValidationError(f"unknown kind {kind!r}: use one of {accepted}")


@dataclass(frozen=True)
class ReplicaPod:
    """One pod of a job's gang, as `GEMClient.pods` reports it.

    Attributes:
        name: The pod's name, e.g. `quick-train-master-0`, `quick-train-worker-1`.
        replica_type: `master` or `worker`.
        index: The replica index (0 for the master; 0..numNodes-2 for workers).
        phase: The pod's phase: Pending, Running, Succeeded, Failed (Unknown if not reported).
        restart_count: Restarts of its `pytorch` container.
        started_at: When the container last started (RFC 3339), if it did.
        exit_code: The container's exit code once it terminated.
        message: The termination message (the trainer's report or error), if any.
    """

    name: str
    replica_type: str
    index: int
    phase: str
    restart_count: int = 0
    started_at: str | None = None
    exit_code: int | None = None
    message: str | None = None


@dataclass(frozen=True, order=True)
class MetricPoint:
    """One logged value of a metric: what `GEMClient.metrics` returns per key, ordered by step.

    Attributes:
        step: The training step it was logged at.
        value: The value.
        timestamp: When it was logged (milliseconds since the epoch).
    """

    step: int
    value: float
    timestamp: int


def default_local_root() -> Path:
    """`$GEM_HOME`, else `~/.gem`."""
    return Path(os.environ.get("GEM_HOME") or Path.home() / ".gem")


class KubernetesBackendConfig(BaseModel):
    """Run jobs on a Kubernetes cluster where the gem operator is installed.

    Attributes:
        kubeconfig: Path of a kubeconfig file. Default: `$KUBECONFIG` or `~/.kube/config`, or the
            in-cluster service account when running in a pod without a kubeconfig.
        context: kubeconfig context to use (default: its current context).
        namespace: Default namespace (default: the context's namespace, the pod's namespace
            in-cluster, else `default`).
        mlflow_tracking_uri: Where `metrics` reads MLflow from this machine (the cluster's
            in-cluster address may not be reachable from here). Default: the job's
            `spec.mlflow.trackingUri`, else `$MLFLOW_TRACKING_URI`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kubeconfig: str | None = None
    context: str | None = None
    namespace: str | None = None
    mlflow_tracking_uri: str | None = None


class LocalBackendConfig(BaseModel):
    """Run jobs as processes on this machine, no cluster needed.

    Attributes:
        root: Directory holding every local job's state (default: `$GEM_HOME` or `~/.gem`).
            Every process using the same root sees the same jobs.
        namespace: Default namespace (default: `default`).
        mlflow_tracking_uri: Where jobs log to MLflow and `metrics` reads from. Default: the
            job's `spec.mlflow.trackingUri`, else `$MLFLOW_TRACKING_URI`, else the sqlite store
            `<root>/mlflow.db`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    root: Path = Field(default_factory=default_local_root)
    namespace: str = "default"
    mlflow_tracking_uri: str | None = None

    def __init__(self, root: str | os.PathLike[str] | None = None, **data: Any) -> None:
        if root is not None:
            data["root"] = Path(root).expanduser()
        super().__init__(**data)

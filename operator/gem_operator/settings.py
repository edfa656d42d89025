"""Operator configuration: from the environment (the Helm chart sets it) and the command line."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class OperatorConfig:
    #: MLflow tracking URI given to trainer pods unless a spec overrides it. Never credentials.
    mlflow_tracking_uri: str | None = None
    #: Base URL of the MLflow UI, used for run links when it differs from the tracking URI.
    mlflow_ui_url: str | None = None
    #: How often (seconds) each resource is re-synced from its PyTorchJob as a safety net.
    resync_seconds: float = 30.0
    #: How often (seconds) a LoopFMDistill re-checks a teacher that is not ready yet.
    teacher_poll_seconds: float = 5.0
    namespaces: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def from_env(cls) -> "OperatorConfig":
        return cls(
            mlflow_tracking_uri=os.environ.get("GEM_MLFLOW_TRACKING_URI") or None,
            mlflow_ui_url=os.environ.get("GEM_MLFLOW_UI_URL") or None,
            resync_seconds=float(os.environ.get("GEM_RESYNC_SECONDS", "30")),
            teacher_poll_seconds=float(os.environ.get("GEM_TEACHER_POLL_SECONDS", "5")),
        )


CONFIG = OperatorConfig.from_env()

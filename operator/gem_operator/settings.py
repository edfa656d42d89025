"""Operator configuration: from the environment (the Helm chart sets it) and the command line."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from gem.api import render
from gem.api.types import DEFAULT_TRAINER_IMAGE


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
    #: Trainer image for specs that name none.
    trainer_image: str | None = None
    #: Secret with MLflow credentials for specs that name none (a name only: never read).
    mlflow_credentials_secret: str | None = None
    #: Kueue LocalQueue every PyTorchJob is labelled for (none: Kueue not used).
    kueue_queue_name: str | None = None
    kueue_queue_label: str = "kueue.x-k8s.io/queue-name"
    #: Seconds a replica's peering record lives without a heartbeat (how fast a standby takes over).
    peering_lifetime: int = 60
    #: Port of the Prometheus /metrics endpoint (0: off).
    metrics_port: int = 0
    #: Seconds any single API request may take (kopf's and the operator's own) before it is
    #: abandoned and retried: a hung connection never blocks a handler thread for good.
    api_timeout_seconds: float = 30.0
    #: Longest delay (seconds) between retries of a reconcile that hit a transient API error;
    #: retries start at 1 s and double up to this.
    retry_max_seconds: float = 30.0
    #: Serve the readiness probe here (e.g. http://0.0.0.0:8081/readyz); None: no readiness endpoint.
    readiness_url: str | None = None
    namespaces: tuple[str, ...] = field(default_factory=tuple)

    def platform_defaults(self) -> render.PlatformDefaults:
        return render.PlatformDefaults(
            trainer_image=self.trainer_image or DEFAULT_TRAINER_IMAGE,
            mlflow_credentials_secret=self.mlflow_credentials_secret,
            queue_name=self.kueue_queue_name,
            queue_label=self.kueue_queue_label,
        )

    @classmethod
    def from_env(cls) -> "OperatorConfig":
        return cls(
            mlflow_tracking_uri=os.environ.get("GEM_MLFLOW_TRACKING_URI") or None,
            mlflow_ui_url=os.environ.get("GEM_MLFLOW_UI_URL") or None,
            resync_seconds=float(os.environ.get("GEM_RESYNC_SECONDS", "30")),
            teacher_poll_seconds=float(os.environ.get("GEM_TEACHER_POLL_SECONDS", "5")),
            trainer_image=os.environ.get("GEM_TRAINER_IMAGE") or None,
            mlflow_credentials_secret=os.environ.get("GEM_MLFLOW_CREDENTIALS_SECRET") or None,
            kueue_queue_name=os.environ.get("GEM_KUEUE_QUEUE_NAME") or None,
            kueue_queue_label=os.environ.get("GEM_KUEUE_QUEUE_LABEL") or "kueue.x-k8s.io/queue-name",
            metrics_port=int(os.environ.get("GEM_METRICS_PORT") or 0),
            peering_lifetime=int(os.environ.get("GEM_PEERING_LIFETIME") or 60),
            api_timeout_seconds=float(os.environ.get("GEM_API_TIMEOUT_SECONDS") or 30),
            retry_max_seconds=float(os.environ.get("GEM_RETRY_MAX_SECONDS") or 30),
            readiness_url=os.environ.get("GEM_READINESS_URL") or None,
            namespaces=tuple(n for n in (os.environ.get("GEM_WATCH_NAMESPACES") or "").split(",") if n),
        )


CONFIG = OperatorConfig.from_env()

"""Operator configuration: from the environment (the Helm chart sets it) and the command line."""

from __future__ import annotations

import os
import re
import urllib.parse
from dataclasses import dataclass, field

from gem.api import render
from gem.api.types import DEFAULT_TRAINER_IMAGE


class SettingsError(ValueError):
    """A GEM_* variable holds a value the operator cannot use; the message names it and the fix."""


def _number(name: str, default: float, minimum: float, cast: type = float) -> float:
    """$name as a number >= minimum (unset or empty: default), or SettingsError naming it.

    A resync of 0 s would spin the timer against the API server and a negative one is meaningless:
    refused at start rather than taken as given or silently defaulted.
    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    noun = "a whole number" if cast is int else "a number"
    try:
        value = cast(raw)
    except ValueError:
        value = None
    if value is None or value != value or value in (float("inf"), float("-inf")) or value < minimum:
        raise SettingsError(f"{name}={raw!r}: must be {noun} >= {minimum:g} (unset: {default:g})")
    return value


#: A namespace name (RFC 1123 label), as the API server requires it.
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def parse_namespaces(values: list[str] | str, source: str) -> tuple[str, ...]:
    """Namespaces from repeated values and/or comma-separated lists, or SettingsError naming `source`."""
    names = [n.strip() for v in ([values] if isinstance(values, str) else values) for n in v.split(",")]
    bad = [n for n in names if n and not _NAMESPACE.fullmatch(n)]
    if bad:
        raise SettingsError(
            f"{source}: {', '.join(repr(n) for n in bad)} is not a namespace name "
            "(lowercase letters, digits and '-', at most 63 characters; separate several with commas)"
        )
    return tuple(dict.fromkeys(n for n in names if n))


def probe_url(url: str | None, source: str, example: str) -> str | None:
    """A probe's URL as served: http://HOST:PORT/PATH, or SettingsError naming `source`.

    Without the scheme (`0.0.0.0:8081/readyz`) kopf's liveness server crashed the operator with a
    traceback, and the readiness server failed the startup handler, retried every minute: the
    operator never started and never said why.
    """
    if not url:
        return None
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "http" or not parts.hostname or not port:
        raise SettingsError(f"{source}={url!r}: must be http://HOST:PORT/PATH, e.g. {example}")
    return url


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
    #: Secrets (in each job's namespace) the kubelet pulls the trainer image with.
    trainer_image_pull_secrets: tuple[str, ...] = ()
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
    #: Seconds each of the readiness probe's API checks may take.
    readiness_timeout_seconds: float = 3.0
    #: Serve the readiness probe here (e.g. http://0.0.0.0:8081/readyz); None: no readiness endpoint.
    readiness_url: str | None = None
    namespaces: tuple[str, ...] = field(default_factory=tuple)

    def platform_defaults(self) -> render.PlatformDefaults:
        return render.PlatformDefaults(
            trainer_image=self.trainer_image or DEFAULT_TRAINER_IMAGE,
            image_pull_secrets=self.trainer_image_pull_secrets,
            mlflow_credentials_secret=self.mlflow_credentials_secret,
            queue_name=self.kueue_queue_name,
            queue_label=self.kueue_queue_label,
        )

    @classmethod
    def from_env(cls) -> "OperatorConfig":
        """The configuration from GEM_* variables; SettingsError names a variable whose value is unusable."""
        return cls(
            mlflow_tracking_uri=os.environ.get("GEM_MLFLOW_TRACKING_URI") or None,
            mlflow_ui_url=os.environ.get("GEM_MLFLOW_UI_URL") or None,
            resync_seconds=_number("GEM_RESYNC_SECONDS", 30, minimum=1),
            teacher_poll_seconds=_number("GEM_TEACHER_POLL_SECONDS", 5, minimum=0.1),
            trainer_image=os.environ.get("GEM_TRAINER_IMAGE") or None,
            trainer_image_pull_secrets=_secret_names("GEM_TRAINER_IMAGE_PULL_SECRETS"),
            mlflow_credentials_secret=os.environ.get("GEM_MLFLOW_CREDENTIALS_SECRET") or None,
            kueue_queue_name=os.environ.get("GEM_KUEUE_QUEUE_NAME") or None,
            kueue_queue_label=os.environ.get("GEM_KUEUE_QUEUE_LABEL") or "kueue.x-k8s.io/queue-name",
            metrics_port=_port("GEM_METRICS_PORT"),
            peering_lifetime=_number("GEM_PEERING_LIFETIME", 60, minimum=1, cast=int),
            api_timeout_seconds=_number("GEM_API_TIMEOUT_SECONDS", 30, minimum=1),
            retry_max_seconds=_number("GEM_RETRY_MAX_SECONDS", 30, minimum=1),
            readiness_timeout_seconds=_number("GEM_READINESS_TIMEOUT_SECONDS", 3, minimum=0.1),
            readiness_url=probe_url(
                os.environ.get("GEM_READINESS_URL"), "--readiness / GEM_READINESS_URL", "http://0.0.0.0:8081/readyz"
            ),
            namespaces=parse_namespaces(os.environ.get("GEM_WATCH_NAMESPACES") or "", "--namespace / GEM_WATCH_NAMESPACES"),
        )


def _secret_names(name: str) -> tuple[str, ...]:
    """A comma-separated list of Secret names (empty: none)."""
    from gem.api.validation import subdomain_problem

    raw = os.environ.get(name) or ""
    names = tuple(n.strip() for n in raw.split(",") if n.strip())
    for n in names:
        problem = subdomain_problem(n)
        if problem:
            raise SettingsError(f"{name}={raw!r}: {problem}")
    return names


def _port(name: str) -> int:
    port = _number(name, 0, minimum=0, cast=int)
    if port > 65535:
        raise SettingsError(f"{name}='{port}': must be a TCP port, 1 to 65535 (0: off)")
    return int(port)


try:
    CONFIG = OperatorConfig.from_env()
except SettingsError as e:  # at start, before kopf: one line naming the variable, not a traceback
    raise SystemExit(f"gem-operator: {e}") from None

"""Metric history from MLflow, shared by both backends. mlflow is imported only when used."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gem_sdk._exceptions import BackendError, NotFoundError, ValidationError, describe
from gem_sdk._types import MetricPoint, Resource

__all__ = ["metric_history"]


def _client(tracking_uri: str) -> Any:
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise BackendError(
            "reading metrics needs the mlflow package: pip install mlflow (or 'gem-platform[train]')"
        ) from None
    return MlflowClient(tracking_uri)


def _run_id(client: Any, obj: Resource) -> str | None:
    """The job's run: status.mlflow.runId once the trainer reported it, else the run the trainer
    tagged with the job's uid (it does so when it starts, see gem/train/tracking.py)."""
    if obj.status and obj.status.mlflow and obj.status.mlflow.run_id:
        return obj.status.mlflow.run_id
    if not obj.metadata.uid:
        return None
    experiment = client.get_experiment_by_name(obj.spec.mlflow.experiment)
    if experiment is None:
        return None
    runs = client.search_runs([experiment.experiment_id], filter_string=f"tags.`gem.dev/uid` = '{obj.metadata.uid}'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0].info.run_id if runs else None


def metric_history(obj: Resource, tracking_uri: str | None, keys: Iterable[str] | None, *,
                   hint: str = "") -> dict[str, list[MetricPoint]]:
    """{metric key: its points ordered by step} of the job's MLflow run (every key when `keys` is None).

    `hint` is added to the message when MLflow cannot be read (where else to look).

    Raises:
        ValidationError: MLflow logging is off for the job, or no tracking URI is known.
        NotFoundError: the job has no MLflow run yet, or the run has none of `keys`.
        BackendError: mlflow is not installed, or the tracking server failed.
    """
    what = describe(obj.kind, obj.metadata.namespace, obj.metadata.name)
    ref = {"kind": obj.kind, "namespace": obj.metadata.namespace, "name": obj.metadata.name}
    if not obj.spec.mlflow.enabled:
        raise ValidationError(f"{what} does not log to MLflow (spec.mlflow.enabled is false)", **ref)
    if not tracking_uri:
        raise ValidationError(
            f"no MLflow tracking URI for {what}: pass mlflow_tracking_uri in the backend config "
            "(gemctl: --mlflow-tracking-uri) or set MLFLOW_TRACKING_URI", **ref,
        )
    client = _client(tracking_uri)
    try:
        run_id = _run_id(client, obj)
        if run_id is None:
            raise NotFoundError(f"{what} has no MLflow run yet at {tracking_uri} (the trainer starts one when it "
                                "starts training)", **ref)
        wanted = list(keys) if keys is not None else sorted(client.get_run(run_id).data.metrics)
        out = {}
        for key in wanted:
            points = client.get_metric_history(run_id, key)
            out[key] = sorted(MetricPoint(int(p.step), float(p.value), int(p.timestamp)) for p in points)
    except NotFoundError:
        raise
    except Exception as e:  # mlflow's own errors and the transport's: nothing of theirs leaks
        raise BackendError(f"cannot read the metrics of {what} from MLflow at {tracking_uri}: {e}{hint}", **ref) from None
    missing = [k for k, v in out.items() if not v]
    if keys is not None and missing and len(missing) == len(out):
        raise NotFoundError(f"the MLflow run {run_id} of {what} has no metric {', '.join(missing)}", **ref)
    return out

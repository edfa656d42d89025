"""MLflow logging, on global rank 0 only.

- Tracking URI: spec.mlflow.trackingUri, else $MLFLOW_TRACKING_URI (credentials, e.g.
  MLFLOW_TRACKING_TOKEN / MLFLOW_TRACKING_USERNAME, come only from the environment). A file store
  is refused before training (a SpecError: exit 2): our metric names do not fit in one.
- One run per training from step 0: tagged gem.dev/{name,namespace,uid,kind}. A job resumed from
  a checkpoint continues the run that checkpoint recorded (trainer_state.json's mlflowRunId);
  a fresh start always creates a new run, even if an earlier run carries the same uid tag (as does a
  resume whose run is missing from the store or deleted).
- Tracking URIs are logged and reported without credentials (user:pass@ is stripped).
- A SQLite store is opened under a file lock (open_client): concurrent first opens corrupt it.
- Params: the resolved spec, flattened (`training.learningRate`, ...), logged once.
- Metrics: per-step loss and lr (buffered, written in batches and at each checkpoint step), eval metrics.
- Artifacts: the resolved manifest (gem.yaml) and the final checkpoint's model.pt + gem.yaml
  under checkpoint/; the eval report (eval/eval_report.json, .png).
- Model registry: the final checkpoint registered as a new version of a registered model
  (register_model), once per run.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import yaml

from gem.api.types import is_file_store
from gem.eval.evaluate import FUNNEL

log = logging.getLogger("gem.train")

FLUSH_EVERY = 20  # buffered step metrics are written in one log_batch call this often
_NOT_IN_MLFLOW_NAMES = re.compile(r"[^\w./\- :]")


def mlflow_metric_name(key: str) -> str:
    """Our metric keys in MLflow's alphabet: `ne/click@feed` -> `ne/click/feed`, `a=b` -> `a_b`.

    MLflow names allow only letters, digits, _ - . / space and colon; the status and JSON reports
    keep the original keys. A source named like a task has its headline keys (`ne@click`, `loss@click`)
    as `ne/source_click`, ...: `ne/click` is that task's NE.
    """
    base, at, source = key.partition("@")
    if at and "/" not in base and source in FUNNEL:
        source = f"source_{source}"
    return _NOT_IN_MLFLOW_NAMES.sub("_", f"{base}/{source}" if at else key)


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = str(value)[:6000]  # MLflow's param value limit
    return out


def redact_uri(uri: str) -> str:
    """The URI without user:password@ (safe to log and to put in reports)."""
    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


def tracking_uri_of(spec: Any) -> tuple[str, str]:
    """(URI, where it came from): spec.mlflow.trackingUri, else $MLFLOW_TRACKING_URI, else MLflow's default."""
    if spec.tracking_uri:
        return spec.tracking_uri, "spec.mlflow.trackingUri"
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"], "$MLFLOW_TRACKING_URI"
    import mlflow

    return mlflow.get_tracking_uri(), "MLflow's default tracking URI (spec.mlflow.trackingUri and $MLFLOW_TRACKING_URI unset)"


def check_tracking_uri(spec: Any) -> None:
    """Refuse a file store before the run trains: it keeps every metric in a file named after it, so
    `ne` (the headline) and `ne/click` (a directory `ne/`) cannot both be logged there (MLflow 3 also
    refuses file stores unless MLFLOW_ALLOW_FILE_STORE is set)."""
    from gem.data.errors import SpecError

    uri, source = tracking_uri_of(spec)
    if not is_file_store(uri):
        return
    parts = urlsplit(uri)
    directory = os.path.abspath(parts.path if parts.scheme == "file" else uri)
    raise SpecError(f"{source}: {redact_uri(uri)} is an MLflow file store, which cannot hold this trainer's "
                    "metrics (ne and ne/click would be a file and a directory of the same name): use a database "
                    f"store, e.g. sqlite:///{directory}/mlflow.db on the same volume, or an MLflow server "
                    "(http://...); or set spec.mlflow.enabled: false")


def artifact_location_for(uri: str) -> str | None:
    """Where a new experiment keeps its artifacts: beside a sqlite store's database (`<dir>/mlartifacts`,
    like `mlflow server`'s default), None (the store's own default) for every other store.

    MLflow's default for a database store is `./mlruns` of the process that creates the experiment: a
    trainer's working directory, which is the pod's sandbox locally (deleted with the job) and the
    container's filesystem on a cluster. Every later run of the experiment would put its checkpoints and
    registered model versions there, and lose them with that first job.
    """
    if not uri.startswith("sqlite:///"):
        return None
    database = uri.removeprefix("sqlite:///").split("?", 1)[0]
    if not database or database == ":memory:":
        return None
    return (Path(database).resolve().parent / "mlartifacts").as_uri()


def job_uid(manifest: Any) -> str:
    """The object's uid; local runs (no uid) get a stable stand-in from namespace and name."""
    meta = manifest.metadata
    return meta.uid or f"local-{meta.namespace or 'local'}-{meta.name}"


def registered_model_name(manifest: Any) -> str:
    """spec.mlflow.registeredModelName, else the experiment for a GEMTraining and metadata.name for a
    LoopFMDistill: a student sharing its teacher's experiment must not become the newest version of
    the teacher's registered model (models:/<name>/latest, which a later distillation would refuse)."""
    mlflow_spec = manifest.spec.mlflow
    if mlflow_spec.registered_model_name:
        return mlflow_spec.registered_model_name
    return mlflow_spec.experiment if manifest.kind == "GEMTraining" else manifest.metadata.name


def open_client(client_cls: Any, tracking_uri: str) -> Any:
    """An MLflow client of `tracking_uri`. Opening a SQLite store creates its tables and runs its
    alembic migrations; two jobs doing that at once on a fresh file (local jobs submitted together
    on a new GEM_HOME) fail ("table ... already exists"), and can leave a half-migrated store that
    no later job opens. So SQLite stores are opened under an exclusive lock on `<file>.lock`."""
    database = _sqlite_file(tracking_uri)
    if database is None:
        return client_cls(tracking_uri)
    import fcntl  # SQLite stores are local files, and this lock is the machine's

    Path(database).parent.mkdir(parents=True, exist_ok=True)
    with open(f"{database}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return client_cls(tracking_uri)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _sqlite_file(tracking_uri: str) -> str | None:
    """The database file of a `sqlite:` URI; None for other stores and in-memory SQLite."""
    if not tracking_uri.startswith("sqlite:"):
        return None
    from sqlalchemy.engine import make_url

    database = make_url(tracking_uri).database
    return database if database and database != ":memory:" else None


class Tracker:
    """No-op unless enabled; call every method on all ranks, it only acts on rank 0."""

    def __init__(self, manifest: Any, *, active: bool):
        self.manifest = manifest
        self.active = active and manifest.spec.mlflow.enabled
        if manifest.spec.mlflow.enabled:  # on every rank: all of them stop before the (slow) setup
            check_tracking_uri(manifest.spec.mlflow)
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.tracking_uri: str | None = None
        self._buffer: list[Any] = []
        self._client: Any = None
        self._checkpoint: str | None = None  # the step directory log_checkpoint logged (step-NNNNNNNN)

    # ------------------------------------------------------------------ lifecycle

    def start(self, resume_run_id: str | None = None) -> None:
        """Continue run `resume_run_id` (the resumed checkpoint's), else create a new run."""
        if not self.active:
            return
        import mlflow
        from mlflow.tracking import MlflowClient

        spec = self.manifest.spec.mlflow
        self.tracking_uri, _ = tracking_uri_of(spec)
        mlflow.set_tracking_uri(self.tracking_uri)
        self._client = open_client(MlflowClient, self.tracking_uri)
        self.experiment_id = self._experiment_id(spec.experiment)
        if resume_run_id and self._continue(resume_run_id):
            return
        self._create_run()

    def _experiment_id(self, name: str) -> str:
        """The experiment's id, created if missing (by another job at the same moment, too)."""
        from mlflow.exceptions import MlflowException

        experiment = self._client.get_experiment_by_name(name)
        if experiment is not None and experiment.lifecycle_stage != "active":
            # its name stays taken until it is purged, and no run can be created or continued in it
            from gem.data.errors import SpecError

            eid = experiment.experiment_id
            raise SpecError(f"spec.mlflow.experiment: the experiment {name!r} was deleted in MLflow "
                            f"({redact_uri(self.tracking_uri)}): restore it (mlflow experiments restore "
                            f"--experiment-id {eid}), delete it for good (mlflow gc --experiment-ids {eid}), "
                            "or set another spec.mlflow.experiment")
        if experiment is not None:
            return experiment.experiment_id
        try:
            return self._client.create_experiment(name, artifact_location=artifact_location_for(self.tracking_uri))
        except MlflowException:  # created by a job that started at the same time
            experiment = self._client.get_experiment_by_name(name)
            if experiment is None:
                raise
            return experiment.experiment_id

    def _continue(self, run_id: str) -> bool:
        """Reopen the resumed checkpoint's run; False (a new run follows) if this store does not have it."""
        from mlflow.exceptions import MlflowException

        try:
            run = self._client.get_run(run_id)
        except MlflowException as e:
            if e.error_code != "RESOURCE_DOES_NOT_EXIST":  # a store that failed to answer: retry on restart,
                raise  # not a new run holding the rest of this one's steps
            log.warning("mlflow: run %s of the checkpoint is not in %s (%s): starting a new run",
                        run_id, redact_uri(self.tracking_uri), e.error_code)
            return False
        if run.info.lifecycle_stage != "active":  # deleted (in the UI): get_run has it, logging to it fails
            log.warning("mlflow: run %s of the checkpoint was deleted from %s: starting a new run",
                        run_id, redact_uri(self.tracking_uri))
            return False
        self.run_id, self.experiment_id = run_id, run.info.experiment_id
        self._client.update_run(self.run_id, status="RUNNING")
        log.info("mlflow: continuing run %s (experiment %s)", self.run_id, self.experiment_id)
        return True

    def _create_run(self) -> None:
        uid = job_uid(self.manifest)
        meta = self.manifest.metadata
        tags = {"gem.dev/name": meta.name, "gem.dev/namespace": meta.namespace or "local", "gem.dev/uid": uid,
                "gem.dev/kind": self.manifest.kind}
        run = self._client.create_run(self.experiment_id, run_name=meta.name, tags=tags)
        self.run_id = run.info.run_id
        from mlflow.entities import Param

        params = flatten(self.manifest.spec.to_wire())
        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow accepts 100 params per batch
            self._client.log_batch(self.run_id, params=items[i : i + 100])
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "gem.yaml"
            path.write_text(yaml.safe_dump(self.manifest.to_wire(), sort_keys=False))
            self._client.log_artifact(self.run_id, str(path))
        log.info("mlflow: started run %s (experiment %s) at %s", self.run_id, self.experiment_id,
                 redact_uri(self.tracking_uri))

    def end(self, status: str = "FINISHED") -> None:
        if self.active and self.run_id:
            self.flush()
            self._client.set_terminated(self.run_id, status=status)

    # ------------------------------------------------------------------ logging

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        if not self.active:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._buffer.extend(Metric(mlflow_metric_name(k), float(v), now, step) for k, v in metrics.items())
        if len(self._buffer) >= FLUSH_EVERY * len(metrics) or self._checkpointed(step):
            self.flush()

    def _checkpointed(self, step: int) -> bool:
        """Whether the trainer saves a checkpoint right after logging `step` (every checkpoint.everySteps
        and the last step, before the final evaluation): a job killed after it (SIGKILL, a preempted
        pod's SIGTERM) resumes after it, so the steps up to it must be in MLflow by then."""
        spec = self.manifest.spec
        return step % spec.checkpoint.every_steps == 0 or step == spec.training.steps

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.log_step(step, {k: v for k, v in metrics.items() if v == v})  # NaN is not loggable
        self.flush()

    def flush(self) -> None:
        if self.active and self._buffer:
            for i in range(0, len(self._buffer), 1000):  # MLflow accepts 1000 metrics per batch
                self._client.log_batch(self.run_id, metrics=self._buffer[i : i + 1000])
            self._buffer = []

    def log_checkpoint(self, ckpt: Path) -> None:
        """The final checkpoint's consumer-facing files (model.pt, gem.yaml) under checkpoint/."""
        if not self.active:
            return
        for name in ("model.pt", "gem.yaml"):
            self._client.log_artifact(self.run_id, str(ckpt / name), artifact_path="checkpoint")
        self._checkpoint = ckpt.name

    def log_artifacts(self, paths: list[Path], artifact_path: str) -> None:
        if self.active:
            for path in paths:
                self._client.log_artifact(self.run_id, str(path), artifact_path=artifact_path)

    def register_model(self) -> str | None:
        """Register runs:/<run>/checkpoint in the model registry; returns "name/version" or None.

        spec.mlflow.registerModel turns it off; the name is `registered_model_name`. Stores without a
        registry only warn.
        """
        mlflow_spec = self.manifest.spec.mlflow
        if not self.active or not self.run_id or not mlflow_spec.register_model:
            return None
        name = registered_model_name(self.manifest)
        try:
            from mlflow.exceptions import MlflowException

            try:
                self._client.create_registered_model(name)
            except MlflowException as e:
                if "RESOURCE_ALREADY_EXISTS" not in str(e.error_code):
                    raise
            source = f"{self._client.get_run(self.run_id).info.artifact_uri.rstrip('/')}/checkpoint"
            registered = self._registered_version(name, source)
            if registered is not None:
                return registered
            mv = self._client.create_model_version(name, source=source, run_id=self.run_id,
                                                   tags={"gem.dev/uid": job_uid(self.manifest),
                                                         "gem.dev/kind": self.manifest.kind,
                                                         "gem.dev/checkpoint": self._checkpoint or ""})
            self._client.set_tag(self.run_id, "gem.dev/registeredModel", f"{name}/{mv.version}")
            log.info("mlflow: registered model %s version %s (%s)", name, mv.version, source)
            return f"{name}/{mv.version}"
        except Exception as e:  # registry is optional: a finished run must not fail here
            log.warning("mlflow: model not registered as %r: %s: %s", name, type(e).__name__, e)
            return None

    def _registered_version(self, name: str, source: str) -> str | None:
        """"name/version" if this run's checkpoint is a version of `name` already: a job killed after it
        registered resumes at its last step and finishes again, which must not add a second version
        (one trained further, to a later step, is a new version)."""
        if not self._checkpoint:
            return None
        try:
            versions = self._client.search_model_versions(f"run_id='{self.run_id}'")
        except Exception as e:  # a registry that cannot search by run: register as before
            log.warning("mlflow: cannot look up the versions of run %s: %s", self.run_id, e)
            return None
        for mv in versions:
            if mv.name == name and mv.source == source and mv.tags.get("gem.dev/checkpoint") == self._checkpoint:
                log.info("mlflow: run %s is registered as %s version %s already", self.run_id, name, mv.version)
                return f"{name}/{mv.version}"
        return None

    # ------------------------------------------------------------------ report fields

    @property
    def run_url(self) -> str | None:
        uri = redact_uri(self.tracking_uri or "")
        if self.run_id and uri.startswith(("http://", "https://")):
            return f"{uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id}"
        return None

"""MLflow tracking (gem/train/tracking.py): which tracking stores a run can log to."""

from __future__ import annotations

import json

import pytest
import yaml

from gem import cli
from gem.train import checkpoint

pytestmark = pytest.mark.usefixtures("trainer_env")  # tests/conftest.py


def manifest(tmp_path, mlflow):
    obj = {"apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": "fs"},
           "spec": {"model": {"preset": "tiny"},
                    "data": {"synthetic": {"numUsers": 50, "numAds": 20, "numTrainExamples": 256,
                                           "numEvalExamples": 64, "meanHistoryLen": 4}},
                    "training": {"steps": 2, "batchSize": 8, "warmupSteps": 0},
                    "checkpoint": {"path": str(tmp_path / "ckpt"), "everySteps": 2},
                    "mlflow": {"enabled": True, "experiment": "fs", **mlflow}}}
    path = tmp_path / "fs.yaml"
    path.write_text(yaml.safe_dump(obj))
    return path


@pytest.mark.parametrize("allow", [None, "true"])
def test_a_file_store_from_the_environment_is_refused_before_training(tmp_path, capsys, monkeypatch, allow):
    """A file store keeps each metric in a file named after it: `ne` (the headline) and `ne/click`
    cannot both exist, so logging the eval metrics failed after the whole run had trained (or, on
    MLflow 3 without MLFLOW_ALLOW_FILE_STORE, at the start with MLflow's traceback): exit 2 at once,
    naming where the URI came from and a store that works."""
    if allow:
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", allow)
    store = tmp_path / "mlruns"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", str(store))  # a plain directory is a file store too
    path = manifest(tmp_path, {})
    assert cli.main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "$MLFLOW_TRACKING_URI" in err and f"sqlite:///{store}/mlflow.db" in err and "Traceback" not in err
    assert "$MLFLOW_TRACKING_URI" in json.loads((tmp_path / "termination-log").read_text())["error"]
    assert checkpoint.latest_complete(tmp_path / "ckpt/local/fs") is None  # nothing was trained


@pytest.mark.parametrize("uri", ["file:///mnt/mlruns", "/mnt/mlruns"])
def test_a_file_store_in_the_spec_is_invalid(tmp_path, capsys, uri):
    """The API refuses it (the operator reports Valid=False, gemctl exit 2) before any pod runs."""
    from pydantic import ValidationError

    from gem.api.types import GEMTraining

    path = manifest(tmp_path, {"trackingUri": uri})
    with pytest.raises(ValidationError, match="mlflow.trackingUri .* file store"):
        GEMTraining.model_validate(yaml.safe_load(path.read_text()))
    assert cli.main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "mlflow.trackingUri" in err and "sqlite:///" in err and "Traceback" not in err
    assert not (tmp_path / "ckpt").exists()


def test_which_uris_are_file_stores():
    from gem.api.types import is_file_store

    for uri in ("file:///mnt/mlruns", "/mnt/mlruns", "mlruns", "./mlruns", "file:mlruns"):
        assert is_file_store(uri), uri
    for uri in ("sqlite:///mlflow.db", "postgresql://db/mlflow", "http://mlflow:5000", "https://mlflow.example.com",
                "databricks", "databricks://profile", "databricks-uc"):
        assert not is_file_store(uri), uri


def test_experiments_keep_artifacts_beside_a_sqlite_store(tmp_path, monkeypatch):
    """MLflow's default artifact root for a database store is ./mlruns of the process that creates the
    experiment: the first job's pod sandbox locally, so deleting that job lost every later run's
    checkpoints and registered model versions. New experiments now put them beside the database."""
    from mlflow.tracking import MlflowClient

    from gem.api import parse_object
    from gem.train.tracking import Tracker, artifact_location_for

    (tmp_path / "sandbox").mkdir()
    monkeypatch.chdir(tmp_path / "sandbox")  # where the trainer runs
    uri = f"sqlite:///{tmp_path}/db/mlflow.db"
    (tmp_path / "db").mkdir()
    obj = parse_object({"apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": "x"},
                        "spec": {"mlflow": {"trackingUri": uri, "experiment": "beside"}}})
    t = Tracker(obj, active=True)
    t.start()
    t.log_artifacts([_file(tmp_path / "sandbox" / "note.txt")], "notes")
    t.end()
    location = MlflowClient(uri).get_experiment(t.experiment_id).artifact_location
    assert location == (tmp_path / "db" / "mlartifacts").as_uri()
    assert list((tmp_path / "db" / "mlartifacts").rglob("note.txt"))
    assert not (tmp_path / "sandbox" / "mlruns").exists()
    # a second Tracker (another job) finds the experiment; other stores keep their own default
    t2 = Tracker(obj, active=True)
    t2.start()
    t2.end()
    assert t2.experiment_id == t.experiment_id
    assert artifact_location_for("http://mlflow:5000") is None
    assert artifact_location_for("sqlite:///rel/mlflow.db") == (tmp_path / "sandbox" / "rel" / "mlartifacts").as_uri()


def _file(path):
    path.write_text("x")
    return path


def test_a_sqlite_store_is_opened_under_a_lock(tmp_path):
    """Opening a SQLite store creates its tables and migrates them: two jobs doing it at once on a
    fresh file failed with 'table ... already exists', or left a half-migrated store no job opened."""
    import fcntl

    from gem.train.tracking import open_client

    db = tmp_path / "sub" / "mlflow.db"
    held = []

    def client(uri):  # opening the store: another process' flock on the lock file must block
        with open(f"{db}.lock") as other:
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held.append(False)
            except BlockingIOError:
                held.append(True)
        return uri

    assert open_client(client, f"sqlite:///{db}") == f"sqlite:///{db}" and held == [True]
    assert open_client(lambda uri: uri, "sqlite://") == "sqlite://"  # in memory: nothing to lock
    assert open_client(lambda uri: uri, "http://mlflow:5000") == "http://mlflow:5000"


def test_jobs_opening_a_fresh_sqlite_store_at_once_all_succeed(tmp_path):
    import subprocess
    import sys
    import time

    db = tmp_path / "mlflow.db"
    script = ("import sys, time\nfrom mlflow.tracking import MlflowClient\nfrom gem.train.tracking import open_client\n"
              "start = float(sys.argv[1])\nwhile time.time() < start: time.sleep(0.001)\n"
              f"c = open_client(MlflowClient, 'sqlite:///{db}')\nprint(c.get_experiment_by_name('Default').name)\n")
    start = time.time() + 10  # every process has imported mlflow by then
    procs = [subprocess.Popen([sys.executable, "-c", script, str(start)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err[-600:] for _, err in results]
    assert [out.strip() for out, _ in results] == ["Default"] * 3


def _tracked(uri, *, every_steps=100, steps=1000, register=False):
    from gem.api import parse_object

    return parse_object({"apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": "t"},
                         "spec": {"checkpoint": {"everySteps": every_steps}, "training": {"steps": steps},
                                  "mlflow": {"trackingUri": uri, "experiment": "t", "registerModel": register}}})


def test_steps_up_to_a_checkpoint_are_in_mlflow_when_the_job_is_killed(tmp_path):
    """Step metrics were written every 20 steps only: a job killed (SIGKILL, or Kubernetes' SIGTERM,
    which the trainer does not catch) after its step-30 checkpoint had steps 21-30 in its buffer, and
    the resumed job trains from step 31, so MLflow never had them. A checkpoint step flushes now."""
    from mlflow.tracking import MlflowClient

    from gem.train.tracking import Tracker

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    t = Tracker(_tracked(uri, every_steps=30), active=True)
    t.start()
    for step in range(1, 36):  # the trainer saves step 30's checkpoint; killed at step 35
        t.log_step(step, {"train/loss": 1.0 / step, "train/lr": 0.1})
    resumed = Tracker(_tracked(uri, every_steps=30), active=True)  # the killed one never flushed again
    resumed.start(resume_run_id=t.run_id)
    for step in range(31, 41):
        resumed.log_step(step, {"train/loss": 1.0 / step, "train/lr": 0.1})
    resumed.end()
    steps = sorted({m.step for m in MlflowClient(uri).get_metric_history(t.run_id, "train/loss")})
    assert steps == list(range(1, 41))


def test_every_step_is_in_mlflow_when_the_job_is_killed_in_its_final_evaluation(tmp_path):
    """The last step is checkpointed before the final evaluation (minutes on a large eval split): a job
    preempted there resumes at the last step and trains nothing, so its buffered steps were lost."""
    from mlflow.tracking import MlflowClient

    from gem.train.tracking import Tracker

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    t = Tracker(_tracked(uri, every_steps=30, steps=45), active=True)
    t.start()
    for step in range(1, 46):
        t.log_step(step, {"train/loss": 1.0 / step, "train/lr": 0.1})
    # killed in the final evaluation; the resumed job evaluates step 45's checkpoint and ends
    resumed = Tracker(_tracked(uri, every_steps=30, steps=45), active=True)
    resumed.start(resume_run_id=t.run_id)
    resumed.log_metrics(45, {"ne": 0.9})
    resumed.end()
    steps = sorted({m.step for m in MlflowClient(uri).get_metric_history(t.run_id, "train/loss")})
    assert steps == list(range(1, 46))


def test_a_resumed_job_whose_run_was_deleted_starts_a_new_run(tmp_path, caplog):
    """A run deleted in the UI (lifecycle stage `deleted`) is still returned by get_run, and reopening
    it failed ('must be in the active state'): every restart of the job failed the same way (exit 1)."""
    from mlflow.tracking import MlflowClient

    from gem.train.tracking import Tracker

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    t = Tracker(_tracked(uri), active=True)
    t.start()
    t.log_step(1, {"train/loss": 1.0})
    t.end("FAILED")
    client = MlflowClient(uri)
    client.delete_run(t.run_id)
    resumed = Tracker(_tracked(uri), active=True)
    resumed.start(resume_run_id=t.run_id)
    resumed.log_metrics(2, {"ne": 0.9})
    resumed.end()
    assert resumed.run_id != t.run_id and f"run {t.run_id} of the checkpoint was deleted" in caplog.text
    run = client.get_run(resumed.run_id)
    assert run.info.status == "FINISHED" and run.data.metrics["ne"] == 0.9
    assert client.get_run(t.run_id).info.lifecycle_stage == "deleted"


def test_registering_the_same_run_again_reuses_its_version(tmp_path):
    """A job killed after it registered its final checkpoint (while it wrote its report or exited)
    resumes at the last step and finishes again: that registered a second version of the same
    checkpoint, which became models:/<name>/latest. The run's version is returned again now."""
    from mlflow.tracking import MlflowClient

    from gem.train.tracking import Tracker

    def step(n):
        ckpt = tmp_path / f"step-{n:08d}"
        ckpt.mkdir(exist_ok=True)
        _file(ckpt / "model.pt"), _file(ckpt / "gem.yaml")
        return ckpt

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    t = Tracker(_tracked(uri, register=True), active=True)
    t.start()
    t.log_checkpoint(step(100))
    assert t.register_model() == "t/1"
    t.end()
    other = Tracker(_tracked(uri, register=True), active=True)  # another run of the same model
    other.start()
    other.log_checkpoint(step(100))
    assert other.register_model() == "t/2"
    other.end()
    again = Tracker(_tracked(uri, register=True), active=True)  # the first job, killed after registering
    again.start(resume_run_id=t.run_id)
    again.log_checkpoint(step(100))
    assert again.register_model() == "t/1"
    again.end()
    further = Tracker(_tracked(uri, register=True), active=True)  # training.steps raised: a new model
    further.start(resume_run_id=t.run_id)
    further.log_checkpoint(step(200))
    assert further.register_model() == "t/3"
    further.end()
    versions = MlflowClient(uri).search_model_versions("name='t'")
    assert sorted(int(v.version) for v in versions) == [1, 2, 3]


def test_a_source_named_like_a_task_keeps_its_own_mlflow_metric(tmp_path):
    """`ne@<source>` is logged as `ne/<source>`: a source named `click` (a valid source name) logged its
    headline NE as `ne/click`, the click NE of the evaluated sources, two values at the same step."""
    import numpy as np
    from mlflow.tracking import MlflowClient

    from gem.eval.evaluate import evaluate_sources
    from gem.train.tracking import Tracker, mlflow_metric_name

    rng = np.random.default_rng(0)

    def predictions(n):
        cols = {t: (rng.random(n) < 0.4).astype(np.float32) for t in ("click", "conversion", "dwell")}
        cols.update({f"pred_{t}": rng.random(n).astype(np.float32) for t in ("click", "conversion", "dwell")})
        cols.update({f"p_{t}": rng.random(n) for t in ("click", "conversion", "dwell")})
        return cols | {"surface": rng.integers(0, 4, n), "objective": rng.integers(0, 2, n)}

    ev = evaluate_sources({"click": [predictions(200)], "web": [predictions(300)]}, ["click", "web"],
                          by_surface=True)
    keys = {**ev.metrics, **ev.surface_metrics}
    names = [mlflow_metric_name(k) for k in keys]
    assert len(set(names)) == len(names)
    assert mlflow_metric_name("ne@web") == "ne/web" and mlflow_metric_name("ne/click@click") == "ne/click/click"
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    t = Tracker(_tracked(uri), active=True)
    t.start()
    t.log_metrics(10, keys)
    t.end()
    client = MlflowClient(uri)
    assert [m.value for m in client.get_metric_history(t.run_id, "ne/click")] == [pytest.approx(keys["ne/click"])]
    assert client.get_run(t.run_id).data.metrics[mlflow_metric_name("ne@click")] == pytest.approx(keys["ne@click"])


def test_an_experiment_deleted_in_mlflow_is_a_config_error(tmp_path, capsys):
    """A deleted experiment keeps its name (until purged), and creating a run in it failed with
    MLflow's 'must be in the active state' (exit 1, every job of the experiment, every restart):
    exit 2 now, naming spec.mlflow.experiment and how to restore or purge it."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    experiment = client.create_experiment("fs")
    client.delete_experiment(experiment)
    path = manifest(tmp_path, {"trackingUri": uri})
    assert cli.main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "spec.mlflow.experiment" in err and f"mlflow experiments restore --experiment-id {experiment}" in err
    assert "Traceback" not in err


def test_a_store_that_fails_to_answer_does_not_fork_the_resumed_run(tmp_path, monkeypatch):
    """Any MLflow error reading the checkpoint's run (a server answering 503 after MLflow's retries)
    was taken for 'not in this store': the resumed job logged the rest of its steps to a new run,
    and the run it belongs to stayed cut short. Only a run the store does not have starts a new one."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import TEMPORARILY_UNAVAILABLE
    from mlflow.tracking import MlflowClient

    from gem.train.tracking import Tracker

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    t = Tracker(_tracked(uri), active=True)
    t.start()
    t.end("FAILED")

    def unavailable(self, run_id):
        raise MlflowException("the server is restarting", error_code=TEMPORARILY_UNAVAILABLE)

    with monkeypatch.context() as m:
        m.setattr(MlflowClient, "get_run", unavailable)
        with pytest.raises(MlflowException, match="restarting"):  # the job fails; its restart resumes again
            Tracker(_tracked(uri), active=True).start(resume_run_id=t.run_id)
    assert len(MlflowClient(uri).search_runs([t.experiment_id])) == 1
    missing = Tracker(_tracked(uri), active=True)  # a run this store does not have: a new run, as before
    missing.start(resume_run_id="0123456789abcdef0123456789abcdef")
    assert missing.run_id not in (None, t.run_id)
    missing.end()

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

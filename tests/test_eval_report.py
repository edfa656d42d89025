"""The eval report (gem/eval/report.py) and its MLflow side: artifact + model registry."""

import json
import os
import warnings

import numpy as np
import pytest
import yaml

from gem.api.types import SyntheticDataSpec
from gem.data import build_splits
from gem.eval.report import build_eval_report, write_eval_report


def oracle_parts(ex, ranks=2, dwell=True):
    """What the trainer gathers: one dict per rank, in rank order (= eval split order)."""
    rng = np.random.default_rng(0)
    cols = {"click": ex.click, "conversion": ex.conversion, "p_click": ex.p_click, "p_conversion": ex.p_conversion,
            "pred_click": ex.p_click, "pred_conversion": np.clip(ex.p_conversion + rng.normal(0, 0.05, len(ex)),
                                                                  0.01, 0.99).astype(np.float32)}
    if dwell:
        cols.update({"dwell": ex.dwell, "p_dwell": ex.p_dwell, "surface": ex.surface, "objective": ex.objective,
                     "pred_dwell": np.full(len(ex), ex.dwell.mean(), np.float32)})  # the base rate: NE 1
    return [{k: v[i] for k, v in cols.items()} for i in np.array_split(np.arange(len(ex)), ranks)]


def test_report_json_and_png(tmp_path):
    _, ev = build_splits(SyntheticDataSpec(num_users=300, num_ads=80, num_train_examples=10, num_eval_examples=6000))
    paths = write_eval_report(oracle_parts(ev), ev, tmp_path / "r", metrics={"ne": 0.9, "auc/x": float("nan")},
                              step=7)
    js, png = paths
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    rep = json.loads(js.read_text())
    assert rep["step"] == 7 and rep["numExamples"] == 6000 and rep["metrics"] == {"ne": 0.9, "auc/x": None}
    click = rep["tasks"]["click"]
    assert click["ne"] == pytest.approx(click["bayesNe"])  # predictions = true probabilities
    assert set(click["bySurface"]) == {"0", "1", "2", "3"}
    assert [s["name"] for s in click["bySurface"].values()] == ["feed", "stories", "reels", "offsite"]
    assert sum(s["n"] for s in click["bySurface"].values()) == 6000
    for s in click["bySurface"].values():
        assert s["bayesNe"] == pytest.approx(s["ne"]) and s["calibration"] == pytest.approx(1.0, abs=0.15)
    assert set(click["byObjective"]) == {"purchase", "install"}
    # awareness: a constant base-rate prediction scores NE 1 overall, the true probabilities far less
    dwell = rep["tasks"]["dwell"]
    assert dwell["n"] == 6000 and dwell["ne"] == pytest.approx(1.0, abs=1e-6) and dwell["bayesNe"] < 0.95
    assert set(dwell["bySurface"]) == {"0", "1", "2", "3"}
    assert all(s["bayesNe"] < s["ne"] for s in dwell["bySurface"].values())
    # an oracle is calibrated: every bin's observed rate is near its mean prediction
    for b in click["calibrationCurve"]:  # within 4.5 standard errors of a bin of n labels
        assert abs(b["meanLabel"] - b["meanPred"]) < 4.5 * np.sqrt(b["meanPred"] * (1 - b["meanPred"]) / b["n"])
    conv = rep["tasks"]["conversion"]
    assert conv["n"] == int(ev.click.sum()) and conv["ne"] > conv["bayesNe"]  # noisy predictions lose


def test_report_of_click_and_conversion_only():
    """A model without a dwell head (and predictions without surface columns): the report has no dwell."""
    _, ev = build_splits(SyntheticDataSpec(num_users=50, num_ads=20, num_train_examples=10, num_eval_examples=500))
    rep = build_eval_report(oracle_parts(ev, ranks=1, dwell=False), ev)
    assert set(rep["tasks"]) == {"click", "conversion"}
    assert sum(s["n"] for s in rep["tasks"]["click"]["bySurface"].values()) == 500  # surfaces from the split


def test_metrics_cover_dwell_and_surfaces():
    from gem.eval.evaluate import metrics_from_predictions

    _, ev = build_splits(SyntheticDataSpec(num_users=300, num_ads=80, num_train_examples=10, num_eval_examples=4000))
    parts = oracle_parts(ev)
    m = metrics_from_predictions(parts)
    assert m["ne"] == pytest.approx((m["ne/click"] + m["ne/conversion"]) / 2)  # the headline is unchanged
    assert m["ne/dwell"] == pytest.approx(1.0, abs=1e-6) and m["bayes_ne/dwell"] < 0.95
    assert not any("@" in k for k in m)  # per-surface keys only when asked for
    by = metrics_from_predictions(parts, by_surface=True)
    for task in ("click", "conversion", "dwell"):
        for surface in ("feed", "stories", "reels", "offsite"):
            for kind in ("ne", "auc", "calibration", "bayes_ne"):
                assert f"{kind}/{task}@surface={surface}" in by
    feed = ev.surface == 0
    assert by["bayes_ne/click@surface=feed"] == pytest.approx(
        metrics_from_predictions([{k: v[feed] for k, v in oracle_parts(ev, ranks=1)[0].items()}])["bayes_ne/click"])
    # unknown labels (NaN dwell, e.g. MovieLens) are left out, not counted as 0
    half = [{**p, "dwell": np.where(np.arange(len(p["dwell"])) % 2 == 0, p["dwell"], np.nan)} for p in parts]
    assert np.isfinite(metrics_from_predictions(half)["ne/dwell"])


def test_each_objective_id_has_its_own_entry():
    """Ids outside purchase / install (a source with more objectives) each get `objective-<id>`, not one
    shared `unknown` entry that the last of them overwrote; -1 (no objective recorded) stays `unknown`."""
    _, ev = build_splits(SyntheticDataSpec(num_users=100, num_ads=40, num_train_examples=10, num_eval_examples=1200))
    parts = oracle_parts(ev, ranks=1)
    ids = np.array([0, 1, -1, 5, 7, 7])[np.arange(len(ev)) % 6]  # 200 rows each, 400 of id 7
    parts[0]["objective"] = ids
    click = build_eval_report(parts, ev)["tasks"]["click"]
    groups = click["byObjective"]
    assert set(groups) == {"purchase", "install", "unknown", "objective-5", "objective-7"}
    assert {k: g["n"] for k, g in groups.items()} == {"purchase": 200, "install": 200, "unknown": 200,
                                                      "objective-5": 200, "objective-7": 400}
    assert sum(g["n"] for g in groups.values()) == click["n"] == len(ev)
    conv = build_eval_report(parts, ev)["tasks"]["conversion"]["byObjective"]
    assert sum(g["n"] for g in conv.values()) == int(ev.click.sum())


def test_report_without_true_probabilities():
    _, ev = build_splits(SyntheticDataSpec(num_users=50, num_ads=20, num_train_examples=10, num_eval_examples=500))
    parts = oracle_parts(ev, ranks=1)
    parts[0]["p_click"] = np.full(500, np.nan, np.float32)
    rep = build_eval_report(parts, ev)
    assert rep["tasks"]["click"]["bayesNe"] is None and rep["tasks"]["click"]["ne"] is not None


def test_report_of_nan_predictions_is_strict_json(tmp_path):
    """A diverged model predicts NaN: the report stays valid JSON (null, never NaN) and still plots."""
    _, ev = build_splits(SyntheticDataSpec(num_users=50, num_ads=20, num_train_examples=10, num_eval_examples=500))
    parts = oracle_parts(ev, ranks=2)
    parts[1]["pred_click"] = np.full(len(parts[1]["pred_click"]), np.nan, np.float32)  # one rank's shard
    js, png = write_eval_report(parts, ev, tmp_path / "r", metrics={"ne/click": float("nan")}, step=3)

    def no_nan(constant):
        raise ValueError(f"{constant} is not JSON")

    rep = json.loads(js.read_text(), parse_constant=no_nan)
    click = rep["tasks"]["click"]
    assert click["ne"] is None and click["auc"] is None and click["calibration"] is None
    curve = click["calibrationCurve"]
    assert sum(b["n"] for b in curve) == 500 and curve[-1]["meanPred"] is None  # NaN sorts last
    assert curve[0]["meanPred"] is not None and curve[0]["meanLabel"] is not None
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("case", ["no clicks", "empty"])
def test_report_of_a_single_class_or_empty_eval_set(tmp_path, case):
    """A task without positives (conversion with no click) or no examples at all: every undefined
    value is null, and the PNG is drawn without matplotlib's 'No artists with labels' warnings."""
    _, ev = build_splits(SyntheticDataSpec(num_users=50, num_ads=20, num_train_examples=10, num_eval_examples=200))
    parts = oracle_parts(ev, ranks=1)
    if case == "no clicks":
        parts[0]["click"] = np.zeros_like(parts[0]["click"])
    else:
        parts = [{k: v[:0] for k, v in parts[0].items()}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        js, png = write_eval_report(parts, None, tmp_path / "r", step=1)
    rep = json.loads(js.read_text())
    click, conv = rep["tasks"]["click"], rep["tasks"]["conversion"]
    assert click["ne"] is None and click["auc"] is None and click["calibration"] is None
    assert conv["n"] == 0 and conv["baseRate"] is None and conv["calibrationCurve"] == [] and conv["bySurface"] == {}
    assert click["baseRate"] == (0.0 if case == "no clicks" else None)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_trainer_logs_the_report_and_registers_the_model(tmp_path, trainer_env):
    import mlflow
    from mlflow.tracking import MlflowClient

    from gem import cli

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    os.environ["MLFLOW_TRACKING_URI"] = uri
    obj = {"apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": "reported"},
           "spec": {"model": {"preset": "tiny"},
                    "data": {"synthetic": {"numUsers": 100, "numAds": 64, "numTrainExamples": 512,
                                           "numEvalExamples": 400, "meanHistoryLen": 8}},
                    "training": {"steps": 6, "batchSize": 32, "warmupSteps": 1},
                    "checkpoint": {"path": str(tmp_path / "ckpt"), "everySteps": 100},
                    "mlflow": {"enabled": True, "experiment": "gem-report"}}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(obj))
    try:
        assert cli.main(["train", "--config", str(path)]) == 0
        report = json.loads((tmp_path / "termination-log").read_text())
        client = MlflowClient(uri)
        run_id = report["mlflowRunId"]
        assert {a.path for a in client.list_artifacts(run_id, "eval")} == {"eval/eval_report.json",
                                                                            "eval/eval_report.png"}
        local = tmp_path / "ckpt/local/reported/reports/step-00000006/eval_report.json"
        assert json.loads(local.read_text())["tasks"]["click"]["bayesNe"] is not None
        versions = client.search_model_versions("name='gem-report'")
        assert len(versions) == 1 and versions[0].run_id == run_id and versions[0].source.endswith("/checkpoint")
        assert client.get_run(run_id).data.tags["gem.dev/registeredModel"] == "gem-report/1"
    finally:
        mlflow.set_tracking_uri(None)

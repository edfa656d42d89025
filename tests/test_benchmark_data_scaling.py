"""`python -m benchmarks.data_scaling --smoke` writes a curve per model whose derived figures
(Bayes NE, half-gap target, slopes, doublings to the target) recompute from sources outside the
benchmark's bookkeeping: the world's true probabilities and the curves' own points."""

from __future__ import annotations

import json
import math

import numpy as np

from benchmarks import data_scaling, quality
from gem.api.types import SyntheticDataSpec
from gem.data.synthetic import SyntheticWorld
from gem.eval.metrics import normalized_entropy


def test_data_scaling_smoke(tmp_path):
    out = tmp_path / "data_scaling.json"
    assert data_scaling.main(["--smoke", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    mode = data_scaling.MODES["smoke"]
    assert doc["mode"] == "smoke" and doc["world_seed"] == quality.WORLD_SEED
    assert doc["command"] == f"python -m benchmarks.data_scaling --smoke --threads 1 --out {out.resolve()}"

    # Bayes: the NE of the held-out world's true click probabilities on the eval split.
    spec = SyntheticDataSpec(**doc["world"])
    assert spec.seed == quality.WORLD_SEED
    eval_ = SyntheticWorld(spec).sample(mode["eval_examples"], split=1)
    assert math.isclose(doc["bayes"]["click"], normalized_entropy(eval_.click, eval_.p_click), rel_tol=1e-6)

    assert set(doc["curves"]) == set(mode["steps"])
    for kind, c in doc["curves"].items():
        pts = c["points"]
        assert [p["steps"] for p in pts] == list(mode["steps"][kind])
        assert [p["impressions"] for p in pts] == [s * mode["batch"] for s in mode["steps"][kind]]
        for p in pts:
            for task, bayes in doc["bayes"].items():
                assert math.isfinite(p[task]) and p[task] >= bayes, (kind, p)
        assert len({p["click"] for p in pts}) == len(pts)  # every rung is its own run
        tail = pts[-3:]
        for task in doc["bayes"]:
            slope = np.polyfit(np.log2([p["impressions"] for p in tail]), [p[task] for p in tail], 1)[0]
            assert math.isclose(c["slope_per_doubling"][task], slope, rel_tol=1e-9, abs_tol=1e-12)
            left = doc["half_gap_target"][task] - tail[-1][task]
            d = c["doublings_to_target"][task]
            if left >= 0:
                assert d == 0.0
            elif slope < 0:
                assert math.isclose(tail[-1][task] + d * slope, doc["half_gap_target"][task], rel_tol=1e-9)
            else:
                assert d is None

    # The target: half of DLRM's gap to Bayes at the quality benchmark's budget.
    base = next(p for p in doc["curves"]["dlrm"]["points"] if p["steps"] == mode["target_steps"])
    for task, bayes in doc["bayes"].items():
        assert math.isclose(doc["half_gap_target"][task], (base[task] + bayes) / 2, rel_tol=1e-12)
    assert out.with_suffix(".png").stat().st_size > 0

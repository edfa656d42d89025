"""The vertical model's per-tier blend of its own score with a Solaris value."""

import numpy as np

from gem.solaris.vertical import TierBlend, fit_logistic


def _logloss(y, logit):
    p = 1 / (1 + np.exp(-logit))
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def test_fit_logistic_recovers_weights():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(20000, 2))
    y = (rng.random(20000) < 1 / (1 + np.exp(-(1.5 * x[:, 0] - 0.7 * x[:, 1] + 0.3)))).astype(float)
    w = fit_logistic(x, y, l2=0.0)
    assert np.allclose(w, [1.5, -0.7, 0.3], atol=0.08)


def test_blend_weighs_each_tier_by_how_informative_it_is():
    rng = np.random.default_rng(1)
    n = 6000
    truth = rng.normal(size=n)  # the true logit
    student = 0.5 * truth + rng.normal(scale=0.8, size=n)  # a weak vertical model
    tiers = rng.choice(["exact", "segment"], size=n)
    # exact: the true logit; segment: noise on a different scale
    value = np.where(tiers == "exact", truth, 3.0 * rng.normal(size=n))
    y = (rng.random(n) < 1 / (1 + np.exp(-truth))).astype(float)
    fit, test = np.arange(n) < n // 2, np.arange(n) >= n // 2
    blend = TierBlend().fit(tiers[fit], student[fit], value[fit], y[fit])
    w_exact, w_seg = blend.weights["exact"], blend.weights["segment"]
    assert w_exact[1] > 0.5 and abs(w_seg[1]) < 0.1  # the exact value is used, the noisy one ignored
    pred = blend.predict(tiers[test], student[test], value[test])
    m = tiers[test] == "exact"
    assert _logloss(y[test][m], pred[m]) < _logloss(y[test][m], student[test][m]) - 0.02
    # an unseen tier falls back to the student's own logit
    assert np.array_equal(blend.predict(np.array(["default"] * 3), student[:3], value[:3]), student[:3])

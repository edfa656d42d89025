"""How a vertical model consumes a Solaris value: per tier, a calibrated blend with its own score.

A Solaris answer is a value (FM logits) and the tier it came from. A segment mean or a default
is a much weaker signal than an exact pair, and on a different scale for this user, so the
vertical model must not treat every tier alike. Per tier t and task:

    logit = w0[t] · student_logit + w1[t] · solaris_value + b[t]

fitted by L2-regularised logistic regression (Newton's method, 3 weights per tier) on labelled
requests served from that tier. A tier with too few labelled requests falls back to the student
alone (w = (1, 0), b = 0), so an unseen tier never makes the prediction worse than no lookup.
"""

from __future__ import annotations

import numpy as np

MIN_EXAMPLES = 50  # fewer labelled requests than this: the tier's blend is not fitted


def fit_logistic(x: np.ndarray, y: np.ndarray, *, l2: float = 1e-3, iters: int = 30) -> np.ndarray:
    """Weights [F+1] (last = bias) of an L2-regularised logistic regression of y [N] on x [N, F]."""
    X = np.concatenate([x, np.ones((len(x), 1))], axis=1).astype(np.float64)  # [N, F+1]
    y = y.astype(np.float64)
    w = np.zeros(X.shape[1])
    reg = l2 * len(X) * np.eye(X.shape[1])
    reg[-1, -1] = 0.0  # the bias is not shrunk
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-np.clip(X @ w, -30, 30)))
        grad = X.T @ (p - y) + reg @ w
        hess = (X * (p * (1 - p))[:, None]).T @ X + reg + 1e-9 * np.eye(X.shape[1])
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.abs(step).max() < 1e-8:
            break
    return w


class TierBlend:
    """Per-tier blend of the vertical model's logit with one Solaris value (one task)."""

    def __init__(self, *, l2: float = 1e-3, min_examples: int = MIN_EXAMPLES):
        self.l2 = l2
        self.min_examples = min_examples
        self.weights: dict[str, np.ndarray] = {}  # tier -> [w0, w1, b]

    def fit(self, tiers: np.ndarray, student_logit: np.ndarray, value: np.ndarray, y: np.ndarray) -> "TierBlend":
        tiers = np.asarray(tiers)
        for tier in np.unique(tiers):
            m = tiers == tier
            if m.sum() >= self.min_examples and 0 < y[m].sum() < m.sum():
                self.weights[str(tier)] = fit_logistic(np.stack([student_logit[m], value[m]], 1), y[m], l2=self.l2)
        return self

    def predict(self, tiers: np.ndarray, student_logit: np.ndarray, value: np.ndarray) -> np.ndarray:
        """Blended logits [N]; the student's own logit where the tier was not fitted."""
        tiers = np.asarray(tiers)
        out = np.asarray(student_logit, np.float64).copy()
        for tier, w in self.weights.items():
            m = tiers == tier
            out[m] = w[0] * student_logit[m] + w[1] * value[m] + w[2]
        return out

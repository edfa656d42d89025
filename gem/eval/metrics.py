"""Offline metrics of binary predictions: normalized entropy, AUC, calibration (numpy only).

NE (He et al., ADKDD 2014; notes section 14) is the average log loss divided by the entropy
of the background rate p = mean(y): a predictor that always says p scores 1, lower is better.
"""

from __future__ import annotations

import math

import numpy as np

_EPS = 1e-7  # probabilities are clipped to [eps, 1-eps] so a confident miss costs ~16 nats, not inf


def log_loss(y: np.ndarray, p: np.ndarray) -> float:
    p = np.clip(p.astype(np.float64), _EPS, 1 - _EPS)
    y = y.astype(np.float64)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def normalized_entropy(y: np.ndarray, p: np.ndarray) -> float:
    """log loss / entropy of the empirical rate; nan when y is empty or has a single class."""
    if y.size == 0:
        return math.nan
    rate = float(np.mean(y, dtype=np.float64))
    if rate <= 0.0 or rate >= 1.0:
        return math.nan
    background = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    return log_loss(y, p) / background


def auc(y: np.ndarray, p: np.ndarray) -> float:
    """ROC AUC via the Mann-Whitney U statistic with average ranks for ties; nan for one class.

    nan too when a prediction is not finite: NaN has no rank (argsort would put it last, as the
    most confident score) and NE is nan then as well.
    """
    y = y.astype(bool)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0 or not np.isfinite(p).all():
        return math.nan
    order = np.argsort(p, kind="mergesort")
    sorted_p = p[order]
    ranks = np.empty(len(p), dtype=np.float64)
    # Average rank (1-based) over each run of tied scores.
    boundaries = np.flatnonzero(np.diff(sorted_p)) + 1
    starts = np.concatenate([[0], boundaries])
    ends = np.concatenate([boundaries, [len(p)]])
    avg = (starts + ends + 1) / 2.0  # mean of ranks starts+1 .. ends
    ranks[order] = np.repeat(avg, ends - starts)
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def calibration(y: np.ndarray, p: np.ndarray) -> float:
    """sum of predictions / number of positives (1.0 is perfectly calibrated)."""
    positives = float(np.sum(y))
    return float(np.sum(p)) / positives if positives > 0 else math.nan


def task_metrics(task: str, y: np.ndarray, p: np.ndarray, p_true: np.ndarray | None = None,
                 *, prefix: str = "") -> dict[str, float]:
    """{prefix}ne/{task}, auc/…, calibration/…, log_loss/… (+ bayes_ne/{task} from the true probabilities)."""
    out = {
        f"{prefix}ne/{task}": normalized_entropy(y, p),
        f"{prefix}auc/{task}": auc(y, p),
        f"{prefix}calibration/{task}": calibration(y, p),
        f"{prefix}log_loss/{task}": log_loss(y, p) if y.size else math.nan,
    }
    if p_true is not None:
        out[f"bayes_ne/{task}"] = normalized_entropy(y, p_true)
    return out


def headline_ne(metrics: dict[str, float], tasks: tuple[str, ...] = ("click", "conversion"), prefix: str = "") -> float:
    """The mean NE over tasks: the one number a job reports."""
    values = [metrics[f"{prefix}ne/{t}"] for t in tasks]
    return float(np.mean(values))

"""Offline evaluation: NE, AUC and calibration per task."""

from gem.eval.metrics import auc, calibration, headline_ne, log_loss, normalized_entropy, task_metrics

__all__ = ["auc", "calibration", "headline_ne", "log_loss", "normalized_entropy", "task_metrics"]

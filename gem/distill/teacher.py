"""Finding and loading the teacher of a LoopFMDistill.

The teacher is a GEM checkpoint directory (gem.yaml + model.pt, see gem/train/checkpoint.py),
named in one of three ways:
  teacher.checkpoint:      a checkpoint directory (or a job directory: its latest complete one)
  teacher.gemTraining:     a GEMTraining of the same namespace: the latest complete checkpoint
                           under <checkpoint.path>/<namespace>/<name>/ (the jobs share the volume)
  teacher.mlflowModelUri:  MLflow artifacts (e.g. runs:/<id>/checkpoint, models:/gem/3),
                           downloaded and loaded the same way
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from torch import nn

from gem.api.types import LoopFMDistillSpec
from gem.train import checkpoint

log = logging.getLogger("gem.distill")


def _checkpoint_in(path: Path, what: str) -> Path:
    """path itself if it is a checkpoint, else its latest complete checkpoint."""
    if (path / checkpoint.MODEL_FILE).is_file():
        return path
    for candidate in (path / "checkpoint", checkpoint.latest_complete(path)):
        if candidate is not None and (candidate / checkpoint.MODEL_FILE).is_file():
            return candidate
    raise FileNotFoundError(f"{what}: no GEM checkpoint (gem.yaml + model.pt) at {path}")


def _download(uri: str, tracking_uri: str | None) -> Path:
    import mlflow

    if tracking_uri:
        mlflow.set_tracking_uri(tracking_uri)
    dst = tempfile.mkdtemp(prefix="gem-teacher-")
    return Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=dst))


def resolve_teacher(spec: LoopFMDistillSpec, namespace: str) -> Path:
    teacher = spec.teacher
    if teacher.checkpoint:
        return _checkpoint_in(Path(teacher.checkpoint), "teacher.checkpoint")
    if teacher.gem_training:
        job = checkpoint.job_dir(checkpoint.checkpoint_root(spec.checkpoint.path), namespace, teacher.gem_training)
        latest = checkpoint.latest_complete(job)
        if latest is None:
            raise FileNotFoundError(
                f"teacher.gemTraining {teacher.gem_training!r}: no complete checkpoint under {job} "
                "(has that GEMTraining finished, and do both jobs mount the same checkpoint volume?)")
        return latest
    tracking_uri = spec.mlflow.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    return _checkpoint_in(_download(teacher.mlflow_model_uri, tracking_uri), "teacher.mlflowModelUri")


def load_teacher(spec: LoopFMDistillSpec, namespace: str) -> tuple[nn.Module, Any, Path]:
    """(frozen teacher in eval mode, its GEMTraining manifest, its checkpoint dir)."""
    path = resolve_teacher(spec, namespace)
    model, manifest = checkpoint.load_model(path)
    if manifest.kind != "GEMTraining":
        raise ValueError(f"teacher checkpoint {path} holds a {manifest.kind}, not a GEM model (GEMTraining)")
    for p in model.parameters():
        p.requires_grad_(False)
    log.info("teacher: %s (preset %s)", path, manifest.spec.model.preset)
    return model, manifest, path

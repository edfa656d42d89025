"""Finding and loading the teacher of a LoopFMDistill.

The teacher is a GEM checkpoint directory (gem.yaml + model.pt, see gem/train/checkpoint.py),
named in one of three ways:
  teacher.checkpoint:      a checkpoint directory (or a job directory: its latest complete one)
  teacher.gemTraining:     a GEMTraining of the same namespace: the latest complete checkpoint
                           under <checkpoint.path>/<namespace>/<name>/ (the jobs share the volume)
  teacher.mlflowModelUri:  MLflow artifacts (e.g. runs:/<id>/checkpoint, models:/gem/3),
                           downloaded and loaded the same way

A teacher that is not there, or is not a GEM model, is a SpecError naming spec.teacher.<field>:
`gem distill` reports it as a config error (exit 2).
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from torch import nn

from gem.api.types import LoopFMDistillSpec
from gem.data.errors import SpecError
from gem.train import checkpoint

log = logging.getLogger("gem.distill")


def _checkpoint_in(path: Path, what: str, fix: str) -> Path:
    """path itself if it is a checkpoint, else its latest complete checkpoint."""
    if (path / checkpoint.MODEL_FILE).is_file():
        return path
    for candidate in (path / "checkpoint", checkpoint.latest_complete(path)):
        if candidate is not None and (candidate / checkpoint.MODEL_FILE).is_file():
            return candidate
    raise SpecError(f"{what}: no GEM checkpoint (gem.yaml + model.pt) at {path}: {fix}")


def _download(uri: str, tracking_uri: str | None) -> Path:
    import mlflow

    if tracking_uri:
        mlflow.set_tracking_uri(tracking_uri)
    dst = tempfile.mkdtemp(prefix="gem-teacher-")
    return Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=dst))


def resolve_teacher(spec: LoopFMDistillSpec, namespace: str) -> Path:
    teacher = spec.teacher
    if teacher.checkpoint:
        return _checkpoint_in(Path(teacher.checkpoint), "spec.teacher.checkpoint",
                              "set it to a checkpoint step directory or its job directory")
    if teacher.gem_training:
        job = checkpoint.job_dir_of(spec.checkpoint.path, namespace, teacher.gem_training)
        latest = checkpoint.latest_complete(job)
        if latest is None:
            raise SpecError(
                f"spec.teacher.gemTraining {teacher.gem_training!r}: no complete checkpoint under {job}: train "
                "that GEMTraining first, mount the same checkpoint volume in both jobs (spec.checkpoint), "
                "or name the teacher by spec.teacher.checkpoint / mlflowModelUri")
        return latest
    tracking_uri = spec.mlflow.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    return _checkpoint_in(_download(teacher.mlflow_model_uri, tracking_uri), "spec.teacher.mlflowModelUri",
                          "point it at the artifacts of a GEM checkpoint (e.g. runs:/<id>/checkpoint)")


def load_teacher(spec: LoopFMDistillSpec, namespace: str) -> tuple[nn.Module, Any, Path]:
    """(frozen teacher in eval mode, its GEMTraining manifest, its checkpoint dir)."""
    path = resolve_teacher(spec, namespace)
    kind = checkpoint.checkpoint_kind(path)  # before loading: a student's checkpoint may not even load as one
    if kind is not None and kind != "GEMTraining":
        raise SpecError(f"spec.teacher: checkpoint {path} holds a {kind} student, not a GEM model: "
                        "name a GEMTraining's checkpoint as the teacher")
    model, manifest = checkpoint.load_model(path)
    for p in model.parameters():
        p.requires_grad_(False)
    log.info("teacher: %s (preset %s)", path, manifest.spec.model.preset)
    return model, manifest, path

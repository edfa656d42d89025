"""Knowledge distillation as a trainer Task.

    loss = Σ_task (1-α)·BCE(student, label) + α·BCE(student/T, sigmoid(teacher/T))

per task (click on every impression, conversion on clicked ones), α = distillation.alpha,
T = distillation.temperature. The teacher runs frozen on the same batches; its eval metrics
are reported beside the student's as teacher_ne/click etc.

distillation.method: loopfm is gem/loopfm/task.py: constructing DistillTask for a loopfm manifest
returns a LoopFMTask, so `gem distill` (gem/cli.py) serves both methods unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from gem.api.types import LoopFMDistill
from gem.data import Batch
from gem.data.errors import SpecError
from gem.distill.student import build_student
from gem.distill.teacher import load_teacher_on_every_rank, resumed_manifest, with_teacher
from gem.model.loss import masked_bce, task_labels, task_masks
from gem.train import checkpoint
from gem.train.task import LossFn


def check_student_unchanged(manifest: LoopFMDistill) -> None:
    """A restarted job whose spec.student / distillation changed the student's shape since its checkpoints:
    a SpecError naming the field (exit 2), not a state-dict mismatch at every restart (exit 1). The
    fields are checkpoint.SHAPE_FIELDS, which also explain a checkpoint that does not load."""
    found = resumed_manifest(manifest)
    if found is None:
        return
    saved, latest = found
    changes = checkpoint.shape_changes(saved.get("spec") or {}, manifest.spec.to_wire())
    if changes:
        raise SpecError(f"{'; '.join(changes)} when {latest.name} under {latest.parent} was saved: a restarted "
                        "distillation resumes its student from there, which needs the same shape. Set them back, "
                        f"or start from scratch under another metadata.name (or move {latest.parent} away)")


class DistillTask:
    def __new__(cls, manifest: LoopFMDistill, *, device: torch.device):
        # `gem distill` constructs DistillTask for every LoopFMDistill: method loopfm gets the LoopFM task.
        if cls is DistillTask and manifest.spec.distillation.method == "loopfm":
            from gem.loopfm.task import LoopFMTask

            return LoopFMTask(manifest, device=device)
        return super().__new__(cls)

    def __init__(self, manifest: LoopFMDistill, *, device: torch.device):
        spec = manifest.spec
        if spec.distillation.method != "kd":
            raise ValueError(f"DistillTask is plain KD, not distillation.method {spec.distillation.method!r}")
        check_student_unchanged(manifest)
        # collective: a rank that cannot load the teacher fails every rank, not only itself
        self.teacher, self.teacher_manifest, self.teacher_dir = load_teacher_on_every_rank(
            spec, manifest.metadata.namespace, job_manifest=manifest)
        self.manifest = with_teacher(manifest, self.teacher_dir)  # the trainer saves this one
        self.teacher.to(device)
        # Batches carry the longer of the two histories; the student keeps its own most recent events.
        self.max_seq_len = max(self.teacher.max_seq_len, spec.student.max_seq_len)
        self.alpha = spec.distillation.alpha
        self.temperature = spec.distillation.temperature

    def build_model(self) -> nn.Module:
        return build_student(self.manifest.spec.student)

    def loss(self, model: nn.Module, batch: Batch) -> LossFn:
        student = model(batch)
        with torch.no_grad():
            teacher = self.teacher(batch)
        return kd_loss(student, teacher, batch, alpha=self.alpha, temperature=self.temperature)

    def reference_metrics(self, evaluate) -> dict[str, float]:
        return evaluate(self.teacher, self.teacher.max_seq_len, "teacher_")


def kd_loss(student: dict[str, torch.Tensor], teacher: dict[str, torch.Tensor], batch: Batch, *,
            alpha: float, temperature: float) -> LossFn:
    """Σ_task (1-α)·BCE(student, label) + α·BCE(student/T, σ(teacher/T)); α = 0 is the no-teacher baseline."""
    labels, masks = task_labels(batch), task_masks(batch)
    T, a = temperature, alpha
    parts: dict[str, torch.Tensor] = {}
    for task in student:
        hard = masked_bce(student[task], labels[task], masks[task])
        soft = masked_bce(student[task].float() / T, torch.sigmoid(teacher[task].float() / T), masks[task])
        parts[task] = (1 - a) * hard + a * soft
    return sum(parts.values()), parts

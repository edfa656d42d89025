"""Knowledge distillation as a trainer Task.

    loss = Σ_task (1-α)·BCE(student, label) + α·BCE(student/T, sigmoid(teacher/T))

per task (click on every impression, conversion on clicked ones), α = distillation.alpha,
T = distillation.temperature. The teacher runs frozen on the same batches; its eval metrics
are reported beside the student's as teacher_ne/click etc.
"""

from __future__ import annotations

import torch
from torch import nn

from gem.api.types import LoopFMDistill
from gem.data import Batch
from gem.distill.student import build_student
from gem.distill.teacher import load_teacher
from gem.model.loss import masked_bce, task_labels, task_masks
from gem.train.task import LossFn


class DistillTask:
    def __init__(self, manifest: LoopFMDistill, *, device: torch.device):
        spec = manifest.spec
        if spec.distillation.method != "kd":
            raise NotImplementedError(
                f"distillation.method {spec.distillation.method!r} is not implemented yet: use kd")
        self.manifest = manifest
        self.teacher, self.teacher_manifest, self.teacher_dir = load_teacher(spec, manifest.metadata.namespace)
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
        labels, masks = task_labels(batch), task_masks(batch)
        T, a = self.temperature, self.alpha
        parts: dict[str, torch.Tensor] = {}
        for task in student:
            hard = masked_bce(student[task], labels[task], masks[task])
            soft = masked_bce(student[task].float() / T, torch.sigmoid(teacher[task].float() / T), masks[task])
            parts[task] = (1 - a) * hard + a * soft
        return sum(parts.values()), parts

    def reference_metrics(self, evaluate) -> dict[str, float]:
        return evaluate(self.teacher, self.teacher.max_seq_len, "teacher_")

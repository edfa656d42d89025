"""The LoopFM task's memory bookkeeping, without the trainer: the job memory is logged completely
(a partial or other-data log is replaced), and a student reloads the memory version it was trained with."""

import logging

import pytest
import torch
import yaml

from gem.api import parse_object
from gem.data.errors import SpecError
from gem.distill.teacher import load_teacher
from gem.loopfm import task as loopfm_task
from gem.loopfm.logging import logged_version
from gem.loopfm.memory import EmbeddingMemory
from gem.loopfm.student import load_loopfm_student
from gem.model import build_model

WORLD = {"numUsers": 30, "numAds": 20, "numTrainExamples": 200, "numEvalExamples": 50, "meanHistoryLen": 6}


@pytest.fixture
def teacher_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("GEM_CHECKPOINT_DIR", raising=False)
    fm = {"apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": "fm"},
          "spec": {"model": {"preset": "tiny"}, "data": {"synthetic": WORLD}}}
    path = tmp_path / "fm" / "step-00000001"
    path.mkdir(parents=True)
    (path / "gem.yaml").write_text(yaml.safe_dump(fm))
    torch.manual_seed(0)
    torch.save(build_model(parse_object(fm).spec.model).state_dict(), path / "model.pt")
    return path


def distill_manifest(tmp_path, teacher, world=WORLD):
    return parse_object({
        "apiVersion": "gem.dev/v1alpha1", "kind": "LoopFMDistill", "metadata": {"name": "lf", "namespace": "local"},
        "spec": {"teacher": {"checkpoint": str(teacher)},
                 "student": {"embeddingDim": 8, "hiddenDim": 16, "maxSeqLen": 8},
                 "distillation": {"method": "loopfm", "memoryK": 4},
                 "data": {"synthetic": world}, "checkpoint": {"path": str(tmp_path / "ckpt")}}})


def rows_of(memory, version):
    return len(memory.index(version))


def test_a_partial_or_other_data_memory_is_logged_again(tmp_path, teacher_dir, monkeypatch):
    manifest = distill_manifest(tmp_path, teacher_dir)
    teacher, _, _ = load_teacher(manifest.spec, "local")
    version = logged_version(teacher_dir)
    memory = EmbeddingMemory(loopfm_task.memory_dir_of(manifest))
    memory.append([1, 2], [1_700_000_000, 1_700_000_001], version, torch.ones(2, 32).numpy())  # preempted log
    full = WORLD["numTrainExamples"] + WORLD["numEvalExamples"]

    memory, got = loopfm_task.build_memory(teacher, teacher_dir, manifest)
    assert got == version and rows_of(memory, version) == full  # replaced, not kept or added to

    def must_not_log(*args, **kw):
        raise AssertionError("a complete memory was logged again")

    with monkeypatch.context() as m:
        m.setattr(loopfm_task, "log_stream", must_not_log)
        memory, _ = loopfm_task.build_memory(teacher, teacher_dir, manifest)
    assert rows_of(memory, version) == full

    other = {**WORLD, "numTrainExamples": 120}  # spec.data changed under the same job name
    memory, _ = loopfm_task.build_memory(teacher, teacher_dir, distill_manifest(tmp_path, teacher_dir, other))
    assert rows_of(memory, version) == 120 + WORLD["numEvalExamples"]


def save_student(task, tmp_path):
    ckpt = tmp_path / "ckpt" / "local" / "lf" / "step-00000001"
    ckpt.mkdir(parents=True)
    (ckpt / "gem.yaml").write_text(yaml.safe_dump(task.manifest.to_wire()))  # what the trainer saves
    torch.save(task.build_model().state_dict(), ckpt / "model.pt")
    return ckpt


def test_a_student_reloads_the_memory_version_it_was_trained_with(tmp_path, teacher_dir, caplog):
    task = loopfm_task.LoopFMTask(distill_manifest(tmp_path, teacher_dir), device=torch.device("cpu"), is_main=True)
    ckpt = save_student(task, tmp_path)
    # another teacher's rows of the same width, whose version sorts after the trained one
    task.memory.append([1, 2, 3], [10, 20, 30], "zzz-later-teacher+history", torch.ones(3, 32).numpy())
    trained_rows = WORLD["numTrainExamples"] + WORLD["numEvalExamples"]

    model, manifest = load_loopfm_student(ckpt)
    assert len(model._memory) == trained_rows
    assert manifest.metadata.annotations[loopfm_task.MEMORY_VERSION_ANNOTATION] == task.model_version

    # a checkpoint from before the record: the old guess, with a warning
    saved = yaml.safe_load((ckpt / "gem.yaml").read_text())
    del saved["metadata"]["annotations"][loopfm_task.MEMORY_VERSION_ANNOTATION]
    (ckpt / "gem.yaml").write_text(yaml.safe_dump(saved))
    with caplog.at_level(logging.WARNING, logger="gem.loopfm"):
        model, _ = load_loopfm_student(ckpt)
    assert len(model._memory) == 3 and "does not record its memory version" in caplog.text


def test_a_missing_teacher_is_a_spec_error_naming_the_field(tmp_path):
    manifest = distill_manifest(tmp_path, tmp_path / "no-such-checkpoint")
    with pytest.raises(SpecError, match=r"^spec\.teacher\.checkpoint: no GEM checkpoint"):
        load_teacher(manifest.spec, "local")


def test_a_student_named_as_teacher_is_a_spec_error_before_loading(tmp_path):
    """The kind in gem.yaml is checked before load_model: a LoopFM student's checkpoint (here one whose
    model.pt would not even load) is a SpecError naming spec.teacher (exit 2), not a load error (exit 1)."""
    student = tmp_path / "student" / "step-00000001"
    student.mkdir(parents=True)
    (student / "gem.yaml").write_text(yaml.safe_dump(distill_manifest(tmp_path, tmp_path / "fm").to_wire()))
    (student / "model.pt").write_bytes(b"")  # never read
    manifest = distill_manifest(tmp_path, student)
    with pytest.raises(SpecError, match=r"^spec\.teacher: checkpoint .* holds a LoopFMDistill student"):
        load_teacher(manifest.spec, "local")

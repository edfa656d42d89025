"""The LoopFM task's memory bookkeeping, without the trainer: the job memory is logged completely
(a partial or other-data log is replaced), and a student reloads the memory version it was trained with."""

import json
import logging
import os
import re
from pathlib import Path

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


def _mismatched_weights(path):
    torch.save({"not.a.gem.weight": torch.zeros(2)}, path / "model.pt")


def _truncated_weights(path):
    data = (path / "model.pt").read_bytes()
    (path / "model.pt").write_bytes(data[: len(data) // 2])


def _empty_manifest(path):
    (path / "gem.yaml").write_text("")


def _not_yaml_manifest(path):
    (path / "gem.yaml").write_text("spec: [unclosed")


@pytest.mark.parametrize("damage", [_mismatched_weights, _truncated_weights, _empty_manifest, _not_yaml_manifest])
def test_a_teacher_that_does_not_load_is_a_spec_error_naming_the_field(tmp_path, teacher_dir, damage):
    """A corrupt, truncated or other-config teacher is the spec's fault (exit 2, no restart loop),
    not a traceback (exit 1): the error names spec.teacher.<field> and the checkpoint."""
    damage(teacher_dir)
    manifest = distill_manifest(tmp_path, teacher_dir)
    with pytest.raises(SpecError, match=r"^spec\.teacher\.checkpoint: .*step-00000001"):
        load_teacher(manifest.spec, "local")


def test_a_student_without_its_memory_does_not_load_silently(tmp_path, teacher_dir):
    """A checkpoint copied out of its job dir (or MLflow's checkpoint/ artifacts) has no memory/ beside
    it: loading it must fail naming the memory, not return a student that reads zeros for every user."""
    import shutil

    from gem.train.checkpoint import load_model

    task = loopfm_task.LoopFMTask(distill_manifest(tmp_path, teacher_dir), device=torch.device("cpu"), is_main=True)
    ckpt = save_student(task, tmp_path)
    copy = tmp_path / "elsewhere" / "step-00000001"
    shutil.copytree(ckpt, copy)
    with pytest.raises(FileNotFoundError, match=r"LoopFM student and its memory .*elsewhere/memory is not there"):
        load_loopfm_student(copy)
    with pytest.raises(FileNotFoundError, match="memory_dir="):
        load_model(copy)  # what `gem eval --checkpoint` uses: an OSError there is exit 2 naming --checkpoint
    model, _ = load_loopfm_student(copy, memory_dir=ckpt.parent / "memory")  # pointed at it, it loads
    assert len(model._memory) == WORLD["numTrainExamples"] + WORLD["numEvalExamples"]


def test_parquet_data_is_logged_like_the_same_examples_in_memory(tmp_path, teacher_dir):
    """spec.data.source: parquet streams its train split (a ParquetSource, not Examples): the memory
    logs it one row group at a time, the same rows and embeddings as the in-memory examples give."""
    import numpy as np

    from gem.api.types import SyntheticDataSpec
    from gem.data.parquet import write_synthetic

    write_synthetic(SyntheticDataSpec.model_validate(WORLD), tmp_path / "pq", rows_per_group=64)  # 4 groups
    synthetic = loopfm_task.LoopFMTask(distill_manifest(tmp_path / "a", teacher_dir), device=torch.device("cpu"),
                                       is_main=True)
    parquet = distill_manifest(tmp_path / "b", teacher_dir)
    parquet.spec.data = parquet.spec.data.model_validate({"source": "parquet", "path": str(tmp_path / "pq")})
    streamed = loopfm_task.LoopFMTask(parquet, device=torch.device("cpu"), is_main=True)
    want, got = synthetic.memory.index(synthetic.model_version), streamed.memory.index(streamed.model_version)
    assert len(got) == WORLD["numTrainExamples"] + WORLD["numEvalExamples"]
    assert np.array_equal(got.keys, want.keys) and np.array_equal(got.users, want.users)
    # rows of one user at one second may come in another order: order both by (key, embedding)
    def rows(index):
        return index.embeddings[np.lexsort((*index.embeddings.T[::-1], index.keys))]

    assert np.allclose(rows(got), rows(want), atol=1e-6)


def test_a_resumed_distillation_keeps_the_teacher_its_checkpoints_were_trained_with(tmp_path, teacher_dir, caplog):
    """spec.teacher.gemTraining names a GEMTraining still training: a distillation restarted after its
    first checkpoint must resume against the teacher (and memory) it trained with, not the teacher's
    newer checkpoint; that teacher pruned away, it is a SpecError, not a silent switch."""
    import shutil

    from gem.distill.task import DistillTask

    teacher_job = tmp_path / "ckpt" / "local" / "fm"
    first = teacher_job / "step-00000001"
    shutil.copytree(teacher_dir, first)
    (first / "COMPLETE").write_text("{}")
    wire = distill_manifest(tmp_path, teacher_dir).to_wire()
    wire["spec"]["teacher"] = {"gemTraining": "fm"}
    manifest = parse_object(wire)

    task = loopfm_task.LoopFMTask(manifest, device=torch.device("cpu"), is_main=True)
    assert task.teacher_dir == first
    (save_student(task, tmp_path) / "COMPLETE").write_text("{}")  # the job's first checkpoint
    kd_wire = {**wire, "metadata": {"name": "kd", "namespace": "local"}}
    kd_wire["spec"] = {**wire["spec"], "distillation": {"method": "kd"}}
    kd = DistillTask(parse_object(kd_wire), device=torch.device("cpu"))
    kd_ckpt = tmp_path / "ckpt" / "local" / "kd" / "step-00000001"
    kd_ckpt.mkdir(parents=True)
    (kd_ckpt / "gem.yaml").write_text(yaml.safe_dump(kd.manifest.to_wire()))
    (kd_ckpt / "COMPLETE").write_text("{}")

    newer = teacher_job / "step-00000002"  # the teacher trained on
    shutil.copytree(first, newer)
    state = torch.load(newer / "model.pt")
    torch.save({k: v + 1 if v.is_floating_point() else v for k, v in state.items()}, newer / "model.pt")

    with caplog.at_level(logging.WARNING, logger="gem.distill"):
        resumed = loopfm_task.LoopFMTask(manifest, device=torch.device("cpu"), is_main=True)
    assert resumed.teacher_dir == first and resumed.model_version == task.model_version
    assert "resuming with that one" in caplog.text
    assert DistillTask(parse_object(kd_wire), device=torch.device("cpu")).teacher_dir == first
    fresh = parse_object({**wire, "metadata": {"name": "lf-new", "namespace": "local"}})
    assert loopfm_task.LoopFMTask(fresh, device=torch.device("cpu"), is_main=True).teacher_dir == newer

    shutil.rmtree(first)  # the teacher's keepLast pruned it
    with pytest.raises(SpecError, match=r"^spec\.teacher\.gemTraining: this job's checkpoints \(step-00000001\) "
                                        r"were trained with teacher step-00000001-.* which is gone"):
        loopfm_task.LoopFMTask(manifest, device=torch.device("cpu"), is_main=True)


def test_a_restart_with_another_student_shape_is_a_spec_error_naming_the_field(tmp_path, teacher_dir):
    """spec.student.hiddenDim (or memoryK) changed under a job with checkpoints: the resume could only fail
    on a state-dict size mismatch (exit 1, every restart); it is a SpecError naming the fields instead."""
    task = loopfm_task.LoopFMTask(distill_manifest(tmp_path, teacher_dir), device=torch.device("cpu"), is_main=True)
    (save_student(task, tmp_path) / "COMPLETE").write_text("{}")
    wire = distill_manifest(tmp_path, teacher_dir).to_wire()
    wire["spec"]["student"]["hiddenDim"] = 32
    wire["spec"]["distillation"]["memoryK"] = 8
    with pytest.raises(SpecError, match=r"^spec\.student\.hiddenDim is 32, was 16; spec\.distillation\.memoryK "
                                        r"is 8, was 4 when step-00000001 under .* was saved"):
        loopfm_task.LoopFMTask(parse_object(wire), device=torch.device("cpu"), is_main=True)
    wire["spec"]["student"]["hiddenDim"], wire["spec"]["distillation"]["memoryK"] = 16, 4
    wire["spec"]["student"]["maxSeqLen"] = 4  # no weight depends on it: the job resumes
    loopfm_task.LoopFMTask(parse_object(wire), device=torch.device("cpu"), is_main=True)


def test_millisecond_request_times_are_a_spec_error_naming_the_data_path(tmp_path, teacher_dir):
    """Parquet logs with request_time in milliseconds (docs/data.md says seconds): a config error naming
    spec.data.path and the unit (exit 2), not a ValueError from the memory that restarts the pod forever."""
    import dataclasses

    from gem.api.types import SyntheticDataSpec
    from gem.data.parquet import write_splits
    from gem.data.synthetic import build_splits

    train, eval_ = build_splits(SyntheticDataSpec.model_validate(WORLD))
    ms = [dataclasses.replace(e, request_time=e.request_time * 1000, seq_timestamp=e.seq_timestamp * 1000)
          for e in (train, eval_)]
    write_splits(*ms, tmp_path / "pq-ms")
    manifest = distill_manifest(tmp_path, teacher_dir)
    manifest.spec.data = manifest.spec.data.model_validate({"source": "parquet", "path": str(tmp_path / "pq-ms")})
    with pytest.raises(SpecError) as e:
        loopfm_task.LoopFMTask(manifest, device=torch.device("cpu"), is_main=True)
    message = str(e.value)
    assert message.startswith(f"spec.data.path: the Parquet data at {str(tmp_path / 'pq-ms')!r} has request_time")
    assert "milliseconds" in message and "unix seconds" in message and "divide" in message, message


def _fake_movielens(n_users=3, per_user=100, n_movies=40):
    """(ratings, items) Parquet bytes shaped like MovieLens-100K's, with histories longer than 64."""
    import io

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gem.data.movielens import GENRES

    rng = np.random.default_rng(0)
    user = np.repeat(np.arange(1, n_users + 1), per_user)
    ts = 880_000_000 + np.tile(np.arange(per_user) * 60, n_users) + user  # distinct per user
    ratings = {"user_id": user, "movie_id": rng.integers(1, n_movies + 1, user.size),
               "rating": rng.integers(1, 6, user.size), "timestamp": ts}
    items = {"movie_id": np.arange(1, n_movies + 1), "release_date": ["01-Jan-1995"] * n_movies,
             **{g: (np.arange(n_movies) % len(GENRES) == i).astype(np.int64) for i, g in enumerate(GENRES)}}

    def parquet(cols):
        buf = io.BytesIO()
        pq.write_table(pa.table(cols), buf)
        return buf.getvalue()

    return parquet(ratings), parquet(items)


def test_the_memory_logs_the_teachers_whole_history_window(tmp_path, monkeypatch):
    """A teacher reading 128 events over MovieLens (which builds histories of max_history events): every
    logged embedding is the teacher's representation of its full 128-event window, not of the 64 most
    recent events (load_splits' default), and a memory logged with another window is logged again."""
    import json

    import numpy as np

    from gem.data import movielens
    from gem.data.batch import make_batch
    from gem.loopfm.logging import UserRepresentation
    from gem.loopfm.memory import MemoryIndex

    monkeypatch.delenv("GEM_CHECKPOINT_DIR", raising=False)
    fake = _fake_movielens()
    monkeypatch.setattr(movielens, "find_movielens", lambda download=False: fake)
    fm = {"apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": "fm"},
          "spec": {"model": {"preset": "tiny", "maxSeqLen": 128}, "data": {"source": "movielens"}}}
    teacher_dir = tmp_path / "fm" / "step-00000001"
    teacher_dir.mkdir(parents=True)
    (teacher_dir / "gem.yaml").write_text(yaml.safe_dump(fm))
    torch.manual_seed(0)
    torch.save(build_model(parse_object(fm).spec.model).state_dict(), teacher_dir / "model.pt")
    manifest = distill_manifest(tmp_path, teacher_dir)
    manifest.spec.data = manifest.spec.data.model_validate({"source": "movielens"})
    teacher, _, _ = load_teacher(manifest.spec, "local")
    assert teacher.max_seq_len == 128

    memory, version = loopfm_task.build_memory(teacher, teacher_dir, manifest)
    got = memory.index(version)

    def expected(window):
        """The teacher's history representation of every example of both splits, histories of `window` events."""
        splits = movielens.movielens_examples(max_history=window)
        rep = UserRepresentation(teacher, "history")
        embs = [rep.history(make_batch(s, np.arange(len(s)), max_seq_len=teacher.max_seq_len)).numpy() for s in splits]
        index = MemoryIndex.build(np.concatenate([s.user_id for s in splits]),
                                  np.concatenate([s.request_time for s in splits]), np.concatenate(embs))
        return index, splits

    want, splits = expected(128)
    assert max(np.diff(s.seq_offsets).max() for s in splits) > 64  # the data has windows longer than 64
    assert np.array_equal(got.keys, want.keys)
    assert np.allclose(got.embeddings, want.embeddings, atol=1e-6)
    truncated, _ = expected(64)
    assert not np.allclose(got.embeddings, truncated.embeddings, atol=1e-3)  # the window matters here

    # a memory logged before the window was recorded (its marker has none): logged again, not trusted
    marker = next(memory.root.glob("logged-*.json"))
    record = json.loads(marker.read_text())
    record.pop("historyWindow", None)
    marker.write_text(json.dumps(record))
    calls = []
    real = loopfm_task.log_stream
    monkeypatch.setattr(loopfm_task, "log_stream", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    memory, _ = loopfm_task.build_memory(teacher, teacher_dir, manifest)
    assert calls == [1] and len(memory.index(version)) == len(want)


def test_loopfm_with_data_sources_is_a_spec_error_before_the_teacher_loads(tmp_path, teacher_dir, monkeypatch):
    """data.sources (mixing) is refused for LoopFM, with the reason, before the (slow) teacher load."""
    manifest = distill_manifest(tmp_path, teacher_dir)
    manifest.spec.data = manifest.spec.data.model_validate(
        {"sources": [{"name": "a", "synthetic": WORLD}, {"name": "b", "synthetic": WORLD}]})

    def must_not_load(*a, **kw):
        raise AssertionError("the teacher was loaded for a spec that cannot run")

    monkeypatch.setattr(loopfm_task, "load_teacher", must_not_load, raising=False)
    monkeypatch.setattr(loopfm_task, "load_teacher_on_every_rank", must_not_load, raising=False)
    with pytest.raises(SpecError) as e:
        loopfm_task.LoopFMTask(manifest, device=torch.device("cpu"), is_main=True)
    message = str(e.value)
    assert message.startswith("spec.data.sources: distillation.method loopfm"), message
    assert "user" in message and "data.source" in message, message
    manifest.spec.data.sources = manifest.spec.data.sources[:1]  # one entry is one source: accepted
    loopfm_task.check_single_source(manifest)


def test_the_teachers_weights_are_hashed_once_per_process(tmp_path, teacher_dir, monkeypatch):
    """model_version_of (the teacher's version, asked for by the resume check, the teacher record and the
    memory) reads a multi-GB model.pt once per process; a changed file is hashed again."""
    import builtins

    from gem.loopfm import logging as loopfm_logging

    reads = []

    def counting_open(file, *args, **kwargs):
        if str(file).endswith("model.pt"):
            reads.append(str(file))
        return builtins.open(file, *args, **kwargs)

    monkeypatch.setattr(loopfm_logging, "open", counting_open, raising=False)
    first = loopfm_logging.model_version_of(teacher_dir)
    assert len(reads) == 1
    assert loopfm_logging.model_version_of(teacher_dir) == first
    assert logged_version(teacher_dir) == f"{first}+history"
    assert len(reads) == 1  # not read again

    torch.save({"other": torch.zeros(3)}, teacher_dir / "model.pt")  # another file at the same path
    second = loopfm_logging.model_version_of(teacher_dir)
    assert len(reads) == 2 and second != first and second.startswith("step-00000001-")


def test_a_registered_model_teacher_has_the_same_version_in_every_process(tmp_path, teacher_dir, monkeypatch):
    """spec.teacher.mlflowModelUri models:/<name>/<version>: MLflow downloads a registered model's files into
    the download directory itself, a fresh random temp dir per process, and the teacher's version is its
    directory name + weights hash. So every rank saw another teacher ('the ranks resolved different
    teachers'), and a restarted pod found its checkpoints' teacher 'gone' (and logged a new memory)."""
    import shutil

    import mlflow
    from mlflow.tracking import MlflowClient

    from gem.distill.teacher import resolve_teacher, with_teacher
    from gem.loopfm.logging import model_version_of

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    with mlflow.start_run() as run:
        mlflow.log_artifacts(str(teacher_dir), artifact_path="checkpoint")
    client = MlflowClient(uri)
    client.create_registered_model("fm")
    client.create_model_version("fm", source=f"{run.info.artifact_uri.rstrip('/')}/checkpoint", run_id=run.info.run_id)
    wire = distill_manifest(tmp_path, teacher_dir).to_wire()
    wire["spec"]["teacher"] = {"mlflowModelUri": "models:/fm/1"}
    wire["spec"]["distillation"]["method"] = "kd"
    manifest = parse_object(wire)

    first, second = resolve_teacher(manifest.spec, "local"), resolve_teacher(manifest.spec, "local")  # two ranks
    assert first != second and model_version_of(first) == model_version_of(second)
    run_uri = parse_object({**wire, "spec": {**wire["spec"], "teacher": {
        "mlflowModelUri": f"runs:/{run.info.run_id}/checkpoint"}}}).spec  # the run's artifacts: the same teacher
    assert model_version_of(resolve_teacher(run_uri, "local")) == model_version_of(first)

    # a restarted pod: its checkpoints record the first download, which lived on the old pod only
    ckpt = tmp_path / "ckpt" / "local" / "lf" / "step-00000001"
    ckpt.mkdir(parents=True)
    (ckpt / "gem.yaml").write_text(yaml.safe_dump(with_teacher(manifest, first).to_wire()))
    (ckpt / "COMPLETE").write_text("{}")
    shutil.rmtree(first)
    _, _, path = load_teacher(manifest.spec, "local", job_manifest=manifest)
    assert model_version_of(path) == model_version_of(second)


@pytest.mark.parametrize("uri", ["models:/nosuch/1", "runs:/0123456789abcdef0123456789abcdef/checkpoint"])
def test_an_mlflow_teacher_that_is_not_there_is_a_spec_error_naming_the_field(tmp_path, teacher_dir, monkeypatch,
                                                                              uri):
    """A registered model, version or run that does not exist was MLflow's own exception (exit 1, a traceback,
    and a pod restarting forever), where a missing checkpoint or GEMTraining is a config error (exit 2)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    wire = distill_manifest(tmp_path, teacher_dir).to_wire()
    wire["spec"]["teacher"] = {"mlflowModelUri": uri}
    with pytest.raises(SpecError, match=rf"^spec\.teacher\.mlflowModelUri {re.escape(repr(uri))}: MLflow has no such"):
        load_teacher(parse_object(wire).spec, "local")


@pytest.mark.parametrize("method", ["kd", "loopfm"])
def test_a_distillation_named_like_its_teacher_is_a_spec_error(tmp_path, teacher_dir, method):
    """LoopFMDistill `fm` distilling GEMTraining `fm` (another kind, so Kubernetes allows the name) under the same
    checkpoint root shares its job directory: the trainer then resumed the student from the teacher's checkpoint
    (a state-dict mismatch, exit 1) or, the uids differing, set the teacher's checkpoints aside."""
    import shutil

    from gem.distill.task import DistillTask

    job = tmp_path / "ckpt" / "local" / "fm"
    shutil.copytree(teacher_dir, job / "step-00000001")
    (job / "step-00000001" / "COMPLETE").write_text("{}")
    wire = distill_manifest(tmp_path, teacher_dir).to_wire()
    wire["metadata"]["name"] = "fm"
    wire["spec"]["teacher"] = {"gemTraining": "fm"}
    wire["spec"]["distillation"]["method"] = method
    with pytest.raises(SpecError, match=r"^spec\.teacher\.gemTraining: the teacher .*step-00000001 is in this "
                                        r"distillation's own job directory .*metadata\.name"):
        DistillTask(parse_object(wire), device=torch.device("cpu"))
    assert not (job / "memory").exists()
    wire["metadata"]["name"] = "fm-student"  # renamed: the same teacher distils
    assert DistillTask(parse_object(wire), device=torch.device("cpu")).teacher_dir == job / "step-00000001"


@pytest.mark.parametrize("column", ["user_id", "request_time"])
def test_parquet_data_without_the_memory_key_columns_is_a_spec_error(tmp_path, teacher_dir, column):
    """A Parquet split without user_id or request_time reads them as 0 (docs/data.md): every example one user,
    or every request at time 0, so the LoopFM student read other users' embeddings, or none at all, silently."""
    import pyarrow.parquet as pq

    from gem.api.types import SyntheticDataSpec
    from gem.data.parquet import write_synthetic

    path = write_synthetic(SyntheticDataSpec.model_validate(WORLD), tmp_path / "pq", rows_per_group=64)
    [eval_file] = sorted((path / "eval").glob("*.parquet"))
    pq.write_table(pq.read_table(eval_file).drop_columns([column]), eval_file)
    manifest = distill_manifest(tmp_path, teacher_dir)
    manifest.spec.data = manifest.spec.data.model_validate({"source": "parquet", "path": str(path)})
    with pytest.raises(SpecError, match=rf"^spec\.data\.path: {re.escape(str(eval_file))} has no {column} column: "
                                        r"the LoopFM memory is keyed by \(user_id, request_time\)"):
        loopfm_task.LoopFMTask(manifest, device=torch.device("cpu"), is_main=True)
    assert not loopfm_task.memory_dir_of(manifest).exists()  # refused before the teacher loads


def _register(client, run_dir, name="fm"):
    """A run logging run_dir as its checkpoint artifacts, registered as the next version of `name`."""
    import mlflow

    with mlflow.start_run() as run:
        mlflow.log_artifacts(str(run_dir), artifact_path="checkpoint")
    return client.create_model_version(name, source=f"{run.info.artifact_uri.rstrip('/')}/checkpoint",
                                       run_id=run.info.run_id).version  # an int in MLflow 3


def test_a_resumed_distillation_keeps_its_registered_model_version_when_latest_moves(tmp_path, teacher_dir,
                                                                                       monkeypatch):
    """mlflowModelUri models:/fm/latest, killed and restarted after version 2 was registered: the record held the
    old pod's temp download (and a version id from it), so the new pod raised 'teacher ... is gone'. The record
    now names the version `latest` resolved to (models:/fm/1), which a restart downloads again; that version
    deleted from the registry, it is a SpecError naming the field."""
    import shutil

    import mlflow
    from mlflow.tracking import MlflowClient

    from gem.distill.task import DistillTask
    from gem.distill.teacher import TEACHER_ANNOTATION
    from gem.loopfm.logging import model_version_of

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(uri)
    client.create_registered_model("fm")
    assert _register(client, teacher_dir) == 1
    wire = distill_manifest(tmp_path, teacher_dir).to_wire()
    wire["spec"]["teacher"] = {"mlflowModelUri": "models:/fm/latest"}
    wire["spec"]["distillation"]["method"] = "kd"
    manifest = parse_object(wire)

    first = DistillTask(manifest, device=torch.device("cpu"))
    trained_with = model_version_of(first.teacher_dir)
    ckpt = tmp_path / "ckpt" / "local" / "lf" / "step-00000001"
    ckpt.mkdir(parents=True)
    (ckpt / "gem.yaml").write_text(yaml.safe_dump(first.manifest.to_wire()))  # what the trainer saves
    (ckpt / "COMPLETE").write_text("{}")
    shutil.rmtree(first.teacher_dir)  # the old pod's /tmp

    other = tmp_path / "fm2" / "step-00000001"  # a newer teacher registered while the job was down
    shutil.copytree(teacher_dir, other)
    torch.manual_seed(1)
    torch.save(build_model(first.teacher_manifest.spec.model).state_dict(), other / "model.pt")
    assert _register(client, other) == 2

    resumed = DistillTask(manifest, device=torch.device("cpu"))
    assert model_version_of(resumed.teacher_dir) == trained_with  # version 1, not latest (2)
    for task in (first, resumed):  # the version latest resolved to, not 'latest'
        assert json.loads(task.manifest.metadata.annotations[TEACHER_ANNOTATION])["mlflowModelUri"] == "models:/fm/1"

    client.delete_model_version("fm", "1")
    with pytest.raises(SpecError, match=r"^spec\.teacher\.mlflowModelUri: this job's checkpoints \(step-00000001\) "
                                        r"were trained with teacher models:/fm/1, which MLflow no longer has"):
        DistillTask(manifest, device=torch.device("cpu"))

    shutil.rmtree(tmp_path / "ckpt")  # a fresh job distils what latest names now
    assert json.loads(DistillTask(manifest, device=torch.device("cpu")).manifest.metadata.annotations[
        TEACHER_ANNOTATION])["mlflowModelUri"] == "models:/fm/2"


def test_mlflow_teacher_downloads_are_removed_when_the_process_exits(tmp_path, teacher_dir):
    """Every start downloaded the teacher (GBs) into a fresh temp dir that nothing removed."""
    import subprocess
    import sys

    import mlflow
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(uri)
    client.create_registered_model("fm")
    _register(client, teacher_dir)
    wire = distill_manifest(tmp_path, teacher_dir).to_wire()
    wire["spec"]["teacher"] = {"mlflowModelUri": "models:/fm/1"}
    script = ("import sys, yaml; from gem.api import parse_object; from gem.distill.teacher import resolve_teacher; "
              "print(resolve_teacher(parse_object(yaml.safe_load(sys.stdin)).spec, 'local'))")
    done = subprocess.run([sys.executable, "-c", script], input=yaml.safe_dump(wire), capture_output=True, text=True,
                          env={**os.environ, "MLFLOW_TRACKING_URI": uri, "TMPDIR": str(tmp_path)}, check=True)
    downloaded = Path(done.stdout.strip().splitlines()[-1])
    assert downloaded.is_relative_to(tmp_path) and downloaded.name == "checkpoint"
    assert not downloaded.exists() and not downloaded.parent.exists()


def test_checkpoints_recorded_before_the_mlflow_version_was_resume_from_the_version_the_error_names(
        tmp_path, teacher_dir, monkeypatch):
    """Checkpoints saved before the record kept the MLflow version cannot say which version `latest` was: the error
    says to name it (models:/<name>/<N>), and with it named the job resumes."""
    import shutil

    import mlflow
    from mlflow.tracking import MlflowClient

    from gem.distill.task import DistillTask
    from gem.distill.teacher import TEACHER_ANNOTATION

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(uri)
    client.create_registered_model("fm")
    _register(client, teacher_dir)
    wire = distill_manifest(tmp_path, teacher_dir).to_wire()
    wire["spec"]["teacher"] = {"mlflowModelUri": "models:/fm/latest"}
    wire["spec"]["distillation"]["method"] = "kd"
    first = DistillTask(parse_object(wire), device=torch.device("cpu"))
    saved = first.manifest.to_wire()
    record = json.loads(saved["metadata"]["annotations"][TEACHER_ANNOTATION])
    del record["mlflowModelUri"]  # as the release before wrote it
    saved["metadata"]["annotations"][TEACHER_ANNOTATION] = json.dumps(record)
    ckpt = tmp_path / "ckpt" / "local" / "lf" / "step-00000001"
    ckpt.mkdir(parents=True)
    (ckpt / "gem.yaml").write_text(yaml.safe_dump(saved))
    (ckpt / "COMPLETE").write_text("{}")
    shutil.rmtree(first.teacher_dir)
    other = tmp_path / "fm2" / "step-00000001"
    shutil.copytree(teacher_dir, other)
    torch.manual_seed(1)
    torch.save(build_model(first.teacher_manifest.spec.model).state_dict(), other / "model.pt")
    _register(client, other)

    with pytest.raises(SpecError, match=r"set it to the version they were trained with, models:/<name>/<N>"):
        DistillTask(parse_object(wire), device=torch.device("cpu"))
    wire["spec"]["teacher"] = {"mlflowModelUri": "models:/fm/1"}
    resumed = DistillTask(parse_object(wire), device=torch.device("cpu"))
    assert json.loads(resumed.manifest.metadata.annotations[TEACHER_ANNOTATION])["version"] == record["version"]

"""`gem distill`: a student learns from a trained GEM teacher found by GEMTraining name or MLflow URI."""

import json

import pytest
import yaml

from gem import cli
from gem.distill.student import StudentModel
from gem.train import checkpoint

DATA = {"synthetic": {"numUsers": 500, "numAds": 200, "numTrainExamples": 8000, "numEvalExamples": 1500,
                      "meanHistoryLen": 24}}


def write(tmp_path, obj):
    path = tmp_path / f"{obj['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(obj))
    return path


# every test runs `gem train` / `gem distill` in this process (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("trainer_env")


def distill_manifest(tmp_path, name, teacher, mlflow=None):
    return write(tmp_path, {
        "apiVersion": "gem.dev/v1alpha1", "kind": "LoopFMDistill", "metadata": {"name": name},
        "spec": {
            "teacher": teacher,
            "student": {"embeddingDim": 16, "hiddenDim": 32, "maxSeqLen": 8},
            "distillation": {"alpha": 0.5, "temperature": 2.0},
            "data": DATA,
            "training": {"steps": 80, "batchSize": 64, "warmupSteps": 5, "learningRate": 0.003},
            "checkpoint": {"path": str(tmp_path / "ckpt"), "everySteps": 40},
            "mlflow": mlflow or {"enabled": False},
        },
    })


def test_distill_from_a_gemtraining_and_from_mlflow(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    teacher = write(tmp_path, {
        "apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": "teacher"},
        "spec": {"model": {"preset": "tiny"}, "data": DATA,
                 "training": {"steps": 100, "batchSize": 64, "warmupSteps": 5, "learningRate": 0.003},
                 "checkpoint": {"path": str(tmp_path / "ckpt"), "everySteps": 100},
                 "mlflow": {"enabled": True, "trackingUri": uri, "experiment": "teachers"}},
    })
    assert cli.main(["train", "--config", str(teacher)]) == 0
    teacher_report = json.loads((tmp_path / "termination-log").read_text())

    # 1. By GEMTraining name: the latest complete checkpoint under the shared checkpoint root.
    path = distill_manifest(tmp_path, "student", {"gemTraining": "teacher"})
    assert cli.main(["distill", "--config", str(path)]) == 0
    report = json.loads((tmp_path / "termination-log").read_text())
    m = report["metrics"]
    assert report["step"] == 80
    assert m["teacher_ne/click"] == pytest.approx(teacher_report["metrics"]["ne/click"], abs=1e-5)
    assert {"teacher_auc/click", "teacher_ne/conversion", "bayes_ne/click", "ne/conversion"} <= m.keys()
    assert m["ne/click"] < 1.0 and m["auc/click"] > 0.55, m
    # The student checkpoint rebuilds from its directory alone.
    model, manifest = checkpoint.load_model(report["checkpoint"])
    assert isinstance(model, StudentModel) and manifest.kind == "LoopFMDistill"

    # 2. By MLflow URI: the teacher run's checkpoint/ artifacts, downloaded and loaded the same way.
    model_uri = f"runs:/{teacher_report['mlflowRunId']}/checkpoint"
    # In the teacher's experiment, with no registeredModelName: the student registers under its own
    # name, never as a new version of the teacher's model (models:/teachers/latest stays the teacher).
    path = distill_manifest(tmp_path, "student-mlflow", {"mlflowModelUri": model_uri},
                            mlflow={"enabled": True, "trackingUri": uri, "experiment": "teachers"})
    assert cli.main(["distill", "--config", str(path)]) == 0
    report2 = json.loads((tmp_path / "termination-log").read_text())
    assert report2["metrics"]["teacher_ne/click"] == pytest.approx(m["teacher_ne/click"], abs=1e-6)
    assert report2["mlflowRunId"] and report2["mlflowRunId"] != teacher_report["mlflowRunId"]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    [teacher_version] = client.search_model_versions("name='teachers'")
    assert teacher_version.run_id == teacher_report["mlflowRunId"] and teacher_version.tags["gem.dev/kind"] == "GEMTraining"
    [student_version] = client.search_model_versions("name='student-mlflow'")
    assert student_version.run_id == report2["mlflowRunId"] and student_version.tags["gem.dev/kind"] == "LoopFMDistill"


def test_distill_without_a_teacher_checkpoint_is_a_config_error(tmp_path, capsys):
    path = distill_manifest(tmp_path, "orphan", {"gemTraining": "never-trained"})
    assert cli.main(["distill", "--config", str(path)]) == 2  # the spec's fault: exit 2, no traceback
    error = json.loads((tmp_path / "termination-log").read_text())["error"]
    assert error.startswith("ConfigError: spec.teacher.gemTraining 'never-trained': no complete checkpoint")
    assert "Traceback" not in capsys.readouterr().err


def test_kd_loss_mixes_labels_and_soft_teacher_targets():
    import numpy as np
    import torch

    from gem.api.types import SyntheticDataSpec
    from gem.data.batch import make_batch
    from gem.data.synthetic import SyntheticWorld
    from gem.distill.task import kd_loss
    from gem.model.loss import masked_bce, task_labels, task_masks

    ex = SyntheticWorld(SyntheticDataSpec(num_users=20, num_ads=40, mean_history_len=6)).sample(64, split=0)
    batch = make_batch(ex, np.arange(64), max_seq_len=8)
    g = torch.Generator().manual_seed(0)
    student = {t: torch.randn(64, generator=g) for t in ("click", "conversion")}
    teacher = {t: torch.randn(64, generator=g) for t in ("click", "conversion")}
    labels, masks = task_labels(batch), task_masks(batch)
    hard = {t: masked_bce(student[t], labels[t], masks[t]) for t in student}
    soft = {t: masked_bce(student[t] / 2.0, torch.sigmoid(teacher[t] / 2.0), masks[t]) for t in student}
    # α = 0 is the no-teacher baseline: labels only, whatever the teacher says
    total, _ = kd_loss(student, teacher, batch, alpha=0.0, temperature=2.0)
    assert torch.allclose(total, hard["click"] + hard["conversion"])
    total, parts = kd_loss(student, teacher, batch, alpha=0.3, temperature=2.0)
    for t in student:
        assert torch.allclose(parts[t], 0.7 * hard[t] + 0.3 * soft[t])
    # conversion is distilled on clicked impressions only
    unclicked = batch.click == 0
    moved = {t: v.clone() for t, v in teacher.items()}
    moved["conversion"][unclicked] += 5.0
    assert torch.allclose(kd_loss(student, moved, batch, alpha=1.0, temperature=2.0)[1]["conversion"],
                          kd_loss(student, teacher, batch, alpha=1.0, temperature=2.0)[1]["conversion"])


def test_a_bf16_students_history_mean_holds_beyond_256_events():
    """precision bf16 trains the student's weights in bf16: its pooled history summed and counted the
    events in bf16, whose running sums stop growing near 256, so a student reading 512 events got twice
    their mean (600 copies of one event pooled to 2x that event)."""
    import copy

    import numpy as np
    import torch

    from gem.api.types import StudentSpec, SyntheticDataSpec
    from gem.data.batch import make_batch
    from gem.data.synthetic import SyntheticWorld

    ex = SyntheticWorld(SyntheticDataSpec(num_users=20, num_ads=40, mean_history_len=6)).sample(2, split=0)
    batch = make_batch(ex, np.arange(2), max_seq_len=8)
    n = 600  # each example's first event, n times: the mean of its last 512 is that event
    first = batch.seq_offsets[:-1]
    for field in ("seq_ad_id", "seq_campaign_id", "seq_type", "seq_timestamp", "seq_surface"):
        setattr(batch, field, getattr(batch, field)[first].repeat_interleave(n))
    batch.seq_offsets = torch.tensor([0, n, 2 * n], dtype=batch.seq_offsets.dtype)
    torch.manual_seed(0)
    model = StudentModel(StudentSpec(embedding_dim=8, hidden_dim=16, max_seq_len=512))
    with torch.no_grad():
        want = model.pooled_history(batch)
        got = copy.deepcopy(model).to(torch.bfloat16).pooled_history(batch)
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want, rtol=2e-2, atol=1e-2), (got, want)


def test_kd_distills_over_mixed_data_sources(tmp_path):
    """distillation.method kd with spec.data.sources: the trainer mixes the sources for the student and the
    teacher alike (both read each batch), with per-source eval metrics; only loopfm refuses mixing."""
    import torch

    from gem.api import parse_object
    from gem.model import build_model

    world = {"numUsers": 40, "numAds": 30, "numTrainExamples": 256, "numEvalExamples": 64, "meanHistoryLen": 6}
    fm = {"apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": "fm"},
          "spec": {"model": {"preset": "tiny"}, "data": {"synthetic": world}}}
    teacher = tmp_path / "fm" / "step-00000001"
    teacher.mkdir(parents=True)
    (teacher / "gem.yaml").write_text(yaml.safe_dump(fm))
    torch.manual_seed(0)
    torch.save(build_model(parse_object(fm).spec.model).state_dict(), teacher / "model.pt")
    path = write(tmp_path, {
        "apiVersion": "gem.dev/v1alpha1", "kind": "LoopFMDistill", "metadata": {"name": "mixed"},
        "spec": {
            "teacher": {"checkpoint": str(teacher)},
            "student": {"embeddingDim": 8, "hiddenDim": 16, "maxSeqLen": 8},
            "distillation": {"method": "kd", "alpha": 0.5},
            "data": {"sources": [{"name": "feed", "synthetic": {**world, "seed": 1}, "weight": 3},
                                 {"name": "reels", "synthetic": {**world, "seed": 2}}]},
            "training": {"steps": 4, "batchSize": 32, "warmupSteps": 1},
            "checkpoint": {"path": str(tmp_path / "ckpt"), "everySteps": 4},
            "mlflow": {"enabled": False},
        },
    })
    assert cli.main(["distill", "--config", str(path)]) == 0
    report = json.loads((tmp_path / "termination-log").read_text())
    assert report["step"] == 4
    m = report["metrics"]
    assert {"ne/click@feed", "ne/click@reels", "teacher_ne/click"} <= m.keys(), sorted(m)
    model, manifest = checkpoint.load_model(report["checkpoint"])
    assert isinstance(model, StudentModel) and [s.name for s in manifest.spec.data.sources] == ["feed", "reels"]

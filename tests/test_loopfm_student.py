"""The LoopFM student: shapes, memory features, aux-head gradient scaling, adapter target, and
`gem distill` with distillation.method: loopfm end to end on a tiny teacher."""

import json
from pathlib import Path

import numpy as np
import torch
import yaml

from gem import cli
from gem.api.types import StudentSpec, SyntheticDataSpec
from gem.data.batch import make_batch
from gem.data.synthetic import SyntheticWorld
from gem.loopfm.memory import EmbeddingMemory
from gem.loopfm.student import LoopFMStudent, load_loopfm_student, scale_grad, student_flops
from gem.loopfm.task import loopfm_loss
from gem.distill.student import StudentModel

SPEC = StudentSpec(embedding_dim=8, hidden_dim=16, max_seq_len=8)


def small_batch(n=32):
    ex = SyntheticWorld(SyntheticDataSpec(num_users=20, num_ads=40, mean_history_len=6)).sample(n, split=0)
    return ex, make_batch(ex, np.arange(n), max_seq_len=8)


def test_scale_grad():
    x = torch.ones(3, requires_grad=True)
    (scale_grad(x, 0.25) * 2).sum().backward()
    assert torch.allclose(x.grad, torch.full((3,), 0.5))


def test_shapes_memory_and_point_in_time(tmp_path):
    ex, batch = small_batch()
    mem = EmbeddingMemory(tmp_path)
    mem.append(ex.user_id, ex.request_time, "v", np.random.default_rng(0).normal(size=(len(ex), 6)))
    model = LoopFMStudent(SPEC, memory_dim=6, memory_k=8).attach_memory(mem.index())
    emb, valid = model.memory_features(batch)
    assert emb.shape == (32, 8, 6) and valid.shape == (32, 8)
    # every returned embedding was logged strictly before the example's own request
    _, ts, v = mem.lookup(ex.user_id, ex.request_time, 8)
    assert (ts[v] < np.repeat(ex.request_time, v.sum(1))).all()
    out = model(batch)
    assert set(out) == {"click", "conversion"} and out["click"].shape == (32,)
    teacher = {"click": torch.randn(32), "conversion": torch.randn(32)}
    out = model(batch, teacher)
    assert {"aux/click", "adapter/click", "aux/conversion", "adapter/conversion"} <= out.keys()
    # the adapter starts as the identity on the teacher logit
    assert torch.allclose(out["adapter/click"], teacher["click"], atol=1e-6)
    # same backbone as the KD student, small extra serving cost
    assert student_flops(model) < 1.6 * student_flops(StudentModel(SPEC))
    # the reader's serving work is counted: ad + campaign (d) and per task B_t m, then · c (d² + d)
    first = LoopFMStudent(SPEC, memory_dim=6, memory_k=8, memory_bilinear=False, memory_campaign=False)
    assert student_flops(model) - student_flops(first) == 8 + 2 * (8 * 8 + 8)
    # a user with no memory yet reads zeros, and the memory token does not depend on empty slots
    assert torch.all(model.read_memory(emb[:1] * 0 + 5.0, torch.zeros(1, 8, dtype=torch.bool)) == 0)
    full = model.read_memory(emb, valid)
    junk = model.read_memory(torch.where(valid.unsqueeze(-1), emb, torch.full_like(emb, 99.0)), valid)
    assert torch.allclose(full, junk)


def test_distillation_spec_is_wired(tmp_path):
    from gem.api.types import DistillationSpec

    dist = DistillationSpec(method="loopfm", beta=0.3, memory_k=4, memory_retention_seconds=5000)
    model = LoopFMStudent.from_spec(SPEC, dist, memory_dim=6)
    assert (model.beta, model.memory_k, model.memory_max_age_s) == (0.3, 4, 5000)
    assert model.memory_recency.shape == (4,)
    # retention: only embeddings within memory_max_age_s of the request are read
    mem = EmbeddingMemory(tmp_path)
    mem.append(np.array([1, 1, 1]), np.array([1000, 5000, 9000]), "v", np.eye(3, 6))
    model.attach_memory(mem.index())
    ex, batch = small_batch(2)
    batch.user_id = torch.tensor([1, 1])
    batch.request_time = torch.tensor([9500, 6500])
    _, valid = model.memory_features(batch)
    assert valid.sum(1).tolist() == [2, 1]  # 9500 reads 9000 and 5000; 6500 reads 5000 (1000 has expired)
    model.memory_max_age_s = None
    assert model.memory_features(batch)[1].sum(1).tolist() == [3, 2]  # no retention: everything before


def test_aux_head_gradient_into_backbone_is_scaled_by_beta():
    _, batch = small_batch()
    teacher = {"click": torch.randn(32), "conversion": torch.randn(32)}
    grads = {}
    for beta in (1.0, 0.25):
        torch.manual_seed(0)
        model = LoopFMStudent(SPEC, memory_dim=6, beta=beta)
        out = model(batch, teacher)
        out["aux/click"].sum().backward()  # only the aux head's loss
        grads[beta] = model.mlp[0].weight.grad.clone()
        assert torch.count_nonzero(model.heads["click"].weight.grad or torch.zeros(1)) == 0
    assert torch.allclose(grads[0.25], 0.25 * grads[1.0], atol=1e-6)


def test_loss_serving_head_sees_labels_only_and_adapter_targets_labels():
    _, batch = small_batch()
    head_grads = []
    for seed in (1, 2):  # two different teachers
        torch.manual_seed(0)
        model = LoopFMStudent(SPEC, memory_dim=6)
        g = torch.Generator().manual_seed(seed)
        teacher = {"click": torch.randn(32, generator=g, requires_grad=True),
                   "conversion": torch.randn(32, generator=g)}
        out = model(batch, teacher)
        total, parts = loopfm_loss(out, teacher, batch, alpha=1.0, temperature=2.0)
        total.backward()
        head_grads.append(model.heads["click"].weight.grad.clone())
        assert model.aux_heads["click"].weight.grad.abs().sum() > 0
        assert model.adapter["click"][2].weight.grad.abs().sum() > 0  # the adapter trains on labels
        assert teacher["click"].grad is None  # the teacher's logits are a constant
        assert "adapter/click" in parts
    # the serving head's gradient does not depend on the teacher at all: it is trained on labels only
    assert head_grads[0].abs().sum() > 0 and torch.allclose(head_grads[0], head_grads[1])


DATA = {"synthetic": {"numUsers": 200, "numAds": 80, "numTrainExamples": 1500, "numEvalExamples": 500,
                      "meanHistoryLen": 12}}


def test_gem_distill_loopfm_end_to_end(tmp_path, trainer_env):
    ckpt = str(tmp_path / "ckpt")
    teacher = tmp_path / "teacher.yaml"
    teacher.write_text(yaml.safe_dump({
        "apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": "teacher"},
        "spec": {"model": {"preset": "tiny"}, "data": DATA,
                 "training": {"steps": 8, "batchSize": 64, "warmupSteps": 3, "learningRate": 0.003},
                 "checkpoint": {"path": ckpt, "everySteps": 8}, "mlflow": {"enabled": False}}}))
    assert cli.main(["train", "--config", str(teacher)]) == 0
    student = tmp_path / "student.yaml"
    student.write_text(yaml.safe_dump({
        "apiVersion": "gem.dev/v1alpha1", "kind": "LoopFMDistill", "metadata": {"name": "lf"},
        "spec": {"teacher": {"gemTraining": "teacher"},
                 "student": {"embeddingDim": 8, "hiddenDim": 16, "maxSeqLen": 8},
                 "distillation": {"method": "loopfm", "alpha": 0.5, "temperature": 2.0, "beta": 0.25,
                                  "memoryK": 4},
                 "data": DATA,
                 "training": {"steps": 8, "batchSize": 64, "warmupSteps": 3, "learningRate": 0.003},
                 "checkpoint": {"path": ckpt, "everySteps": 8}, "mlflow": {"enabled": False}}}))
    assert cli.main(["distill", "--config", str(student)]) == 0
    report = json.loads((tmp_path / "termination-log").read_text())
    m = report["metrics"]
    assert report["step"] == 8 and m["ne/click"] is not None and m["teacher_ne/click"] is not None
    memory = EmbeddingMemory(tmp_path / "ckpt" / "local" / "lf" / "memory")
    assert len(memory.index()) == 2000 and memory.index().dim == 32  # tiny preset: the "history" kind, d
    model, manifest = load_loopfm_student(report["checkpoint"])
    assert isinstance(model, LoopFMStudent) and manifest.spec.distillation.method == "loopfm"
    assert model._memory is not None and len(model._memory) == 2000
    assert (model.beta, model.memory_k) == (0.25, 4)  # from the manifest's distillation fields
    # the trainer saved the memory version in gem.yaml, and the job memory is marked complete
    from gem.loopfm.task import MEMORY_VERSION_ANNOTATION

    assert manifest.metadata.annotations[MEMORY_VERSION_ANNOTATION] == memory.model_versions()[0]
    assert len(list(memory.root.glob("logged-*.json"))) == 1
    # the generic loader (`gem eval`, Solaris) rebuilds the same student, memory attached
    from gem.train.checkpoint import load_model

    loaded, _ = load_model(report["checkpoint"])
    assert isinstance(loaded, LoopFMStudent) and len(loaded._memory) == 2000
    batch = make_batch(SyntheticWorld(SyntheticDataSpec.model_validate(DATA["synthetic"])).sample(16, split=1),
                       np.arange(16), max_seq_len=8)
    with torch.no_grad():
        assert torch.equal(loaded(batch)["click"], model(batch)["click"])

    # A checkpoint of the first reader (ad ⊙ memory only: no campaign, no bilinear scores) loads as that reader.
    from gem.train.checkpoint import MODEL_FILE

    first = LoopFMStudent.from_spec(manifest.spec.student, manifest.spec.distillation, model.memory_dim,
                                    memory_bilinear=False, memory_campaign=False)
    torch.save(first.state_dict(), Path(report["checkpoint"]) / MODEL_FILE)
    old, _ = load_loopfm_student(report["checkpoint"])
    assert old.memory_score is None and not old.memory_campaign and old._memory is not None
    with torch.no_grad():
        assert torch.equal(old(batch)["click"], first.eval().attach_memory(old._memory)(batch)["click"])


def _train_eval_click_ne(model, train, evaluation, steps=250):
    from gem.eval.metrics import normalized_entropy
    from gem.model.loss import multitask_bce

    rng = np.random.default_rng(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.003)
    model.train()
    for _ in range(steps):
        b = make_batch(train, rng.choice(len(train), 128, replace=False), max_seq_len=8)
        loss, _ = multitask_bce(model(b), b)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        logit = model(make_batch(evaluation, np.arange(len(evaluation)), max_seq_len=8))["click"].numpy()
    return float(normalized_entropy(evaluation.click, 1 / (1 + np.exp(-logit))))


def test_informative_memory_beats_uninformative_on_a_tiny_problem(tmp_path):
    """The reader must turn a memory of the users' interests into better predictions: the same
    student, same batches, reading (a) noisy copies of each user's hidden interest logged before
    the requests, (b) random vectors of the same shape. (a) must win clearly; a reader that
    ignored the memory, or could not cross it with the candidate, would tie."""
    from gem.data.synthetic import START_TIME

    spec = SyntheticDataSpec(num_users=60, num_ads=64, mean_history_len=4, interest_drift=0.0)
    world = SyntheticWorld(spec)
    train, evaluation = world.sample(6000, split=0), world.sample(3000, split=1)
    rng = np.random.default_rng(1)
    users = np.repeat(np.arange(spec.num_users), 4)
    ts = START_TIME - rng.integers(1, 86400, len(users))  # all logged before any request
    informative = world.interest_start[users] + 0.1 * rng.normal(size=(len(users), 8))
    nes = {}
    for name, emb in (("informative", informative), ("random", rng.normal(size=informative.shape))):
        mem = EmbeddingMemory(tmp_path / name)
        mem.append(users, ts, "v", emb.astype(np.float32))
        torch.manual_seed(0)
        model = LoopFMStudent(StudentSpec(embedding_dim=8, hidden_dim=32, max_seq_len=8), memory_dim=8, memory_k=4)
        nes[name] = _train_eval_click_ne(model.attach_memory(mem.index()), train, evaluation)
    assert nes["informative"] < nes["random"] - 0.01, nes  # 0.03 here (0.01 to 0.03 over torch seeds)

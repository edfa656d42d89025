"""`gem train` / `gem eval` as one process: checkpoints, resume, the report, MLflow, bad configs.

The runs call gem.cli.main in-process (no torch/DeepSpeed import per run); test_gem_distributed.py
covers torchrun. Learning, the final report, the checkpoint layout and `gem eval` of a finished run
are checked on test_modules_gem_train.py's run (the GEM it compares with DLRM): one training for both.
"""

import json
import os
import shutil

import pytest
import torch
import yaml

from gem import cli
from gem.train import checkpoint


def manifest(tmp_path, name, *, steps=40, every=20, mlflow=None, **spec_overrides):
    spec = {
        "model": {"preset": "tiny"},
        "data": {"synthetic": {"numUsers": 500, "numAds": 200, "numTrainExamples": 6000, "numEvalExamples": 1500,
                               "meanHistoryLen": 24}},
        "training": {"steps": steps, "batchSize": 32, "warmupSteps": 5, "learningRate": 0.003},
        "checkpoint": {"path": str(tmp_path / "ckpt"), "everySteps": every, "keepLast": 2},
        "mlflow": mlflow or {"enabled": False},
    }
    for key, value in spec_overrides.items():
        spec[key] = {**spec.get(key, {}), **value}
    obj = {"apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": name}, "spec": spec}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(obj))
    return path


# every test runs `gem train` / `gem distill` in this process (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("trainer_env")


def termination(tmp_path):
    return json.loads((tmp_path / "termination-log").read_text())


def test_resume_continues_at_the_right_step_and_matches_an_uninterrupted_run(tmp_path, caplog):
    straight = manifest(tmp_path, "straight", steps=40, every=20)
    assert cli.main(["train", "--config", str(straight)]) == 0

    resumed = manifest(tmp_path, "resumed", steps=40, every=20)
    os.environ["GEM_FAULT_AT_STEP"] = "30"  # dies after step 30; the last checkpoint is step 20
    assert cli.main(["train", "--config", str(resumed)]) == 1
    assert termination(tmp_path) == {"error": "RuntimeError: fault injected after step 30 (GEM_FAULT_AT_STEP)"}
    del os.environ["GEM_FAULT_AT_STEP"]
    with caplog.at_level("INFO", logger="gem.train"):
        assert cli.main(["train", "--config", str(resumed)]) == 0
    assert "resumed from" in caplog.text and "at step 20" in caplog.text
    assert termination(tmp_path)["step"] == 40

    a = torch.load(tmp_path / "ckpt/local/straight/step-00000040/model.pt")
    b = torch.load(tmp_path / "ckpt/local/resumed/step-00000040/model.pt")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6, msg=name)


def test_an_interrupted_save_is_never_taken_as_complete(tmp_path, monkeypatch, caplog):
    path = manifest(tmp_path, "crashy", steps=60, every=20)
    real = checkpoint.full_state_dict
    calls = []

    def crash_on_second_save(engine, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full (simulated)")
        return real(engine, **kw)

    monkeypatch.setattr(checkpoint, "full_state_dict", crash_on_second_save)
    assert cli.main(["train", "--config", str(path)]) == 1
    assert termination(tmp_path)["error"] == "OSError: disk full (simulated)"
    job = tmp_path / "ckpt/local/crashy"
    assert (job / ".tmp-step-00000040").is_dir()  # the half-written save is left behind...
    assert checkpoint.latest_complete(job) == job / "step-00000020"  # ...but ignored
    # A directory renamed but not yet marked COMPLETE is ignored too.
    shutil.copytree(job / "step-00000020", job / "step-00000050")
    (job / "step-00000050" / "COMPLETE").unlink()
    assert checkpoint.latest_complete(job) == job / "step-00000020"

    monkeypatch.setattr(checkpoint, "full_state_dict", real)
    with caplog.at_level("INFO", logger="gem.train"):
        assert cli.main(["train", "--config", str(path)]) == 0
    assert "at step 20" in caplog.text
    assert [p.name for p in checkpoint.complete_checkpoints(job)] == ["step-00000040", "step-00000060"]
    assert not any(p.name.startswith(".tmp") for p in job.iterdir())


def test_mlflow_logging_and_a_restart_reuses_the_run(tmp_path, monkeypatch):
    import mlflow
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)  # nothing the run writes lands in the repository
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    os.environ["MLFLOW_TRACKING_URI"] = uri
    path = manifest(tmp_path, "tracked", steps=30, every=10, mlflow={"enabled": True, "experiment": "gem-test"})
    os.environ["GEM_FAULT_AT_STEP"] = "20"
    assert cli.main(["train", "--config", str(path)]) == 1
    del os.environ["GEM_FAULT_AT_STEP"]
    assert cli.main(["train", "--config", str(path)]) == 0
    report = termination(tmp_path)

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("gem-test")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1  # the restart continued the same run
    run = runs[0]
    assert report["mlflowRunId"] == run.info.run_id and report["mlflowExperimentId"] == exp.experiment_id
    assert report["mlflowRunUrl"] is None  # only http(s) tracking servers have a UI link
    assert run.info.status == "FINISHED"
    assert run.data.tags["gem.dev/name"] == "tracked" and run.data.tags["gem.dev/namespace"] == "local"
    assert run.data.tags["gem.dev/kind"] == "GEMTraining" and run.data.tags["gem.dev/uid"]
    assert run.data.params["training.steps"] == "30" and run.data.params["model.preset"] == "tiny"
    losses = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted({m.step for m in losses}) == list(range(1, 31))
    assert run.data.metrics["ne/click"] == pytest.approx(report["metrics"]["ne/click"])
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"gem.yaml", "checkpoint"} <= artifacts
    assert {a.path for a in client.list_artifacts(run.info.run_id, "checkpoint")} == {
        "checkpoint/gem.yaml", "checkpoint/model.pt"}
    mlflow.set_tracking_uri(None)


def test_run_url_for_http_tracking():
    from gem.api import parse_object
    from gem.train.tracking import Tracker

    obj = parse_object({"apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": "x"},
                        "spec": {}})
    t = Tracker(obj, active=True)
    t.tracking_uri, t.experiment_id, t.run_id = "http://mlflow.gem-system:5000/", "7", "abc"
    assert t.run_url == "http://mlflow.gem-system:5000/#/experiments/7/runs/abc"


@pytest.mark.parametrize("change, field", [
    (lambda o: o["spec"]["training"].update(steps=0), "spec.training.steps"),
    (lambda o: o["spec"]["model"].update(preset="huge"), "spec.model.preset"),
    (lambda o: o["spec"]["training"].update(batchSise=8), "spec.training.batchSise"),
])
def test_bad_config_names_the_field(tmp_path, capsys, change, field):
    path = manifest(tmp_path, "bad")
    obj = yaml.safe_load(path.read_text())
    change(obj)
    path.write_text(yaml.safe_dump(obj))
    assert cli.main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert field in err
    assert field in termination(tmp_path)["error"]


def test_wrong_kind_and_missing_file(tmp_path, capsys):
    path = manifest(tmp_path, "kind")
    assert cli.main(["distill", "--config", str(path)]) == 2
    assert "kind must be LoopFMDistill" in capsys.readouterr().err
    assert cli.main(["train", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_cpu_init_skips_deepspeeds_shared_memory_op():
    """DeepSpeed's CPU backend would JIT-compile its shm all-reduce op (~40 s of g++) that training
    never uses; init_distributed keeps it from being built (gem.parallel.deepspeed_config)."""
    import deepspeed.comm.comm as ds_comm

    from gem.train.dist import init_distributed, shutdown

    env = init_distributed()
    try:
        assert env.device.type == "cpu" and ds_comm.cdb is not None
        assert ds_comm.cdb.shm_comm_op is None
    finally:
        shutdown()


def test_the_loaders_random_streams_are_not_the_synthetic_worlds(tmp_path, monkeypatch):
    """training.seed and data.synthetic.seed both default to 0, and both seeded numpy with plain entropy
    [seed, ...]: the loader's epoch 0 order was a permutation drawn from the world's own generator
    ([seed, 0]), epoch 1's from the train split's sampler ([seed, 1], which numpy pads to [seed, 1, 0]),
    epoch 3's from the first chunk of the streamed train split; a Parquet epoch's row-group order from
    split e's sampler. The loaders now draw from spawned streams of training.seed."""
    import numpy as np

    from gem.api.types import SyntheticDataSpec
    from gem.data import loader as loader_mod
    from gem.data.parquet import ParquetLoader, write_splits
    from gem.data.synthetic import build_splits

    spec = SyntheticDataSpec(num_users=50, num_ads=20, num_train_examples=64, num_eval_examples=8, mean_history_len=4)
    train, eval_ = build_splits(spec)
    n = len(train)
    # the synthetic world's streams (gem/data/synthetic.py): world, split samplers, streamed chunks
    world = [[spec.seed, 0]] + [[spec.seed, 1, split] for split in range(4)] + \
            [[spec.seed, 3, split, i] for split in range(2) for i in range(4)]

    def world_orders(size):
        return [np.random.default_rng(entropy).permutation(size).tolist() for entropy in world]

    monkeypatch.setattr(loader_mod, "make_batch", lambda examples, index, **kw: index)  # the order handed out
    loader = loader_mod.ShardedLoader(train, batch_size=n, max_seq_len=8, rank=0, world_size=1, seed=spec.seed)
    orders = [loader.next_batch().tolist() for _ in range(8)]  # one batch per epoch
    assert all(sorted(o) == list(range(n)) for o in orders)
    taken = world_orders(n)
    assert not [e for e, o in enumerate(orders) if o in taken]

    # 16 row groups of 4 rows: the epoch's row-group order
    parquet = ParquetLoader(write_splits(train, eval_, tmp_path / "pq", rows_per_group=4) / "train",
                            batch_size=4, max_seq_len=8, seed=spec.seed)
    groups = len(parquet.source.groups)
    assert groups == 16
    taken = world_orders(groups)
    assert not [e for e in range(4) if parquet._epoch_groups(e).tolist() in taken]


@pytest.mark.parametrize("message", ["line\n" * 2000, '"quoted" ' * 1000, "é" * 3000])
def test_a_long_error_report_is_valid_json(tmp_path, monkeypatch, message):
    """The termination message (Kubernetes keeps 4096 bytes) of a long error: cut at a byte count of
    the raw message, its JSON (newlines and quotes escaped to 2 bytes, non-ASCII to 6) outgrew the
    limit, and the last-resort cut left invalid JSON, which the operator's status cannot read."""
    from gem.train import report

    path = tmp_path / "termination-log"
    monkeypatch.setenv(report.ENV_PATH, str(path))
    report.write(report.error_payload(RuntimeError(message)))
    assert len(path.read_bytes()) <= report.MAX_BYTES
    error = json.loads(path.read_text())["error"]
    assert error.startswith("RuntimeError: " + message[:100]) and error.endswith("…")
    assert len(path.read_bytes()) > report.MAX_BYTES - 8  # cut no shorter than it must be


def test_a_loss_that_is_not_finite_stops_the_run_before_a_checkpoint_of_it(tmp_path, monkeypatch):
    """A NaN in a batch's dense features (or a diverging model) made the loss NaN and, from that step on,
    every weight: training went on, saved NaN checkpoints and reported NaN metrics with exit 0. It now
    stops at that step (exit 1, the report naming it); the checkpoints before it stay the last complete."""
    from gem.train.trainer import Trainer

    real, calls = Trainer._train_step, []

    def poisoned(self, batch):
        calls.append(1)
        if len(calls) == 5:
            batch.dense[0, 0] = float("nan")  # what a feature pipeline's missing value looks like
        return real(self, batch)

    monkeypatch.setattr(Trainer, "_train_step", poisoned)
    path = manifest(tmp_path, "nan", steps=10, every=2)
    assert cli.main(["train", "--config", str(path)]) == 1
    error = termination(tmp_path)["error"]
    assert error.startswith("DivergedError: the training loss is nan at step 5 (rank 0)"), error
    assert "the last complete checkpoint is step-00000004" in error and "spec.training.learningRate" in error
    job = tmp_path / "ckpt" / "local" / "nan"
    assert [p.name for p in checkpoint.complete_checkpoints(job)] == ["step-00000002", "step-00000004"]
    state = torch.load(job / "step-00000004" / "model.pt")
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())

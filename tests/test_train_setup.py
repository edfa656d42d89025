"""`gem train` / `gem eval` in-process: config errors found at setup exit 2 naming the field, where
`gem eval` looks for checkpoints, corrupt-checkpoint fallback, durable saves, and which MLflow run
a start continues."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest
import yaml

from gem import cli
from gem.data.errors import SpecError
from gem.train import checkpoint
from gem.train.dist import DistEnv

pytestmark = pytest.mark.usefixtures("trainer_env")  # tests/conftest.py


def manifest(tmp_path, name, *, steps=4, every=2, ckpt="ckpt", **spec_overrides):
    spec = {
        "model": {"preset": "tiny"},
        "data": {"synthetic": {"numUsers": 50, "numAds": 20, "numTrainExamples": 256, "numEvalExamples": 64,
                               "meanHistoryLen": 4}},
        "training": {"steps": steps, "batchSize": 8, "warmupSteps": 0},
        "checkpoint": {"path": str(tmp_path / ckpt), "everySteps": every, "keepLast": 3},
        "mlflow": {"enabled": False},
    }
    for key, value in spec_overrides.items():
        spec[key] = {**spec.get(key, {}), **value}
    obj = {"apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": name}, "spec": spec}
    path = tmp_path / f"{name}-{ckpt}.yaml"
    path.write_text(yaml.safe_dump(obj))
    return path


def config_error(tmp_path, capsys, argv, field):
    """Run the CLI; it must exit 2 with `field` in stderr and in the termination message."""
    assert cli.main(argv) == 2
    assert field in capsys.readouterr().err
    assert field in json.loads((tmp_path / "termination-log").read_text())["error"]


# --------------------------------------------------------------------------- config errors at setup


def test_missing_parquet_data_is_a_config_error(tmp_path, capsys):
    path = manifest(tmp_path, "pq", data={"source": "parquet", "path": str(tmp_path / "no-such-dir")})
    config_error(tmp_path, capsys, ["train", "--config", str(path)], "spec.data.path")
    # refused before anything was trained or saved (only the job dir exists: the writability check made it)
    assert checkpoint.latest_complete(tmp_path / "ckpt/local/pq") is None
    assert not any((tmp_path / "ckpt/local/pq").iterdir())


def test_an_empty_eval_split_fails_before_training(tmp_path, capsys):
    from tests.test_data_spec_errors import write_parquet

    data = write_parquet(tmp_path / "d", n_train=256, n_eval=0)
    path = manifest(tmp_path, "noeval", data={"source": "parquet", "path": str(data)})
    config_error(tmp_path, capsys, ["train", "--config", str(path)], "spec.data.path")
    assert checkpoint.latest_complete(tmp_path / "ckpt/local/noeval") is None


@pytest.mark.parametrize("via_env", [False, True])
def test_an_unwritable_checkpoint_root_fails_before_training(tmp_path, capsys, monkeypatch, via_env):
    """A root under a regular file cannot be created, even by root: exit 2 naming both knobs, before
    any data is loaded (was: PermissionError at the first save, checkpoint.everySteps steps in)."""
    (tmp_path / "file").write_text("")
    monkeypatch.delenv(checkpoint.ENV_CHECKPOINT_DIR, raising=False)
    if via_env:
        monkeypatch.setenv(checkpoint.ENV_CHECKPOINT_DIR, str(tmp_path / "file" / "volume"))
        path = manifest(tmp_path, "ro")
    else:
        path = manifest(tmp_path, "ro", checkpoint={"path": str(tmp_path / "file" / "ckpt")})

    def no_setup(*args, **kwargs):
        raise AssertionError("the run set up before checking its checkpoint root")

    monkeypatch.setattr("gem.train.trainer.load_data", no_setup)
    config_error(tmp_path, capsys, ["train", "--config", str(path)], "spec.checkpoint.path")
    report = json.loads((tmp_path / "termination-log").read_text())["error"]
    assert "GEM_CHECKPOINT_DIR" in report and str(tmp_path / "file") in report
    assert ("wins over spec.checkpoint.path" in report) == via_env


def test_an_unwritable_checkpoint_root_fails_before_a_loopfm_distill_loads_its_teacher(tmp_path, capsys, monkeypatch):
    """`gem distill` (LoopFM) checks the root before building its task, which loads the teacher and
    creates the memory dir under the root (was: PermissionError, exit 1, after the teacher load)."""
    (tmp_path / "file").write_text("")
    monkeypatch.delenv(checkpoint.ENV_CHECKPOINT_DIR, raising=False)
    obj = {"apiVersion": "gem.dev/v1alpha1", "kind": "LoopFMDistill", "metadata": {"name": "lf"},
           "spec": {"teacher": {"checkpoint": str(tmp_path / "fm")},
                    "student": {"embeddingDim": 8, "hiddenDim": 16, "maxSeqLen": 8},
                    "distillation": {"method": "loopfm", "memoryK": 4},
                    "data": {"synthetic": {"numUsers": 30, "numAds": 20, "numTrainExamples": 200,
                                           "numEvalExamples": 50, "meanHistoryLen": 6}},
                    "checkpoint": {"path": str(tmp_path / "file" / "ckpt")}, "mlflow": {"enabled": False}}}
    path = tmp_path / "lf.yaml"
    path.write_text(yaml.safe_dump(obj))

    def no_task(*args, **kwargs):
        raise AssertionError("the run built its task (loading the teacher) before checking its checkpoint root")

    monkeypatch.setattr(cli, "_task", no_task)
    config_error(tmp_path, capsys, ["distill", "--config", str(path)], "spec.checkpoint.path")
    assert str(tmp_path / "file") in json.loads((tmp_path / "termination-log").read_text())["error"]


@pytest.mark.parametrize("example", ["quickstart.yaml", "loopfm-distill.yaml"])
def test_example_local_commands_set_a_writable_checkpoint_root(example):
    """The examples keep the pods' checkpoint.path (/var/lib/gem/...): their local `gem` command must
    point GEM_CHECKPOINT_DIR somewhere a user can write, or it dies at the first save."""
    text = (Path(__file__).resolve().parents[1] / "examples" / example).read_text()
    commands = [line for line in text.splitlines() if line.startswith("#") and " --config examples/" in line
                and ("gem train" in line or "gem distill" in line)]
    assert commands
    for line in commands:
        assert "GEM_CHECKPOINT_DIR=.gem/checkpoints gem " in line, line


def test_gradient_accumulation_overrides_are_refused(tmp_path, capsys):
    from gem.api.types import ParallelismSpec, TrainingSpec
    from gem.train.dist import deepspeed_config

    for key, value in (("gradient_accumulation_steps", 4), ("train_micro_batch_size_per_gpu", 4),
                       ("train_batch_size", 32)):
        training = TrainingSpec.model_validate({"batchSize": 8, "deepspeed": {key: value}})
        with pytest.raises(SpecError, match=rf"^spec\.training\.deepspeed\.{key}: "):
            deepspeed_config(training, ParallelismSpec(), world_size=1)
    same = TrainingSpec.model_validate({"batchSize": 8, "deepspeed": {"gradient_accumulation_steps": 1}})
    assert deepspeed_config(same, ParallelismSpec(), world_size=1)["gradient_accumulation_steps"] == 1
    path = manifest(tmp_path, "gas", training={"deepspeed": {"gradient_accumulation_steps": 4,
                                                             "train_batch_size": 32}})
    config_error(tmp_path, capsys, ["train", "--config", str(path)],
                 "spec.training.deepspeed.gradient_accumulation_steps")


@pytest.mark.parametrize("precision,key,section", [("bf16", "bf16", {"enabled": False}),
                                                   ("mxfp8", "bf16", {"enabled": False}),
                                                   ("fp32", "bf16", {"enabled": True}),
                                                   ("fp32", "bfloat16", {"enabled": True}),
                                                   ("fp32", "fp16", {"enabled": True}),
                                                   ("bf16", "fp16", {"enabled": True})])
def test_precision_overrides_that_contradict_spec_training_precision_are_refused(precision, key, section):
    """bf16.enabled false with precision bf16 trained fp32 weights under bf16 autocast, which gem eval
    then evaluated cast to bf16 (other metrics than the trainer's); fp16 (not offered) was accepted."""
    from gem.api.types import ParallelismSpec, TrainingSpec
    from gem.train.dist import deepspeed_config

    training = TrainingSpec.model_validate({"batchSize": 8, "precision": precision, "deepspeed": {key: section}})
    with pytest.raises(SpecError, match=rf"^spec\.training\.deepspeed\.{key}: .*spec\.training\.precision"):
        deepspeed_config(training, ParallelismSpec(), world_size=1)


def test_precision_overrides_that_agree_with_spec_training_precision_are_merged():
    from gem.api.types import ParallelismSpec, TrainingSpec
    from gem.train.dist import deepspeed_config

    training = TrainingSpec.model_validate({"batchSize": 8, "precision": "bf16", "deepspeed": {
        "bf16": {"enabled": True, "immediate_grad_update": True}, "fp16": {"enabled": False}}})
    config = deepspeed_config(training, ParallelismSpec(), world_size=1)
    assert config["bf16"] == {"enabled": True, "immediate_grad_update": True}
    assert config["fp16"] == {"enabled": False}


def test_the_trainer_refuses_overrides_with_the_operators_check_and_its_own_plan():
    """One check: the trainer raises what the operator and `gemctl --local` report from the spec (which,
    before, accepted these); at setup it also compares the global batch with its plan's data ranks,
    which the spec alone leaves open when the plan chooses tp."""
    from gem.api.types import GEMTraining
    from gem.api.validation import runnable_problems
    from gem.parallel.plan import ParallelPlan
    from gem.train.dist import deepspeed_config

    def gemt(training, parallelism):
        return GEMTraining.model_validate({"metadata": {"name": "x"},
                                           "spec": {"training": training, "parallelism": parallelism}})

    obj = gemt({"batchSize": 8, "precision": "bf16", "deepspeed": {
        "gradient_accumulation_steps": 4, "train_batch_size": 24, "bf16": {"enabled": False}}}, {"numNodes": 1})
    with pytest.raises(SpecError) as e:
        deepspeed_config(obj.spec.training, obj.spec.parallelism, world_size=1)
    assert str(e.value) == "; ".join(runnable_problems(obj)) and str(e.value).count("spec.training.deepspeed.") == 3
    # 4 ranks: 32 is right at tp 1, which the spec allows; the plan's tp 2 leaves 2 data ranks (16)
    obj = gemt({"batchSize": 8, "deepspeed": {"train_batch_size": 32}}, {"numNodes": 1, "procsPerNode": 4})
    assert runnable_problems(obj) == []
    plan = ParallelPlan.from_config({"dpShard": 2, "tp": 2}, world_size=4)
    with pytest.raises(SpecError, match=r"^spec\.training\.deepspeed\.train_batch_size: 32 differs from the trainer's 16;"):
        deepspeed_config(obj.spec.training, obj.spec.parallelism, world_size=4, plan=plan)


def test_a_bf16_override_disabling_bf16_is_a_config_error(tmp_path, capsys):
    path = manifest(tmp_path, "nobf16", training={"precision": "bf16", "deepspeed": {"bf16": {"enabled": False}}})
    config_error(tmp_path, capsys, ["train", "--config", str(path)], "spec.training.deepspeed.bf16")
    assert "spec.training.precision" in json.loads((tmp_path / "termination-log").read_text())["error"]
    assert checkpoint.latest_complete(tmp_path / "ckpt/local/nobf16") is None


def test_deepspeeds_own_autocast_under_fp32_is_a_config_error(tmp_path, capsys):
    """torch_autocast replaces the trainer's autocast inside the engine's forward: with precision fp32
    this job trained its forward in bf16 (exit 0) and gem eval evaluated it in fp32."""
    path = manifest(tmp_path, "dsautocast", training={"precision": "fp32", "deepspeed": {
        "torch_autocast": {"enabled": True, "dtype": "bf16"}}})
    config_error(tmp_path, capsys, ["train", "--config", str(path)], "spec.training.deepspeed.torch_autocast")
    assert checkpoint.latest_complete(tmp_path / "ckpt/local/dsautocast") is None


def test_a_zero_stage_override_is_refused_by_the_trainer_too():
    """zero_optimization.stage merged over spec.parallelism.zeroStage: DeepSpeed ran the override while
    the plan's rules (ep / sparseShard only at ZeRO-1/2) and resume's check read zeroStage."""
    from gem.api.types import ParallelismSpec, TrainingSpec
    from gem.train.dist import deepspeed_config

    training = TrainingSpec.model_validate({"deepspeed": {"zero_optimization": {"stage": 3}}})
    with pytest.raises(SpecError, match=r"^spec\.training\.deepspeed\.zero_optimization\.stage: 3 differs from "
                                        r"the trainer's 1; .*spec\.parallelism\.zeroStage"):
        deepspeed_config(training, ParallelismSpec(zeroStage=1), world_size=1)
    assert deepspeed_config(training, ParallelismSpec(zeroStage=3), world_size=1)["zero_optimization"]["stage"] == 3


def test_an_hpz_override_that_differs_from_the_plan_is_refused():
    """zero_hpz_partition_size merged over the plan's: the trainer points DeepSpeed's hpZ group at the plan's
    dp_shard group, so another size contradicted that group (or made DeepSpeed build its own across it)."""
    from gem.api.types import ParallelismSpec, TrainingSpec
    from gem.parallel.plan import ParallelPlan
    from gem.train.dist import deepspeed_config

    hsdp = ParallelPlan.from_config({"dpReplicate": 2, "dpShard": 2}, world_size=4, zero_stage=3)
    flat = ParallelPlan.from_config({"dpShard": 4}, world_size=4, zero_stage=3)
    parallelism = ParallelismSpec(zeroStage=3, numNodes=1, procsPerNode=4)

    def config(hpz, plan):
        training = TrainingSpec.model_validate({"deepspeed": {"zero_optimization": {"zero_hpz_partition_size": hpz}}})
        return deepspeed_config(training, parallelism, world_size=4, plan=plan)

    assert config(2, hsdp)["zero_optimization"]["zero_hpz_partition_size"] == 2  # agrees: merged
    for hpz, plan, planned in ((4, hsdp, 2), (2, flat, 1)):
        with pytest.raises(SpecError, match=rf"^spec\.training\.deepspeed\.zero_optimization\.zero_hpz_partition_size: "
                                            rf"{hpz} differs from the parallel plan's {planned} .*spec\.parallelism\.plan\.dpShard"):
            config(hpz, plan)


@pytest.mark.parametrize(("override", "named"), [({"zero_optimization": {"stagee": 2}}, "stagee"),
                                               ({"nebula": {"enabled": True}}, "nebula")])
def test_an_override_deepspeed_refuses_is_a_config_error_naming_training_deepspeed(tmp_path, capsys, override, named):
    """A misspelt key in a DeepSpeed section (its pydantic models forbid extras) or a key DeepSpeed 0.19
    removed failed deepspeed.initialize with exit 1 and a message that did not name the spec field."""
    path = manifest(tmp_path, "dsbad", training={"deepspeed": override})
    config_error(tmp_path, capsys, ["train", "--config", str(path)], "spec.training.deepspeed: DeepSpeed ")
    assert named in json.loads((tmp_path / "termination-log").read_text())["error"]


def test_optimizer_sections_deepspeed_would_ignore_are_a_config_error(tmp_path, capsys):
    """With the trainer's AdamW and schedule handed in, DeepSpeed ignored an `optimizer` / `scheduler`
    section: this job trained at learningRate 0.002, not 0.5, and exited 0."""
    path = manifest(tmp_path, "dsopt", training={"learningRate": 0.002, "deepspeed": {
        "optimizer": {"type": "Adam", "params": {"lr": 0.5}}}})
    config_error(tmp_path, capsys, ["train", "--config", str(path)], "spec.training.deepspeed.optimizer")
    assert "spec.training.learningRate" in json.loads((tmp_path / "termination-log").read_text())["error"]


def test_deepspeed_dtype_overrides_that_agree_keep_the_spec_precision(tmp_path, monkeypatch):
    """What validation lets through trains as the spec says: bf16 forward, bf16 module, bf16 gradients
    (DeepSpeed's data_types and torch_autocast, said again)."""
    import torch

    seen = []
    save = checkpoint.save

    def recording_save(engine, env, job, **kwargs):
        seen.append((engine.get_data_types(), engine.torch_autocast_dtype(),
                     {p.dtype for p in engine.module.parameters()}))
        return save(engine, env, job, **kwargs)

    monkeypatch.setattr(checkpoint, "save", recording_save)
    path = manifest(tmp_path, "dsagree", steps=2, training={"precision": "bf16", "deepspeed": {
        "torch_autocast": {"enabled": True, "dtype": "bfloat16"},
        "data_types": {"grad_accum_dtype": "bf16", "param_dtype": "bf16", "keep_in_fp32_modules": []}}})
    assert cli.main(["train", "--config", str(path)]) == 0
    assert seen and all(s == ((torch.bfloat16, torch.bfloat16), torch.bfloat16, {torch.bfloat16}) for s in seen)


def test_shards_with_bf16_are_a_config_error_on_every_rank(tmp_path):
    """ep=2 with bf16 (2 ranks, ZeRO-2, the tiny preset's 2 experts): the expert shards would train
    without fp32 master weights. The trainer refused it with a plain ValueError (exit 1: Kubernetes
    restarts the pod again and again); now check_deepspeed_plan, which the operator runs too, refuses it
    at setup on every rank: exit 2 naming the fields and the fix, before anything is trained or saved."""
    from tests.test_train_resume_multirank import run

    path = manifest(tmp_path, "epbf16", training={"precision": "bf16"},
                    parallelism={"numNodes": 1, "procsPerNode": 2, "zeroStage": 2, "plan": {"dpShard": 2, "ep": 2}})
    code, out = run(path, tmp_path)
    assert code != 0
    fields = "spec.parallelism.plan.ep=2 with spec.training.precision bf16 is not supported"
    assert f"gem train: {fields}" in out, out[-4000:]  # a config error, not a traceback
    # torchrun's summary: exit 2 (a rank still starting when the other failed may be stopped by SIGTERM)
    codes = {int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", out)}
    assert 2 in codes and codes <= {2, -signal.SIGTERM}, out[-4000:]
    error = json.loads((tmp_path / "termination-log").read_text())["error"]
    assert fields in error and "Set spec.training.precision to fp32, or spec.parallelism.plan.ep to 1" in error
    assert checkpoint.latest_complete(tmp_path / "ckpt/local/epbf16") is None


def test_eval_of_a_missing_checkpoint_is_a_config_error(tmp_path, capsys):
    path = manifest(tmp_path, "ev")
    config_error(tmp_path, capsys, ["eval", "--config", str(path), "--checkpoint", str(tmp_path / "nope")],
                 "--checkpoint")


# --------------------------------------------------------------------------- checkpoints


def test_eval_reads_checkpoints_where_the_trainer_wrote_them(tmp_path, monkeypatch, capsys):
    """GEM_CHECKPOINT_DIR (the mounted volume) wins over spec.checkpoint.path for both."""
    monkeypatch.setenv(checkpoint.ENV_CHECKPOINT_DIR, str(tmp_path / "volume"))
    path = manifest(tmp_path, "mounted", steps=2)
    assert cli.main(["train", "--config", str(path)]) == 0
    capsys.readouterr()
    # another run's checkpoint at spec.checkpoint.path: not the one to evaluate
    other = tmp_path / "ckpt/local/mounted/step-00000009"
    other.mkdir(parents=True)
    (other / checkpoint.COMPLETE).write_text("{}")
    assert cli.main(["eval", "--config", str(path)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["checkpoint"] == str(tmp_path / "volume/local/mounted/step-00000002")


def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    path = manifest(tmp_path, "corrupt", steps=6, every=2)
    os.environ["GEM_FAULT_AT_STEP"] = "4"
    assert cli.main(["train", "--config", str(path)]) == 1
    del os.environ["GEM_FAULT_AT_STEP"]
    job = tmp_path / "ckpt/local/corrupt"
    latest = checkpoint.latest_complete(job)
    assert latest.name == "step-00000004"
    (latest / "mp_rank_00_model_states.pt").write_bytes(b"truncated")
    with caplog.at_level("INFO", logger="gem.train"):
        assert cli.main(["train", "--config", str(path)]) == 0
    assert "step-00000004 does not load" in caplog.text and "at step 2" in caplog.text
    report = json.loads((tmp_path / "termination-log").read_text())
    assert report["step"] == 6 and report["checkpoint"] == str(job / "step-00000006")


def test_a_zero_stage_changed_since_the_checkpoints_is_a_config_error_naming_it(tmp_path, capsys):
    """DeepSpeed's own error here is a bare `AssertionError: `; the run must say what changed and the fix."""
    os.environ["GEM_FAULT_AT_STEP"] = "2"
    assert cli.main(["train", "--config", str(manifest(tmp_path, "restaged", parallelism={"zeroStage": 1}))]) == 1
    del os.environ["GEM_FAULT_AT_STEP"]
    path = manifest(tmp_path, "restaged", parallelism={"zeroStage": 3})
    config_error(tmp_path, capsys, ["train", "--config", str(path)], "spec.parallelism.zeroStage is 3, was 1")
    error = json.loads((tmp_path / "termination-log").read_text())["error"]
    assert "step-00000002" in error and "Set them back, or start from scratch" in error


def test_a_model_shape_changed_since_the_checkpoints_is_a_config_error_naming_it(tmp_path, capsys):
    """Weights of another shape never load (a state-dict size mismatch): a restart loop at exit 1 unless
    the run names the spec.model field that changed and the fix."""
    os.environ["GEM_FAULT_AT_STEP"] = "2"
    assert cli.main(["train", "--config", str(manifest(tmp_path, "reshaped", model={"embeddingDim": 32}))]) == 1
    del os.environ["GEM_FAULT_AT_STEP"]
    path = manifest(tmp_path, "reshaped", model={"embeddingDim": 48})
    config_error(tmp_path, capsys, ["train", "--config", str(path)], "spec.model.embeddingDim is 48, was 32")
    error = json.loads((tmp_path / "termination-log").read_text())["error"]
    assert "step-00000002" in error and "Set them back, or start from scratch" in error


def test_the_start_line_counts_the_whole_model_under_zero3(tmp_path, caplog):
    """ZeRO-3 leaves each rank's parameters empty (numel 0) once DeepSpeed partitions them."""
    from gem.api import parse_object
    from gem.model import build_model

    path = manifest(tmp_path, "count", steps=1, every=1, parallelism={"zeroStage": 3})
    whole = sum(p.numel() for p in build_model(parse_object(yaml.safe_load(path.read_text())).spec.model).parameters())
    with caplog.at_level("INFO", logger="gem.train"):
        assert cli.main(["train", "--config", str(path)]) == 0
    assert f"zero_stage=3 precision=fp32 params={whole} " in caplog.text


def test_each_step_logs_the_learning_rate_it_trained_with(tmp_path, monkeypatch, caplog):
    """Warmup 2 then cosine over 3 steps: steps 1, 2, 3 train at 0.5, 1 and 1 x the peak (the cosine's
    floor, 0.1 x, would be the rate of a 4th step)."""
    from gem.train.trainer import Tracker

    logged = {}
    monkeypatch.setattr(Tracker, "log_step", lambda self, step, metrics: logged.update(
        {step: metrics["train/lr"]} if "train/lr" in metrics else {}))
    path = manifest(tmp_path, "rates", steps=3, every=3, training={"warmupSteps": 2, "learningRate": 0.004})
    with caplog.at_level("INFO", logger="gem.train"):
        assert cli.main(["train", "--config", str(path)]) == 0
    assert logged == pytest.approx({1: 0.002, 2: 0.004, 3: 0.004})
    assert "step step=3 total_steps=3 lr=0.004 " in caplog.text


def _saved_checkpoint(tmp_path, spec: dict, ranks: int) -> Path:
    ckpt = tmp_path / "step-00000002"
    (ckpt / "rng").mkdir(parents=True)
    for r in range(ranks):
        (ckpt / "rng" / f"rank-{r:05d}.pt").write_bytes(b"")
    obj = {"apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": "x"}, "spec": spec}
    (ckpt / checkpoint.MANIFEST_FILE).write_text(yaml.safe_dump(obj))
    return ckpt


def _spec(**parts):
    from gem.api import parse_object

    return parse_object({"apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": "x"},
                         "spec": parts}).spec


def test_setup_changes_name_what_deepspeeds_files_depend_on(tmp_path):
    saved = _spec(training={"precision": "bf16"}, parallelism={"zeroStage": 2, "procsPerNode": 2}).to_wire()
    ckpt = _saved_checkpoint(tmp_path, saved, ranks=2)
    same = _spec(training={"precision": "mxfp8"}, parallelism={"zeroStage": 2, "procsPerNode": 2})
    assert checkpoint.setup_changes(ckpt, same, world_size=2) == []  # mxfp8 writes bf16's files
    changed = _spec(training={"precision": "fp32"}, parallelism={"zeroStage": 2, "plan": {"dpShard": 4}})
    assert checkpoint.setup_changes(ckpt, changed, world_size=4) == [
        "spec.training.precision is fp32, was bf16",
        "spec.parallelism.plan is {'dpShard': 4}, was automatic",
        "the world size (spec.parallelism.numNodes x procsPerNode) is 4, was 2",
    ]
    # ZeRO-0 keeps the whole optimizer in one file: any world size resumes it
    zero0 = _spec(parallelism={"zeroStage": 0})
    ckpt0 = _saved_checkpoint(tmp_path / "z0", zero0.to_wire(), ranks=2)
    assert checkpoint.setup_changes(ckpt0, zero0, world_size=1) == []
    assert checkpoint.setup_changes(tmp_path / "no-such-dir", zero0, world_size=1) == []
    # the weights' shape: GEMTraining's spec.model (an override set or unset counts too)
    wider = _spec(parallelism={"zeroStage": 0}, model={"preset": "tiny", "numLayers": 3})
    assert checkpoint.setup_changes(ckpt0, wider, world_size=2) == ["spec.model.numLayers is 3, was unset"]


def test_a_checkpoint_from_before_the_affinity_branch_loads_as_the_model_it_holds(tmp_path):
    """Manifests written before spec.model.affinityBranch (2026-12-07) lack it, and their models have
    no branch: load_model (gem eval, a LoopFM teacher) builds that model, and a resume under the new
    default names the field instead of DeepSpeed's list of missing keys."""
    import torch

    from gem.model import build_model

    old = _spec(parallelism={"zeroStage": 0}, model={"preset": "tiny", "affinityBranch": False}).to_wire()
    del old["model"]["affinityBranch"]
    ckpt = _saved_checkpoint(tmp_path, old, ranks=1)
    torch.manual_seed(0)
    weights = build_model(_spec(model={"preset": "tiny", "affinityBranch": False}).model).state_dict()
    torch.save(weights, ckpt / checkpoint.MODEL_FILE)
    model, manifest = checkpoint.load_model(ckpt)
    assert model.affinity is None and manifest.spec.model.affinity_branch is False
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    # the field is read from the weights only where gem.yaml lacks it
    torch.save(build_model(_spec(model={"preset": "tiny"}).model).state_dict(), ckpt / checkpoint.MODEL_FILE)
    assert checkpoint.load_model(ckpt)[0].affinity is not None

    now = _spec(parallelism={"zeroStage": 0}, model={"preset": "tiny"})  # the default: with the branch
    assert now.model.affinity_branch is True and build_model(now.model).affinity is not None
    assert checkpoint.setup_changes(ckpt, now, world_size=1) == ["spec.model.affinityBranch is True, was False"]
    off = _spec(parallelism={"zeroStage": 0}, model={"preset": "tiny", "affinityBranch": False})
    assert checkpoint.setup_changes(ckpt, off, world_size=1) == []


def test_the_generative_objective_changes_the_weights_only_when_switched_on_or_off(tmp_path):
    """spec.model.generativeLossWeight adds its logit scales to the weights when > 0: a resume that
    switches it on or off names the field; another weight, or a manifest from before the field
    (off), loads as is."""
    zero0 = {"zeroStage": 0}
    off = _spec(parallelism=zero0).to_wire()
    del off["model"]["generativeLossWeight"]  # a manifest from before the field
    ckpt = _saved_checkpoint(tmp_path / "off", off, ranks=1)
    assert checkpoint.setup_changes(ckpt, _spec(parallelism=zero0), world_size=1) == []
    on = _spec(parallelism=zero0, model={"preset": "tiny", "generativeLossWeight": 0.5})
    assert checkpoint.setup_changes(ckpt, on, world_size=1) == [
        "spec.model.generativeLossWeight is 0.5, was unset"]
    ckpt_on = _saved_checkpoint(tmp_path / "on", on.to_wire(), ranks=1)
    other = _spec(parallelism=zero0, model={"preset": "tiny", "generativeLossWeight": 2.0})
    assert checkpoint.setup_changes(ckpt_on, other, world_size=1) == []
    assert checkpoint.setup_changes(ckpt_on, _spec(parallelism=zero0), world_size=1) == [
        "spec.model.generativeLossWeight is 0.0, was 0.5"]


def test_setup_changes_read_the_plan_where_the_planner_does(tmp_path):
    """The deprecated training.deepspeed.parallelPlan is the plan when spec.parallelism.plan is absent:
    moving it there (as its deprecation note says) was reported as a plan change, the cause of a
    checkpoint that did not load for another reason; a changed legacy plan went unnamed."""
    legacy = _spec(training={"deepspeed": {"parallelPlan": {"dpShard": 2}}}, parallelism={"zeroStage": 0})
    ckpt = _saved_checkpoint(tmp_path, legacy.to_wire(), ranks=2)
    moved = _spec(parallelism={"zeroStage": 0, "plan": {"dpShard": 2}})
    assert checkpoint.setup_changes(ckpt, moved, world_size=2) == []
    assert checkpoint.setup_changes(ckpt, _spec(parallelism={"zeroStage": 0}), world_size=2) == [
        "spec.parallelism.plan is automatic, was {'dpShard': 2}"]


def test_one_rule_names_the_fields_that_change_the_weights_shape(tmp_path):
    """check_student_unchanged (a distillation's restart, before the teacher loads) and setup_changes
    (why no checkpoint loads) had two rules. setup_changes named every differing spec.student /
    spec.model field: a checkpoint that did not load for another reason (a damaged file) was blamed on
    spec.student.maxSeqLen, which no weight depends on (a SpecError, exit 2, saying to set it back), and
    a changed distillation.method went unnamed; check_student_unchanged refused a kd job over memoryK,
    which only the LoopFM student reads."""
    from gem.api import parse_object
    from gem.distill.task import check_student_unchanged

    root = str(tmp_path / "ckpt")

    def distill(**parts):
        return parse_object({"apiVersion": "gem.dev/v1alpha1", "kind": "LoopFMDistill", "metadata": {"name": "d"},
                             "spec": {"teacher": {"checkpoint": "/t"}, "checkpoint": {"path": root}, **parts}})

    ckpt = _saved_checkpoint(checkpoint.job_dir_of(root, None, "d"), distill().spec.to_wire(), ranks=1)
    (ckpt / checkpoint.COMPLETE).write_text("{}")
    for change, expected in [
        ({"student": {"maxSeqLen": 64}}, []),
        ({"distillation": {"memoryK": 4}}, []),
        ({"student": {"hiddenDim": 128, "maxSeqLen": 64}}, ["spec.student.hiddenDim is 128, was 64"]),
        ({"distillation": {"method": "loopfm", "memoryK": 4}},
         ["spec.distillation.method is loopfm, was kd", "spec.distillation.memoryK is 4, was 16"]),
    ]:
        now = distill(**change)
        assert checkpoint.setup_changes(ckpt, now.spec, world_size=1) == expected, change
        if expected:
            with pytest.raises(SpecError, match=re.escape("; ".join(expected)) + " when step-00000002 under "):
                check_student_unchanged(now)
        else:
            check_student_unchanged(now)
    # GEMTraining: spec.model.maxSeqLen shapes no weight of the GEM model either
    gem_ckpt = _saved_checkpoint(tmp_path / "gem", _spec(model={"preset": "tiny"}).to_wire(), ranks=1)
    assert checkpoint.setup_changes(gem_ckpt, _spec(model={"preset": "tiny", "maxSeqLen": 128}), world_size=1) == []


def test_save_makes_everything_durable_before_complete_and_prunes_after(tmp_path, monkeypatch):
    """Every file and directory of a checkpoint is fsynced before it is renamed; the job dir after the
    rename; COMPLETE last; older checkpoints are deleted only then, each one's COMPLETE removal
    fsynced before its files go; the job dir, made by the first save, is fsynced into its parent."""
    import torch

    events: list[tuple[str, str]] = []
    real_fsync, real_rename, real_prune = os.fsync, os.rename, checkpoint.prune
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                  real_fsync(fd))[1])
    monkeypatch.setattr(os, "rename", lambda a, b: (events.append(("rename", str(b))), real_rename(a, b))[1])
    monkeypatch.setattr(checkpoint, "prune", lambda job, keep: (events.append(("prune", "")), real_prune(job, keep))[1])
    monkeypatch.setattr(checkpoint, "full_state_dict", lambda engine, **kw: {"w": torch.zeros(2)})

    class Engine:  # DeepSpeed's part: writes its own files into the tag directory
        def save_checkpoint(self, save_dir, tag, save_latest):
            (Path(save_dir) / tag / "mp_rank_00_model_states.pt").write_bytes(b"ds")

    job = tmp_path / "runs" / "job"
    env = DistEnv(0, 1, 0, 1, torch.device("cpu"))
    for step in (1, 2):
        events.clear()
        final = checkpoint.save(Engine(), env, job, step=step, manifest={}, state={"step": step}, keep_last=1)
        if step == 1:  # both new directories' entries, before anything is written inside them
            assert events[:2] == [("fsync", str(tmp_path)), ("fsync", str(tmp_path / "runs"))]
    tmp = str(job / ".tmp-step-00000002")
    synced_before_rename = {p for kind, p in events[: events.index(("rename", str(final)))] if kind == "fsync"}
    files = {str(p).replace(str(final), tmp) for p in final.rglob("*") if p.name != checkpoint.COMPLETE}
    assert files <= synced_before_rename  # model.pt, rng/, DeepSpeed's file, the rng/ directory
    assert tmp in synced_before_rename
    after = events[events.index(("rename", str(final))) + 1:]
    assert after == [("fsync", str(job)), ("fsync", str(final / checkpoint.COMPLETE)), ("fsync", str(final)),
                     ("prune", ""), ("fsync", str(job / "step-00000001"))]  # its COMPLETE gone, durably
    assert [p.name for p in checkpoint.complete_checkpoints(job)] == ["step-00000002"]


class _CheckpointEngine:
    """DeepSpeed's pluggable checkpoint engine (TorchCheckpointEngine's interface); `full` fails its writes."""

    def __init__(self, full: bool = False):
        self.full = full

    def save(self, state_dict, path):
        if self.full:
            raise OSError(28, "No space left on device", path)
        Path(path).write_bytes(b"ds")

    def makedirs(self, path, exist_ok=False):
        os.makedirs(path, exist_ok=exist_ok)

    def is_decoupled(self):
        return False


class _Engine:
    """DeepSpeed's save_checkpoint: its writes through its checkpoint engine, then a barrier (here: a flag)."""

    def __init__(self, full: bool = False):
        self.checkpoint_engine = _CheckpointEngine(full)
        self.reached_barrier = False

    def save_checkpoint(self, save_dir, tag, save_latest):
        self.checkpoint_engine.makedirs(str(Path(save_dir) / tag), exist_ok=True)
        self.checkpoint_engine.save({}, str(Path(save_dir) / tag / "mp_rank_00_model_states.pt"))
        self.reached_barrier = True


def test_a_failed_write_inside_deepspeeds_save_still_reaches_its_barrier_and_leaves_no_checkpoint(tmp_path,
                                                                                                   monkeypatch):
    """The write error is recorded, not raised inside DeepSpeed's save_checkpoint (whose barrier the
    other ranks wait in), then raised by save on every rank: CheckpointSaveError naming the rank, its
    file and error; the temp dir is removed and the previous checkpoint stays the latest complete one."""
    import torch

    monkeypatch.setattr(checkpoint, "full_state_dict", lambda engine, **kw: {"w": torch.zeros(2)})
    job, env = tmp_path / "job", DistEnv(0, 1, 0, 1, torch.device("cpu"))
    checkpoint.save(_Engine(), env, job, step=1, manifest={}, state={"step": 1}, keep_last=1)
    engine = _Engine(full=True)
    inner = engine.checkpoint_engine
    with pytest.raises(checkpoint.CheckpointSaveError) as e:
        checkpoint.save(engine, env, job, step=2, manifest={}, state={"step": 2}, keep_last=1)
    assert engine.reached_barrier and engine.checkpoint_engine is inner  # the engine is DeepSpeed's own again
    msg = str(e.value)
    assert msg.startswith(f"checkpoint step-00000002 under {job} was not saved: rank 0: writing "
                          f"{job}/.tmp-step-00000002/mp_rank_00_model_states.pt: OSError: [Errno 28] No space left")
    assert "a restart resumes from step-00000001" in msg
    assert not (job / ".tmp-step-00000002").exists() and not (job / "step-00000002").exists()
    assert [p.name for p in checkpoint.complete_checkpoints(job)] == ["step-00000001"]


def test_a_failed_complete_marker_leaves_no_checkpoint_that_looks_complete(tmp_path, monkeypatch):
    """Disk full while writing COMPLETE: an empty marker would make the step look complete. It is
    removed with the step's directory; the older checkpoint is not pruned."""
    import torch

    monkeypatch.setattr(checkpoint, "full_state_dict", lambda engine, **kw: {"w": torch.zeros(2)})
    job, env = tmp_path / "job", DistEnv(0, 1, 0, 1, torch.device("cpu"))
    checkpoint.save(_Engine(), env, job, step=1, manifest={}, state={"step": 1}, keep_last=1)

    def full_disk(path, text):
        path.touch()  # created, nothing written
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(checkpoint, "_fsync_write", full_disk)
    with pytest.raises(checkpoint.CheckpointSaveError, match=r"rank 0: publishing .*: OSError: \[Errno 28\]"):
        checkpoint.save(_Engine(), env, job, step=2, manifest={}, state={"step": 2}, keep_last=1)
    assert not (job / "step-00000002").exists() and not (job / ".tmp-step-00000002").exists()
    assert [p.name for p in checkpoint.complete_checkpoints(job)] == ["step-00000001"]


# --------------------------------------------------------------------------- MLflow


def test_a_fresh_start_gets_a_new_mlflow_run_and_a_resume_continues_its_own(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    mlflow_spec = {"enabled": True, "experiment": "runs", "trackingUri": uri, "registerModel": False}
    first = manifest(tmp_path, "same-name", steps=2, ckpt="a", mlflow=mlflow_spec)
    second = manifest(tmp_path, "same-name", steps=4, ckpt="b", mlflow=mlflow_spec)  # same uid, fresh start
    assert cli.main(["train", "--config", str(first)]) == 0
    first_run = json.loads((tmp_path / "termination-log").read_text())["mlflowRunId"]
    os.environ["GEM_FAULT_AT_STEP"] = "3"  # the step-2 checkpoint records the second run's id
    assert cli.main(["train", "--config", str(second)]) == 1
    del os.environ["GEM_FAULT_AT_STEP"]
    assert cli.main(["train", "--config", str(second)]) == 0
    second_run = json.loads((tmp_path / "termination-log").read_text())["mlflowRunId"]

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("runs").experiment_id])
    assert first_run != second_run and {r.info.run_id for r in runs} == {first_run, second_run}
    assert client.get_run(first_run).data.metrics["train/loss"] and client.get_run(first_run).info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(second_run, "train/loss")]
    assert sorted(set(steps)) == [1, 2, 3, 4] and steps.count(3) == 2  # step 3 ran (and was logged) twice


def test_tracking_uris_are_reported_without_credentials():
    from gem.api import parse_object
    from gem.train.tracking import Tracker, redact_uri

    assert redact_uri("https://user:s3cret@mlflow.example:5000/") == "https://mlflow.example:5000/"
    assert redact_uri("sqlite:////tmp/mlflow.db") == "sqlite:////tmp/mlflow.db"
    obj = parse_object({"apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": "x"},
                        "spec": {}})
    t = Tracker(obj, active=True)
    t.tracking_uri, t.experiment_id, t.run_id = "http://bob:pw@mlflow:5000", "7", "abc"
    assert t.run_url == "http://mlflow:5000/#/experiments/7/runs/abc"

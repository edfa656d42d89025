"""`gem eval` / `gem serve-precompute` given a --checkpoint that does not load: exit 2 naming the flag;
`gem eval` reports what the trainer's final evaluation reported, in one process or under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from gem import cli
from gem.api import parse_object
from gem.launcher import free_port
from gem.model import build_model
from gem.train import checkpoint

pytestmark = pytest.mark.usefixtures("trainer_env")  # tests/conftest.py

MANIFEST = {"apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": "ev", "namespace": "local"},
            "spec": {"model": {"preset": "tiny"},
                     "data": {"synthetic": {"numUsers": 50, "numAds": 20, "numTrainExamples": 64,
                                            "numEvalExamples": 64, "meanHistoryLen": 4}},
                     "mlflow": {"enabled": False}}}


def a_checkpoint(directory):
    """What load_model reads: model.pt (a tiny GEM's weights) + gem.yaml."""
    directory.mkdir(parents=True)
    (directory / checkpoint.MANIFEST_FILE).write_text(yaml.safe_dump(MANIFEST))
    model = build_model(parse_object(MANIFEST).spec.model)
    torch.save(model.state_dict(), directory / checkpoint.MODEL_FILE)
    return directory


def corrupt(directory, how):
    model_pt, gem_yaml = directory / checkpoint.MODEL_FILE, directory / checkpoint.MANIFEST_FILE
    if how == "model.pt garbage":
        model_pt.write_bytes(b"not a torch file\n")
    elif how == "model.pt truncated":  # e.g. copied while being written
        model_pt.write_bytes(model_pt.read_bytes()[:1000])
    elif how == "model.pt of another model":
        other = build_model(parse_object({**MANIFEST, "spec": {"model": {"preset": "tiny", "numLayers": 3}}}).spec.model)
        torch.save(other.state_dict(), model_pt)
    elif how == "gem.yaml not YAML":
        gem_yaml.write_text("spec: [\n")
    elif how == "gem.yaml not a manifest":
        gem_yaml.write_text("kind: GEMTraining\n")


HOW = ["model.pt garbage", "model.pt truncated", "model.pt of another model", "gem.yaml not YAML",
       "gem.yaml not a manifest"]


def test_eval_of_a_good_checkpoint(tmp_path, capsys):
    ckpt = a_checkpoint(tmp_path / "step-00000001")
    config = tmp_path / "ev.yaml"
    config.write_text(yaml.safe_dump(MANIFEST))
    assert cli.main(["eval", "--config", str(config), "--checkpoint", str(ckpt)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["checkpoint"] == str(ckpt) and out["metrics"]["num_examples"] == 64


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("command", ["eval", "serve-precompute"])
def test_a_checkpoint_that_does_not_load_is_a_config_error(tmp_path, capsys, how, command):
    ckpt = a_checkpoint(tmp_path / "step-00000001")
    corrupt(ckpt, how)
    config = tmp_path / "ev.yaml"
    config.write_text(yaml.safe_dump(MANIFEST))
    assert cli.main([command, "--config", str(config), "--checkpoint", str(ckpt)]) == 2  # not 1 with a traceback
    err = capsys.readouterr().err
    assert f"--checkpoint {ckpt}" in err and "Traceback" not in err
    assert "step-NNNNNNNN" in err  # says what to pass instead
    if command == "eval":  # the pod's termination message says it too
        assert f"--checkpoint {ckpt}" in json.loads((tmp_path / "termination-log").read_text())["error"]


def test_eval_of_an_mxfp8_checkpoint_with_a_torchao_lacking_the_mx_api_is_a_config_error(tmp_path, capsys,
                                                                                        monkeypatch):
    """gem eval rebuilds an mxfp8 checkpoint's MX Linears (gem.eval.evaluate.as_trained): a torchao
    without the MX training op is the same config error as at `gem train` (exit 2 naming
    spec.training.precision), not a traceback (exit 1). Simulated as in tests/test_precision.py."""
    import sys

    ckpt = a_checkpoint(tmp_path / "step-00000001")
    mxfp8 = {**MANIFEST, "spec": {**MANIFEST["spec"], "training": {"precision": "mxfp8"}}}
    (ckpt / checkpoint.MANIFEST_FILE).write_text(yaml.safe_dump(mxfp8))
    config = tmp_path / "ev.yaml"
    config.write_text(yaml.safe_dump(MANIFEST))
    monkeypatch.setitem(sys.modules, "torchao.prototype.moe_training.mxfp8_linear", None)  # its import fails
    assert cli.main(["eval", "--config", str(config), "--checkpoint", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert "spec.training.precision" in err and "mxfp8" in err and "torchao" in err, err
    assert "spec.training.precision" in json.loads((tmp_path / "termination-log").read_text())["error"]


def _last_json(out):
    return json.loads(out.strip().splitlines()[-1])


def _same_metrics(got, want, tol=1e-6):
    """Key by key: the same keys, each value within tol (None, JSON's NaN, on both sides alike)."""
    assert sorted(got) == sorted(want)
    off = {k: (got[k], want[k]) for k in want
           if (got[k] is None) != (want[k] is None) or (want[k] is not None and abs(got[k] - want[k]) > tol)}
    assert not off, off


def _synthetic(seed, n_eval):
    return {"seed": seed, "numUsers": 50, "numAds": 20, "numTrainExamples": 256, "numEvalExamples": n_eval,
            "meanHistoryLen": 4}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_eval_reports_the_trainers_final_metrics_of_a_mixed_run(tmp_path, capsys, precision):
    """A mixed run's final report holds each source's metrics (ne/click@<source>, ..., a source left out of
    the headline too); `gem eval` of its checkpoint reports the same keys and values, in the precision
    the run trained in (bf16: bf16 weights under autocast, as DeepSpeed evaluated them, not model.pt's
    fp32 masters)."""
    obj = {"apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": "mix"},
           "spec": {"model": {"preset": "tiny"},
                    "data": {"sources": [{"name": "feed", "synthetic": _synthetic(1, 200), "weight": 2},
                                         {"name": "logs", "synthetic": _synthetic(2, 150), "evaluate": False}]},
                    "training": {"steps": 4, "batchSize": 16, "warmupSteps": 1, "precision": precision},
                    "checkpoint": {"path": str(tmp_path / "ckpt"), "everySteps": 4},
                    "mlflow": {"enabled": False}}}
    config = tmp_path / "mix.yaml"
    config.write_text(yaml.safe_dump(obj))
    assert cli.main(["train", "--config", str(config)]) == 0
    trained = _last_json(capsys.readouterr().out)  # stdout: the whole report (the termination log may trim it)
    assert {"ne/click@feed", "auc/click@logs", "num_examples@logs"} <= trained["metrics"].keys()
    assert cli.main(["eval", "--config", str(config)]) == 0
    evaluated = _last_json(capsys.readouterr().out)
    assert evaluated["checkpoint"] == trained["checkpoint"]
    _same_metrics(evaluated["metrics"], trained["metrics"])
    assert evaluated["ne"] == pytest.approx(trained["ne"], abs=1e-6)
    assert evaluated["metrics"]["num_examples"] == 200 and evaluated["metrics"]["num_examples@logs"] == 150


def test_eval_under_torchrun_shards_the_split_and_rank_0_reports(tmp_path, capsys):
    """2 processes: each evaluates its shard of every source; one report (rank 0's), equal to one process's."""
    spec = {"model": {"preset": "tiny"},
            "data": {"sources": [{"name": "a", "synthetic": _synthetic(1, 101)},
                                 {"name": "b", "synthetic": _synthetic(2, 77)}]},
            "mlflow": {"enabled": False}}
    obj = {**MANIFEST, "spec": spec}
    ckpt = a_checkpoint(tmp_path / "step-00000001")
    config = tmp_path / "ev.yaml"
    config.write_text(yaml.safe_dump(obj))
    assert cli.main(["eval", "--config", str(config), "--checkpoint", str(ckpt)]) == 0
    alone = _last_json(capsys.readouterr().out)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["GEM_TERMINATION_MESSAGE_PATH"] = str(tmp_path / "termination-torchrun")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), "-m", "gem", "eval", "--config", str(config),
                           "--checkpoint", str(ckpt)], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 1, proc.stdout  # rank 0's only
    sharded = json.loads(reports[0])
    assert sharded["checkpoint"] == str(ckpt) and sharded["metrics"]["num_examples"] == 178  # no padding rows
    _same_metrics(sharded["metrics"], alone["metrics"])


@pytest.mark.parametrize("collective", [True, False])
def test_ranks_failing_together_leave_the_process_group_together(monkeypatch, collective):
    """An error every rank raises at once (on_every_rank: a config error found on one rank, a SIGTERM
    stop) is followed by a barrier before the group is destroyed, as a success is: a rank tearing down
    its gloo pairs while its peer still used them aborted the peer (exit -6 instead of 2, seen in a
    fresh-clone make test). An error of this rank alone gets no barrier: its peers may never reach one."""
    from types import SimpleNamespace

    import gem.train.dist as dist
    import gem.train.trainer as trainer
    from gem.data.errors import SpecError

    calls: list[str] = []
    error = SpecError("spec.mlflow.experiment: deleted")
    if collective:
        error.on_every_rank = True

    class FailingTrainer:
        def __init__(self, task, env):
            pass

        def run(self):
            raise error

    monkeypatch.setattr(dist, "init_distributed", lambda: SimpleNamespace(is_main=True))
    monkeypatch.setattr(dist, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(dist, "shutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(checkpoint, "check_writable", lambda *a, **k: None)
    monkeypatch.setattr(trainer, "Trainer", FailingTrainer)
    monkeypatch.setattr(cli, "_task", lambda *a: None)
    manifest = SimpleNamespace(metadata=SimpleNamespace(namespace="t", name="x"),
                               spec=SimpleNamespace(checkpoint=SimpleNamespace(path="/tmp")))
    with pytest.raises(Exception):
        cli._train(manifest, "train")
    assert calls == (["barrier", "shutdown"] if collective else ["shutdown"])

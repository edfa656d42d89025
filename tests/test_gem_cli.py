"""`gem eval` / `gem serve-precompute` given a --checkpoint that does not load: exit 2 naming the flag."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from gem import cli
from gem.api import parse_object
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

"""The Kunlun GEM trains end to end through `gem train`, reports, and beats the DLRM baseline on NE.

Both models go through the same Trainer (data order, AdamW + warmup/cosine, DeepSpeed, eval):
GEM via the `gem train` CLI, DLRM via a Task whose model is gem.baselines.DLRMModel. The data is
the synthetic ads world seen once (no repeated examples, as in production: ids overfit on
repeats), the `tiny` preset, a few hundred steps. The GEM run is also the one whose report,
checkpoints and `gem eval` are checked (one training for both: it is the suite's slowest in-process run).
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from torch import nn

from gem import cli
from gem.api import parse_object
from gem.baselines import DLRMConfig, DLRMModel
from gem.data import Batch
from gem.model import config_from_spec, kunlun_config
from gem.modules import from_v1_batch
from gem.train import checkpoint
from gem.train.dist import init_distributed, shutdown
from gem.train.task import GEMTask
from gem.train.trainer import Trainer

STEPS, BATCH, EVERY = 600, 64, 240


def _manifest(tmp_path, name: str) -> dict:
    return {
        "apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": name},
        "spec": {
            "model": {"preset": "tiny"},
            "data": {"synthetic": {"seed": 3, "numUsers": 2000, "numAds": 500, "numTrainExamples": STEPS * BATCH,
                                   "numEvalExamples": 4000, "meanHistoryLen": 48}},
            "training": {"steps": STEPS, "batchSize": BATCH, "warmupSteps": 20, "learningRate": 0.004, "seed": 0,
                         "evalEvery": 100},
            "checkpoint": {"path": str(tmp_path / "ckpt"), "everySteps": EVERY, "keepLast": 2},
            "mlflow": {"enabled": False},
        },
    }


class DLRMOverBatch(nn.Module):
    """DLRMModel behind the trainer's Batch interface."""

    def __init__(self, model: DLRMModel, max_seq_len: int):
        super().__init__()
        self.dlrm, self.max_seq_len = model, max_seq_len

    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        return self.dlrm(from_v1_batch(batch))


class DLRMTask(GEMTask):
    def build_model(self) -> nn.Module:
        return DLRMOverBatch(DLRMModel(DLRMConfig(base=kunlun_config(self.config))), self.max_seq_len)


def test_gem_trains_through_gem_train_reports_and_beats_dlrm_on_ne(tmp_path, trainer_env, capsys):
    path = tmp_path / "gem.yaml"
    path.write_text(yaml.safe_dump(_manifest(tmp_path, "gem")))
    assert cli.main(["train", "--config", str(path)]) == 0
    gem = json.loads((tmp_path / "termination-log").read_text())
    m = gem["metrics"]
    assert gem["step"] == gem["totalSteps"] == STEPS
    assert m["ne/click"] < 0.95 and m["auc/click"] > 0.7, m
    # Post-click CVR sees ~1/6 of the examples: after 300 steps it has only begun to learn.
    assert m["ne/conversion"] < 1.03 and gem["ne"] < 0.97, m
    assert m["bayes_ne/click"] < m["ne/click"]  # nobody beats the true probabilities
    assert gem["ne"] == pytest.approx((m["ne/click"] + m["ne/conversion"]) / 2)
    assert gem["mlflowRunId"] is None and len((tmp_path / "termination-log").read_bytes()) <= 4096
    # Checkpoint layout: keepLast=2 complete checkpoints, each self-describing.
    job = tmp_path / "ckpt" / "local" / "gem"
    assert [p.name for p in checkpoint.complete_checkpoints(job)] == [f"step-{2 * EVERY:08d}", f"step-{STEPS:08d}"]
    final = job / f"step-{STEPS:08d}"
    assert gem["checkpoint"] == str(final)
    for name in ("COMPLETE", "gem.yaml", "model.pt", "trainer_state.json", "rng/rank-00000.pt"):
        assert (final / name).is_file(), name
    assert yaml.safe_load((final / "gem.yaml").read_text())["metadata"]["name"] == "gem"
    # the data seen exactly once (numTrainExamples = STEPS x BATCH): the loader stands at the start of epoch 1
    assert json.loads((final / "trainer_state.json").read_text())["loader"] == {"position": STEPS, "epoch": 1,
                                                                              "consumed": 0}
    # stdout carries the same report; `gem eval` reproduces the metrics from the directory alone.
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ne"] == gem["ne"]
    assert cli.main(["eval", "--config", str(path)]) == 0
    evaluated = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert evaluated["checkpoint"] == str(final)
    assert evaluated["metrics"]["ne/click"] == pytest.approx(m["ne/click"], abs=1e-5)

    manifest = parse_object(_manifest(tmp_path, "dlrm"))
    dist_env = init_distributed()
    try:
        dlrm = Trainer(DLRMTask(manifest), dist_env).run()
    finally:
        shutdown()
    g, d = gem["metrics"], dlrm["metrics"]
    summary = {k: (g[k], d[k]) for k in ("ne", "ne/click", "ne/conversion", "auc/click", "bayes_ne/click")}
    print("GEM vs DLRM:", summary)
    assert gem["ne"] < dlrm["ne"], summary
    assert g["ne/click"] < d["ne/click"], summary
    assert config_from_spec(manifest.spec.model).preset == "tiny"

"""The Kunlun GEM trains end to end through `gem train` and beats the DLRM baseline on NE.

Both models go through the same Trainer (data order, AdamW + warmup/cosine, DeepSpeed, eval):
GEM via the `gem train` CLI, DLRM via a Task whose model is gem.baselines.DLRMModel. The data is
the synthetic ads world seen once (no repeated examples, as in production: ids overfit on
repeats), the `tiny` preset, a few hundred steps.
"""

from __future__ import annotations

import json

import torch
import yaml
from torch import nn

from gem import cli
from gem.api import parse_object
from gem.baselines import DLRMConfig, DLRMModel
from gem.data import Batch
from gem.model import config_from_spec, kunlun_config
from gem.modules import from_v1_batch
from gem.train.dist import init_distributed, shutdown
from gem.train.task import GEMTask
from gem.train.trainer import Trainer

STEPS, BATCH = 300, 64


def _manifest(tmp_path, name: str) -> dict:
    return {
        "apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": name},
        "spec": {
            "model": {"preset": "tiny"},
            "data": {"synthetic": {"seed": 3, "numUsers": 2000, "numAds": 500, "numTrainExamples": STEPS * BATCH,
                                   "numEvalExamples": 4000, "meanHistoryLen": 48}},
            "training": {"steps": STEPS, "batchSize": BATCH, "warmupSteps": 20, "learningRate": 0.004, "seed": 0},
            "checkpoint": {"path": str(tmp_path / "ckpt"), "everySteps": STEPS, "keepLast": 1},
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


def test_gem_trains_through_gem_train_and_beats_dlrm_on_ne(tmp_path, trainer_env):
    path = tmp_path / "gem.yaml"
    path.write_text(yaml.safe_dump(_manifest(tmp_path, "gem")))
    assert cli.main(["train", "--config", str(path)]) == 0
    gem = json.loads((tmp_path / "termination-log").read_text())
    assert gem["step"] == STEPS

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

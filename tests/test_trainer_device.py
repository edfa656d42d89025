"""Device handling of the paths that only ever ran on CPU with gloo, checked without a GPU.

On GPU nodes each process trains on its local rank's GPU and NCCL takes only CUDA tensors ("No backend
type associated with device type cpu"). Here `meta` stands in for the CUDA device: fakes record the
device of the tensors they are handed (a collective, a model's forward) and stop there, as
tests/test_parallel_layers.py::test_size_exchanges_run_on_the_device_of_the_data does.
"""

from __future__ import annotations

import signal
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as torch_dist
from torch import nn

from gem.api.types import SyntheticDataSpec
from gem.data.synthetic import SyntheticWorld

META = torch.device("meta")


class Reached(Exception):
    pass


class FakeFM(nn.Module):
    """Stands in for a GEM model whose weights are on a GPU (meta): its forward and its embedding lookup
    record the device of the batch they are handed, then stop."""

    max_seq_len = 8

    def __init__(self, seen: list[torch.device]):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, device=META))
        self.norm_out = nn.LayerNorm(4, device=META)
        self.cfg = SimpleNamespace(num_non_seq_tokens=2)
        self.seen = seen
        fm = self

        class Tables:
            def lookup(self, table: str, ids: torch.Tensor) -> torch.Tensor:
                fm.seen.append(ids.device)
                raise Reached

        self.embeddings = Tables()

    def forward(self, batch):
        self.seen.append(batch.user_id.device)
        raise Reached


def _examples(n: int = 16):
    spec = SyntheticDataSpec.model_validate({"numUsers": 10, "numAds": 8, "numTrainExamples": n,
                                             "numEvalExamples": 4, "meanHistoryLen": 3})
    return SyntheticWorld(spec).sample(n, split=0)


@pytest.mark.parametrize("kind,logits", [("history", False), ("tokens", True)])
def test_the_memory_log_runs_the_teacher_on_its_device(kind, logits):
    """LoopFM logs its memory with the teacher (embed_examples / log_stream): the batches go where the
    teacher's weights are. Before, they stayed on the CPU, so a teacher on a GPU failed ("Expected all
    tensors to be on the same device") and LoopFMTask logged with the teacher still on the CPU."""
    from gem.loopfm.logging import embed_examples

    seen: list[torch.device] = []
    with pytest.raises(Reached):
        embed_examples(FakeFM(seen), _examples(), kind=kind, logits=logits)
    assert seen and all(d.type == "meta" for d in seen), seen


def test_the_solaris_scorer_scores_on_the_models_device():
    """FMScorer.score hands the FM its batches on the FM's device (a GPU when the model was moved there),
    not the CPU's; the values come back to the CPU (numpy)."""
    from gem.solaris.scorer import FMScorer

    seen: list[torch.device] = []
    ex = _examples()
    scorer = FMScorer(FakeFM(seen), ad_campaign=np.arange(8) // 2, campaign_advertiser=np.arange(4) // 2)
    with pytest.raises(Reached):
        scorer.score(ex, np.arange(4), ex.ad_id[:4])
    assert seen and all(d.type == "meta" for d in seen), seen


def test_loopfm_moves_its_teacher_to_the_training_device_before_logging_the_memory(tmp_path, monkeypatch):
    """Rank 0 logs the job's memory with the teacher: on the training device (a GPU), not on the CPU the
    checkpoint loads it onto (map_location="cpu"), while the other ranks wait in a collective."""
    from gem.loopfm import task as loopfm_task
    from tests.test_loopfm_task import distill_manifest

    monkeypatch.delenv("GEM_CHECKPOINT_DIR", raising=False)
    teacher = nn.Linear(2, 2)
    monkeypatch.setattr(loopfm_task, "load_teacher_on_every_rank",
                        lambda *a, **k: (teacher, None, tmp_path / "fm" / "step-00000001"))
    logged_on: list[torch.device] = []

    def build_memory(model, *a, **k):
        logged_on.append(model.weight.device)
        raise Reached

    monkeypatch.setattr(loopfm_task, "build_memory", build_memory)
    with pytest.raises(Reached):
        loopfm_task.LoopFMTask(distill_manifest(tmp_path, tmp_path / "fm" / "step-00000001"), device=META,
                               is_main=True)
    assert [d.type for d in logged_on] == ["meta"]


def test_the_sigterm_stop_decision_is_all_reduced_on_the_training_device(monkeypatch):
    """The per-step all-reduce of the SIGTERM flag (Trainer._stop_requested) runs on the rank's device:
    NCCL refuses CPU tensors."""
    from gem.train.dist import DistEnv
    from gem.train.trainer import Trainer

    seen: list[torch.device] = []

    def all_reduce(t, *a, **k):
        seen.append(t.device)
        raise Reached

    monkeypatch.setattr(torch_dist, "all_reduce", all_reduce)
    trainer = object.__new__(Trainer)  # only _stop_requested's state
    trainer.env = DistEnv(rank=0, world_size=2, local_rank=0, local_world_size=2, device=META)
    trainer._signal = signal.SIGTERM
    with pytest.raises(Reached):
        trainer._stop_requested()
    assert [d.type for d in seen] == ["meta"]


def test_ranks_that_do_not_write_model_pt_join_the_gathers_but_keep_no_copy(monkeypatch):
    """checkpoint.save gathers the fp32 masters on every rank (collective under ZeRO) and rank 0 writes them.
    The others keep nothing: before, each rank of a GPU node held a whole fp32 copy of the model in host
    memory at every save (8 GPUs: 8 copies, the pod's memory limit the risk)."""
    import deepspeed.utils

    from gem.train import checkpoint

    gathered: list[torch.Tensor] = []

    def safe_get_full_fp32_param(param):  # DeepSpeed's gather of a parameter's fp32 master
        gathered.append(param)
        return param.detach() * 2

    monkeypatch.setattr(deepspeed.utils, "safe_get_full_fp32_param", safe_get_full_fp32_param)
    engine = SimpleNamespace(module=nn.Linear(3, 2), optimizer=None)
    kept = checkpoint.full_state_dict(engine)
    assert set(kept) == {"weight", "bias"} and torch.equal(kept["weight"], engine.module.weight.detach() * 2)
    gathered.clear()
    assert checkpoint.full_state_dict(engine, keep=False) == {}
    assert len(gathered) == 2  # still joined every gather

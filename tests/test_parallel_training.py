"""parallelize + sync_gradients train like one process: per dimension switched on, and all five together.

A tiny model with every part the plan acts on: a big embedding table (sparse sharding), a jagged
history pooled per example (context parallel), an MLP (tensor parallel) and a dense expert ensemble
(expert parallel). Each data shard of the global batch goes to one dp rank (cp and tp peers share
it); the reference is one process on the whole global batch. After three SGD steps the per-step
losses, the first step's gradients and the final weights must match (gathered to full tensors).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from gem.parallel.mesh import build_mesh
from gem.parallel.parallelize import full_state_dict, parallelize, sync_gradients
from gem.parallel.plan import ParallelPlan
from gem.parallel.testing import run_distributed

STEPS, GLOBAL_BATCH, LR = 3, 8, 0.5
TOL = dict(rtol=2e-5, atol=2e-6)


@dataclass
class TinyBatch:
    user_id: torch.Tensor  # int64 [B]
    label: torch.Tensor  # float32 [B]
    seq_offsets: torch.Tensor  # int64 [B+1]
    seq_item: torch.Tensor  # int64 [ΣL]


class MLP(nn.Module):
    def __init__(self, d_in, d_hidden, d_out):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_in, d_hidden), nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Experts(nn.Module):
    def __init__(self, d, num):
        super().__init__()
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(num))
        self.expert_combine = "concat"

    def forward(self, x):
        return torch.cat([e(x) for e in self.experts], -1)


class TinyModel(nn.Module):
    def __init__(self, d=4, rows=2048, experts=4):
        super().__init__()
        self.user = nn.Embedding(rows, d)  # sharded when sparse_shard > 1
        self.item = nn.Embedding(64, d)  # small: stays whole
        self.mlp = MLP(2 * d, 8, d)
        self.experts = Experts(d, experts)
        self.head = nn.Linear(experts * d, 1)

    def forward(self, batch: TinyBatch) -> torch.Tensor:
        B = batch.user_id.shape[0]
        u = self.user(batch.user_id)  # [B, d]
        s = self.item(batch.seq_item)  # [ΣL, d]
        seg = torch.repeat_interleave(torch.arange(B), batch.seq_offsets.diff())
        pooled = torch.zeros_like(u).index_add(0, seg, s) / batch.seq_offsets.diff().clamp_min(1).unsqueeze(1)
        h = self.mlp(torch.cat([u, pooled], -1))  # [B, d]
        return self.head(self.experts(h)).squeeze(-1)  # [B]


def make_batch(step: int, lo: int, hi: int) -> TinyBatch:
    g = torch.Generator().manual_seed(1000 + step)
    lengths = torch.randint(0, 7, (GLOBAL_BATCH,), generator=g)
    lengths[step % GLOBAL_BATCH] = 20  # one long history: the balanced split must cope
    user = torch.randint(0, 2048, (GLOBAL_BATCH,), generator=g)
    label = torch.randint(0, 2, (GLOBAL_BATCH,), generator=g).float()
    items = torch.randint(0, 64, (int(lengths.sum()),), generator=g)
    offsets = torch.zeros(GLOBAL_BATCH + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    return TinyBatch(user_id=user[lo:hi], label=label[lo:hi], seq_offsets=offsets[lo:hi + 1] - offsets[lo],
                     seq_item=items[offsets[lo]:offsets[hi]])


def loss_fn(logits: torch.Tensor, batch: TinyBatch) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, batch.label)


def reference() -> dict:
    torch.manual_seed(0)
    model = TinyModel()
    losses, grads = [], None
    for step in range(STEPS):
        model.zero_grad()
        loss = loss_fn(model(make_batch(step, 0, GLOBAL_BATCH)), make_batch(step, 0, GLOBAL_BATCH))
        loss.backward()
        losses.append(loss.item())
        if grads is None:
            grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return {"losses": losses, "grads": grads, "params": {k: v.clone() for k, v in model.state_dict().items()}}


def _train(rank: int, world: int, plan_kwargs: dict) -> dict:
    plan = ParallelPlan(world_size=world, **plan_kwargs)
    mesh = build_mesh(plan)
    torch.manual_seed(0)
    model = parallelize(TinyModel(), plan, mesh)
    dp = plan.dp_replicate * plan.dp_shard  # distinct data shards; cp and tp peers share one
    coords = plan.coords(rank)
    shard = (coords["dp_replicate"] * plan.dp_shard_mod_ep + coords["dp_shard_mod_ep"]) * plan.ep + coords["ep"]
    per = GLOBAL_BATCH // dp
    losses, grads = [], None
    for step in range(STEPS):
        model.zero_grad()
        batch = make_batch(step, shard * per, (shard + 1) * per)
        loss = loss_fn(model(batch), batch)
        loss.backward()
        sync_gradients(model, mesh)
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=mesh.get_group("data"))  # cp peers hold the same shard's loss
        losses.append(mean.item() / plan.data_world)
        if grads is None:
            grads = full_state_dict(model, mesh, grads=True)
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return {"losses": losses, "grads": grads, "params": full_state_dict(model, mesh),
            "applied": model.gem_parallel.summary(), "warnings": model.gem_parallel.warnings}


CASES = {
    "hsdp": (4, dict(dp_replicate=2, dp_shard=2)),
    "tp": (4, dict(dp_shard=2, tp=2)),
    "ep": (4, dict(dp_replicate=2, dp_shard=2, ep=2)),
    "cp": (4, dict(dp_shard=2, cp=2)),
    "sparse": (4, dict(dp_shard=4, sparse_shard=2)),  # 2 shards x 2 replicas
    "all5": (8, dict(dp_replicate=1, dp_shard=2, ep=2, cp=2, tp=2, sparse_shard=4)),
    "all5-hsdp": (8, dict(dp_replicate=2, dp_shard=2, ep=2, cp=1, tp=2, sparse_shard=2)),
}


@pytest.fixture(scope="module")
def ref() -> dict:
    return reference()


@pytest.mark.parametrize("case", list(CASES))
def test_matches_single_process(case, ref):
    world, kwargs = CASES[case]
    results = run_distributed(_train, world, kwargs)
    for rank, res in enumerate(results):
        assert res["warnings"] == [], res["warnings"]
        assert res["losses"] == pytest.approx(ref["losses"], rel=1e-5), (case, rank)
        for what in ("grads", "params"):
            assert set(res[what]) == set(ref[what]), (case, what)
            for name, full in ref[what].items():
                torch.testing.assert_close(res[what][name], full, **TOL, msg=f"{case} rank {rank} {what} {name}")
    applied = results[0]["applied"]
    if kwargs.get("tp", 1) > 1:
        assert "tp on 2 linears" in applied
    if kwargs.get("ep", 1) > 1:
        assert "ep on 1 ensembles" in applied
    if kwargs.get("cp", 1) > 1:
        assert "cp on" in applied


# ---------------------------------------------------------------------------- the shards' share of the global norm


def _shard_norm_sq(rank: int, world: int, plan_kwargs: dict) -> float:
    """gem.train.optim.ShardOptimizer's squared norm of the expert and embedding-row shards after one backward."""
    from gem.api.types import TrainingSpec
    from gem.parallel.parallelize import grad_group
    from gem.train.optim import ShardOptimizer

    plan = ParallelPlan(world_size=world, **plan_kwargs)
    mesh = build_mesh(plan)
    torch.manual_seed(0)
    model = parallelize(TinyModel(), plan, mesh)
    shards = [p for p in model.parameters() if grad_group(p) != "data"]
    opt = ShardOptimizer(model, shards, mesh, TrainingSpec())
    coords = plan.coords(rank)
    shard = (coords["dp_replicate"] * plan.dp_shard_mod_ep + coords["dp_shard_mod_ep"]) * plan.ep + coords["ep"]
    per = GLOBAL_BATCH // (plan.dp_replicate * plan.dp_shard)
    batch = make_batch(0, shard * per, (shard + 1) * per)
    loss_fn(model(batch), batch).backward()
    opt.sync()
    return float(opt._norm_sq)


@pytest.mark.parametrize("plan_kwargs", [dict(dp_shard=4, ep=2, sparse_shard=2),
                                         dict(dp_shard=2, ep=2, tp=2, sparse_shard=2)], ids=["dp", "dp-tp"])
def test_shard_optimizer_counts_each_shard_once_in_the_global_norm(plan_kwargs, ref):
    """tp peers hold the same (unsplit) experts and embedding rows: counted once each, the clipping
    norm is the single process's, whatever tp is."""
    want = sum(float(g.double().pow(2).sum()) for name, g in ref["grads"].items()
               if name.startswith("experts.") or name == "user.weight")
    got = run_distributed(_shard_norm_sq, 4, plan_kwargs)
    assert got == pytest.approx([want] * 4, rel=1e-5)


def test_shard_optimizer_reduces_the_norm_on_the_shards_device(monkeypatch):
    """NCCL groups take only CUDA tensors: the shards' squared norm is all-reduced on their device, not the
    CPU (every ep / sparse_shard step on GPUs failed in ShardOptimizer.sync). Meta stands in for CUDA; the
    fake all_reduce records the device it is handed."""
    import gem.parallel.parallelize as parallelize_mod
    from gem.train.optim import ShardOptimizer

    seen: list[torch.device] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: seen.append(t.device))
    monkeypatch.setattr(parallelize_mod, "sync_parameter_gradients", lambda params, mesh: None)
    shard = nn.Parameter(torch.empty(3, 2, device="meta"))
    shard.grad = torch.empty(3, 2, device="meta")
    opt = object.__new__(ShardOptimizer)  # only sync's state: no mesh or optimizer needed
    opt.shards, opt.copies, opt.mesh = [shard], [1], None
    opt.sync()
    assert [d.type for d in seen] == ["meta"]

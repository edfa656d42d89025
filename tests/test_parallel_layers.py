"""The parallel building blocks against their single-device originals (gloo processes, fp32).

Gradient convention (gem/parallel/functional.py): with exact-adjoint collectives, the true gradient
of a replicated tensor is the mean over the ranks that computed the same loss, and of a shard its
own gradient divided by that count; tensor parallelism (Megatron) leaves the true gradient on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from gem.model.jagged import jagged_attention
from gem.parallel.context_parallel import balanced_split, cp_jagged_attention, split_tokens
from gem.parallel.expert_parallel import ExpertParallel
from gem.parallel.sharded_embedding import RowShardedEmbedding
from gem.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from gem.parallel.testing import run_distributed

def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """fp32, only the order of summation differs: relative 1e-5, absolute 1e-6 of the tensor's scale."""
    scale = max(1.0, b.abs().max().item()) if b.numel() else 1.0
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6 * scale)


# ---------------------------------------------------------------------------- tensor parallel


def _tp(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(6, 8), nn.Linear(8, 5)
    x = torch.randn(3, 4, 6)
    w = torch.randn(3, 4, 5)
    xr = x.clone().requires_grad_()
    ref = fc2(F.gelu(fc1(xr)))
    (ref * w).sum().backward()

    group = dist.group.WORLD
    col, row = ColumnParallelLinear.from_linear(fc1, group), RowParallelLinear.from_linear(fc2, group)
    xp = x.clone().requires_grad_()
    out = row(F.gelu(col(xp)))
    (out * w).sum().backward()
    gathered = ColumnParallelLinear.from_linear(fc1, group, gather_output=True)(x)
    return {
        "out": _close(out, ref), "gather_output": _close(gathered, fc1(x)), "x_grad": _close(xp.grad, xr.grad),
        "w1": _close(col.weight.grad, fc1.weight.grad.chunk(world, 0)[rank]),
        "b1": _close(col.bias.grad, fc1.bias.grad.chunk(world, 0)[rank]),
        "w2": _close(row.weight.grad, fc2.weight.grad.chunk(world, 1)[rank]),
        "b2": _close(row.bias.grad, fc2.bias.grad),
    }


def test_tensor_parallel_mlp_equals_unsplit_linears():
    for res in run_distributed(_tp, 2):
        assert all(res.values()), res


def _tp_attention(rank: int, world: int) -> dict:
    """Megatron attention split of one block attention layer: rank r owns heads [2r, 2r+2) of 4."""
    import copy
    from dataclasses import replace

    from gem.modules import PRESETS
    from gem.modules.attention import BlockAttentionLayer
    from gem.modules.oneseq import TierBatch
    from gem.ops.testing import make_offsets
    from gem.parallel.parallelize import full_state_dict
    from gem.parallel.tensor_parallel import QKV_COLWISE, ROWWISE, apply_tensor_parallel

    torch.manual_seed(0)
    tier = replace(PRESETS["tiny"].tiers[0], num_heads=4)
    ref = BlockAttentionLayer(tier, shift=tier.block_size // 2)
    par = copy.deepcopy(ref)
    done = apply_tensor_parallel(par, dist.group.WORLD, {"w_qkv": QKV_COLWISE, "w_o": ROWWISE})
    lengths = [5, 0, 37, 9]
    g = torch.Generator().manual_seed(1)
    values = torch.randn(sum(lengths), tier.dim, generator=g)
    phase = torch.rand(sum(lengths), generator=g) * 60
    w = torch.randn(sum(lengths), tier.dim, generator=g)
    outs, grads = [], []
    for layer in (ref, par):
        x = values.clone().requires_grad_()
        out = layer(TierBatch(x, make_offsets(lengths), phase))
        (out * w).sum().backward()
        outs.append(out)
        grads.append(x.grad)
    full = full_state_dict(par, grads=True)
    d, h = tier.dim, world  # rows of w_qkv: [q; k; v], each head-major; this rank's heads of each
    qkv_rows = ref.w_qkv.weight.grad.view(3, h, d // h, d)[:, rank].reshape(-1, d)
    return {
        "replaced": done == ["w_qkv", "w_o"], "local_heads": par.local_heads == 2,
        "out": _close(outs[1], outs[0]), "x_grad": _close(grads[1], grads[0]),
        "norm": _close(par.norm.weight.grad, ref.norm.weight.grad),
        "w_qkv": _close(par.w_qkv.weight.grad, qkv_rows),
        "w_o": _close(par.w_o.weight.grad, ref.w_o.weight.grad.chunk(world, 1)[rank]),
        "gathered": all(_close(full[n], p.grad) for n, p in ref.named_parameters()),
    }


def test_tensor_parallel_block_attention_splits_whole_heads():
    for res in run_distributed(_tp_attention, 2):
        assert all(res.values()), res


def _tp_kunlun(rank: int, world: int) -> dict:
    """The tiny GEM (Kunlun) model at tp=2 against itself unsplit on one process: 2 SGD steps."""
    import copy

    from gem.api.types import ModelSpec
    from gem.model import GEMModel, config_from_spec
    from gem.modules.inputs import random_inputs
    from gem.parallel.mesh import build_mesh
    from gem.parallel.parallelize import full_state_dict, parallelize, sync_gradients
    from gem.parallel.plan import ParallelPlan

    torch.manual_seed(0)
    ref = GEMModel(config_from_spec(ModelSpec(num_heads=4)))
    model = copy.deepcopy(ref)
    plan = ParallelPlan(world_size=world, dp_shard=1, tp=world)
    mesh = build_mesh(plan)
    parallelize(model, plan, mesh)
    batches = [random_inputs(ref.cfg, torch.tensor([7, 0, 40, 19]), seed=s) for s in (1, 2)]
    res = {"losses": [], "ref_losses": []}
    for step, batch in enumerate(batches):
        for m, key in ((ref, "ref_losses"), (model, "losses")):
            m.zero_grad()
            loss = m.loss(batch)[0]
            loss.backward()
            res[key].append(loss.item())
        sync_gradients(model, mesh)
        if step == 0:
            full = full_state_dict(model, mesh, grads=True)
            # a parameter without a path to the loss (unused tables) is gathered as zeros
            res["grads"] = all(_close(full[n], torch.zeros_like(p) if p.grad is None else p.grad)
                               for n, p in ref.named_parameters())
        with torch.no_grad():
            for m in (ref, model):
                for p in m.parameters():
                    if p.grad is not None:
                        p -= 0.5 * p.grad
    full = full_state_dict(model, mesh)
    res["params"] = all(_close(full[n], p) for n, p in ref.named_parameters())
    res["split"] = sorted(model.gem_parallel.tensor_parallel)
    res["warnings"] = model.gem_parallel.warnings
    return res


def test_tensor_parallel_kunlun_model_trains_like_one_process():
    for res in run_distributed(_tp_kunlun, 2):
        assert res["losses"] == pytest.approx(res["ref_losses"], rel=1e-5), res
        assert res["grads"] and res["params"] and res["warnings"] == [], res
        # the local layer (1) of each tier: its attention heads split, nothing else in the model is Linear-pair shaped
        assert res["split"] == [f"layers.1.attn.{t}.{w}" for t in ("engaged", "impressions") for w in ("w_o", "w_qkv")]


def test_model_hints_name_what_tp_splits_and_match_the_operator():
    from gem.api.types import GEMTrainingSpec
    from gem.model import build_model
    from gem.parallel.job import spec_hints
    from gem.parallel.parallelize import model_shape_hints

    for model in ({"numHeads": 4}, {"preset": "small"}):
        spec = GEMTrainingSpec.model_validate({"model": model})
        hints, op = model_shape_hints(build_model(spec.model), gpu_memory_bytes=2**30), spec_hints(spec)
        assert hints.hidden_dim > 0 and hints.num_experts > 1
        assert (hints.hidden_dim, hints.hidden_units, hints.num_experts) == (op.hidden_dim, op.hidden_units,
                                                                             op.num_experts)


# ---------------------------------------------------------------------------- expert parallel


class Ensemble(nn.Module):
    def __init__(self, d: int, d_out: int, num: int, combine: str):
        super().__init__()
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, d_out), nn.Tanh()) for _ in range(num))
        self.expert_combine = combine

    def forward(self, x):
        outs = [e(x) for e in self.experts]
        return torch.cat(outs, -1) if self.expert_combine == "concat" else torch.stack(outs).sum(0) / (
            len(outs) if self.expert_combine == "mean" else 1)


def _ep(rank: int, world: int, combine: str) -> dict:
    torch.manual_seed(0)
    ens = Ensemble(4, 3, num=4, combine=combine)
    sizes = [2 + r for r in range(world)]  # EP ranks hold different numbers of examples
    xs = [torch.randn(n, 2, 4) for n in sizes]
    width = 12 if combine == "concat" else 3
    ws = [torch.randn(n, 2, width) for n in sizes]
    x_all = torch.cat(xs).requires_grad_()
    (ens(x_all) * torch.cat(ws)).sum().backward()  # reference: the sum of every rank's loss
    ref_x_grad = x_all.grad.split(sizes)[rank]

    ep = ExpertParallel(ens, dist.group.WORLD)
    x = xs[rank].clone().requires_grad_()
    y = ep(x)
    (y * ws[rank]).sum().backward()
    per = len(ens.experts) // world
    grads_ok = all(_close(p.grad, q.grad) for local, full in zip(ep.experts, ens.experts[rank * per:(rank + 1) * per])
                   for p, q in zip(local.parameters(), full.parameters()))
    return {"out": _close(y, ens(xs[rank])), "x_grad": _close(x.grad, ref_x_grad), "expert_grads": grads_ok}


def test_expert_parallel_equals_the_whole_ensemble():
    for combine in ("concat", "sum", "mean"):
        for res in run_distributed(_ep, 2, combine):
            assert all(res.values()), (combine, res)


def test_size_exchanges_run_on_the_device_of_the_data(monkeypatch):
    """NCCL takes only CUDA tensors: the row counts that expert parallelism and row-sharded embeddings
    exchange before their data must sit on the data's device, not the CPU (every ep / sparse_shard step on
    GPUs failed with "No backend type associated with device type cpu"). Meta stands in for CUDA here:
    the fake collective records the devices it is handed and stops the forward."""
    seen: list[torch.device] = []

    class Reached(Exception):
        pass

    def collective(*args, **kwargs):
        seen.extend(t.device for a in args for t in (a if isinstance(a, list) else [a]) if isinstance(t, torch.Tensor))
        raise Reached

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "all_gather", collective)
    monkeypatch.setattr(dist, "all_to_all_single", collective)

    ens = nn.Module()
    ens.experts, ens.expert_combine = nn.ModuleList([nn.Linear(3, 2) for _ in range(2)]), "sum"
    emb = RowShardedEmbedding(37, 3, group=None)
    for forward, data in ((ExpertParallel(ens, None), torch.empty(4, 3, device="meta")),
                          (emb, torch.empty(4, 5, dtype=torch.int64, device="meta"))):
        seen.clear()
        with pytest.raises(Reached):
            forward(data)
        assert seen and all(d.type == "meta" for d in seen), (type(forward).__name__, seen)


# ---------------------------------------------------------------------------- sharded embedding


def _emb(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    table = nn.Embedding(37, 3)  # 37 rows: the last shard is short
    ids = [torch.randint(0, 37, (r + 1, 5)) for r in range(world)]  # different ids (and counts) per rank
    ws = [torch.randn(r + 1, 5, 3) for r in range(world)]
    sum(((table(i) * w).sum() for i, w in zip(ids, ws))).backward()

    sharded = RowShardedEmbedding.from_embedding(table, dist.group.WORLD)
    out = sharded(ids[rank])
    (out * ws[rank]).sum().backward()
    lo = sharded.row_offset
    empty = sharded(torch.zeros(0, dtype=torch.int64))
    return {"lookup": torch.equal(out, table(ids[rank])),
            "grad": _close(sharded.weight.grad, table.weight.grad[lo:lo + sharded.weight.shape[0]]),
            "empty": empty.shape == (0, 3)}


def test_sharded_embedding_returns_the_same_rows_as_one_table():
    for res in run_distributed(_emb, 4):
        assert all(res.values()), res


# ---------------------------------------------------------------------------- context parallel


def _cp_attention(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    lengths = torch.tensor([0, 1, 5, 17, 2, 9])  # an empty history and one shorter than cp
    offsets = torch.zeros(7, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    q = torch.randn(6, 3, 2, 4)
    k, v = torch.randn(int(offsets[-1]), 2, 4), torch.randn(int(offsets[-1]), 2, 4)
    w = torch.randn(6, 3, 2, 4)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = jagged_attention(qr, kr, vr, offsets)
    (ref * w).sum().backward()

    pos, local_offsets = split_tokens(offsets, world, rank)
    qp, kp, vp = q.clone().requires_grad_(), k[pos].clone().requires_grad_(), v[pos].clone().requires_grad_()
    out = cp_jagged_attention(qp, kp, vp, local_offsets, dist.group.WORLD)
    (out * w).sum().backward()
    q_grad = qp.grad.clone()
    dist.all_reduce(q_grad)
    return {"out": _close(out, ref), "q_grad": _close(q_grad / world, qr.grad),
            "k_grad": _close(kp.grad / world, kr.grad[pos]), "v_grad": _close(vp.grad / world, vr.grad[pos]),
            "pos": pos.tolist()}


def test_context_parallel_attention_over_split_tokens_is_exact():
    results = run_distributed(_cp_attention, 3)
    for res in results:
        assert all(v for k, v in res.items() if k != "pos"), res
    covered = sorted(p for r in results for p in r["pos"])
    assert covered == list(range(34))  # every token on exactly one rank


def test_balanced_split_balances_tokens_and_is_deterministic():
    lengths = torch.tensor([100, 1, 1, 50, 49, 3, 2, 0])
    parts = balanced_split(lengths, 2)
    assert sorted(torch.cat(parts).tolist()) == list(range(8))
    loads = [int((lengths[p] + 1).sum()) for p in parts]
    assert max(loads) - min(loads) <= 3
    assert all(torch.equal(a, b) for a, b in zip(parts, balanced_split(lengths, 2)))
    assert [p.tolist() for p in balanced_split(torch.tensor([5]), 3)] == [[0], [], []]


def _stacked(rank: int, world: int) -> dict:
    from gem.modules.mowe import MixtureOfWukongExperts
    from gem.parallel.expert_parallel import apply_expert_parallel

    torch.manual_seed(0)
    mowe = MixtureOfWukongExperts(num_in=6, num_out=5, dim=4, num_experts=4, expert_tokens=4, rank=2, hidden=8)
    sizes = [1 + 2 * r for r in range(world)]
    zs = [torch.randn(n, 6, 4) for n in sizes]
    ws = [torch.randn(n, 5, 4) for n in sizes]
    z_all = torch.cat(zs).requires_grad_()
    (mowe(z_all) * torch.cat(ws)).sum().backward()
    ref = {k: p.grad.clone() for k, p in mowe.named_parameters()}
    ref_out = mowe(zs[rank]).detach()
    ref_z = z_all.grad.split(sizes)[rank]

    holder = nn.Module()
    holder.mowe = mowe
    mowe.zero_grad()
    assert apply_expert_parallel(holder, dist.group.WORLD) == ["mowe"]
    z = zs[rank].clone().requires_grad_()
    out = holder.mowe(z)
    (out * ws[rank]).sum().backward()
    sl = mowe.expert_slice(rank, world, 4)
    ok = {"out": _close(out, ref_out), "z_grad": _close(z.grad, ref_z)}
    for name, p in mowe.named_parameters():
        if name.startswith("combine_proj"):
            g = p.grad.clone()
            dist.all_reduce(g)  # dense: each rank holds its examples' part
            ok[name] = _close(g, ref[name])
        else:
            ok[name] = p.shape[0] == 2 and _close(p.grad, ref[name][sl])
    return ok


def test_stacked_wukong_experts_split_over_ep_ranks():
    for res in run_distributed(_stacked, 2):
        assert all(res.values()), res


def _bags(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    table = nn.Embedding(50, 3)
    ids = torch.randint(0, 50, (9,))
    offsets = torch.tensor([0, 2, 2, 7, 9])  # a bag of zero ids included
    sharded = RowShardedEmbedding.from_embedding(table, dist.group.WORLD)
    return {mode: _close(sharded(ids, offsets, mode), F.embedding_bag(ids, table.weight, offsets[:-1], mode=mode))
            for mode in ("sum", "mean")}


def test_sharded_embedding_bags_pool_like_embedding_bag():
    for res in run_distributed(_bags, 2):
        assert all(res.values()), res


def test_select_examples_agrees_for_both_batch_layouts():
    import dataclasses

    import numpy as np

    from gem.api.types import SyntheticDataSpec
    from gem.data import build_splits, make_batch
    from gem.modules.inputs import from_v1_batch
    from gem.parallel.context_parallel import example_costs, select_examples

    train, _ = build_splits(SyntheticDataSpec(num_train_examples=64, num_eval_examples=8))
    batch = make_batch(train, np.arange(12), max_seq_len=32)
    index = torch.tensor([0, 3, 4, 11])
    sub = select_examples(batch, index)
    assert torch.equal(sub.seq_offsets.diff(), batch.seq_offsets.diff()[index])
    assert torch.equal(sub.user_id, batch.user_id[index])
    lo, hi = int(batch.seq_offsets[3]), int(batch.seq_offsets[4])
    assert torch.equal(sub.seq_ad_id[int(sub.seq_offsets[1]):int(sub.seq_offsets[2])], batch.seq_ad_id[lo:hi])

    inputs = from_v1_batch(batch)
    assert torch.equal(example_costs(inputs), example_costs(batch))  # the same events, split by type

    def flat(x):
        if isinstance(x, torch.Tensor):
            return [x]
        if isinstance(x, dict):
            return [t for k in sorted(x) for t in flat(x[k])]
        if isinstance(x, tuple):
            return [t for v in x for t in flat(v)]
        if dataclasses.is_dataclass(x):
            return [t for f in dataclasses.fields(x) for t in flat(getattr(x, f.name))]
        return []

    got, want = flat(select_examples(inputs, index)), flat(from_v1_batch(sub))
    assert len(got) == len(want) > 10 and all(torch.equal(a, b) for a, b in zip(got, want))


# ---------------------------------------------------------------------------- tp with ep


class _MLPExpert(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class _MLPEnsemble(nn.Module):
    expert_combine = "sum"

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(_MLPExpert() for _ in range(2))

    def forward(self, x):
        return sum(e(x) for e in self.experts)


class _ExpertModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.ens, self.mlp = _MLPEnsemble(), _MLPExpert()  # the MLP outside the ensemble: tp splits it

    def forward(self, x):
        return self.mlp(self.ens(x))


def _tp_ep(rank: int, world: int) -> dict:
    from gem.parallel.mesh import build_mesh
    from gem.parallel.parallelize import full_state_dict, parallelize
    from gem.parallel.plan import ParallelPlan

    torch.manual_seed(0)
    model = _ExpertModel()
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2 * world, 4)
    want = model(x)
    plan = ParallelPlan(world_size=world, dp_shard=2, ep=2, tp=2, sparse_shard=1)
    mesh = build_mesh(plan)
    parallelize(model, plan, mesh)
    d = plan.coords(rank)["dp_shard_mod_ep"] * 2 + plan.coords(rank)["ep"]  # this rank's examples
    got = full_state_dict(model, mesh)
    return {"tp": model.gem_parallel.tensor_parallel, "state": set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref),
            "out": _close(model(x[2 * d:2 * d + 2]), want[2 * d:2 * d + 2])}


def test_tensor_parallel_leaves_experts_whole_when_expert_parallel_splits_them():
    """tp=2 x ep=2 with MLP-shaped experts: tp split the experts' fc1/fc2 too, and the consolidated state
    (full_state_dict, model.pt) then held half-width expert weights under the full names. The experts
    stay whole (ep splits them); the MLP outside the ensemble is still split."""
    for res in run_distributed(_tp_ep, 4):
        assert res["tp"] == ["mlp.fc1", "mlp.fc2"] and res["state"] and res["out"], res

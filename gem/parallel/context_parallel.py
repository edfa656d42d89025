"""Context parallelism for jagged sequence batches.

Two granularities, both exact:

1. Whole sequences (`apply_context_parallel`, what `parallelize` applies). The cp ranks of a group hold
   the same batch. Its sequences are dealt to the ranks by balanced token counts (longest first,
   each to the rank with the fewest tokens so far: GEM's length-sorted sub-batches), each rank runs
   the model on its sub-batch, and the per-example outputs are all-gathered back into batch order,
   so every cp rank computes the loss of the whole batch. Works for any model that maps a jagged
   batch to per-example outputs, with no change to the model.

2. Tokens of one sequence (`split_tokens` + `cp_jagged_attention`), for histories too long for one
   rank: each rank holds a contiguous slice of every sequence, attends to it with the full query,
   and the partial softmaxes are merged exactly with a log-sum-exp all-reduce
   (num = Σ_r e^{m_r - m} num_r, den = Σ_r e^{m_r - m} den_r). Only [B, Nq, H, dh+1] floats cross
   the group per layer, whatever the history length. This needs the model's attention call to be
   swappable; it is tested against gem.model.jagged.jagged_attention.

Batches follow the vocabulary of gem/data/batch.py: `seq_offsets` [B+1], `seq_*` jagged [ΣL]
fields, every other tensor field per example [B, ...].
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gem.parallel.functional import all_gather_rows, all_reduce_sum

# ---------------------------------------------------------------------------- whole sequences


def balanced_split(lengths: torch.Tensor, cp: int) -> list[torch.Tensor]:
    """Example indices for each of cp ranks, balancing Σ(length + 1) (the +1 is the per-example work).

    Longest-processing-time-first greedy: deterministic, so every rank computes the same split.
    Each rank's indices are sorted (its sub-batch keeps the batch's order).
    """
    return _balanced(lengths.to(torch.int64) + 1, cp)


def _balanced(costs: torch.Tensor, cp: int) -> list[torch.Tensor]:
    cost = costs.tolist()
    order = sorted(range(len(cost)), key=lambda i: (-cost[i], i))
    heap = [(0, 0, r) for r in range(cp)]  # (tokens, examples, rank)
    owned: list[list[int]] = [[] for _ in range(cp)]
    for i in order:
        tokens, count, r = heapq.heappop(heap)
        owned[r].append(i)
        heapq.heappush(heap, (tokens + cost[i], count + 1, r))
    return [torch.tensor(sorted(o), dtype=torch.int64) for o in owned]


def _jagged_index(offsets: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [Σl] of the events of examples `index` and the new offsets [b+1]."""
    lengths = offsets.diff()[index]  # [b]
    new_offsets = torch.zeros(index.numel() + 1, dtype=offsets.dtype, device=offsets.device)
    new_offsets[1:] = torch.cumsum(lengths, 0)
    within = torch.arange(int(new_offsets[-1]), device=offsets.device) - torch.repeat_interleave(new_offsets[:-1], lengths)
    return torch.repeat_interleave(offsets[:-1][index], lengths) + within, new_offsets


def example_costs(batch: Any) -> torch.Tensor:
    """Work per example, int64 [B]: its events (all histories) + 1."""
    if hasattr(batch, "seq_offsets"):
        return batch.seq_offsets.diff().cpu() + 1
    if hasattr(batch, "sequences"):  # gem.modules.inputs.GemInputs
        total = torch.ones(batch.size, dtype=torch.int64)
        for seq in batch.sequences.values():
            total += seq.offsets.diff().cpu()
        return total
    raise TypeError(f"context parallel does not know how to split a {type(batch).__name__}: it needs seq_offsets "
                    "(gem.data.Batch) or sequences (gem.modules.inputs.GemInputs)")


def select_examples(batch: Any, index: torch.Tensor) -> Any:
    """The sub-batch of examples `index`, for the two jagged batch layouts of this repository.

    gem.data.Batch-like dataclasses: `seq_offsets` [B+1], `seq_*` jagged, other tensors per example.
    GemInputs-like: per-example tensors and dicts of them, `sparse` (ids, offsets) bags, `sequences`
    of EventSequence (offsets, timestamps, ids, surface).
    """
    if hasattr(batch, "seq_offsets"):
        src, new_offsets = _jagged_index(batch.seq_offsets, index)
        values = {}
        for f in dataclasses.fields(batch):
            v = getattr(batch, f.name)
            if f.name == "seq_offsets":
                values[f.name] = new_offsets
            elif f.name.startswith("seq_"):
                values[f.name] = v.index_select(0, src)
            elif isinstance(v, torch.Tensor) and v.dim() > 0:
                values[f.name] = v.index_select(0, index)
            else:
                values[f.name] = v
        return dataclasses.replace(batch, **values)
    return _select_structured(batch, index)


def _select_structured(batch: Any, index: torch.Tensor) -> Any:
    def rows(v):
        if isinstance(v, torch.Tensor):
            return v.index_select(0, index)
        if isinstance(v, dict):
            return {k: rows(x) for k, x in v.items()}
        return v

    values = {}
    for f in dataclasses.fields(batch):
        v = getattr(batch, f.name)
        if f.name == "sparse":
            values[f.name] = {}
            for name, (ids, offsets) in v.items():
                pos, new_offsets = _jagged_index(offsets, index)
                values[f.name][name] = (ids.index_select(0, pos), new_offsets)
        elif f.name == "sequences":
            values[f.name] = {}
            for name, seq in v.items():
                pos, new_offsets = _jagged_index(seq.offsets, index)
                values[f.name][name] = dataclasses.replace(
                    seq, offsets=new_offsets, timestamps=seq.timestamps.index_select(0, pos),
                    ids={k: i.index_select(0, pos) for k, i in seq.ids.items()},
                    surface=None if seq.surface is None else seq.surface.index_select(0, pos))
        else:
            values[f.name] = rows(v)
    return dataclasses.replace(batch, **values)


def _batch_device(batch: Any) -> torch.device:
    for f in dataclasses.fields(batch):
        v = getattr(batch, f.name)
        if isinstance(v, torch.Tensor):
            return v.device
    return torch.device("cpu")


def gather_examples(out: Any, owned: list[torch.Tensor], group) -> Any:
    """Per-example outputs of this rank's sub-batch -> the whole batch, on every rank (differentiable)."""
    if isinstance(out, dict):
        return {k: gather_examples(v, owned, group) for k, v in out.items()}
    if isinstance(out, (tuple, list)):
        return type(out)(gather_examples(v, owned, group) for v in out)
    sizes = [o.numel() for o in owned]
    full = all_gather_rows(out, group, sizes)  # [B, ...] in rank order
    perm = torch.cat(owned).to(full.device)  # full[j] belongs to example perm[j]
    return torch.empty_like(full).index_copy(0, perm, full)


def apply_context_parallel(model: nn.Module, group) -> None:
    """Make `model` run each cp rank on a token-balanced share of the batch's examples, in place.

    The model's forward is replaced on the instance (its parameters and their names are
    unchanged, so checkpoints do not depend on cp); the original is kept as `_gem_cp_inner`.
    """
    cp, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    inner = model.forward

    def forward(batch: Any, *args: Any, **kwargs: Any) -> Any:
        owned = _balanced(example_costs(batch), cp)
        sub = select_examples(batch, owned[cp_rank].to(_batch_device(batch)))
        return gather_examples(inner(sub, *args, **kwargs), owned, group)

    model._gem_cp_inner = inner
    model.forward = forward


# ---------------------------------------------------------------------------- tokens of one sequence


def split_tokens(offsets: torch.Tensor, cp: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's contiguous slice of every sequence: (token positions [Σl], local offsets [B+1]).

    Sequence b of length L gives rank r the tokens [floor(L r / cp), floor(L (r+1) / cp)).
    """
    lengths = offsets.diff()
    lo = torch.div(lengths * rank, cp, rounding_mode="floor")
    hi = torch.div(lengths * (rank + 1), cp, rounding_mode="floor")
    local_len = hi - lo
    local_offsets = torch.zeros_like(offsets)
    local_offsets[1:] = torch.cumsum(local_len, 0)
    within = torch.arange(int(local_offsets[-1]), device=offsets.device) - torch.repeat_interleave(local_offsets[:-1], local_len)
    positions = torch.repeat_interleave(offsets[:-1] + lo, local_len) + within
    return positions, local_offsets


def _local_scores(q, k, offsets):
    """Scores of this rank's tokens [Σl, Nq, H], their example index [Σl], and the local max [B, Nq, H]."""
    B, Nq, H, dh = q.shape
    seg = torch.repeat_interleave(torch.arange(B, device=offsets.device), offsets.diff())  # [Σl]
    scores = (q.index_select(0, seg) * k.unsqueeze(1)).sum(-1) * dh**-0.5  # [Σl, Nq, H]
    m = torch.full((B, Nq, H), float("-inf"), dtype=scores.dtype, device=scores.device)
    m = m.scatter_reduce(0, seg.view(-1, 1, 1).expand_as(scores), scores.detach(), "amax")
    return scores, seg, m


def cp_jagged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, group) -> torch.Tensor:
    """softmax(q k^T / sqrt(dh)) v over every rank's slice of each sequence (gem.model.jagged semantics).

    q: [B, Nq, H, dh] (same on every rank)   k, v: [Σl, H, dh] this rank's tokens   offsets: local [B+1]
    -> [B, Nq, H, dh], identical on every rank; examples with no events anywhere get zeros.
    """
    B, Nq, H, dh = q.shape
    scores, seg, m_local = _local_scores(q, k, offsets)
    m = m_local.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)  # global max: a constant, cancels in the ratio
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - m_safe.index_select(0, seg))  # [Σl, Nq, H]
    den = scores.new_zeros(B, Nq, H).index_add(0, seg, p)  # [B, Nq, H]
    num = q.new_zeros(B, Nq, H, dh).index_add(0, seg, p.unsqueeze(-1) * v.unsqueeze(1))  # [B, Nq, H, dh]
    both = all_reduce_sum(torch.cat([num, den.unsqueeze(-1)], dim=-1), group)  # [B, Nq, H, dh + 1]
    num, den = both[..., :dh], both[..., dh]
    return num / den.clamp_min(torch.finfo(den.dtype).tiny).unsqueeze(-1)

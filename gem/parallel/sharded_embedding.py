"""Row-wise sharded embedding tables for the sparse side (TorchRec's "row-wise" sharding).

A table of R rows is split over the n ranks of a sparse group: rank s owns rows
[s*ceil(R/n), (s+1)*ceil(R/n)). A lookup of ids [N] on each rank:

    owner = id // rows_per_shard;  sort ids by owner
    all_to_all(ids)          -> the ids other ranks want from my shard
    local lookup             -> their rows
    all_to_all(rows)         -> my rows back, unsorted to the original id order      [N, d]

Bytes moved per rank: N ids and N x d values each way, instead of the whole table. The sparse
groups stay inside one HSDP shard group by default (plan.py), so the all-to-alls stay in a block;
copies of the shard across sparse groups (the sparse_replica group) are kept in sync by
`sync_gradients`. A lookup returns exactly what the unsharded nn.Embedding returns.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from gem.parallel.expert_parallel import GRAD_GROUP_ATTR
from gem.parallel.functional import all_to_all_rows


class _AllToAllIds:
    @staticmethod
    def exchange(ids: torch.Tensor, send: torch.Tensor, group) -> tuple[torch.Tensor, list[int], list[int]]:
        """Send consecutive id blocks of `send` [n] ids to each rank; return the ids received, the counts sent
        and received. The counts stay on the ids' device until both are exchanged: NCCL takes no CPU tensors."""
        recv_t = torch.empty_like(send)
        dist.all_to_all_single(recv_t, send, group=group)
        send_l, recv = send.tolist(), recv_t.tolist()
        out = ids.new_empty(sum(recv))
        dist.all_to_all_single(out, ids.contiguous(), output_split_sizes=recv, input_split_sizes=send_l, group=group)
        return out, send_l, recv


class RowShardedEmbedding(nn.Module):
    """nn.Embedding with its rows split over a process group; same forward contract (ids -> [..., d])."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group):
        super().__init__()
        n, r = dist.get_world_size(group), dist.get_rank(group)
        self.num_embeddings, self.embedding_dim, self.group = num_embeddings, embedding_dim, group
        self.rows_per_shard = math.ceil(num_embeddings / n)
        self.row_offset = r * self.rows_per_shard
        local_rows = max(0, min(num_embeddings, self.row_offset + self.rows_per_shard) - self.row_offset)
        self.weight = nn.Parameter(torch.empty(local_rows, embedding_dim))  # [R/n, d]
        setattr(self.weight, GRAD_GROUP_ATTR, "sparse_replica")

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, group) -> "RowShardedEmbedding":
        mod = cls(emb.num_embeddings, emb.embedding_dim, group=group).to(emb.weight.device, emb.weight.dtype)
        with torch.no_grad():
            mod.weight.copy_(emb.weight[mod.row_offset: mod.row_offset + mod.weight.shape[0]])
        return mod

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor | None = None, mode: str = "sum") -> torch.Tensor:
        """ids [...] -> [..., d]; with bag offsets [B+1] (offsets[0] = 0): pooled [B, d] like F.embedding_bag.

        Code that reads `.weight` directly (F.embedding_bag(ids, emb.weight, ...)) sees only this rank's rows:
        call the module instead.
        """
        rows = self._lookup(ids)
        if offsets is None:
            return rows
        counts = offsets.diff()  # [B]
        seg = torch.repeat_interleave(torch.arange(counts.numel(), device=ids.device), counts)
        pooled = rows.new_zeros(counts.numel(), self.embedding_dim).index_add(0, seg, rows)  # [B, d]
        if mode == "mean":
            pooled = pooled / counts.clamp_min(1).unsqueeze(1).to(pooled.dtype)
        elif mode != "sum":
            raise ValueError(f"mode {mode!r}: only sum and mean bags are supported")
        return pooled

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)  # [N]
        n = dist.get_world_size(self.group)
        owner = torch.div(flat, self.rows_per_shard, rounding_mode="floor")  # [N]
        order = torch.argsort(owner, stable=True)  # ids grouped by owning rank
        ones = torch.ones_like(owner, dtype=torch.int64)
        send = torch.zeros(n, dtype=torch.int64, device=ids.device).index_add_(0, owner, ones)  # ids per owner
        wanted, send, recv = _AllToAllIds.exchange(flat[order], send, self.group)  # ids others want from me
        rows = F.embedding(wanted - self.row_offset, self.weight)  # [Σrecv, d]
        mine = all_to_all_rows(rows, recv, send, self.group)  # [N, d] in `order`
        out = torch.empty_like(mine).index_copy(0, order, mine) if flat.numel() else mine
        return out.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows {self.row_offset}.."
                f"{self.row_offset + self.weight.shape[0] - 1}")


def apply_sparse_sharding(model: nn.Module, group, *, min_rows: int) -> list[str]:
    """Replace every nn.Embedding with at least min_rows rows by a RowShardedEmbedding. Returns names."""
    done = []
    for name, mod in list(model.named_modules()):
        if isinstance(mod, nn.Embedding) and mod.num_embeddings >= min_rows and name:
            if mod.padding_idx is not None or mod.max_norm is not None or mod.sparse:
                continue  # not the plain lookups this sharding reproduces
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child,
                    RowShardedEmbedding.from_embedding(mod, group))
            done.append(name)
    return done

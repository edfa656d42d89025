"""A generative objective over the event history: each event's ids predicted from the rest of it.

    x_e   = Σ_tables E_t[id_t(e)]                        the event's embedding (FeatureEmbeddings.events)
    ctx_e = (Σ_{e' in its history} x_e' - x_e) / (n - 1)    leave-one-out mean, every event type
    loss  = mean over tables t, events e of CE(s · ctx_e · E_t[c]ᵀ for c in the batch's ids of t, id_t(e))

An impression carries one click label but a history of ~50 events, and which campaigns a user's
history holds together is evidence of the latent interests behind the user x ad affinity, the
part of the ads world no single label reveals (docs/quality.md, "How much of the gap is
reachable"). HSTU trains on the history itself (next-item prediction); this is the order-free
form of that objective (word2vec's CBOW over one history), so it needs no causal mask in the
trunk and reads only the embedding tables: the same rows the candidate and the history tokens use,
so what it learns is what the dot products of the affinity branch and the target-aware events
read. No labels enter it, so it adds no leakage.

Negatives are the batch's distinct ids of the table (in-batch sampled softmax, as HSTU and
two-tower retrieval train): the whole table when it is small, a popularity-weighted sample of it
when it is not (popular ids are over-represented as negatives; no log-Q correction, since the
loss only shapes embeddings and its logits are never served). At most `max_events` events per
batch are scored, every k-th, so the cost stays bounded on long histories.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from gem.modules.embeddings import FeatureEmbeddings, hash_ids
from gem.modules.inputs import GemInputs
from gem.ops import segment_ids, segment_sum


class HistoryGenerativeLoss(nn.Module):
    def __init__(self, dim: int, *, max_events: int = 2048):
        super().__init__()
        self.max_events = max_events
        # Learnt logit scale; embeddings start at norm ~1 and a mean of many of them is short, so
        # the raw dot products start near 0. torch.full draws nothing: the model's other weights
        # are the same with and without this module. Shape [1], not []: DeepSpeed broadcasts every
        # parameter viewed as bytes, which a 0-dim tensor cannot be.
        self.log_scale = nn.Parameter(torch.full((1,), math.log(math.sqrt(dim))))

    def forward(self, emb: FeatureEmbeddings, inputs: GemInputs) -> torch.Tensor:
        """The loss, a float32 scalar (0 when no history has two events)."""
        names = emb.cfg.features.event_types
        tables = emb.cfg.features.event_tables
        xs, segs = [], []
        total = None
        for name in names:
            seq = inputs.sequences[name]
            x = emb.events(seq)  # [ΣL, d]
            xs.append(x)
            segs.append(segment_ids(seq.offsets, x.shape[0]))
            pooled = segment_sum(x, seq.offsets)  # [B, d]
            total = pooled if total is None else total + pooled
        x, seg = torch.cat(xs), torch.cat(segs)
        count = torch.bincount(seg, minlength=inputs.size)  # events per example, every type
        # Events of histories with another event to predict them from. (nonzero and unique below
        # wait for the device: two syncs per step, inherent in their data-dependent sizes.) No early
        # return when none is kept: every rank calls every table (row-sharded tables and ZeRO-3
        # gather collectively), and a sum over no events is a 0 that keeps the graph.
        rows = (count[seg] >= 2).nonzero().squeeze(1)
        rows = rows[::max(1, math.ceil(rows.numel() / self.max_events))]
        x, seg = x[rows], seg[rows]
        ctx = (total[seg] - x) / (count[seg] - 1).clamp_min(1).to(x.dtype)[:, None]  # [N, d]
        scale = self.log_scale.exp()
        loss = x.new_zeros((), dtype=torch.float32)
        for table in tables:
            ids = torch.cat([inputs.sequences[name].ids[table] for name in names])[rows]
            hashed = hash_ids(ids, emb.buckets[table], emb.salts[table])
            cand, target = torch.unique(hashed, return_inverse=True)
            out = emb.tables[table](cand)  # [K, d]; called as a module: sharded tables see it
            logits = (ctx @ out.to(ctx.dtype).T).float() * scale.float()  # [N, K]
            loss = loss + F.cross_entropy(logits, target, reduction="sum") / max(1, rows.numel())
        return loss / len(tables)

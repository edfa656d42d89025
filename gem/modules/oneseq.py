"""OneSeq: heterogeneous event sequences merged into one time-ordered jagged sequence per tier.

For every tier (a group of event types sharing one capacity, e.g. clicks + conversions at
width 256, impressions at width 128):

    index, offsets, source = oneseq_merge_index(times of each type)   (stable sort by (example, time))
    e = Proj_type(Σ_tables Emb(ids)) + E_type[type] + E_surface[surface] + E_age[log-bucket(age)]
    S = LN(e)                                    [ΣL_tier, d_tier]   + offsets [B+1]

Event-level personalisation: each event type has its own projection, and each tier its own
width, heads, length, seeds and summary size (notes sections 10 and 19.B). The merge happens on
integer indices first, so events cut by max_seq_len are never embedded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from gem.modules.common import JaggedModule, linear_flops
from gem.modules.config import KunlunConfig, TierConfig
from gem.modules.embeddings import FeatureEmbeddings
from gem.modules.inputs import EventSequence, GemInputs
from gem.ops import oneseq_merge_index, segment_ids
from gem.ops.common import BlockPlan, BucketPlan, SlotLayout, from_slots, offsets_of, plan_blocks, plan_buckets
from gem.ops.rotary import DEFAULT_ROTARY_BASE, rotary_cos_sin


def time_bucket(age_s: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """Log-spaced age buckets: 1 min -> 2, 1 h -> 12, 1 day -> 21, 1 month -> 31."""
    return (torch.log1p(age_s.clamp_min(0) / 60.0) * 3.0).long().clamp(max=num_buckets - 1)


@dataclass
class TierBatch:
    """One tier's merged sequence for a batch, plus per-batch plans shared by every layer."""

    values: torch.Tensor  # [ΣL, d_tier]
    offsets: torch.Tensor  # int64 [B+1]
    phase: torch.Tensor  # float32 [ΣL], rotary phase (log time)
    _plans: dict = field(default_factory=dict, repr=False)

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets.diff()

    def replace_values(self, values: torch.Tensor) -> "TierBatch":
        return TierBatch(values, self.offsets, self.phase, self._plans)

    def _memo(self, key, make):
        if key not in self._plans:
            self._plans[key] = make()
        return self._plans[key]

    def block_plan(self, block: int, shift: int, align: str = "start") -> BlockPlan:
        return self._memo(("blocks", block, shift, align),
                          lambda: plan_blocks(self.offsets, block, shift=shift, align=align))

    def kv_buckets(self, num_kv: int) -> BucketPlan:
        """Buckets for long queries (this sequence) over num_kv keys per example."""
        def make():
            B = self.offsets.numel() - 1
            k_off = offsets_of(torch.full((B,), num_kv, dtype=torch.int64, device=self.offsets.device))
            return plan_buckets(self.offsets, k_off, overhead=4096.0)
        return self._memo(("kv", num_kv), make)

    def seed_buckets(self, num_seeds: int) -> BucketPlan:
        """Buckets for num_seeds broadcast queries over this sequence."""
        def make():
            B = self.offsets.numel() - 1
            q_off = offsets_of(torch.full((B,), num_seeds, dtype=torch.int64, device=self.offsets.device))
            return plan_buckets(q_off, self.offsets, overhead=4096.0)
        return self._memo(("seeds", num_seeds), make)

    def rotary(self, head_dim: int, dtype: torch.dtype, base: float = DEFAULT_ROTARY_BASE):
        return self._memo(("rotary", head_dim, dtype, base),
                          lambda: rotary_cos_sin(self.phase, head_dim, base=base, dtype=dtype))


class OneSeqEncoder(JaggedModule):
    def __init__(self, cfg: KunlunConfig, tier: TierConfig):
        super().__init__()
        self.cfg, self.tier = cfg, tier
        d, dt = cfg.dim, tier.dim
        # One projection per event type: capacity where the signal is (notes section 10).
        self.proj = nn.ModuleDict({t: nn.Linear(d, dt, bias=False) for t in tier.event_types})
        self.type_emb = nn.Embedding(len(tier.event_types), dt)
        self.surface_emb = nn.Embedding(cfg.features.num_surfaces, dt)
        self.age_emb = nn.Embedding(cfg.num_time_buckets, dt)
        for emb in (self.type_emb, self.surface_emb, self.age_emb):
            nn.init.normal_(emb.weight, std=1.0 / math.sqrt(dt))
        self.norm = nn.LayerNorm(dt)
        # Target-aware events [PROPOSAL]: e_event ⊙ e_candidate from the same tables is large and
        # positive exactly where the event was on the candidate's ad or campaign.
        use_target = cfg.target_aware_events and bool(cfg.features.candidate)
        self.target = nn.Linear(d, dt, bias=False) if use_target else None
        # ... and exact-match flags: bit i set when the event's id in candidate feature i's table
        # equals the candidate's (e.g. same ad, same campaign): 2^n buckets.
        tables = {s.name: s.table for s in cfg.features.sparse}
        self.match_features = tuple(c for c in cfg.features.candidate if tables[c] in cfg.features.event_tables) \
            if use_target and cfg.match_flags else ()
        self.match_tables = tuple(tables[c] for c in self.match_features)
        self.match_emb = nn.Embedding(2 ** len(self.match_features), dt) if self.match_features else None
        if self.match_emb is not None:
            nn.init.normal_(self.match_emb.weight, std=1.0 / math.sqrt(dt))

    def forward(self, inputs: GemInputs, embeddings: FeatureEmbeddings,
                candidate: torch.Tensor | None = None) -> TierBatch:
        """candidate: [B, d] sum of the candidate's embeddings (needed when target-aware)."""
        seqs: list[EventSequence] = [inputs.sequences[t] for t in self.tier.event_types]
        index, offsets, source = oneseq_merge_index([s.timestamps for s in seqs], [s.offsets for s in seqs],
                                                    max_seq_len=self.tier.max_seq_len, kernel=self.kernel)
        merged = EventSequence(
            offsets=offsets,
            timestamps=torch.cat([s.timestamps for s in seqs])[index],
            ids={t: torch.cat([s.ids[t] for s in seqs])[index] for t in self.cfg.features.event_tables},
            surface=None if any(s.surface is None for s in seqs) else torch.cat([s.surface for s in seqs])[index],
        )
        raw = embeddings.events(merged)  # [ΣL, d]
        e = self._project_by_type(raw, source)  # [ΣL, d_tier], in the autocast dtype if any
        seg = segment_ids(offsets, index.numel())
        if self.target is not None:
            e = e + self.target(raw * candidate.to(raw.dtype).index_select(0, seg))
        age = (inputs.request_time[seg] - merged.timestamps).float().clamp_min(0)  # [ΣL], s
        surface = torch.zeros_like(source) if merged.surface is None else merged.surface
        surface = surface.clamp(0, self.cfg.features.num_surfaces - 1)
        match = self._match_bucket(inputs, merged, seg) if self.match_emb is not None else torch.zeros_like(seg)
        e = e + self._small_embeddings(source, surface, time_bucket(age, self.cfg.num_time_buckets), match, e.dtype)
        phase = self.cfg.rotary_scale * torch.log1p(age / 60.0)
        return TierBatch(self.norm(e), offsets, phase)

    def _small_embeddings(self, etype, surface, age_bucket, match, dtype) -> torch.Tensor:
        """E_type + E_surface + E_age [+ E_match] per event with one lookup: the small tables are
        summed into their (type, surface, age, match) product table first (hundreds of rows, not ΣL)."""
        T, S, A = self.type_emb.num_embeddings, self.surface_emb.num_embeddings, self.age_emb.num_embeddings
        M = 1 if self.match_emb is None else self.match_emb.num_embeddings
        row = torch.arange(T * S * A * M, device=etype.device)  # row = ((t·S + s)·A + a)·M + m
        table = (self.type_emb(row // (S * A * M)) + self.surface_emb(row // (A * M) % S)
                 + self.age_emb(row // M % A))  # [T·S·A·M, d_t]
        if self.match_emb is not None:
            table = table + self.match_emb(row % M)
        return table.to(dtype).index_select(0, ((etype * S + surface) * A + age_bucket) * M + match)

    def _match_bucket(self, inputs: GemInputs, merged: EventSequence, seg: torch.Tensor) -> torch.Tensor:
        """int64 [ΣL]: Σ_i 2^i · [event id == candidate id] over the candidate features (a bag's first id)."""
        bucket = torch.zeros_like(seg)
        for i, (feature, table) in enumerate(zip(self.match_features, self.match_tables)):
            ids, offsets = inputs.sparse[feature]
            if ids.numel() == 0:
                continue
            cand = ids[offsets[:-1].clamp(max=ids.numel() - 1)]  # [B]
            # An empty bag has no candidate id: its index points at a neighbour's first id, which
            # would leak that example's candidate into this one's flags. No id: no match.
            has_id = offsets.diff() > 0  # [B]
            bucket = bucket + ((merged.ids[table] == cand[seg]) & has_id[seg]).long() * (1 << i)
        return bucket

    def _project_by_type(self, raw: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        types = self.tier.event_types
        if len(types) == 1:
            return self.proj[types[0]](raw)
        # Rows grouped by type, projected per group, then put back in sequence order (a permutation).
        order = torch.sort(source, stable=True).indices  # [ΣL], rows of type 0, then type 1, ...
        # index_add, not bincount: on a GPU bincount reads its input's max back first (a second sync)
        counts = torch.zeros(len(types), dtype=torch.int64, device=source.device).index_add_(
            0, source, torch.ones_like(source)).tolist()
        parts = [self.proj[t](rows) for t, rows in zip(types, raw.index_select(0, order).split(counts))]
        dt = parts[0].dtype
        grouped = torch.cat([p.to(dt) for p in parts])  # [ΣL, d_tier] in type order
        return from_slots(grouped, SlotLayout(torch.empty_like(order).index_copy_(
            0, order, torch.arange(order.numel(), device=order.device)), order.numel(), order))

    def flops(self, tokens: float) -> float:
        return linear_flops(tokens, self.cfg.dim, self.tier.dim) * (1 if self.target is None else 2)

"""What the Kunlun model reads: GemInputs, and its construction from the v1 training Batch.

Every sequence is jagged (values + offsets [B+1]); nothing is padded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gem.ops.common import offsets_of


@dataclass
class EventSequence:
    """One event type's history (e.g. ad clicks), oldest first within each example."""

    offsets: torch.Tensor  # int64 [B+1]
    timestamps: torch.Tensor  # int64 [ΣL], seconds
    ids: dict[str, torch.Tensor]  # table name -> int64 [ΣL]
    surface: torch.Tensor | None = None  # int64 [ΣL], where the event happened (None: surface 0)


@dataclass
class GemInputs:
    request_time: torch.Tensor  # int64 [B], seconds
    surface: torch.Tensor  # int64 [B], the request's surface
    sparse: dict[str, tuple[torch.Tensor, torch.Tensor]]  # feature -> (ids int64 [ΣN], offsets [B+1])
    dense: torch.Tensor  # float32 [B, num_dense]
    sequences: dict[str, EventSequence]  # event type -> its jagged history
    content: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> float32 [B, dim]
    labels: dict[str, torch.Tensor] = field(default_factory=dict)  # task -> float32 [B]
    weight: torch.Tensor | None = None  # float32 [B]: 0 for padding examples

    @property
    def size(self) -> int:
        return int(self.request_time.shape[0])

    def to(self, device: torch.device | str) -> "GemInputs":
        def mv(x):
            return x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x
        seqs = {k: EventSequence(mv(s.offsets), mv(s.timestamps), {t: mv(i) for t, i in s.ids.items()}, mv(s.surface))
                for k, s in self.sequences.items()}
        return GemInputs(mv(self.request_time), mv(self.surface), {k: (mv(a), mv(b)) for k, (a, b) in self.sparse.items()},
                         mv(self.dense), seqs, {k: mv(v) for k, v in self.content.items()},
                         {k: mv(v) for k, v in self.labels.items()}, mv(self.weight))


def split_by_type(offsets: torch.Tensor, types: torch.Tensor, timestamps: torch.Tensor,
                  ids: dict[str, torch.Tensor], type_names: tuple[str, ...],
                  surface: torch.Tensor | None = None) -> dict[str, EventSequence]:
    """One typed jagged history -> one jagged sequence per event type (order kept).

    On a GPU it reads the device once (the type range and counts together): a nonzero and a bincount
    per type, and the range check, each waited for the stream on every training step."""
    B, T = offsets.numel() - 1, len(type_names)
    ones = torch.ones_like(types, dtype=torch.int64)
    per_type = torch.zeros(T, dtype=torch.int64, device=types.device).index_add_(0, types.clamp(0, T - 1), ones)
    counts = [0] * T
    if types.numel():
        lo, hi, *counts = torch.cat([torch.stack([types.min(), types.max()]).long(), per_type]).tolist()
        if lo < 0 or hi >= T:  # such events were dropped without a word
            raise ValueError(f"seq_type must be in [0, {T}): "
                             + ", ".join(f"{i} {n}" for i, n in enumerate(type_names))
                             + f"; got values in [{lo}, {hi}]")
    seg = torch.repeat_interleave(torch.arange(B, device=offsets.device), offsets.diff(), output_size=types.numel())
    # Rows grouped by type; the stable sort keeps them time-ordered within each example.
    by_type = torch.sort(types, stable=True).indices.split(counts)
    out = {}
    for name, rows in zip(type_names, by_type):
        lengths = torch.zeros(B, dtype=torch.int64, device=offsets.device).index_add_(0, seg[rows], ones[rows])
        out[name] = EventSequence(
            offsets=offsets_of(lengths), timestamps=timestamps[rows], ids={k: v[rows] for k, v in ids.items()},
            surface=None if surface is None else surface[rows])
    return out


def single_id_bag(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One id per example as a bag: (ids [B], offsets 0..B)."""
    return ids, torch.arange(ids.numel() + 1, device=ids.device)


def from_v1_batch(batch, event_types: tuple[str, ...] = ("impression", "click", "conversion", "organic")
                  ) -> GemInputs:
    """gem.data.Batch (one typed event history) -> GemInputs (one sequence per event type).

    event_types[i] names seq_type i (gem.data.synthetic.EVENT_TYPES); a type absent from a batch
    is an empty sequence, so sources without organic events (MovieLens) work unchanged.
    """
    seqs = split_by_type(batch.seq_offsets, batch.seq_type, batch.seq_timestamp,
                         {"item": batch.seq_ad_id, "campaign": batch.seq_campaign_id}, event_types,
                         getattr(batch, "seq_surface", None))
    labels = {"click": batch.click, "conversion": batch.conversion}
    dwell = getattr(batch, "dwell", None)
    if dwell is not None:
        labels["dwell"] = dwell
    return GemInputs(
        request_time=batch.request_time, surface=batch.surface,
        sparse={"user": single_id_bag(batch.user_id), "ad": single_id_bag(batch.ad_id),
                "campaign": single_id_bag(batch.campaign_id), "advertiser": single_id_bag(batch.advertiser_id)},
        dense=batch.dense, sequences=seqs, labels=labels, weight=batch.weight)


def random_inputs(cfg, lengths: torch.Tensor, *, seed: int = 0,
                  type_probs: tuple[float, ...] | None = None) -> GemInputs:
    """Random GemInputs whose example b has lengths[b] history events in total (benchmarks, tests).

    Events get types with `type_probs` (default: uniform over cfg.features.event_types), ids
    uniform in each table, timestamps over the month before the request, ascending per example.
    """
    f = cfg.features
    g = torch.Generator().manual_seed(seed)
    B = int(lengths.numel())
    probs = torch.tensor(type_probs or [1.0] * len(f.event_types), dtype=torch.float32)
    request_time = torch.full((B,), 1_700_000_000, dtype=torch.int64)
    offsets = offsets_of(lengths.to(torch.int64))
    total = int(offsets[-1])
    types = torch.multinomial(probs, total, replacement=True, generator=g) if total else torch.zeros(0, dtype=torch.int64)
    age = torch.rand(total, generator=g) * 30 * 86400
    seg = torch.repeat_interleave(torch.arange(B), lengths)
    order = torch.argsort(seg * 1e8 - age.double())  # oldest first within each example
    timestamps = (request_time[seg] - age.long())[order]
    ids = {t: torch.randint(0, f.table(t).num_buckets, (total,), generator=g) for t in f.event_tables}
    surface = torch.randint(0, f.num_surfaces, (total,), generator=g)
    seqs = split_by_type(offsets, types, timestamps, ids, f.event_types, surface)
    sparse = {s.name: single_id_bag(torch.randint(0, f.table(s.table).num_buckets, (B,), generator=g)) for s in f.sparse}
    labels = {}
    for t in cfg.tasks:
        labels[t.name] = (torch.rand(B, generator=g) < 0.3).float()
        if t.requires is not None:
            labels[t.name] = labels[t.name] * labels[t.requires]
    return GemInputs(
        request_time=request_time, surface=torch.randint(0, f.num_surfaces, (B,), generator=g), sparse=sparse,
        dense=torch.randn(B, f.num_dense, generator=g),
        sequences=seqs, content={c.name: torch.randn(B, c.dim, generator=g) for c in f.content}, labels=labels,
        weight=torch.ones(B))

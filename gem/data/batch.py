"""The training batch: dense per-example tensors plus a jagged event history.

The history is never padded: `seq_*` hold the events of all B examples back to back and
`seq_offsets[b]:seq_offsets[b+1]` are example b's events (oldest first, most recent last).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from gem.data.synthetic import Examples


@dataclass
class Batch:
    user_id: torch.Tensor  # int64 [B]
    ad_id: torch.Tensor  # int64 [B]
    campaign_id: torch.Tensor  # int64 [B]
    advertiser_id: torch.Tensor  # int64 [B]
    surface: torch.Tensor  # int64 [B]
    request_time: torch.Tensor  # int64 [B], seconds
    dense: torch.Tensor  # float32 [B, NUM_DENSE]
    seq_offsets: torch.Tensor  # int64 [B+1], seq_offsets[0] = 0
    seq_ad_id: torch.Tensor  # int64 [ΣL]
    seq_campaign_id: torch.Tensor  # int64 [ΣL]
    seq_type: torch.Tensor  # int64 [ΣL]
    seq_timestamp: torch.Tensor  # int64 [ΣL], seconds
    seq_surface: torch.Tensor  # int64 [ΣL], the surface each event happened on
    click: torch.Tensor  # float32 [B]
    conversion: torch.Tensor  # float32 [B]
    p_click: torch.Tensor  # float32 [B], true probability (evaluation only, never a feature)
    p_conversion: torch.Tensor  # float32 [B]
    weight: torch.Tensor  # float32 [B]: 1 for real examples, 0 for padding that evens out eval shards
    dwell: torch.Tensor  # float32 [B], awareness label; NaN where a source does not know it
    p_dwell: torch.Tensor  # float32 [B]
    objective: torch.Tensor  # int64 [B], the campaign's objective (0: off-site purchase, 1: app install)

    @property
    def size(self) -> int:
        return int(self.user_id.shape[0])

    @property
    def seq_lengths(self) -> torch.Tensor:
        return self.seq_offsets.diff()  # [B]

    @property
    def seq_age(self) -> torch.Tensor:
        """Seconds between each event and its example's request, float32 [ΣL]."""
        owner = torch.repeat_interleave(torch.arange(self.size, device=self.seq_offsets.device), self.seq_lengths)
        return (self.request_time[owner] - self.seq_timestamp).float()

    def to(self, device: torch.device | str) -> "Batch":
        return Batch(**{f.name: getattr(self, f.name).to(device, non_blocking=True) for f in fields(self)})


def make_batch(ex: Examples, index: np.ndarray, *, max_seq_len: int, weight: np.ndarray | None = None) -> Batch:
    """Gather examples `index` into a Batch, keeping each history's most recent max_seq_len events."""
    lengths = np.minimum(ex.seq_lengths[index], max_seq_len)  # [B]
    starts = ex.seq_offsets[index + 1] - lengths  # [B], first kept event of each example
    offsets = np.zeros(len(index) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    # Source position of every kept event: its segment's start + its rank inside the segment.
    rank_in_segment = np.arange(offsets[-1]) - np.repeat(offsets[:-1], lengths)
    src = np.repeat(starts, lengths) + rank_in_segment  # [ΣL]

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a))

    return Batch(
        user_id=t(ex.user_id[index]),
        ad_id=t(ex.ad_id[index]),
        campaign_id=t(ex.campaign_id[index]),
        advertiser_id=t(ex.advertiser_id[index]),
        surface=t(ex.surface[index]),
        request_time=t(ex.request_time[index]),
        dense=t(ex.dense[index]),
        seq_offsets=t(offsets),
        seq_ad_id=t(ex.seq_ad_id[src]),
        seq_campaign_id=t(ex.seq_campaign_id[src]),
        seq_type=t(ex.seq_type[src]),
        seq_timestamp=t(ex.seq_timestamp[src]),
        seq_surface=t(ex.seq_surface[src]),
        click=t(ex.click[index]),
        conversion=t(ex.conversion[index]),
        p_click=t(ex.p_click[index]),
        p_conversion=t(ex.p_conversion[index]),
        weight=t(np.ones(len(index), np.float32) if weight is None else weight.astype(np.float32)),
        dwell=t(ex.dwell[index]),
        p_dwell=t(ex.p_dwell[index]),
        objective=t(ex.objective[index]),
    )

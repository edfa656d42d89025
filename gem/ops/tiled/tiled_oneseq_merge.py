"""oneseq_merge_index vectorised: two stable sorts over the concatenation.

A stable sort by time followed by a stable sort by example orders events by (example, time);
ties keep concatenation order, i.e. (input, position), exactly like the reference.
"""

from __future__ import annotations

import torch

from gem.ops.common import offsets_of, positions_in_segment, segment_ids


def tiled_oneseq_merge_index(timestamps: list[torch.Tensor], offsets: list[torch.Tensor],
                             max_seq_len: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ts = torch.cat(timestamps)  # [ΣE]
    example = torch.cat([segment_ids(o, t.numel()) for o, t in zip(offsets, timestamps)])  # [ΣE]
    source = torch.cat([torch.full((t.numel(),), i, dtype=torch.int64, device=ts.device)
                        for i, t in enumerate(timestamps)])
    order = torch.sort(ts, stable=True).indices
    order = order[torch.sort(example[order], stable=True).indices]  # [ΣE], by (example, time)
    lengths = torch.stack([o.diff() for o in offsets]).sum(0)  # [B]
    merged = offsets_of(lengths)
    if max_seq_len is not None:
        seg = example[order]
        keep = positions_in_segment(merged, ts.numel()) >= (lengths - max_seq_len)[seg]  # the most recent events
        order = order[keep]
        merged = offsets_of(lengths.clamp(max=max_seq_len))
    return order, merged, source[order]

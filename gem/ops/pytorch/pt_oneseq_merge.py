"""Reference of oneseq_merge_index: per example, collect every event and sort it in Python."""

from __future__ import annotations

import torch


def pytorch_oneseq_merge_index(timestamps: list[torch.Tensor], offsets: list[torch.Tensor],
                               max_seq_len: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (index into the concatenated inputs [ΣL'], merged offsets [B+1], source input [ΣL']), on the
    inputs' device. The loop runs on host copies read once (not one device sync per event)."""
    device = offsets[0].device
    B = offsets[0].numel() - 1
    base = [0]
    for ts in timestamps:
        base.append(base[-1] + ts.numel())
    times = [ts.tolist() for ts in timestamps]  # Python numbers, as .item() gives: fractional seconds order too
    bounds = [off.tolist() for off in offsets]
    index, source, lengths = [], [], []
    for b in range(B):
        events = []  # (time, input, position-in-concatenation)
        for i, (ts, off) in enumerate(zip(times, bounds)):
            for r in range(off[b], off[b + 1]):
                events.append((ts[r], i, base[i] + r))
        events.sort()  # by time, then input order, then original position
        if max_seq_len is not None:
            events = events[len(events) - min(len(events), max_seq_len):]  # the most recent
        index += [e[2] for e in events]
        source += [e[1] for e in events]
        lengths.append(len(events))
    merged_offsets = torch.zeros(B + 1, dtype=torch.int64)
    merged_offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return (torch.tensor(index, dtype=torch.int64, device=device), merged_offsets.to(device),
            torch.tensor(source, dtype=torch.int64, device=device))

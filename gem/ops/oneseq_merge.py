"""OneSeq merge: several jagged event sequences -> one time-ordered jagged sequence.

Input i: timestamps_i [ΣL_i] with offsets_i [B+1] (every input has the same B). The merged
sequence of example b holds all of b's events from every input, ordered by time (ties: input
order, then original order), keeping the most recent max_seq_len when given.

oneseq_merge_index returns integer indices only, so any number of per-event tensors (values,
types, surfaces) can follow with one gather each:

    index, offsets, source = oneseq_merge_index([t_click, t_conv], [o_click, o_conv])
    values = torch.cat([v_click, v_conv])[index]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gem.ops.common import DEFAULT_KERNEL, Kernel, check_offsets
from gem.ops.pytorch.pt_oneseq_merge import pytorch_oneseq_merge_index
from gem.ops.tiled.tiled_oneseq_merge import tiled_oneseq_merge_index


def oneseq_merge_index(timestamps: Sequence[torch.Tensor], offsets: Sequence[torch.Tensor], *,
                       max_seq_len: int | None = None, kernel: Kernel = DEFAULT_KERNEL
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (index [ΣL'] into the concatenation of the inputs, offsets [B+1], source input [ΣL'])"""
    timestamps, offsets = list(timestamps), list(offsets)
    torch._assert(len(timestamps) == len(offsets) and len(offsets) >= 1, "one offsets tensor per input")
    for i, (ts, off) in enumerate(zip(timestamps, offsets)):
        check_offsets(off, ts.numel(), f"offsets[{i}]")
        torch._assert(off.numel() == offsets[0].numel(), "every input must have the same batch size")
    if max_seq_len is not None and max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    if kernel == Kernel.PYTORCH:
        return pytorch_oneseq_merge_index(timestamps, offsets, max_seq_len)
    return tiled_oneseq_merge_index(timestamps, offsets, max_seq_len)


def oneseq_merge(values: Sequence[torch.Tensor], timestamps: Sequence[torch.Tensor],
                 offsets: Sequence[torch.Tensor], *, max_seq_len: int | None = None,
                 kernel: Kernel = DEFAULT_KERNEL
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (values [ΣL', ...], timestamps [ΣL'], offsets [B+1], source [ΣL'])"""
    index, merged_offsets, source = oneseq_merge_index(timestamps, offsets, max_seq_len=max_seq_len, kernel=kernel)
    return torch.cat(list(values))[index], torch.cat(list(timestamps))[index], merged_offsets, source

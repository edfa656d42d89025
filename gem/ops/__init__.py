"""Jagged ops of the GEM model: one dispatcher per op, a plain reference, a fast tiled kernel.

    gem/ops/<op>.py               the dispatcher (checks, then branches on `kernel`)
    gem/ops/pytorch/pt_<op>.py    plain padded + masked PyTorch reference (fp32, readable)
    gem/ops/tiled/tiled_<op>.py   fast kernel over dense tiles (length buckets / fixed blocks)

Layout and names: values [ΣL, ...] + offsets int64 [B+1] (gem/ops/common.py).
"""

from gem.ops.activations import ACTIVATIONS
from gem.ops.block_attention import block_attention
from gem.ops.common import DEFAULT_KERNEL, Kernel, offsets_of, plan_blocks, plan_buckets, segment_ids
from gem.ops.gdpa import gdpa
from gem.ops.jagged_attention import jagged_attention
from gem.ops.oneseq_merge import oneseq_merge, oneseq_merge_index
from gem.ops.rotary import rotary_cos_sin, time_rotary
from gem.ops.segment import jagged_last_k, segment_mean, segment_sum

__all__ = [
    "ACTIVATIONS", "DEFAULT_KERNEL", "Kernel", "block_attention", "gdpa", "jagged_attention", "jagged_last_k",
    "offsets_of", "oneseq_merge", "oneseq_merge_index", "plan_blocks", "plan_buckets", "rotary_cos_sin",
    "segment_ids", "segment_mean", "segment_sum", "time_rotary",
]

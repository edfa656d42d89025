"""The tiled kernels' hand-written backward passes against numerical derivatives (float64, tiny
inputs). The references compute in fp32 and share no backward code with them, so these are the
only checks of the tiled gradients that do not go through another implementation."""

from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck

from gem.ops import Kernel, block_attention, gdpa, jagged_attention, jagged_last_k, segment_sum, time_rotary
from gem.ops.testing import make_offsets

OFFSETS = make_offsets([3, 0, 5, 1])  # an empty segment, a single row, a segment across blocks of 2
T = 9
TILED = Kernel.TILED


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


QKV = [_rand(T, 2, 4, seed=i).requires_grad_() for i in range(3)]
PHASE = _rand(T, seed=9) * 5
DENSE_KV = [_rand(4, 3, 2, 4, seed=10 + i).requires_grad_() for i in range(2)]
SEEDS = _rand(3, 2, 4, seed=12).requires_grad_()

CASES = {
    "jagged_attention": (lambda q, k, v: jagged_attention(q, k, v, OFFSETS, kernel=TILED), QKV),
    "block_attention_shift_rotary": (lambda q, k, v: block_attention(q, k, v, OFFSETS, block_size=2, shift=1,
                                                                     rotary_phase=PHASE, kernel=TILED), QKV),
    "block_attention_end": (lambda q, k, v: block_attention(q, k, v, OFFSETS, block_size=2, align="end",
                                                            kernel=TILED), QKV),
    "gdpa_window": (lambda q, k, v: gdpa(q, k, v, q_offsets=OFFSETS, k_offsets=OFFSETS, window=1, qk_scale=0.3,
                                         activation="silu", kernel=TILED), QKV),
    "gdpa_short_dense_kv": (lambda q, k, v: gdpa(q, k, v, q_offsets=OFFSETS, qk_scale=0.3, activation=("silu", "gelu"),
                                                 kernel=TILED),
                            [QKV[0], *DENSE_KV]),
    "gdpa_broadcast": (lambda q, k, v: gdpa(q, k, v, k_offsets=OFFSETS, broadcast_q=True, qk_scale=0.3,
                                            activation="gelu", kernel=TILED), [SEEDS, QKV[1], QKV[2]]),
    "time_rotary": (lambda x: time_rotary(x, PHASE, kernel=TILED), QKV[:1]),
    "segment_sum": (lambda x: segment_sum(x, OFFSETS, kernel=TILED), QKV[:1]),
    "jagged_last_k": (lambda x: jagged_last_k(x, OFFSETS, 2, kernel=TILED)[0], QKV[:1]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_tiled_gradients_match_numerical_derivatives(name):
    fn, inputs = CASES[name]
    assert gradcheck(fn, inputs, eps=1e-6, atol=1e-6, rtol=1e-4)

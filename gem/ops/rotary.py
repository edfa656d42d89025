"""Time-based rotary encoding: rotary angles from event time instead of position.

Token t at phase φ_t (e.g. φ = 16 · log1p(age / 60 s), see gem.modules.oneseq) has its
(i, i + dh/2) pairs rotated by φ_t · ω_i, ω_i = base^(-2i/dh). After rotating q and k, a
score depends on φ_i - φ_j only: relative log-time, as "ROTE" in the Kunlun notes (section 13).
"""

from __future__ import annotations

import torch

from gem.ops.common import DEFAULT_KERNEL, Kernel
from gem.ops.pytorch.pt_rotary import pytorch_time_rotary
from gem.ops.tiled.tiled_rotary import rotary_cos_sin, tiled_time_rotary

DEFAULT_ROTARY_BASE = 10000.0


def time_rotary(x: torch.Tensor, phase: torch.Tensor, *, base: float = DEFAULT_ROTARY_BASE,
                kernel: Kernel = DEFAULT_KERNEL,
                cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x: [ΣL, H, dh] (dh even)  phase: float [ΣL]  ->  [ΣL, H, dh]. The phase is data (event
    times): the tiled kernel passes no gradient to it.

    cos_sin: a precomputed rotary_cos_sin(phase, dh, base=..., dtype=x.dtype) (tiled only).
    """
    torch._assert(x.dim() == 3 and x.shape[-1] % 2 == 0, "x must be [ΣL, H, dh] with an even dh")
    torch._assert(phase.shape == x.shape[:1], "phase must be [ΣL], one per row of x")
    if kernel == Kernel.PYTORCH:
        return pytorch_time_rotary(x, phase, base=base)
    if cos_sin is None:
        cos_sin = rotary_cos_sin(phase, x.shape[-1], base=base, dtype=x.dtype)
    return tiled_time_rotary(x, *cos_sin)


__all__ = ["DEFAULT_ROTARY_BASE", "rotary_cos_sin", "time_rotary"]

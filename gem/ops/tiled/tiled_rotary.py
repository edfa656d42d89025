"""time_rotary with real arithmetic: [x1, x2] -> [x1 cos - x2 sin, x1 sin + x2 cos]."""

from __future__ import annotations

import torch


def rotary_cos_sin(phase: torch.Tensor, head_dim: int, *, base: float, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of phase · ω_i, each [ΣL, 1, dh/2]; compute once per batch, reuse in every layer."""
    half = head_dim // 2
    omega = base ** (-torch.arange(half, dtype=torch.float32, device=phase.device) * 2.0 / head_dim)
    angle = phase.float()[:, None] * omega[None, :]  # [ΣL, dh/2]
    return angle.cos().to(dtype)[:, None, :], angle.sin().to(dtype)[:, None, :]


def tiled_time_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [ΣL, H, dh]  cos, sin: [ΣL, 1, dh/2]  ->  [ΣL, H, dh]"""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

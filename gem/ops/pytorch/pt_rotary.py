"""Reference of time_rotary: rotate pairs (x_i, x_{i+dh/2}) as complex numbers by phase · ω_i."""

from __future__ import annotations

import torch


def pytorch_time_rotary(x: torch.Tensor, phase: torch.Tensor, *, base: float) -> torch.Tensor:
    """x: [ΣL, H, dh]  phase: [ΣL]  ->  [ΣL, H, dh]"""
    dh = x.shape[-1]
    half = dh // 2
    omega = base ** (-torch.arange(half, dtype=torch.float64, device=phase.device) * 2.0 / dh)  # [dh/2]
    angle = phase.double()[:, None] * omega[None, :]  # [ΣL, dh/2]
    rot = torch.polar(torch.ones_like(angle), angle)[:, None, :]  # [ΣL, 1, dh/2], e^{iθ}
    z = torch.complex(x[..., :half].double(), x[..., half:].double()) * rot  # [ΣL, H, dh/2]
    return torch.cat([z.real, z.imag], dim=-1).to(x.dtype)

"""time_rotary with real arithmetic: [x1, x2] -> [x1 cos - x2 sin, x1 sin + x2 cos]."""

from __future__ import annotations

import torch


def rotary_cos_sin(phase: torch.Tensor, head_dim: int, *, base: float, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of phase · ω_i, each [ΣL, 1, dh/2]; compute once per batch, reuse in every layer.

    The angles are computed in the phase's own precision, at least float32: a float64 phase (large
    values: raw seconds, unix times) was once rounded to float32 first, off by up to 0.03 rad at 1e6
    and 64 rad at a unix time. The model's phases are float32 log-ages (< ~300, error < 2e-5 rad),
    where float64 would only triple this table's cost.
    """
    half = head_dim // 2
    wide = torch.float64 if phase.dtype == torch.float64 else torch.float32
    omega = base ** (-torch.arange(half, dtype=wide, device=phase.device) * 2.0 / head_dim)
    angle = phase.to(wide)[:, None] * omega[None, :]  # [ΣL, dh/2]
    return angle.cos().to(dtype)[:, None, :], angle.sin().to(dtype)[:, None, :]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [x1 cos - x2 sin, x1 sin + x2 cos], written into one new tensor (no cat)."""
    x1, x2 = x.chunk(2, dim=-1)
    out = torch.empty_like(x)
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=o1)
    o1.addcmul_(x2, sin, value=-1.0)
    torch.mul(x1, sin, out=o2)
    o2.addcmul_(x2, cos)
    return out


class _TimeRotary(torch.autograd.Function):
    """A rotation: its backward is the rotation by the opposite angle."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rotate(grad.contiguous(), cos, -sin), None, None


def tiled_time_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [ΣL, H, dh]  cos, sin: [ΣL, 1, dh/2]  ->  [ΣL, H, dh] (no gradient to cos/sin: they come from data)"""
    return _TimeRotary.apply(x.contiguous(), cos.to(x.dtype), sin.to(x.dtype))

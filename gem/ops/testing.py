"""Helpers for the op tests: random jagged inputs and a forward + backward comparison."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from gem.ops.common import offsets_of


def make_offsets(lengths: Sequence[int]) -> torch.Tensor:
    return offsets_of(torch.tensor(list(lengths), dtype=torch.int64))


def random_lengths(gen: torch.Generator, batch: int, *, mu: float = 5.0, sigma: float = 1.0,
                   min_len: int = 8, max_len: int = 2048) -> torch.Tensor:
    """The benchmark's reference length distribution: LogNormal(mu, sigma) clipped, int64 [batch]."""
    raw = torch.exp(mu + sigma * torch.randn(batch, generator=gen))
    return raw.round().clamp(min_len, max_len).long()


def assert_fwd_bwd_close(ref: Callable[..., torch.Tensor], fast: Callable[..., torch.Tensor],
                         inputs: Sequence[torch.Tensor], *, atol: float = 1e-5, rtol: float = 1e-4,
                         grad_atol: float | None = None, grad_rtol: float | None = None, seed: int = 0) -> None:
    """Run both on copies of `inputs` (float ones get gradients), compare outputs and input grads."""
    def run(fn):
        xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
        out = fn(*xs)
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(out.shape, generator=g, dtype=torch.float32).to(out.dtype)  # random cotangent
        if out.requires_grad:  # an empty input may give an output with no graph at all
            (out.float() * w.float()).sum().backward()
        # An input the output does not depend on (e.g. an empty batch) gets a zero gradient.
        return out, [torch.zeros_like(x) if x.grad is None else x.grad for x in xs if x.is_floating_point()]

    out_ref, grads_ref = run(ref)
    out_fast, grads_fast = run(fast)
    torch.testing.assert_close(out_fast.float(), out_ref.float(), atol=atol, rtol=rtol)
    for i, (gr, gf) in enumerate(zip(grads_ref, grads_fast)):
        torch.testing.assert_close(gf.float(), gr.float(), atol=grad_atol or atol, rtol=grad_rtol or rtol,
                                   msg=lambda m, i=i: f"grad of input {i}: {m}")

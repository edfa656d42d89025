"""Generalized dot-product attention (GDPA): an activation instead of softmax.

    S = Q Kᵀ;  S = where(|i-j| <= window, S, 0);  P = act_h(S) · qk_scale;  O = P V

per example and head (notes section 2; semantics of the kernel library's Triton GDPA). The
scale is applied after the activation, there is no row normalisation, and every activation
has act(0) = 0 so zero-padded keys contribute nothing. GEM uses it twice:

* seed pooling (HSP): broadcast_q=True, q = [Nq, H, dh] learned seeds shared by every example,
  long jagged keys -> [B, Nq, H, dh];
* the personalised FFN: long jagged queries (the event tokens) over short per-example keys and
  values generated from the non-sequence summary -> [ΣLq, H, dh].

Keys and values may be given jagged ([ΣLk, H, dh] + k_offsets) or dense per example
([B, n, H, dh], k_offsets omitted).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gem.ops.activations import check_activations
from gem.ops.common import DEFAULT_KERNEL, BucketPlan, Kernel, check_offsets, offsets_of
from gem.ops.pytorch.pt_gdpa import pytorch_gdpa
from gem.ops.tiled.tiled_gdpa import tiled_gdpa


def gdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_offsets: torch.Tensor | None = None,
         k_offsets: torch.Tensor | None = None, activation: str | Sequence[str] = "gelu_tanh",
         qk_scale: float = 1.0, window: int | None = None, broadcast_q: bool = False,
         kernel: Kernel = DEFAULT_KERNEL, buckets: BucketPlan | None = None) -> torch.Tensor:
    """See the module docstring. activation: one name, or one per head (see gem.ops.activations).

    buckets: a precomputed common.plan_buckets for these offsets (tiled only), reused across layers.
    """
    dense = k.dim() == 4
    if dense:  # dense per-example keys [B, n, H, dh]: jagged with equal lengths
        torch._assert(k_offsets is None, "pass k_offsets only with jagged [ΣLk, H, dh] keys")
        torch._assert(v.shape == k.shape, "v must be the same shape as k")
        B, n = k.shape[:2]
        k_offsets = offsets_of(torch.full((B,), n, dtype=torch.int64, device=k.device))
        if kernel == Kernel.PYTORCH or broadcast_q:
            k, v = k.reshape(B * n, *k.shape[2:]), v.reshape(B * n, *v.shape[2:])
            dense = False
    torch._assert(k_offsets is not None, "k_offsets is required with jagged keys")
    torch._assert(q.dim() == 3 and k.dim() == (4 if dense else 3), "q must be [ΣLq or Nq, H, dh], k [ΣLk, H, dh]")
    torch._assert(v.shape == k.shape, "v must be the same shape as k")
    torch._assert(q.shape[1:] == k.shape[-2:], "q and k must have the same heads and head dim")
    if not dense:
        check_offsets(k_offsets, k.shape[0], "k_offsets")
    if broadcast_q:
        torch._assert(q_offsets is None, "broadcast_q shares one [Nq, H, dh] query set: omit q_offsets")
        if window is not None:
            raise ValueError("a window needs positions on both sides; it is not defined with broadcast_q")
    else:
        torch._assert(q_offsets is not None, "q_offsets is required unless broadcast_q")
        check_offsets(q_offsets, q.shape[0], "q_offsets")
        torch._assert(q_offsets.numel() == k_offsets.numel(), "q_offsets and k_offsets must have the same B")
    if window is not None and window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    names = check_activations(activation, q.shape[1])
    if buckets is not None:
        buckets.check(None if broadcast_q else q_offsets, k_offsets, broadcast_rows=q.shape[0])
    if kernel == Kernel.PYTORCH:
        return pytorch_gdpa(q, k, v, q_offsets=q_offsets, k_offsets=k_offsets, activations=names,
                            qk_scale=qk_scale, window=window, broadcast_q=broadcast_q)
    return tiled_gdpa(q, k, v, q_offsets=q_offsets, k_offsets=k_offsets, activations=names, qk_scale=qk_scale,
                      window=window, broadcast_q=broadcast_q, buckets=buckets, dense_kv=dense)

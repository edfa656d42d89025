"""Reference of gdpa: pad, score, window, activation, scale, matmul (fp32, notes section 2)."""

from __future__ import annotations

import torch

from gem.ops.activations import ACTIVATIONS
from gem.ops.pytorch.pt_jagged import jagged_to_padded, padded_to_jagged


def pytorch_gdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_offsets: torch.Tensor | None,
                 k_offsets: torch.Tensor, activations: tuple[str, ...], qk_scale: float,
                 window: int | None, broadcast_q: bool) -> torch.Tensor:
    """Per example b and head h:

        S = Q_bh K_bhᵀ                       (no 1/sqrt(d) unless the caller scaled q)
        S = where(|i - j| <= window, S, 0)   (when a window is given)
        P = act_h(S) · qk_scale              (scale after the activation)
        O = P V_bh                           (no normalisation)

    Padded keys are zero rows, so they add act(0) = 0; the key mask below says so explicitly.
    q: [ΣLq, H, dh] (or [Nq, H, dh] with broadcast_q)  k, v: [ΣLk, H, dh]
    -> [ΣLq, H, dh] (or [B, Nq, H, dh] with broadcast_q)
    """
    B = k_offsets.numel() - 1
    kp, kmask = jagged_to_padded(k.float(), k_offsets)  # [B, Tk, H, dh], [B, Tk]
    vp, _ = jagged_to_padded(v.float(), k_offsets)
    if broadcast_q:
        qp = q.float().unsqueeze(0).expand(B, -1, -1, -1)  # [B, Nq, H, dh]
    else:
        qp, _ = jagged_to_padded(q.float(), q_offsets)  # [B, Tq, H, dh]
    scores = torch.einsum("bihd,bjhd->bhij", qp, kp)  # [B, H, Tq, Tk]
    if window is not None:
        i = torch.arange(scores.shape[2], device=scores.device)[:, None]
        j = torch.arange(scores.shape[3], device=scores.device)[None, :]
        scores = torch.where((i - j).abs() <= window, scores, torch.zeros_like(scores))
    probs = torch.stack([ACTIVATIONS[activations[h]](scores[:, h]) for h in range(scores.shape[1])], dim=1)
    probs = probs * qk_scale * kmask[:, None, None, :]
    out = torch.einsum("bhij,bjhd->bihd", probs, vp)  # [B, Tq, H, dh]
    if broadcast_q:
        return out.to(q.dtype)
    return padded_to_jagged(out, q_offsets).to(q.dtype)

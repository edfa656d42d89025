"""Multi-task, multi-surface heads over the funnel, and the masked multi-task loss.

PLE/MMoE-style (notes section 19.D): shared experts plus experts of each surface; for every
(task, surface) a softmax gate over [shared ‖ that surface's experts] and a tower. An example
uses the gates and towers of its own request surface. Everything is stacked along leading
(expert / task x surface) dimensions and computed for all surfaces, then the example's surface
is selected: with a handful of surfaces that costs little and keeps the code branch-free.

Loss: Σ_t w_t · mean over examples where task t's label can exist of BCE(logit, label); a label
cannot exist when its `requires` label is 0 (no conversion without a click).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from gem.modules.common import linear_flops
from gem.modules.config import KunlunConfig, Task


def _stacked(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape) / math.sqrt(shape[-2]))


class MultiTaskHeads(nn.Module):
    def __init__(self, d_in: int, cfg: KunlunConfig):
        super().__init__()
        self.tasks = cfg.tasks
        T, S = len(cfg.tasks), cfg.features.num_surfaces
        n_sh, n_ps, hid, e, tw = (cfg.num_shared_experts, cfg.num_surface_experts, cfg.head_hidden,
                                  cfg.head_expert_dim, cfg.tower_dim)
        self.T, self.S, self.n_sh, self.n_ps, self.hid, self.e, self.tw = T, S, n_sh, n_ps, hid, e, tw
        self.d_in = d_in
        self.inp = nn.Linear(d_in, hid)
        self.expert_w = _stacked(n_sh + S * n_ps, hid, e)  # shared first, then surface s's block
        self.expert_b = nn.Parameter(torch.zeros(n_sh + S * n_ps, e))
        self.gate_w = _stacked(T * S, hid, n_sh + n_ps)
        self.tower1_w = _stacked(T * S, e, tw)
        self.tower1_b = nn.Parameter(torch.zeros(T * S, tw))
        self.tower2_w = _stacked(T * S, tw, 1)
        self.tower2_b = nn.Parameter(torch.zeros(T * S, 1))

    def forward(self, h: torch.Tensor, surface: torch.Tensor) -> dict[str, torch.Tensor]:
        """h [B, d_in], surface int64 [B] -> {task: logits [B]}"""
        B, T, S, dt = h.shape[0], self.T, self.S, h.dtype
        surface = surface.clamp(0, S - 1)
        ar = torch.arange(B, device=h.device)
        x = F.gelu(self.inp(h))  # [B, hid]
        experts = F.gelu(torch.einsum("bh,jhe->bje", x, self.expert_w.to(dt)) + self.expert_b.to(dt))  # [B, J, e]
        shared = experts[:, : self.n_sh]  # [B, n_sh, e]
        own = experts[:, self.n_sh :].reshape(B, S, self.n_ps, self.e)[ar, surface]  # [B, n_ps, e]
        pool = torch.cat([shared, own], dim=1)  # [B, n_g, e]
        gates = torch.einsum("bh,ghn->bgn", x, self.gate_w.to(dt)).view(B, T, S, self.n_sh + self.n_ps)[ar, :, surface]  # [B, T, n_g]
        mixed = torch.einsum("btn,bne->bte", torch.softmax(gates.float(), -1).to(dt), pool)  # [B, T, e]
        # Towers of every (task, surface), then the example's surface.
        t1 = F.gelu(torch.einsum("bte,tsef->btsf", mixed, self.tower1_w.to(dt).view(T, S, self.e, self.tw))
                    + self.tower1_b.to(dt).view(T, S, self.tw))  # [B, T, S, tw]
        t2 = torch.einsum("btsf,tsfo->btso", t1, self.tower2_w.to(dt).view(T, S, self.tw, 1)).squeeze(-1)
        logits = (t2 + self.tower2_b.to(dt).view(T, S))[ar, :, surface]  # [B, T]
        return {task.name: logits[:, i].float() for i, task in enumerate(self.tasks)}

    def flops(self, batch: int) -> float:
        J = self.n_sh + self.S * self.n_ps
        per = linear_flops(1, self.d_in, self.hid) + linear_flops(1, self.hid, J * self.e)
        per += linear_flops(1, self.hid, self.T * self.S * (self.n_sh + self.n_ps))
        per += 2.0 * self.T * (self.n_sh + self.n_ps) * self.e
        per += self.T * self.S * (linear_flops(1, self.e, self.tw) + linear_flops(1, self.tw, 1))
        return batch * per


def task_masks(tasks: tuple[Task, ...], labels: dict[str, torch.Tensor], weight: torch.Tensor | None
               ) -> dict[str, torch.Tensor]:
    """Float [B] per task: 1 where the task's label exists.

    A label exists when the example is real (weight), the label is known (not NaN: a data source
    may lack it) and the label it requires is 1 (no conversion without a click).
    """
    base = torch.ones_like(labels[tasks[0].name]) if weight is None else weight
    masks = {}
    for t in tasks:
        m = base * torch.isfinite(labels[t.name]).to(base.dtype)
        if t.requires is not None:
            m = m * torch.nan_to_num(labels[t.requires], nan=0.0)
        masks[t.name] = m
    return masks


def multitask_loss(logits: dict[str, torch.Tensor], labels: dict[str, torch.Tensor], tasks: tuple[Task, ...],
                   weight: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Σ_t w_t · masked-mean BCE, and each task's loss for logging (0 when no label exists)."""
    masks = task_masks(tasks, labels, weight)
    parts = {}
    for t in tasks:
        target = torch.nan_to_num(labels[t.name].float(), nan=0.0)  # masked out below
        bce = F.binary_cross_entropy_with_logits(logits[t.name].float(), target, reduction="none")
        parts[t.name] = (bce * masks[t.name]).sum() / masks[t.name].sum().clamp_min(1.0)
    return sum(t.weight * parts[t.name] for t in tasks), parts

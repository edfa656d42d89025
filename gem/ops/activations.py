"""Element-wise activations GDPA may use. Every one satisfies act(0) = 0.

That property is what lets the kernels skip masks: a padded key is loaded as a zero row, its
score is 0, act(0) = 0, so it adds nothing to the output (notes section 2). Softmax does not
have it, which is why softmax attention needs explicit key masks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.nn import functional as F


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "raw": lambda x: x,  # identity: GDPA is then plain linear attention
    "relu": F.relu,
    "relu2": _relu2,
    "leaky_relu": lambda x: F.leaky_relu(x, 0.01),
    "gelu": F.gelu,  # erf form
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # "fast_gelu" in the kernel library
    "silu": F.silu,
    "hardswish": F.hardswish,
}


def check_activations(activation: str | Sequence[str], num_heads: int) -> tuple[str, ...]:
    """One activation name per head (a single name is used for every head)."""
    names = (activation,) * num_heads if isinstance(activation, str) else tuple(activation)
    if len(names) != num_heads:
        raise ValueError(f"got {len(names)} per-head activations for {num_heads} heads")
    unknown = [n for n in names if n not in ACTIVATIONS]
    if unknown:
        raise ValueError(f"unknown GDPA activation(s) {unknown}; choose from {sorted(ACTIVATIONS)}")
    return names


def apply_per_head(scores: torch.Tensor, names: tuple[str, ...], head_dim: int) -> torch.Tensor:
    """act_h applied to scores whose dimension `head_dim` indexes heads."""
    if len(set(names)) == 1:
        return ACTIVATIONS[names[0]](scores)
    heads = scores.unbind(head_dim)
    return torch.stack([ACTIVATIONS[n](s) for n, s in zip(names, heads)], dim=head_dim)

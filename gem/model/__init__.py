"""The GEM model. Everything outside this package builds it through `build_model(spec)`.

The torch modules are imported on first use (PEP 562), so `gem.model.config` stays torch-free: the
operator reads a spec's model shape (experts, heads) for the automatic plan.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from gem.api.types import ModelSpec
from gem.model.config import PRESETS, GEMConfig, config_from_spec, kunlun_config

if TYPE_CHECKING:
    from gem.model.kunlun import GEMModel

_LAZY = {"GEMModel": "gem.model.kunlun"}


def build_model(spec: ModelSpec) -> GEMModel:
    """A freshly initialised GEM model of the size spec describes (call under torch.manual_seed)."""
    from gem.model.kunlun import GEMModel

    return GEMModel(config_from_spec(spec))


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gem.model' has no attribute {name!r}")


__all__ = ["GEMConfig", "GEMModel", "PRESETS", "build_model", "config_from_spec", "kunlun_config"]

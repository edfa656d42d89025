"""The GEM model. Everything outside this package builds it through `build_model(spec)`."""

from __future__ import annotations

from gem.api.types import ModelSpec
from gem.model.config import PRESETS, GEMConfig, config_from_spec, kunlun_config
from gem.model.gem import TASKS, GEMModelV1
from gem.model.kunlun import GEMModel


def build_model(spec: ModelSpec) -> GEMModel:
    """A freshly initialised GEM model of the size spec describes (call under torch.manual_seed)."""
    return GEMModel(config_from_spec(spec))


__all__ = ["GEMConfig", "GEMModel", "GEMModelV1", "PRESETS", "TASKS", "build_model", "config_from_spec",
           "kunlun_config"]

"""nn.Modules of the Kunlun GEM model, built on gem.ops (see docs/architecture.md).

The names below are imported on first use (PEP 562), so `gem.modules.config` (plain dataclasses)
stays importable without torch: the operator reads the presets' shape for the automatic plan.
"""

from importlib import import_module
from typing import Any

from gem.modules.config import PRESETS, FeatureSchema, KunlunConfig, Task, TierConfig

_LAZY = {"set_kernel": "gem.modules.common", "EventSequence": "gem.modules.inputs",
         "GemInputs": "gem.modules.inputs", "from_v1_batch": "gem.modules.inputs",
         "KunlunLayer": "gem.modules.kunlun", "KunlunModel": "gem.modules.kunlun"}

__all__ = ["EventSequence", "FeatureSchema", "GemInputs", "KunlunConfig", "KunlunLayer", "KunlunModel", "PRESETS",
           "Task", "TierConfig", "from_v1_batch", "set_kernel"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gem.modules' has no attribute {name!r}")

"""nn.Modules of the Kunlun GEM model, built on gem.ops (see docs/architecture.md)."""

from gem.modules.common import set_kernel
from gem.modules.config import PRESETS, FeatureSchema, KunlunConfig, Task, TierConfig
from gem.modules.inputs import EventSequence, GemInputs, from_v1_batch
from gem.modules.kunlun import KunlunLayer, KunlunModel

__all__ = ["EventSequence", "FeatureSchema", "GemInputs", "KunlunConfig", "KunlunLayer", "KunlunModel", "PRESETS",
           "Task", "TierConfig", "from_v1_batch", "set_kernel"]

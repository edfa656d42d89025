"""Baselines in the same codebase, reading the same GemInputs:

* DLRMModel: sum-pooled sequences, pairwise dot interaction, MLPs (the classic recsys model);
* PaddedKunlunModel: the same GEM with padded dense softmax attention in place of jagged block
  attention (what a model without jagged kernels does).
"""

from gem.baselines.dlrm import DLRMConfig, DLRMModel
from gem.baselines.padded_gem import PaddedKunlunModel

__all__ = ["DLRMConfig", "DLRMModel", "PaddedKunlunModel"]

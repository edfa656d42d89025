"""Synthetic ads data: the world, jagged batches and a sharded, resumable loader."""

from gem.data.batch import Batch, make_batch
from gem.data.loader import ShardedLoader, eval_batches
from gem.data.synthetic import Examples, SyntheticWorld, build_splits

__all__ = ["Batch", "Examples", "ShardedLoader", "SyntheticWorld", "build_splits", "eval_batches", "make_batch"]

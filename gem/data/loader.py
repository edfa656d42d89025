"""Sharded, resumable batch iteration.

Training: every epoch is a seeded permutation of the split; rank r takes every world_size-th
example of it (disjoint shards), in batches of batch_size, dropping the ragged tail so that all
ranks run the same number of steps. The whole loader state is one integer, `position` (batches
handed out so far), so a resumed job continues with exactly the batch it would have seen next.

Evaluation: every example exactly once; shards are padded to equal length with weight-0
examples because ranks must run the same number of forward passes (ZeRO-3 gathers parameters
collectively inside forward).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from gem.data.batch import Batch, make_batch
from gem.data.synthetic import Examples


class ShardedLoader:
    def __init__(self, examples: Examples, *, batch_size: int, max_seq_len: int, rank: int, world_size: int,
                 seed: int):
        self.examples = examples
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.position = 0  # batches handed out so far: the loader's whole state
        shard_len = len(examples) // world_size
        self.batches_per_epoch = shard_len // batch_size
        if self.batches_per_epoch == 0:
            # the caller (gem.data.sources) adds which spec field holds the examples
            raise ValueError(f"{len(examples)} training examples are too few for batch size {batch_size} x "
                             f"{world_size} ranks: need at least {batch_size * world_size}")
        self._epoch = -1
        self._shard: np.ndarray | None = None

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])

    def _shard_of(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))
            self._shard, self._epoch = perm[self.rank :: self.world_size], epoch
        return self._shard

    def next_batch(self) -> Batch:
        epoch, j = divmod(self.position, self.batches_per_epoch)
        index = self._shard_of(epoch)[j * self.batch_size : (j + 1) * self.batch_size]
        self.position += 1
        return make_batch(self.examples, index, max_seq_len=self.max_seq_len)


def eval_batches(examples: Examples, *, batch_size: int, max_seq_len: int, rank: int,
                 world_size: int) -> Iterator[Batch]:
    """This rank's share of the eval split, padded so every rank yields the same number of batches."""
    n = len(examples)
    per_rank = -(-n // world_size)  # ceil
    per_rank = -(-per_rank // batch_size) * batch_size  # whole batches
    index = np.arange(rank * per_rank, (rank + 1) * per_rank)  # [per_rank]
    weight = (index < n).astype(np.float32)
    index = np.minimum(index, n - 1)  # padding repeats the last example with weight 0
    for lo in range(0, per_rank, batch_size):
        sl = slice(lo, lo + batch_size)
        yield make_batch(examples, index[sl], max_seq_len=max_seq_len, weight=weight[sl])

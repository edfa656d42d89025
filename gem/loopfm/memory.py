"""The embedding memory: foundation-model user embeddings logged over time, in Parquet shards.

    append(user_ids, timestamps, model_version, embeddings)   # one new shard per call
    apply_retention(now, max_age_s)                            # drop rows older than now - max_age_s
    drop_version(model_version)                                # drop one model version's rows
    lookup(user_ids, as_of, k[, max_age_s]) -> (emb [N, k, D], ts [N, k], valid [N, k])

Layout: <root>/shard-000000.parquet, ... each with columns user_id int64, timestamp int64,
model_version string, embedding fixed_size_list<float32>[D]. Shards are immutable; retention
rewrites only the shards that hold expired rows (atomic rename).

Point-in-time: lookup returns, for each query (user u, time t), the k most recent embeddings of u
with timestamp < t (strictly before), most recent first. An embedding logged at the example's own
request time (computed from that very impression) is never returned for it, so no training example
sees the present or the future. User ids are any int64 (hashed ids may be negative or use all 64
bits): the index maps them to dense codes (np.unique), so the lookup stays vectorised: rows are
sorted once by the packed key (code << 32 | timestamp) and each query is one searchsorted into the
user codes and two into the keys.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gem.data.parquet import scaled_unix_time

_TS_BITS = 32  # timestamps are unix seconds < 2^32 (year 2106); user codes < 2^31 (distinct users)


class TimestampRangeError(ValueError):
    """Timestamps outside [0, 2^32): not unix seconds (milliseconds, most often). The LoopFM task reports it
    as a SpecError naming the data field; `low` / `high` are the offending extremes."""

    def __init__(self, low: int, high: int):
        self.low, self.high = low, high
        #: the unit the values look like (None: not a scaled unix time, e.g. negative)
        self.unit, self.scale = scaled_unix_time(low, high) or (None, 1)  # unix seconds = value // scale
        hint = f" (they look like {self.unit})" if self.unit else ""
        super().__init__(f"timestamps must be unix seconds in [0, 2^32); got values in [{low}, {high}]{hint}")


def _check_timestamps(ts: np.ndarray) -> np.ndarray:
    ts = np.asarray(ts, dtype=np.int64)
    if ts.size and (ts.min() < 0 or ts.max() >= (1 << _TS_BITS)):
        raise TimestampRangeError(int(ts.min()), int(ts.max()))
    return ts


def _pack(codes: np.ndarray, ts: np.ndarray) -> np.ndarray:
    """codes: dense user codes in [0, 2^31) (positions in MemoryIndex.users), never raw user ids."""
    return (np.asarray(codes, dtype=np.int64) << _TS_BITS) | _check_timestamps(ts)


@dataclass
class MemoryIndex:
    """All rows of one model version, sorted by (user, timestamp): what lookups read."""

    keys: np.ndarray  # int64 [M], code << 32 | timestamp, ascending (code: the user's position in `users`)
    timestamps: np.ndarray  # int64 [M]
    embeddings: np.ndarray  # float32 [M, D]
    users: np.ndarray  # int64 [U], the distinct user ids, ascending

    @classmethod
    def build(cls, user_ids: np.ndarray, timestamps: np.ndarray, embeddings: np.ndarray) -> "MemoryIndex":
        """Index rows of any int64 user ids (unsorted)."""
        users, codes = np.unique(np.asarray(user_ids, dtype=np.int64), return_inverse=True)
        timestamps = _check_timestamps(timestamps)
        keys = _pack(codes.reshape(-1), timestamps)
        order = np.argsort(keys, kind="stable")
        return cls(keys[order], timestamps[order], embeddings[order], users)

    @classmethod
    def empty(cls) -> "MemoryIndex":
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 0), np.float32), np.zeros(0, np.int64))

    @property
    def dim(self) -> int:
        return int(self.embeddings.shape[1])

    def __len__(self) -> int:
        return int(self.keys.shape[0])

    def lookup(self, user_ids: np.ndarray, as_of: np.ndarray, k: int, *, max_age_s: int | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """k most recent rows strictly before each as_of, most recent first: (emb [N,k,D], ts [N,k], valid [N,k]).

        max_age_s: also only rows with timestamp >= as_of - max_age_s, i.e. what a memory under that
        retention held at time as_of (so training reads what serving will read, point in time).
        """
        user_ids = np.asarray(user_ids, dtype=np.int64)
        as_of = np.asarray(as_of, dtype=np.int64)
        n = user_ids.shape[0]
        code = np.searchsorted(self.users, user_ids)  # [N] the user's code, if the memory knows them
        known = code < self.users.shape[0]
        known[known] = self.users[code[known]] == user_ids[known]
        code = np.where(known, code, 0)  # unknown users: any code, their rows are masked below
        end = np.searchsorted(self.keys, _pack(code, as_of), side="left")  # first row >= (u, t)
        oldest = np.zeros_like(as_of) if max_age_s is None else np.maximum(as_of - int(max_age_s), 0)
        start = np.searchsorted(self.keys, _pack(code, oldest), side="left")  # u's first row in the window
        avail = np.where(known, end - start, 0)  # [N] rows of u strictly before t
        slot = np.arange(k)  # [k]
        valid = slot[None, :] < avail[:, None]  # [N, k]
        rows = np.where(valid, end[:, None] - 1 - slot[None, :], 0)  # [N, k], most recent first
        if len(self) == 0:
            return (np.zeros((n, k, 0), np.float32), np.zeros((n, k), np.int64), np.zeros((n, k), bool))
        emb = self.embeddings[rows] * valid[..., None]
        ts = np.where(valid, self.timestamps[rows], 0)
        return emb.astype(np.float32), ts, valid


class EmbeddingMemory:
    """A directory of Parquet shards of (user_id, timestamp, model_version, embedding)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._cache: dict[str | None, MemoryIndex] = {}

    # ------------------------------------------------------------------ writing

    def shards(self) -> list[Path]:
        return sorted(self.root.glob("shard-*.parquet"))

    def _next_shard(self) -> Path:
        existing = [int(p.stem.split("-")[1]) for p in self.shards()]
        return self.root / f"shard-{(max(existing) + 1 if existing else 0):06d}.parquet"

    def append(self, user_ids: np.ndarray, timestamps: np.ndarray, model_version: str,
               embeddings: np.ndarray) -> Path:
        """Write one shard; returns its path."""
        user_ids = np.asarray(user_ids, dtype=np.int64)
        timestamps = np.asarray(timestamps, dtype=np.int64)
        embeddings = np.ascontiguousarray(embeddings, dtype=np.float32)
        if not (user_ids.shape[0] == timestamps.shape[0] == embeddings.shape[0]) or embeddings.ndim != 2:
            raise ValueError("append: user_ids [N], timestamps [N] and embeddings [N, D] must agree")
        _check_timestamps(timestamps)  # user ids: any int64
        dim = embeddings.shape[1]
        table = pa.table({
            "user_id": pa.array(user_ids),
            "timestamp": pa.array(timestamps),
            "model_version": pa.array([model_version] * len(user_ids), type=pa.string()),
            "embedding": pa.FixedSizeListArray.from_arrays(pa.array(embeddings.reshape(-1)), dim),
        })
        with self._lock:
            path = self._next_shard()
            tmp = path.with_suffix(".tmp")
            pq.write_table(table, tmp)
            os.replace(tmp, path)
            self._cache.clear()
        return path

    def apply_retention(self, now: int, max_age_s: int) -> int:
        """Drop rows with timestamp < now - max_age_s; returns how many were dropped."""
        cutoff = int(now) - int(max_age_s)
        return self._keep_rows(lambda table: table.column("timestamp").to_numpy() >= cutoff)

    def drop_version(self, model_version: str) -> int:
        """Drop every row of one model version (e.g. a partial log being replaced); returns how many."""
        return self._keep_rows(
            lambda table: pc.not_equal(table.column("model_version"), model_version).to_numpy(zero_copy_only=False))

    def _keep_rows(self, keep_of) -> int:
        """Rewrite every shard to the rows `keep_of(table)` (a bool mask) keeps; returns how many were dropped."""
        dropped = 0
        with self._lock:
            for shard in self.shards():
                table = pq.read_table(shard)
                keep = keep_of(table)
                if keep.all():
                    continue
                dropped += int((~keep).sum())
                if not keep.any():
                    shard.unlink()
                    continue
                tmp = shard.with_suffix(".tmp")
                pq.write_table(table.filter(pa.array(keep)), tmp)
                os.replace(tmp, shard)
            self._cache.clear()
        return dropped

    # ------------------------------------------------------------------ reading

    def model_versions(self) -> list[str]:
        versions: set[str] = set()
        for shard in self.shards():
            versions.update(pq.read_table(shard, columns=["model_version"]).column(0).to_pylist())
        return sorted(versions)

    def index(self, model_version: str | None = None) -> MemoryIndex:
        """The sorted in-memory index of all rows (of one model version, if given); cached until a write."""
        with self._lock:
            if model_version in self._cache:
                return self._cache[model_version]
            tables = [pq.read_table(s) for s in self.shards()]
            if model_version is not None:  # filter per shard: versions may log embeddings of different widths
                tables = [t.filter(pc.equal(t.column("model_version"), model_version)) for t in tables]
            tables = [t for t in tables if t.num_rows]
            widths = {t.schema.field("embedding").type.list_size for t in tables}
            if len(widths) > 1:
                raise ValueError(f"memory {self.root} holds embeddings of widths {sorted(widths)}: "
                                 "index one model_version")
            table = pa.concat_tables(tables) if tables else None
            if table is None:
                index = MemoryIndex.empty()
            else:
                emb_col = table.column("embedding").combine_chunks()
                dim = emb_col.type.list_size
                emb = emb_col.flatten().to_numpy(zero_copy_only=False).reshape(-1, dim).astype(np.float32)
                index = MemoryIndex.build(table.column("user_id").to_numpy(), table.column("timestamp").to_numpy(), emb)
            self._cache[model_version] = index
            return index

    def lookup(self, user_ids: np.ndarray, as_of_timestamps: np.ndarray, k: int,
               model_version: str | None = None, *, max_age_s: int | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """k most recent embeddings strictly before each as-of time, most recent first (see MemoryIndex.lookup)."""
        return self.index(model_version).lookup(user_ids, as_of_timestamps, k, max_age_s=max_age_s)

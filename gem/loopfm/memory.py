"""The embedding memory: foundation-model user embeddings logged over time, in Parquet shards.

    append(user_ids, timestamps, model_version, embeddings)   # one new shard per call
    apply_retention(now, max_age_s)                            # drop rows older than now - max_age_s
    lookup(user_ids, as_of, k[, max_age_s]) -> (emb [N, k, D], ts [N, k], valid [N, k])

Layout: <root>/shard-000000.parquet, ... each with columns user_id int64, timestamp int64,
model_version string, embedding fixed_size_list<float32>[D]. Shards are immutable; retention
rewrites only the shards that hold expired rows (atomic rename).

Point-in-time: lookup returns, for each query (user u, time t), the k most recent embeddings of u
with timestamp < t (strictly before), most recent first. An embedding logged at the example's own
request time (computed from that very impression) is never returned for it, so no training example
sees the present or the future. The lookup is vectorised: rows are sorted once by the packed key
(user << 32 | timestamp) and each query is two searchsorted calls.
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

_TS_BITS = 32  # timestamps are unix seconds < 2^32 (year 2106); user ids < 2^31


def _pack(users: np.ndarray, ts: np.ndarray) -> np.ndarray:
    users = np.asarray(users, dtype=np.int64)
    ts = np.asarray(ts, dtype=np.int64)
    if users.size and (users.min() < 0 or users.max() >= (1 << 31)):
        raise ValueError("user ids must be in [0, 2^31)")
    if ts.size and (ts.min() < 0 or ts.max() >= (1 << _TS_BITS)):
        raise ValueError("timestamps must be unix seconds in [0, 2^32)")
    return (users << _TS_BITS) | ts


@dataclass
class MemoryIndex:
    """All rows of one model version, sorted by (user, timestamp): what lookups read."""

    keys: np.ndarray  # int64 [M], user << 32 | timestamp, ascending
    timestamps: np.ndarray  # int64 [M]
    embeddings: np.ndarray  # float32 [M, D]

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
        end = np.searchsorted(self.keys, _pack(user_ids, as_of), side="left")  # first row >= (u, t)
        oldest = np.zeros_like(as_of) if max_age_s is None else np.maximum(as_of - int(max_age_s), 0)
        start = np.searchsorted(self.keys, _pack(user_ids, oldest), side="left")  # u's first row in the window
        avail = end - start  # [N] rows of u strictly before t
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
        _pack(user_ids, timestamps)  # validates ranges
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
        dropped = 0
        with self._lock:
            for shard in self.shards():
                table = pq.read_table(shard)
                ts = table.column("timestamp").to_numpy()
                keep = ts >= cutoff
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
                index = MemoryIndex(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 0), np.float32))
            else:
                users = table.column("user_id").to_numpy()
                ts = table.column("timestamp").to_numpy()
                emb_col = table.column("embedding").combine_chunks()
                dim = emb_col.type.list_size
                emb = emb_col.flatten().to_numpy(zero_copy_only=False).reshape(-1, dim).astype(np.float32)
                keys = _pack(users, ts)
                order = np.argsort(keys, kind="stable")
                index = MemoryIndex(keys[order], ts[order], emb[order])
            self._cache[model_version] = index
            return index

    def lookup(self, user_ids: np.ndarray, as_of_timestamps: np.ndarray, k: int,
               model_version: str | None = None, *, max_age_s: int | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """k most recent embeddings strictly before each as-of time, most recent first (see MemoryIndex.lookup)."""
        return self.index(model_version).lookup(user_ids, as_of_timestamps, k, max_age_s=max_age_s)

"""The precompute store: versioned, TTL'd foundation-model values per (user, ad), plus the
aggregates the fallback tiers read (user x campaign, segment x ad, user embeddings, defaults).

Every entry carries the model version it was computed with and its expiry time; a lookup with
`now` past the expiry, or under another model version, misses. All methods take one lock, so the
store is safe from threads and from asyncio tasks (each call is short and never awaits).
Time is passed in explicitly (`now`, seconds) so that replays run on simulated time.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Entry:
    value: np.ndarray  # float32 [V]: e.g. FM logits (click, conversion)
    version: str
    computed_at: float
    expires_at: float


class _Mean:
    """A running mean of value vectors with a freshness stamp."""

    __slots__ = ("total", "count", "updated_at", "version")

    def __init__(self, dim: int, version: str):
        self.total = np.zeros(dim, np.float64)
        self.count = 0
        self.updated_at = 0.0
        self.version = version

    def add(self, v: np.ndarray, now: float) -> None:
        self.total += v
        self.count += 1
        self.updated_at = now

    @property
    def mean(self) -> np.ndarray:
        return (self.total / max(self.count, 1)).astype(np.float32)


class PrecomputeStore:
    def __init__(self, *, ttl_s: float, version: str, value_dim: int = 2, max_entries: int = 1_000_000):
        self.ttl_s = float(ttl_s)
        self.value_dim = value_dim
        self.max_entries = max_entries
        self._version = version
        self._lock = threading.Lock()
        self._pairs: dict[tuple[int, int], Entry] = {}
        self._by_ad: dict[int, dict[int, Entry]] = {}  # ad -> user -> entry (the neighbour tier's index)
        self._user_campaign: dict[tuple[int, int], _Mean] = {}
        self._segment_ad: dict[tuple[int, int], _Mean] = {}
        self._ad_default: dict[int, _Mean] = {}
        self._global = _Mean(value_dim, version)
        self._user_emb: dict[int, np.ndarray] = {}
        self.puts = 0

    # ------------------------------------------------------------------ versions

    @property
    def version(self) -> str:
        return self._version

    def set_version(self, version: str) -> None:
        """A new model is live: everything computed by the old one stops being served."""
        with self._lock:
            if version != self._version:
                self._version = version
                self._pairs.clear()
                self._by_ad.clear()
                self._user_campaign.clear()
                self._segment_ad.clear()
                self._ad_default.clear()
                self._global = _Mean(self.value_dim, version)
                self._user_emb.clear()

    # ------------------------------------------------------------------ writes

    def put(self, user: int, ad: int, campaign: int, segment: int, value: np.ndarray, *, now: float,
            version: str | None = None, user_embedding: np.ndarray | None = None) -> bool:
        """Store one computed pair (and fold it into the aggregates); False if its version is stale."""
        version = version or self._version
        value = np.asarray(value, np.float32)
        with self._lock:
            if version != self._version:
                return False
            if len(self._pairs) >= self.max_entries:
                self._evict_expired(now)
            entry = self._pairs[(user, ad)] = Entry(value, version, now, now + self.ttl_s)
            self._by_ad.setdefault(ad, {})[user] = entry
            for table, key in ((self._user_campaign, (user, campaign)), (self._segment_ad, (segment, ad)),
                               (self._ad_default, ad)):
                agg = table.get(key)
                if agg is None:
                    agg = table[key] = _Mean(self.value_dim, version)
                agg.add(value, now)
            self._global.add(value, now)
            if user_embedding is not None:
                self._user_emb[user] = np.asarray(user_embedding, np.float32)
            self.puts += 1
            return True

    def _evict_expired(self, now: float) -> int:
        dead = [k for k, e in self._pairs.items() if e.expires_at <= now]
        for k in dead:
            del self._pairs[k]
            by_user = self._by_ad.get(k[1])
            if by_user is not None:
                by_user.pop(k[0], None)
        return len(dead)

    def evict_expired(self, now: float) -> int:
        with self._lock:
            return self._evict_expired(now)

    # ------------------------------------------------------------------ reads

    def get(self, user: int, ad: int, *, now: float) -> Entry | None:
        """The exact pair if fresh and of the live version."""
        with self._lock:
            e = self._pairs.get((user, ad))
        if e is None or e.expires_at <= now or e.version != self._version:
            return None
        return e

    def _fresh_mean(self, table: dict, key, now: float) -> np.ndarray | None:
        with self._lock:
            agg = table.get(key)
        if agg is None or agg.count == 0 or agg.version != self._version or agg.updated_at + self.ttl_s <= now:
            return None
        return agg.mean

    def user_campaign(self, user: int, campaign: int, *, now: float) -> np.ndarray | None:
        return self._fresh_mean(self._user_campaign, (user, campaign), now)

    def segment_ad(self, segment: int, ad: int, *, now: float) -> np.ndarray | None:
        return self._fresh_mean(self._segment_ad, (segment, ad), now)

    def ad_default(self, ad: int) -> np.ndarray | None:
        with self._lock:
            agg = self._ad_default.get(ad)
        return None if agg is None or agg.count == 0 else agg.mean

    def global_default(self) -> np.ndarray:
        with self._lock:
            return self._global.mean

    def user_embedding(self, user: int) -> np.ndarray | None:
        with self._lock:
            return self._user_emb.get(user)

    def users_with_ad(self, ad: int, *, now: float) -> tuple[np.ndarray, np.ndarray]:
        """(users, values [n, V]) with a fresh exact entry for `ad`."""
        with self._lock:
            items = [(u, e.value) for u, e in self._by_ad.get(ad, {}).items()
                     if e.expires_at > now and e.version == self._version]
        if not items:
            return np.zeros(0, np.int64), np.zeros((0, self.value_dim), np.float32)
        return np.array([u for u, _ in items]), np.stack([v for _, v in items])

    def user_embeddings(self, users: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(embeddings [n, D] of the users that have one, mask [n])."""
        with self._lock:
            got = [self._user_emb.get(int(u)) for u in users]
        mask = np.array([g is not None for g in got], bool)
        if not mask.any():
            return np.zeros((0, 0), np.float32), mask
        return np.stack([g for g in got if g is not None]), mask

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"pairs": len(self._pairs), "user_campaign": len(self._user_campaign),
                    "segment_ad": len(self._segment_ad), "user_embeddings": len(self._user_emb), "puts": self.puts}

"""The precompute store: versioned, TTL'd foundation-model values per (user, ad), plus the
aggregates the fallback tiers read (user x campaign, segment x ad, ad default, global default),
and each user's latest FM user embedding (the neighbours tier's similarity key).

Every entry carries the model version it was computed with and its expiry time; a lookup with
`now` past the expiry, or under another model version, misses. The aggregates are sums over the
entries held *now*: a pair computed again replaces its old value, and an entry leaves every
aggregate when it expires or is evicted, so a mean never mixes stale values into fresh ones.
Expired entries are swept (in expiry order, from a heap) by every read and write, so each entry is
removed once and a lookup stays O(1) amortised. At `max_entries`, a put evicts the entry that
expires first (TTLs are equal, so the oldest computed) before inserting a new pair.

`put` keeps its own read-only copy of a value and embedding: the caller may reuse its buffer, and
what a read returns cannot be edited in place (either would change a held value behind the means).

A value or embedding that is not finite (a diverged model's NaN/inf) is refused and counted in
`nonfinite`: lookups fall through to the next tier instead of serving it.

User embeddings are not TTL'd with the pairs: an embedding is the key the neighbours tier compares
users by, not a value it serves (it serves the mean of the neighbours' fresh pairs), and under one
model version it changes only when the user's state does. So a user whose pairs all expired still
finds their neighbours. They are dropped by `set_version` (another model, another space), and at most
`max_entries` are held (the least recently computed user goes first), so memory stays bounded.

All methods take one lock (reads included: a sweep mutates), so the store is safe from threads and
from asyncio tasks (each call is short and never awaits). Time is passed in explicitly (`now`,
seconds) so that replays run on simulated time; it is expected not to go backwards.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Entry:
    value: np.ndarray  # float32 [V]: e.g. FM logits (click, conversion)
    version: str
    computed_at: float
    expires_at: float
    campaign: int | None = None  # the aggregate keys it was folded into, to take it out again
    segment: int | None = None  # None: the user has no segment (not in the segment x ad tier)


class _Sum:
    """The sum and count of the value vectors of the entries currently held under one key."""

    __slots__ = ("total", "count")

    def __init__(self, dim: int):
        self.total = np.zeros(dim, np.float64)
        self.count = 0

    def add(self, v: np.ndarray) -> None:
        self.total += v
        self.count += 1

    def remove(self, v: np.ndarray) -> None:
        self.total -= v
        self.count -= 1

    @property
    def mean(self) -> np.ndarray:
        return (self.total / max(self.count, 1)).astype(np.float32)


def _frozen(a) -> np.ndarray:
    a = np.array(a, np.float32)  # always a copy
    a.flags.writeable = False
    return a


def _add_to(table: dict, key, value: np.ndarray, dim: int) -> None:
    agg = table.get(key)
    if agg is None:
        agg = table[key] = _Sum(dim)
    agg.add(value)


def _remove_from(table: dict, key, value: np.ndarray) -> None:
    agg = table[key]
    agg.remove(value)
    if agg.count == 0:  # drop empty keys: memory stays bounded and no float residue lingers
        del table[key]


class PrecomputeStore:
    def __init__(self, *, ttl_s: float, version: str, value_dim: int = 2, max_entries: int = 1_000_000):
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        if not ttl_s > 0:  # also refuses NaN, which would make every entry fresh forever
            raise ValueError(f"ttl_s must be a positive number of seconds, got {ttl_s}")
        self.ttl_s = float(ttl_s)
        self.value_dim = value_dim
        self.max_entries = max_entries
        self._version = version
        self._lock = threading.Lock()
        self._seq = itertools.count()  # heap tie-break: entries themselves are never compared
        self._clear()
        self.puts = 0
        self.nonfinite = 0  # puts refused because the value or embedding was NaN/inf

    def _clear(self) -> None:
        self._pairs: dict[tuple[int, int], Entry] = {}
        self._by_ad: dict[int, dict[int, Entry]] = {}  # ad -> user -> entry (the neighbour tier's index)
        # (expires_at, seq, key, entry); an item whose entry was replaced or removed is stale, skipped when popped
        self._expiry: list[tuple[float, int, tuple[int, int], Entry]] = []
        self._user_campaign: dict[tuple[int, int], _Sum] = {}
        self._segment_ad: dict[tuple[int, int], _Sum] = {}
        self._ad_default: dict[int, _Sum] = {}
        self._global = _Sum(self.value_dim)
        self._user_emb: OrderedDict[int, np.ndarray] = OrderedDict()  # least recently computed first

    # ------------------------------------------------------------------ versions

    @property
    def version(self) -> str:
        return self._version

    def set_version(self, version: str) -> None:
        """A new model is live: everything computed by the old one stops being served."""
        with self._lock:
            if version != self._version:
                self._version = version
                self._clear()

    # ------------------------------------------------------------------ aggregates (lock held)

    def _fold_in(self, user: int, ad: int, e: Entry) -> None:
        _add_to(self._user_campaign, (user, e.campaign), e.value, self.value_dim)
        if e.segment is not None:
            _add_to(self._segment_ad, (e.segment, ad), e.value, self.value_dim)
        _add_to(self._ad_default, ad, e.value, self.value_dim)
        self._global.add(e.value)

    def _take_out(self, user: int, ad: int, e: Entry) -> None:
        _remove_from(self._user_campaign, (user, e.campaign), e.value)
        if e.segment is not None:
            _remove_from(self._segment_ad, (e.segment, ad), e.value)
        _remove_from(self._ad_default, ad, e.value)
        self._global.remove(e.value)

    def _drop(self, key: tuple[int, int]) -> None:
        """Remove a held pair from the pairs, the neighbour index and every aggregate."""
        e = self._pairs.pop(key)
        by_user = self._by_ad[key[1]]
        del by_user[key[0]]
        if not by_user:
            del self._by_ad[key[1]]
        self._take_out(key[0], key[1], e)

    def _pop_soonest(self) -> tuple[tuple[int, int], Entry] | None:
        """Pop the held entry that expires first (skipping stale heap items); None if none is held."""
        while self._expiry:
            _, _, key, e = heapq.heappop(self._expiry)
            if self._pairs.get(key) is e:
                return key, e
        return None

    def _sweep(self, now: float) -> int:
        """Drop every entry expired at `now`; amortised O(1) per entry ever put."""
        dropped = 0
        while self._expiry and self._expiry[0][0] <= now:
            _, _, key, e = heapq.heappop(self._expiry)
            if self._pairs.get(key) is e:
                self._drop(key)
                dropped += 1
        return dropped

    def _compact_heap(self) -> None:
        # Replaced pairs leave stale heap items behind; rebuild once they outnumber the live ones.
        if len(self._expiry) > 2 * len(self._pairs) + 64:
            self._expiry = [(e.expires_at, next(self._seq), k, e) for k, e in self._pairs.items()]
            heapq.heapify(self._expiry)

    # ------------------------------------------------------------------ writes

    def put(self, user: int, ad: int, campaign: int, segment: int | None, value: np.ndarray, *, now: float,
            version: str | None = None, user_embedding: np.ndarray | None = None) -> bool:
        """Store one computed pair, replacing its previous value everywhere; False (nothing changes) if
        its version is stale or the value or embedding is not finite (counted in `nonfinite`).

        segment None: the user has no segment (a user the segmentation never saw), so the pair feeds
        no segment x ad mean.
        """
        version = version or self._version
        with np.errstate(over="ignore"):  # an overflow to inf is refused below, not warned about
            # own read-only copies: a caller reusing its buffer, or a reader editing what get returned,
            # would change a held value behind the means it was folded into
            value = _frozen(value)
            emb = None if user_embedding is None else _frozen(user_embedding)
        if value.shape != (self.value_dim,):  # checked before any table changes: a bad put must not half-land
            raise ValueError(f"value must have shape ({self.value_dim},), got {value.shape}")
        key = (user, ad)
        with self._lock:
            # checked after the float32 cast (1e39 becomes inf); the pair's earlier value, if any, stays
            if not np.isfinite(value).all() or (emb is not None and not np.isfinite(emb).all()):
                self.nonfinite += 1
                return False
            if version != self._version:
                return False
            self._sweep(now)
            if key in self._pairs:
                self._drop(key)  # replaced, not counted twice
            while len(self._pairs) >= self.max_entries:
                user_ad, _ = self._pop_soonest()
                self._drop(user_ad)
            entry = self._pairs[key] = Entry(value, version, now, now + self.ttl_s, campaign, segment)
            self._by_ad.setdefault(ad, {})[user] = entry
            heapq.heappush(self._expiry, (entry.expires_at, next(self._seq), key, entry))
            self._compact_heap()
            self._fold_in(user, ad, entry)
            if emb is not None:
                self._user_emb[user] = emb
                self._user_emb.move_to_end(user)
                if len(self._user_emb) > self.max_entries:
                    self._user_emb.popitem(last=False)
            self.puts += 1
            return True

    def evict_expired(self, now: float) -> int:
        with self._lock:
            return self._sweep(now)

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
            self._sweep(now)
            agg = table.get(key)
            return None if agg is None else agg.mean

    def user_campaign(self, user: int, campaign: int, *, now: float) -> np.ndarray | None:
        """Mean over the user's fresh pairs of this campaign."""
        return self._fresh_mean(self._user_campaign, (user, campaign), now)

    def segment_ad(self, segment: int | None, ad: int, *, now: float) -> np.ndarray | None:
        """Mean over the segment's fresh pairs of this ad (None for a user without a segment)."""
        return None if segment is None else self._fresh_mean(self._segment_ad, (segment, ad), now)

    def ad_default(self, ad: int, *, now: float | None = None) -> np.ndarray | None:
        """Mean over every user's fresh pair of this ad (`now` None: as of the last sweep)."""
        with self._lock:
            if now is not None:
                self._sweep(now)
            agg = self._ad_default.get(ad)
            return None if agg is None else agg.mean

    def global_default(self, *, now: float | None = None) -> np.ndarray:
        """Mean over every fresh pair (zeros while none is held)."""
        with self._lock:
            if now is not None:
                self._sweep(now)
            return self._global.mean

    def user_embedding(self, user: int) -> np.ndarray | None:
        with self._lock:
            return self._user_emb.get(user)

    def users_with_ad(self, ad: int, *, now: float) -> tuple[np.ndarray, np.ndarray]:
        """(users, values [n, V]) with a fresh exact entry for `ad`."""
        with self._lock:
            self._sweep(now)  # what is left is fresh (expires_at > now) and of the live version
            items = [(u, e.value) for u, e in self._by_ad.get(ad, {}).items()]
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

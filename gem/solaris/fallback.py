"""Hierarchical lookup: the best value available for (user, ad), and which tier it came from.

    exact      the precomputed (user, ad) pair, fresh and of the live model version
    campaign   the user's mean over fresh precomputed ads of the same campaign (user x ad cluster)
    segment    the user's segment's mean for this ad; skipped for a user without a segment
               (segment_of returns None: a user the segmentation never saw)
    neighbors  the mean over the k most similar users (cosine of FM user embeddings) holding a fresh
               exact entry for this ad
    default    the ad's mean over every user's fresh pair, else the global mean over every fresh pair
               (zeros while the store holds none; never missing)

Every mean is over the entries the store holds now (see gem/solaris/store.py): expired values
are out of it.

Every result carries its tier (and the tier's index, TIER_INDEX, for a model feature), so the
vertical model knows what it got. `lookup(..., tiers=...)` restricts the tiers tried, which the
benchmark uses to price each fallback against exact pairs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from gem.solaris.store import PrecomputeStore

TIERS = ("exact", "campaign", "segment", "neighbors", "default")
TIER_INDEX = {t: i for i, t in enumerate(TIERS)}


@dataclass(frozen=True)
class LookupResult:
    value: np.ndarray  # float32 [V]
    tier: str
    version: str

    @property
    def tier_index(self) -> int:
        return TIER_INDEX[self.tier]

    def to_json(self) -> dict:
        return {"value": [float(x) for x in self.value], "tier": self.tier, "tierIndex": self.tier_index,
                "version": self.version}


class HierarchicalLookup:
    def __init__(self, store: PrecomputeStore, *, campaign_of: Callable[[int], int],
                 segment_of: Callable[[int], int | None], neighbors_k: int = 8, min_similarity: float = 0.0):
        self.store = store
        self.campaign_of = campaign_of
        self.segment_of = segment_of
        self.neighbors_k = neighbors_k
        self.min_similarity = min_similarity

    def _neighbors(self, user: int, ad: int, now: float) -> np.ndarray | None:
        me = self.store.user_embedding(user)
        if me is None:
            return None
        users, values = self.store.users_with_ad(ad, now=now)
        keep = users != user
        users, values = users[keep], values[keep]
        if users.size == 0:
            return None
        embs, mask = self.store.user_embeddings(users)
        if not mask.any():
            return None
        values = values[mask]
        sim = embs @ me / (np.linalg.norm(embs, axis=1) * np.linalg.norm(me) + 1e-8)  # [n]
        top = np.argsort(-sim)[: self.neighbors_k]
        top = top[sim[top] > self.min_similarity]
        if top.size == 0:
            return None
        w = np.maximum(sim[top], 1e-6)
        return (values[top] * w[:, None]).sum(0) / w.sum()

    def lookup(self, user: int, ad: int, *, now: float, tiers: Sequence[str] = TIERS) -> LookupResult | None:
        """The first tier (in TIERS order, among `tiers`) that has a value; None only if `default` is excluded."""
        unknown = [t for t in tiers if t not in TIER_INDEX]
        if unknown:  # e.g. "neighbours": a misspelt tier would otherwise be skipped silently
            raise ValueError(f"unknown tiers {unknown}: tiers are {list(TIERS)}")
        version = self.store.version
        for tier in TIERS:
            if tier not in tiers:
                continue
            if tier == "exact":
                e = self.store.get(user, ad, now=now)
                value = None if e is None else e.value
            elif tier == "campaign":
                value = self.store.user_campaign(user, self.campaign_of(ad), now=now)
            elif tier == "segment":
                value = self.store.segment_ad(self.segment_of(user), ad, now=now)
            elif tier == "neighbors":
                value = self._neighbors(user, ad, now)
            else:
                value = self.store.ad_default(ad, now=now)
                if value is None:
                    value = self.store.global_default(now=now)
            if value is not None:
                return LookupResult(np.asarray(value, np.float32), tier, version)
        return None

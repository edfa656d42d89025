"""Which (user, ad) pairs will be requested soon.

Two signals, both updated online from the request stream (`observe`):

  recent candidates   the last `recent_per_user` distinct ads each user was requested with
                      (ads are re-requested: targeting keeps picking from the same campaigns)
  segment popularity  per user segment, exponentially decayed request counts per campaign; the top
                      campaigns of the user's segment contribute their most-requested ads

`predict(users, per_user)` returns up to per_user ads per user: recent candidates first, then the
popular ads of the user's segment that are not already in the list. Users without a segment
(segment_of returns None: users the segmentation never saw) share one popularity pool.

A user not seen for `forget_after_s` (default 7 days, longer than the service's 24h activity
window) is forgotten: their recent candidates and last-seen time are dropped, so memory is bounded
by the users of the horizon, not by every user id ever looked up. Users are kept in last-seen
order and pruned from the oldest end by `observe` and `active_users` (O(1) amortised); `now` is
expected to move forward. A forgotten user who comes back is predicted like a new one (their
segment's popular ads); predictions for users seen within the horizon are unchanged.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Callable

import numpy as np


DEFAULT_FORGET_AFTER_S = 7 * 24 * 3600.0


class RequestPredictor:
    def __init__(self, *, segment_of: Callable[[int], int | None], campaign_of: Callable[[int], int],
                 recent_per_user: int = 8, half_life_s: float = 6 * 3600.0, top_campaigns: int = 4,
                 ads_per_campaign: int = 2, forget_after_s: float = DEFAULT_FORGET_AFTER_S):
        if not forget_after_s > 0:
            raise ValueError(f"forget_after_s must be a positive number of seconds, got {forget_after_s}")
        self.segment_of = segment_of
        self.campaign_of = campaign_of
        self.recent_per_user = recent_per_user
        self.half_life_s = half_life_s
        self.top_campaigns = top_campaigns
        self.ads_per_campaign = ads_per_campaign
        self.forget_after_s = float(forget_after_s)
        self._recent: dict[int, OrderedDict[int, float]] = defaultdict(OrderedDict)
        self._campaign_score: dict[int | None, dict[int, float]] = defaultdict(dict)  # segment -> campaign -> score
        self._ad_score: dict[int, dict[int, float]] = defaultdict(dict)  # campaign -> ad -> score
        self._clock = 0.0  # decayed scores are stored relative to this time
        self.last_seen: OrderedDict[int, float] = OrderedDict()  # least recently seen first

    def _forget(self, now: float) -> None:
        """Drop users not seen for forget_after_s (from the least recently seen end: amortised O(1))."""
        while self.last_seen:
            user, seen = next(iter(self.last_seen.items()))
            if now - seen <= self.forget_after_s:
                break
            del self.last_seen[user]
            self._recent.pop(user, None)

    def _decay_weight(self, now: float) -> float:
        # Scores are stored as weight * 2^((t - t0)/h): adding a new event adds 2^((now - t0)/h),
        # so older events decay relative to newer ones without touching every score.
        return float(2.0 ** ((now - self._clock) / self.half_life_s))

    def observe(self, user: int, ad: int, now: float) -> None:
        recent = self._recent[user]
        recent.pop(ad, None)
        recent[ad] = now
        while len(recent) > self.recent_per_user:
            recent.popitem(last=False)
        if now - self._clock > 30 * self.half_life_s:  # rebase before the weights overflow
            scale = 2.0 ** ((self._clock - now) / self.half_life_s)
            for table in (*self._campaign_score.values(), *self._ad_score.values()):
                for k in table:
                    table[k] *= scale
            self._clock = now
        w = self._decay_weight(now)
        campaign = self.campaign_of(ad)
        seg = self._campaign_score[self.segment_of(user)]
        seg[campaign] = seg.get(campaign, 0.0) + w
        ads = self._ad_score[campaign]
        ads[ad] = ads.get(ad, 0.0) + w
        self.last_seen[user] = now
        self.last_seen.move_to_end(user)
        self._forget(now)

    def observe_many(self, users: np.ndarray, ads: np.ndarray, times: np.ndarray) -> None:
        for u, a, t in zip(users.tolist(), ads.tolist(), times.tolist()):
            self.observe(u, a, t)

    def popular_ads(self, segment: int | None) -> list[int]:
        campaigns = self._campaign_score.get(segment, {})
        top = sorted(campaigns, key=campaigns.get, reverse=True)[: self.top_campaigns]
        out: list[int] = []
        for c in top:
            ads = self._ad_score.get(c, {})
            out.extend(sorted(ads, key=ads.get, reverse=True)[: self.ads_per_campaign])
        return out

    def predict(self, users: list[int] | np.ndarray, per_user: int) -> list[tuple[int, int]]:
        pairs: list[tuple[int, int]] = []
        popular_cache: dict[int | None, list[int]] = {}
        for u in (int(x) for x in users):
            chosen = list(reversed(self._recent.get(u, {})))[:per_user]  # most recent first
            if len(chosen) < per_user:
                seg = self.segment_of(u)
                if seg not in popular_cache:
                    popular_cache[seg] = self.popular_ads(seg)
                for a in popular_cache[seg]:
                    if len(chosen) >= per_user:
                        break
                    if a not in chosen:
                        chosen.append(a)
            pairs.extend((u, a) for a in chosen)
        return pairs

    def active_users(self, now: float, window_s: float) -> list[int]:
        """Users requested within window_s before now: who to precompute for."""
        self._forget(now)
        return [u for u, t in self.last_seen.items() if now - t <= window_s]

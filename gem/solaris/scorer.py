"""Computing foundation-model values for (user, ad) pairs, and user segments.

A pair is scored with the user's latest known state (the last impression we saw for them: its
event history, surface and history-length feature) and the candidate ad swapped in, which is what
a speculative precompute can know before the request arrives. The ad's side of the dense features
(the synthetic world's noisy quality score of the shown ad) is swapped too: a candidate other
than the impression's own ad gets its mean score over the context's impressions of it (an ad the
context never showed: the mean over all impressions), not the shown ad's. The value is the FM's logits
(click, conversion); the FM's user representation (gem.loopfm.logging.UserRepresentation) comes
along and feeds the nearest-neighbour tier.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from gem.data.batch import make_batch
from gem.data.synthetic import DENSE_AD_QUALITY, Examples
from gem.loopfm.logging import UserRepresentation, model_device



def mean_ad_quality(context: Examples, num_ads: int) -> np.ndarray:
    """[num_ads] each ad's mean quality score over the context's impressions of it (none: over all)."""
    q = context.dense[:, DENSE_AD_QUALITY].astype(np.float64)
    total = np.bincount(context.ad_id, weights=q, minlength=num_ads)
    count = np.bincount(context.ad_id, minlength=num_ads)
    return np.where(count > 0, total / np.maximum(count, 1), q.mean() if len(q) else 0.0).astype(np.float32)


class FMScorer:
    def __init__(self, model: nn.Module, *, ad_campaign: np.ndarray, campaign_advertiser: np.ndarray,
                 batch_size: int = 512):
        self.model = model.eval()
        self.rep = UserRepresentation(self.model)
        self.ad_campaign = ad_campaign
        self.campaign_advertiser = campaign_advertiser
        self.batch_size = batch_size  # scoring runs under no_grad (thread-local), never disabling grad globally

    def score(self, context: Examples, rows: np.ndarray, ads: np.ndarray, *,
              quality: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(values [N, 2] = FM logits (click, conversion), user embeddings [N, D]) for context rows x ads.

        quality: `mean_ad_quality(context, ...)`, when the caller scores one context in several calls."""
        rows, ads = np.asarray(rows, np.int64), np.asarray(ads, np.int64)
        values, embs = [], []
        if quality is None and len(rows):
            quality = mean_ad_quality(context, len(self.ad_campaign))
        for lo in range(0, len(rows), self.batch_size):
            r, a = rows[lo : lo + self.batch_size], ads[lo : lo + self.batch_size]
            batch = make_batch(context, r, max_seq_len=self.model.max_seq_len)
            # the candidate's quality score, not the shown ad's (a row scored with its own ad keeps its own)
            dense = context.dense[r].copy()
            swapped = context.ad_id[r] != a
            dense[swapped, DENSE_AD_QUALITY] = quality[a[swapped]]
            batch.dense = torch.from_numpy(dense)
            campaign = self.ad_campaign[a]
            batch.ad_id = torch.from_numpy(a)
            batch.campaign_id = torch.from_numpy(campaign)
            batch.advertiser_id = torch.from_numpy(self.campaign_advertiser[campaign])
            with torch.no_grad():  # on the model's device (a GPU when it was moved there), values back on the CPU
                logits, emb = self.rep(batch.to(model_device(self.model)))
            values.append(torch.stack([logits["click"], logits["conversion"]], 1).float().cpu().numpy())
            embs.append(emb.cpu().numpy())
        if not values:
            return np.zeros((0, 2), np.float32), np.zeros((0, self.rep.dim), np.float32)
        return np.concatenate(values), np.concatenate(embs)


def user_segments(scorer: FMScorer, context: Examples, num_segments: int, *, until: float = np.inf) -> dict[int, int]:
    """{user: segment}: k-means of the FM's user representation at each user's latest impression in the
    context before `until` (a user with none has no segment)."""
    known = np.flatnonzero(context.request_time < until)
    order = known[np.argsort(context.request_time[known], kind="stable")]
    last = dict(zip(context.user_id[order].tolist(), order.tolist()))
    users = np.array(sorted(last), np.int64)
    rows = np.array([last[u] for u in users.tolist()], np.int64)
    _, embs = scorer.score(context, rows, context.ad_id[rows])
    return dict(zip(users.tolist(), kmeans_segments(embs, num_segments).tolist()))


def kmeans_segments(embeddings: np.ndarray, k: int, *, iters: int = 15, seed: int = 0) -> np.ndarray:
    """Cluster ids [N] of embeddings [N, D] (plain Lloyd's k-means on normalised vectors)."""
    x = embeddings / (np.linalg.norm(embeddings, axis=1, keepdims=True) + 1e-8)
    rng = np.random.default_rng(seed)
    k = min(k, len(x))
    centers = x[rng.choice(len(x), k, replace=False)]
    assign = np.zeros(len(x), np.int64)
    for _ in range(iters):
        assign = np.argmax(x @ centers.T, axis=1)
        for c in range(k):
            members = x[assign == c]
            if len(members):
                centers[c] = members.mean(0)
    return assign

"""Solaris scorer: what a precomputed (user state, candidate ad) pair is scored with."""

import dataclasses

import numpy as np

from gem.api import parse_object
from gem.data.synthetic import DENSE_AD_QUALITY, SyntheticWorld
from gem.model import build_model
from gem.solaris.scorer import FMScorer


MANIFEST = {"apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": "fm"},
            "spec": {"model": {"preset": "tiny"},
                     "data": {"synthetic": {"numUsers": 60, "numAds": 40, "numTrainExamples": 600,
                                            "numEvalExamples": 50, "meanHistoryLen": 8}}}}


def test_a_candidate_is_scored_with_its_own_quality_score_not_the_shown_ads():
    """dense[:, 1] is the shown ad's quality score: a candidate swapped into the row was scored with the
    quality of whichever ad the user's last impression happened to show. It gets its own now."""
    manifest = parse_object(MANIFEST)
    world = SyntheticWorld(manifest.spec.data.synthetic)
    context = world.sample(600, split=0)
    scorer = FMScorer(build_model(manifest.spec.model), ad_campaign=world.ad_campaign,
                      campaign_advertiser=world.campaign_advertiser)
    row = 5
    shown = int(context.ad_id[row])
    candidate, other = (shown + 1) % 40, (shown + 2) % 40
    assert (context.ad_id == candidate).any() and (context.ad_id == other).any()

    seen = []
    rep = scorer.rep
    scorer.rep = lambda batch: (seen.append(batch.dense.clone()), rep(batch))[1]
    value, _ = scorer.score(context, [row], [candidate])
    mean_quality = context.dense[context.ad_id == candidate, DENSE_AD_QUALITY].mean()
    assert np.isclose(seen[-1][0, DENSE_AD_QUALITY].item(), mean_quality, atol=1e-5)
    assert seen[-1][0, 0].item() == context.dense[row, 0]  # the user's side (history length) is the row's

    # the same user state whose last impression showed another ad: the candidate's value is the same
    moved = dataclasses.replace(context, ad_id=context.ad_id.copy(), dense=context.dense.copy())
    moved.ad_id[row], moved.dense[row, DENSE_AD_QUALITY] = other, world.ad_quality[other]
    moved_value, _ = scorer.score(moved, [row], [candidate])
    np.testing.assert_allclose(moved_value, value, rtol=1e-5, atol=1e-6)

    # a row scored with its own ad (the live request) keeps its own quality score
    scorer.score(context, [row], [shown])
    assert seen[-1][0, DENSE_AD_QUALITY].item() == context.dense[row, DENSE_AD_QUALITY]

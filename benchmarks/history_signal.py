"""How much of the user x ad affinity the event histories reveal without any label.

    python -m benchmarks.history_signal            # seconds; the quality study's held-out world
    python -m benchmarks.history_signal --smoke    # the test's run
    -> benchmarks/results/history_signal.json

benchmarks.quality's gap split (`main.gap_split`) fits logistic regressions on the world's exact
logit terms: without the affinity, and with its campaign part. Almost all of the models' gap to
Bayes is that affinity, which no single impression reveals. This adds the row between them: the
predictor without the affinity, given instead features built from the training histories alone,
no label read. Campaign embeddings are the truncated SVD of the positive PMI of campaigns
co-occurring in one history (the factorization word2vec performs implicitly, Levy and Goldberg
2014); per impression, the dot product of its history's mean embedding with its candidate's
campaign embedding (ranks 8 and 16), and the mean PPMI of the candidate with the history. It also
reports how much of the true campaign latent vectors (R², linear fit) the embeddings recover.

The row measures what the generative objective over the history (gem.modules.generative,
docs/architecture.md §11) could hand a model: the same co-occurrence, learnt by SGD beside the
task losses instead of factorized in closed form.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import quality as Q  # noqa: E402
from gem.api.types import SyntheticDataSpec  # noqa: E402
from gem.data import Examples  # noqa: E402
from gem.data.synthetic import SyntheticWorld  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "history_signal.json"
RANKS = (8, 16)


def campaign_counts(ex: Examples, num_campaigns: int) -> np.ndarray:
    """[N, C]: how many of each example's history events are on each campaign (topic, for posts)."""
    owner = np.repeat(np.arange(len(ex)), ex.seq_lengths)
    counts = np.zeros((len(ex), num_campaigns))
    np.add.at(counts, (owner, ex.seq_campaign_id), 1.0)
    return counts


def ppmi_embeddings(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(PPMI [C, C] of campaigns co-occurring in one history, U, S of its SVD)."""
    share = counts / np.maximum(counts.sum(1, keepdims=True), 1.0)
    co = counts.T @ share  # each history's campaigns x its campaign mix
    np.fill_diagonal(co, 0.0)
    total = co.sum()
    rows, cols = co.sum(1) / total, co.sum(0) / total
    with np.errstate(divide="ignore"):
        pmi = np.log(np.maximum(co / total, 1e-300) / np.maximum(np.outer(rows, cols), 1e-300))
    ppmi = np.maximum(pmi, 0.0)
    u, s, _ = np.linalg.svd(ppmi)
    return ppmi, u, s


def cooccurrence_features(ex: Examples, ppmi: np.ndarray, u: np.ndarray, s: np.ndarray) -> np.ndarray:
    """[N, len(RANKS) + 1]: history-mean x candidate embedding dot per rank, mean PPMI with the candidate."""
    counts = campaign_counts(ex, ppmi.shape[0])
    mix = counts / np.maximum(counts.sum(1, keepdims=True), 1.0)
    cols = []
    for k in RANKS:
        emb = u[:, :k] * np.sqrt(s[:k])
        cols.append(np.einsum("nk,nk->n", mix @ emb, emb[ex.campaign_id]))
    cols.append((mix @ ppmi)[np.arange(len(ex)), ex.campaign_id])
    return np.stack(cols, 1)


def latent_r2(world: SyntheticWorld, u: np.ndarray, s: np.ndarray) -> dict[str, float]:
    """R² of the true campaign latents from the embeddings at each rank (least squares, with intercept)."""
    out = {}
    lat = world.campaign_latent
    for k in RANKS:
        emb = np.hstack([u[:, :k] * np.sqrt(s[:k]), np.ones((u.shape[0], 1))])
        coef, *_ = np.linalg.lstsq(emb, lat, rcond=None)
        out[str(k)] = float(1 - ((emb @ coef - lat) ** 2).sum() / ((lat - lat.mean(0)) ** 2).sum())
    return out


def study(data: dict[str, Any]) -> dict[str, Any]:
    """benchmarks.quality's gap split of `data` (a quality job's data dict) with the row between its
    two predictors: the one without the affinity, given the co-occurrence features instead."""
    spec = SyntheticDataSpec(**data["spec"])
    world = SyntheticWorld(spec)
    train, eval_ = Q.load_data(data)  # the cache gap_split reads too
    ppmi, u, s = ppmi_embeddings(campaign_counts(train, world.num_campaigns))  # training histories only
    split = Q.gap_split(data)
    rows = {}
    for task in ("click", "dwell"):  # conversion's affinity is 0.6 of click's, on ~8 labels per ad
        x, y = {}, {}
        for name, ex in (("train", train), ("eval", eval_)):
            terms = world.logit_terms(ex)[task]
            known = [v for k, v in terms.items() if k not in ("intercept", *Q.GAP_SPLIT["without_affinity"])]
            x[name] = np.hstack([np.stack(known, 1), cooccurrence_features(ex, ppmi, u, s)])
            y[name] = getattr(ex, task)
        row = dict(split[task])
        row["with_history_cooccurrence"] = Q._logistic_ne(x["train"], y["train"], x["eval"], y["eval"])
        rows[task] = {k: row[k] for k in ("bayes", "without_affinity", "with_history_cooccurrence",
                                          "with_campaign_affinity")}
    return {"world": data["spec"], "num_campaigns": world.num_campaigns,
            "train_examples": len(train), "eval_examples": len(eval_), "ne": rows,
            "campaign_latent_r2": latent_r2(world, u, s)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="the test's run: the smoke world (seconds)")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    mode = Q.MODES["smoke" if args.smoke else "full"]
    data = Q.plan_main(mode, threads=1, kinds=("gem",))["main/gem"]["data"]  # the quality study's examples
    t0 = time.time()
    doc = {"command": "python -m benchmarks.history_signal" + (" --smoke" if args.smoke else ""), **study(data)}
    doc["wall_seconds"] = round(time.time() - t0, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    for task, row in doc["ne"].items():
        print(f"{task}: " + ", ".join(f"{k} {v:.4f}" for k, v in row.items()))
    print(f"campaign latents recovered (R²): {doc['campaign_latent_r2']}; {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

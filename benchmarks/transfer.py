"""Transfer ratio of plain KD and of LoopFM, on the synthetic ads world.

    python -m benchmarks.transfer [--quick | --smoke] [--seeds N] [--steps N] [--fm-steps N] [--no-cache] [--out PATH]

One process, fp32, CPU, every model trained by the same plain loop (AdamW, betas 0.9/0.98, warmup
+ cosine from gem.train.optim, batch 128) on the same world; the losses are the trainer Tasks'
own (gem.model.loss.multitask_bce, gem.distill.task.kd_loss, gem.loopfm.task.loopfm_loss):

  FM         a tiny-preset GEM (the teacher), one pass over FM_DATA_FACTOR x the vertical's
             impressions of the same world (split 3: the platform traffic a foundation model
             learns from), trained once and cached (see --cache)
  memory     the FM's user embeddings of every impression it scored (its own traffic, the
             vertical's train and eval), logged in request-time order into an EmbeddingMemory
             (gem.loopfm.logging.log_stream, kind "history": the FM's item + campaign embeddings
             pooled over the request's history, candidate-independent); read point-in-time
             (strictly before each request)
  students   two passes over the vertical's train split (more over-fits their id tables)
  baseline   the KD student architecture, labels only (kd_loss with α = 0)
  kd         the same student, plain KD (α, T)
  loopfm     LoopFMStudent: memory features read bilinearly with the candidate + aux head (β) + adapter

The baseline and KD students are widened (hidden width) until their serving cost matches the
LoopFM student's (multiply-adds per request within 5%; both counts and the parameter counts of
the serving paths are in the JSON). Each student is trained for every seed (initialisation and
data order; the same seed gives the three students the same batches) and

    TR = (NE_baseline - NE_student) / (NE_baseline - NE_FM)    NE = mean(ne/click, ne/conversion), held-out

is computed per seed against that seed's baseline, then averaged. The teacher's logits on the
train split are computed once (the FM is frozen and deterministic in eval mode): the same targets
the trainer's Task would compute per batch, without re-running the FM every step.

Diagnostics in the JSON (`memory`): coverage (share of eval requests that read at least one
embedding, mean embeddings read), held-out click NE of logistic probes (memory_probes): on the
memory mean alone (a main effect only), on the baseline student's logit with and without it, with
it crossed with the candidate's campaign (a bilinear read), and on the FM's embedding of the
request itself (not servable: an upper bound on what the representation holds); and interest_r2,
how much of the user's hidden interest vector the memory mean and the student's own 8-event window
explain (reads the world's latents: a diagnostic, never a model input).

Writes benchmarks/results/transfer.json and transfer.png (or --out and the PNG beside it). The
results of record use --quick's world; --smoke is a far smaller one (a structure check, seconds of
training: its figures mean nothing).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results"
STUDENT = {"embeddingDim": 16, "hiddenDim": 64, "maxSeqLen": 8}
BATCH = 128
LR = 0.003
WARMUP = 20


FM_SPLIT = 3  # the platform's traffic the FM learns from (0: the vertical's train, 1: eval, 2: Solaris' stream)
FM_DATA_FACTOR = 4  # the FM sees 4x the vertical's impressions, as a foundation model sees every surface


def data_spec(quick: bool, smoke: bool = False) -> dict:
    """The vertical's world: its train split is what the students learn from."""
    if smoke:
        return {"seed": 7, "numUsers": 200, "numAds": 60, "numTrainExamples": 2000, "numEvalExamples": 1000,
                "meanHistoryLen": 24}
    if quick:
        return {"seed": 7, "numUsers": 800, "numAds": 240, "numTrainExamples": 16000, "numEvalExamples": 6000,
                "meanHistoryLen": 24}
    return {"seed": 7, "numUsers": 1500, "numAds": 320, "numTrainExamples": 40000, "numEvalExamples": 10000,
            "meanHistoryLen": 24}


def train_loop(model, loss_fn, train, *, steps: int, seed: int, max_seq_len: int) -> None:
    """AdamW + warmup/cosine over `steps` batches of the train split; epochs reshuffled from `seed`."""
    import torch

    from gem.data.batch import make_batch
    from gem.train.optim import lr_factor

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.98), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, warmup_steps=WARMUP, total_steps=steps))
    order = np.zeros(0, np.int64)
    model.train()
    for _ in range(steps):
        if len(order) < BATCH:
            order = np.concatenate([order, rng.permutation(len(train))])
        idx, order = order[:BATCH], order[BATCH:]
        loss, _ = loss_fn(model, make_batch(train, idx, max_seq_len=max_seq_len), idx)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    model.eval()


def evaluate(model, examples, max_seq_len: int) -> dict[str, float]:
    import torch

    from gem.eval.evaluate import collect_predictions, metrics_from_predictions

    preds = collect_predictions(model, examples, max_seq_len=max_seq_len, rank=0, world_size=1,
                                device=torch.device("cpu"))
    return {k: float(v) for k, v in metrics_from_predictions([preds]).items() if isinstance(v, (int, float))}


def train_fm(data: dict, train, steps: int, out: Path) -> Path:
    """A tiny GEM trained on `train` (impressions of the world `data` describes), saved as a
    checkpoint directory (gem.yaml + model.pt)."""
    import torch
    import yaml

    from gem.api.types import ModelSpec
    from gem.model import build_model
    from gem.model.loss import multitask_bce

    torch.manual_seed(0)
    fm = build_model(ModelSpec(preset="tiny"))
    train_loop(fm, lambda m, b, _: multitask_bce(m(b), b), train, steps=steps, seed=0, max_seq_len=fm.max_seq_len)
    out.mkdir(parents=True, exist_ok=True)
    manifest = {"apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": "fm"},
                "spec": {"model": {"preset": "tiny"},
                         "data": {"synthetic": {**data, "numTrainExamples": len(train)}},
                         "training": {"steps": steps, "batchSize": BATCH, "learningRate": LR, "warmupSteps": WARMUP}}}
    (out / "gem.yaml").write_text(yaml.safe_dump(manifest))
    torch.save(fm.state_dict(), out / "model.pt")
    return out


def memory_probes(fm, baseline, index, train, evaluation, *, k: int, max_seq_len: int, world=None,
                  student_seq_len: int = STUDENT["maxSeqLen"]) -> dict[str, dict[str, float]]:
    """Does the memory carry signal, and in what form? Probes fitted on the train split, held out on eval.

    click (held-out click NE of logistic probes): memory_mean, the masked mean of the k embeddings
    read (point-in-time), alone: a main effect only, blind to a user x ad signal; baseline, the
    baseline student's logit; baseline+memory_mean: both; baseline+memory_x_campaign: the baseline
    logit and memory_mean ⊗ one-hot(candidate campaign), a bilinear read (what the LoopFM reader
    can use); current_embedding: the FM's token embedding of the request itself (an upper bound,
    not servable).
    interest_r2 (diagnostic, reads the world's hidden latents, never used by a model): R² of a ridge
    regression of the user's true interest vector at request time on memory_mean, and on the
    campaign histogram of the student's own window (its `student_seq_len` most recent events).
    """
    import torch

    from gem.data.batch import make_batch
    from gem.eval.metrics import normalized_entropy
    from gem.loopfm.logging import embed_examples
    from gem.solaris.vertical import fit_logistic

    def memory_mean(ex):
        emb, _, valid = index.lookup(ex.user_id, ex.request_time, k)
        w = valid[..., None].astype(np.float32)
        return (emb * w).sum(1) / np.maximum(w.sum(1), 1.0)

    def student_logit(ex):
        with torch.no_grad():
            return np.concatenate([baseline(make_batch(ex, np.arange(lo, min(lo + 1024, len(ex))),
                                                       max_seq_len=max_seq_len))["click"].numpy()
                                   for lo in range(0, len(ex), 1024)])[:, None]

    num_campaigns = int(max(train.campaign_id.max(), evaluation.campaign_id.max())) + 1
    feats, mem = {}, {}
    for split, ex in (("train", train), ("eval", evaluation)):
        mem[split] = memory_mean(ex)
        by_campaign = (mem[split][:, :, None] * np.eye(num_campaigns, dtype=np.float32)[ex.campaign_id][:, None, :])
        feats[split] = {"memory_mean": mem[split], "baseline": student_logit(ex),
                        "current_embedding": embed_examples(fm, ex)[0]}
        feats[split]["baseline+memory_mean"] = np.concatenate([feats[split]["baseline"], mem[split]], 1)
        feats[split]["baseline+memory_x_campaign"] = np.concatenate(
            [feats[split]["baseline"], by_campaign.reshape(len(ex), -1)], 1)
    click = {}
    for name in feats["train"]:
        x_tr, x_ev = feats["train"][name], feats["eval"][name]
        mu, sd = x_tr.mean(0), x_tr.std(0) + 1e-6
        w = fit_logistic((x_tr - mu) / sd, train.click, l2=1e-3 if "_x_" in name else 1e-4)
        logit = np.concatenate([(x_ev - mu) / sd, np.ones((len(x_ev), 1))], 1) @ w
        click[name] = float(normalized_entropy(evaluation.click, 1 / (1 + np.exp(-logit))))
    out = {"click": click}
    if world is not None:
        def own_window(ex):  # campaign histogram of the student's most recent events
            off = ex.seq_offsets
            owner = np.repeat(np.arange(len(ex)), np.diff(off))
            keep = (np.repeat(off[1:], np.diff(off)) - 1 - np.arange(off[-1])) < student_seq_len
            h = np.zeros((len(ex), num_campaigns), np.float32)
            np.add.at(h, (owner[keep], ex.seq_campaign_id[keep]), 1.0)
            return h / np.maximum(h.sum(1, keepdims=True), 1.0)

        def ridge_r2(x_tr, x_ev):
            y_tr, y_ev = (world.interest_at(ex.user_id, ex.request_time) for ex in (train, evaluation))
            mu, sd = x_tr.mean(0), x_tr.std(0) + 1e-6
            a, b = (np.c_[(x - mu) / sd, np.ones(len(x))] for x in (x_tr, x_ev))
            w = np.linalg.solve(a.T @ a + np.eye(a.shape[1]), a.T @ y_tr)
            return float(1 - ((y_ev - b @ w) ** 2).mean() / y_ev.var(0).mean())

        out["interest_r2"] = {"memory_mean": ridge_r2(mem["train"], mem["eval"]),
                              "student_window": ridge_r2(own_window(train), own_window(evaluation))}
    return out


def matched_hidden(target_flops: int, spec) -> int:
    """The hidden width at which the KD student's serving multiply-adds are closest to target_flops."""
    from gem.distill.student import StudentModel
    from gem.loopfm.student import student_flops

    best = min(range(8, 512), key=lambda h: abs(student_flops(StudentModel(spec.model_copy(update={"hidden_dim": h})))
                                                - target_flops))
    return best


def code_fingerprint() -> bytes:
    """The source of everything the cached FM and its memory depend on: a change to the model, the
    trainer or the logging code gives a new cache key (a stale FM would otherwise load under new code)."""
    h = hashlib.sha1()
    for sub in ("modules", "model", "ops", "train", "loopfm", "data"):
        for path in sorted((ROOT / "gem" / sub).rglob("*.py")):
            h.update(path.relative_to(ROOT).as_posix().encode() + path.read_bytes())
    return h.digest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller world (the one the results of record use)")
    ap.add_argument("--smoke", action="store_true", help="a tiny world (a structure check; the figures mean nothing)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps of every student")
    ap.add_argument("--fm-steps", type=int, default=None, help="optimizer steps of the FM")
    ap.add_argument("--seeds", type=int, default=3)
    # Each method at the better of the settings tried (docs/loopfm.md): KD alpha 0.5 (alpha 1, soft labels
    # only, was worse than no teacher); LoopFM alpha 1, beta 3 (better than alpha 0.5, beta 1).
    ap.add_argument("--kd-alpha", type=float, default=0.5, help="KD: weight of the soft-label loss")
    ap.add_argument("--alpha", type=float, default=1.0, help="LoopFM: weight of the aux head's loss")
    ap.add_argument("--temperature", type=float, default=2.0)
    ap.add_argument("--beta", type=float, default=3.0, help="LoopFM: aux-head gradient scale into the body")
    ap.add_argument("--memory-k", type=int, default=None, help="default: DistillationSpec's")
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "gem-transfer-cache"),
                    help="where the trained FM and its memory are kept between runs (keyed by world, FM steps and code)")
    ap.add_argument("--no-cache", action="store_true", help="train the FM and log its memory afresh")
    ap.add_argument("--out", default=str(RESULTS / "transfer.json"))
    args = ap.parse_args(argv)

    import torch

    from gem.api.types import DistillationSpec, StudentSpec, SyntheticDataSpec
    from gem.data.synthetic import SyntheticWorld
    from gem.distill.student import StudentModel
    from gem.distill.task import kd_loss
    from gem.loopfm.logging import LOGGED_KIND, UserRepresentation, embed_examples, log_stream, logged_version
    from gem.loopfm.memory import EmbeddingMemory
    from gem.loopfm.student import LoopFMStudent, serving_params, student_flops
    from gem.loopfm.task import loopfm_loss
    from gem.train.checkpoint import load_model

    torch.set_num_threads(1)  # small models: threads only contend
    data = data_spec(args.quick, args.smoke)
    # One pass over the FM's traffic; two over the vertical's (more overfits the students' id tables).
    fm_examples = FM_DATA_FACTOR * data["numTrainExamples"]
    steps = args.steps or 2 * data["numTrainExamples"] // BATCH
    fm_steps = args.fm_steps or fm_examples // BATCH
    dist = DistillationSpec(method="loopfm", alpha=args.alpha, temperature=args.temperature, beta=args.beta,
                            **({} if args.memory_k is None else {"memory_k": args.memory_k}))
    world = SyntheticWorld(SyntheticDataSpec.model_validate(data))  # built once: the splits, the FM's traffic, the probes
    train, evaluation = world.splits()
    timings: dict[str, float] = {}

    key = hashlib.sha1(json.dumps([data, fm_steps, fm_examples, FM_SPLIT]).encode() + train.p_click.tobytes()  # the world's fingerprint
                       + train.seq_ad_id.tobytes() + code_fingerprint()).hexdigest()[:12]
    tmp = tempfile.TemporaryDirectory(prefix="gem-transfer-")
    work = Path(tmp.name) if args.no_cache else Path(args.cache) / key
    fm_dir = work / "fm"
    t0 = time.perf_counter()
    fm_traffic = functools.cache(lambda: world.sample(fm_examples, split=FM_SPLIT))  # sampled once, on a cache miss
    if not (fm_dir / "model.pt").is_file():
        train_fm(data, fm_traffic(), fm_steps, fm_dir)
    timings["fm_train"] = time.perf_counter() - t0
    fm, _ = load_model(fm_dir)
    version = logged_version(fm_dir, LOGGED_KIND)
    memory = EmbeddingMemory(work / "memory")
    t0 = time.perf_counter()
    if version not in memory.model_versions():
        # Everything the FM scored: its own traffic and the vertical's, in request-time order.
        log_stream(fm, [fm_traffic(), train, evaluation], memory, version, kind=LOGGED_KIND)
    index = memory.index(version)
    timings["memory_log"] = time.perf_counter() - t0
    # Teacher logits on the train split: what the Task's frozen teacher returns for each batch.
    _, teacher_logits = embed_examples(fm, train)
    teacher_t = {k: torch.from_numpy(v) for k, v in teacher_logits.items()}
    memory_dim = UserRepresentation(fm, LOGGED_KIND).dim
    max_seq_len = fm.max_seq_len  # batches carry the teacher's history; students keep their own most recent
    fm_metrics = evaluate(fm, evaluation, fm.max_seq_len)

    student_spec = StudentSpec.model_validate(STUDENT)
    probe = LoopFMStudent.from_spec(student_spec, dist, memory_dim)
    kd_hidden = matched_hidden(student_flops(probe), student_spec)
    kd_spec = student_spec.model_copy(update={"hidden_dim": kd_hidden})
    cost = {"loopfm": {"flops": student_flops(probe), "params": serving_params(probe), "hidden": student_spec.hidden_dim},
            "kd": {"flops": student_flops(StudentModel(kd_spec)), "params": serving_params(StudentModel(kd_spec)),
                   "hidden": kd_hidden}}

    def teacher_of(idx):
        return {k: v[idx] for k, v in teacher_t.items()}

    def kd_fn(alpha):
        return lambda m, b, idx: kd_loss(m(b), teacher_of(idx), b, alpha=alpha, temperature=args.temperature)

    def loopfm_fn(m, b, idx):
        t = teacher_of(idx)
        return loopfm_loss(m(b, t), t, b, alpha=args.alpha, temperature=args.temperature)

    per_seed: list[dict] = []
    for seed in range(args.seeds):
        row: dict[str, dict] = {}
        for name in ("baseline", "kd", "loopfm"):
            torch.manual_seed(seed)
            if name == "loopfm":
                model, fn = LoopFMStudent.from_spec(student_spec, dist, memory_dim).attach_memory(index), loopfm_fn
            else:
                model, fn = StudentModel(kd_spec), kd_fn(0.0 if name == "baseline" else args.kd_alpha)
            t0 = time.perf_counter()
            train_loop(model, fn, train, steps=steps, seed=seed, max_seq_len=max_seq_len)
            timings[f"{name}_seed{seed}"] = time.perf_counter() - t0
            row[name] = evaluate(model, evaluation, max_seq_len)
            if seed == 0 and name == "baseline":
                baseline0 = model
        per_seed.append(row)
        print(f"seed {seed}: " + ", ".join(f"{k} NE {v['ne']:.4f}" for k, v in row.items()), flush=True)
    tmp.cleanup()

    gap = [r["baseline"]["ne"] - fm_metrics["ne"] for r in per_seed]
    tr = {k: [(r["baseline"]["ne"] - r[k]["ne"]) / g for r, g in zip(per_seed, gap)] for k in ("kd", "loopfm")}

    def mean_std(xs):
        return {"mean": float(np.mean(xs)), "std": float(np.std(xs)), "values": [float(x) for x in xs]}

    def stat(metric: str) -> dict:
        out = {k: mean_std([r[k][metric] for r in per_seed]) for k in ("baseline", "kd", "loopfm")}
        out["fm"] = fm_metrics[metric]
        return out

    _, _, valid = index.lookup(evaluation.user_id, evaluation.request_time, dist.memory_k)
    probes = memory_probes(fm, baseline0, index, train, evaluation, k=dist.memory_k, max_seq_len=max_seq_len,
                           world=world)
    result = {
        "transfer_ratio_loopfm": float(np.mean(tr["loopfm"])),
        "transfer_ratio_kd": float(np.mean(tr["kd"])),
        "transfer_ratio": {k: mean_std(v) for k, v in tr.items()},
        "loopfm_over_kd": float(np.mean(tr["loopfm"]) / np.mean(tr["kd"])) if np.mean(tr["kd"]) > 0 else None,
        "ne": stat("ne"),
        "ne_click": stat("ne/click"),
        "ne_conversion": stat("ne/conversion"),
        "auc_click": stat("auc/click"),
        "bayes_ne": (fm_metrics["bayes_ne/click"] + fm_metrics["bayes_ne/conversion"]) / 2,
        "fm_gain_over_baseline": mean_std(gap),
        "serving_cost": cost,
        "memory": {"rows": len(index), "dim": memory_dim, "k": dist.memory_k,
                   "eval_coverage": float(valid.any(1).mean()), "eval_mean_embeddings_read": float(valid.sum(1).mean()),
                   "representation": LOGGED_KIND, "click_probes": probes["click"],
                   "interest_r2": probes["interest_r2"]},
        "seconds": {k: round(v, 1) for k, v in timings.items()},
        "config": {"data": data, "steps": steps, "fm_steps": fm_steps, "fm_examples": fm_examples, "fm_split": FM_SPLIT, "batch_size": BATCH, "learning_rate": LR,
                   "seeds": args.seeds, "student": STUDENT, "kd_hidden": kd_hidden, "kd_alpha": args.kd_alpha,
                   "loopfm_alpha": args.alpha,
                   "temperature": args.temperature, "beta": dist.beta, "memory_k": dist.memory_k,
                   "fm_preset": "tiny", "quick": args.quick, "smoke": args.smoke},
        "command": "python -m benchmarks.transfer " + " ".join(argv if argv is not None else sys.argv[1:]),
        "definition": "TR = (NE_baseline - NE_student) / (NE_baseline - NE_FM) per seed, averaged; "
                      "NE = mean(ne/click, ne/conversion) on the same held-out impressions",
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    _plot(result, out.with_suffix(".png"))
    print(json.dumps({k: result[k] for k in ("transfer_ratio_loopfm", "transfer_ratio_kd", "loopfm_over_kd",
                                              "serving_cost")}, indent=2))
    return 0


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = ["baseline", "kd", "loopfm"]
    ne = [result["ne"][n]["mean"] for n in names] + [result["ne"]["fm"]]
    err = [result["ne"][n]["std"] for n in names] + [0.0]
    a.bar(names + ["fm"], ne, yerr=err, color=["grey", "tab:blue", "tab:green", "black"])
    a.axhline(result["bayes_ne"], ls="--", color="red", label="Bayes NE")
    a.set_ylim(min(result["bayes_ne"], *ne) - 0.02, max(ne) + 0.02)
    a.set_ylabel("held-out NE (mean of click, conversion)")
    a.legend()
    tr = result["transfer_ratio"]
    b.bar(["kd", "loopfm"], [tr["kd"]["mean"], tr["loopfm"]["mean"]], yerr=[tr["kd"]["std"], tr["loopfm"]["std"]],
          color=["tab:blue", "tab:green"])
    b.set_ylabel("transfer ratio")
    b.set_title("TR at equal serving cost (mean ± std over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())

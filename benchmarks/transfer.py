"""Transfer ratio of plain KD and of LoopFM, on the synthetic ads world.

    python -m benchmarks.transfer [--quick] [--steps N]

Trains, through the shared trainer (`gem train` / `gem distill` as a library, one process, fp32,
into a temporary checkpoint root):

  FM         a tiny-preset GEM (the teacher)
  baseline   the vertical student with no teacher (method kd, alpha 0: labels only)
  kd         the same student with plain KD (method kd, alpha, T)
  loopfm     the same backbone + FM-memory features + aux head (β-scaled) + adapter (method loopfm)

all evaluated on the same held-out impressions of the same world, then

    TR = (NE_baseline - NE_student) / (NE_baseline - NE_FM)          (NE: mean of click and conversion)

Writes benchmarks/results/transfer.json and transfer.png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results"
STUDENT = {"embeddingDim": 16, "hiddenDim": 64, "maxSeqLen": 8}


def data_spec(quick: bool) -> dict:
    if quick:
        return {"synthetic": {"seed": 7, "numUsers": 800, "numAds": 240, "numTrainExamples": 12000,
                              "numEvalExamples": 4000, "meanHistoryLen": 24}}
    return {"synthetic": {"seed": 7, "numUsers": 2000, "numAds": 400, "numTrainExamples": 40000,
                          "numEvalExamples": 10000, "meanHistoryLen": 32}}


def _run(cmd: str, manifest: dict, workdir: Path) -> dict:
    from gem import cli

    name = manifest["metadata"]["name"]
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(manifest))
    log = workdir / f"{name}.report.json"
    os.environ["GEM_TERMINATION_MESSAGE_PATH"] = str(log)
    t0 = time.perf_counter()
    rc = cli.main([cmd, "--config", str(path)])
    if rc != 0:
        raise RuntimeError(f"gem {cmd} {name} failed with exit code {rc}")
    report = json.loads(log.read_text())
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller world and fewer steps (a smoke run)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps of every model")
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--temperature", type=float, default=2.0)
    ap.add_argument("--out", default=str(RESULTS / "transfer.json"))
    args = ap.parse_args(argv)
    steps = args.steps or (120 if args.quick else 400)
    data = data_spec(args.quick)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GEM_FAULT_AT_STEP"):
        os.environ.pop(var, None)

    with tempfile.TemporaryDirectory(prefix="gem-transfer-") as tmp:
        work = Path(tmp)
        ckpt = {"path": str(work / "ckpt"), "everySteps": steps, "keepLast": 1}
        training = {"steps": steps, "batchSize": 128, "warmupSteps": 20, "learningRate": 0.003, "seed": 0}
        base = {"apiVersion": "gem.dev/v1alpha1", "metadata": {"namespace": "bench"}}

        def manifest(kind: str, name: str, spec: dict) -> dict:
            return {**base, "kind": kind, "metadata": {"name": name, "namespace": "bench"},
                    "spec": {"data": data, "training": training, "checkpoint": ckpt, "mlflow": {"enabled": False},
                             **spec}}

        runs: dict[str, dict] = {}
        runs["fm"] = _run("train", manifest("GEMTraining", "fm", {"model": {"preset": "tiny"}}), work)

        def student(name: str, method: str, alpha: float) -> dict:
            return manifest("LoopFMDistill", name, {
                "teacher": {"gemTraining": "fm"}, "student": STUDENT,
                "distillation": {"method": method, "alpha": alpha, "temperature": args.temperature}})

        runs["baseline"] = _run("distill", student("baseline", "kd", 0.0), work)
        runs["kd"] = _run("distill", student("kd", "kd", args.alpha), work)
        runs["loopfm"] = _run("distill", student("loopfm", "loopfm", args.alpha), work)
        flops = _serving_flops(runs)

    ne = {k: r["metrics"]["ne"] for k, r in runs.items()}
    gap = ne["baseline"] - ne["fm"]

    def tr(k: str) -> float:
        return (ne["baseline"] - ne[k]) / gap

    result = {
        "transfer_ratio_loopfm": tr("loopfm"),
        "transfer_ratio_kd": tr("kd"),
        "loopfm_over_kd": tr("loopfm") / tr("kd") if tr("kd") > 0 else None,
        "ne": ne,
        "ne_click": {k: r["metrics"]["ne/click"] for k, r in runs.items()},
        "ne_conversion": {k: r["metrics"]["ne/conversion"] for k, r in runs.items()},
        "auc_click": {k: r["metrics"]["auc/click"] for k, r in runs.items()},
        "bayes_ne": (runs["fm"]["metrics"]["bayes_ne/click"] + runs["fm"]["metrics"]["bayes_ne/conversion"]) / 2,
        "student_serving_flops": flops,
        "seconds": {k: r["seconds"] for k, r in runs.items()},
        "config": {"data": data, "steps": steps, "batch_size": 128, "student": STUDENT, "alpha": args.alpha,
                   "temperature": args.temperature, "fm_preset": "tiny", "quick": args.quick},
        "definition": "TR = (NE_baseline - NE_student) / (NE_baseline - NE_FM); NE = mean(ne/click, ne/conversion) "
                      "on the same held-out impressions",
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    _plot(result, out.with_suffix(".png"))
    print(json.dumps({k: result[k] for k in ("transfer_ratio_loopfm", "transfer_ratio_kd", "loopfm_over_kd", "ne")},
                     indent=2))
    return 0


def _serving_flops(runs: dict) -> dict:
    from gem.distill.student import StudentModel
    from gem.loopfm.student import load_loopfm_student, student_flops
    from gem.train.checkpoint import load_model

    kd, _ = load_model(runs["kd"]["checkpoint"])
    lf, _ = load_loopfm_student(runs["loopfm"]["checkpoint"])
    assert isinstance(kd, StudentModel)
    return {"kd": student_flops(kd), "loopfm": student_flops(lf),
            "kd_params": sum(p.numel() for p in kd.parameters()),
            "loopfm_params_serving": sum(p.numel() for n, p in lf.named_parameters()
                                         if not n.startswith(("aux_heads", "adapter")))}


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = ["baseline", "kd", "loopfm", "fm"]
    a.bar(names, [result["ne"][n] for n in names], color=["grey", "tab:blue", "tab:green", "black"])
    a.axhline(result["bayes_ne"], ls="--", color="red", label="Bayes NE")
    lo = min(result["bayes_ne"], *result["ne"].values())
    a.set_ylim(lo - 0.02, max(result["ne"].values()) + 0.02)
    a.set_ylabel("held-out NE (mean of click, conversion)")
    a.legend()
    b.bar(["kd", "loopfm"], [result["transfer_ratio_kd"], result["transfer_ratio_loopfm"]],
          color=["tab:blue", "tab:green"])
    b.set_ylabel("transfer ratio")
    b.set_title("(NE_base - NE_student) / (NE_base - NE_FM)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())

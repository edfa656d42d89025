"""Cross-block traffic of the topology-aware plan against a topology-unaware one, on simulated clusters.

    python -m benchmarks.parallel [--quick]

For each simulated cluster, auto_plan (gem/parallel/plan.py) chooses a plan from a GEM-like
workload as the trainer and the operator do on the DeepSpeed path (ZeRO-3: the dimensions
deepspeed_auto_dims allows, so ep = sparse_shard = 1); gem/parallel/comm_model.py counts the bytes
every collective of one training step moves on each network level, as DeepSpeed runs them:

  chosen    the auto plan (HSDP -> ZeRO++ hpZ), ranks placed by Kueue TAS (consecutive node ranks fill a block)
  unaware   what a topology-blind setup does with the same tp/cp: ZeRO-3 over every data rank
            (no hpZ), nodes placed in arbitrary order
  variants  one change at a time: the chosen plan with arbitrary placement; the chosen degrees
            with the mesh axes in reverse order (dp_replicate innermost); the unaware plan placed
            by Kueue TAS (separates the plan's share of the saving from the placement's)
  hsdpModel the same two plans counted as an ideal HSDP (FSDP2) would run them (zero_model="hsdp"):
            what DeepSpeed's whole-data-group ZeRO costs against it

`cross_block_bytes_ratio` = unaware / chosen bytes on links that leave a block (summed over the job);
`busiestRankCrossBlockBytes` is what the busiest rank sends out of its block (a ring's pace). Writes
benchmarks/results/parallel.json and .png. A model, not a measurement: see docs/parallelism.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gem.parallel.comm_model import (  # noqa: E402
    Workload,
    comm_seconds,
    cross_block_bytes,
    level_totals,
    shuffled_nodes,
    step_counts,
)
from gem.parallel.plan import MESH_AXES, ModelShapeHints, ParallelPlan, auto_plan, deepspeed_auto_dims  # noqa: E402
from gem.parallel.topology import Topology  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"

#: A GEM-scale model (GEM-26: billions of dense params, 1K+ examples per GPU; histories up to tens
#: of thousands of events). The numbers are assumptions of this benchmark, not GEM's.
HINTS = ModelShapeHints(dense_params=1_500_000_000, hidden_dim=8192, num_experts=8, expert_params=100_000_000,
                        max_seq_len=32768, sparse_params=128_000_000_000, gpu_memory_bytes=80 * 2**30)
WORKLOAD = Workload(dense_params=HINTS.dense_params, tp_fraction=0.6, num_experts=HINTS.num_experts,
                    expert_params=HINTS.expert_params, examples_per_rank=1024, tokens_per_example=2048,
                    interaction_tokens=64, d_model=512, tp_layers=8, expert_layers=4, seq_layers=4,
                    sparse_lookups_per_example=512, sparse_dim=128)
#: The trainer's stage for a model this size (the state of 1.5 B params does not fit one GPU replicated).
ZERO_STAGE = 3

CLUSTERS = [
    # name, GPUs, GPUs per node, levels above the node (name, nodes per domain)
    ("1024gpu-8pernode-32perblock", 1024, 8, [("block", 32)]),
    ("4096gpu-8pernode-32perblock-256perzone", 4096, 8, [("block", 32), ("zone", 256)]),
    ("1152gpu-4pernode-nvl72clique-144perblock", 1152, 4, [("clique", 18), ("block", 144)]),
]
QUICK = CLUSTERS[:1]
COLORS = {"node": "tab:blue", "clique": "tab:cyan", "block": "tab:orange", "zone": "tab:purple", "cluster": "tab:red"}


def _measure(plan: ParallelPlan, topo: Topology, zero_model: str = "deepspeed", **layout) -> dict:
    # zero_model "deepspeed" (default): what the trainer runs; "hsdp": the ideal, for comparison
    per, busiest = step_counts(plan, topo, WORKLOAD, zero_model=zero_model, **layout)
    return {"plan": plan.to_dict(), "bytes": per, "levelTotals": level_totals(per),
            "crossBlockBytes": cross_block_bytes(per, topo), "commSecondsEstimate": comm_seconds(per, topo),
            "busiestRankCrossBlockBytes": busiest}


def run_cluster(name: str, gpus: int, per_node: int, levels: list[tuple[str, int]]) -> dict:
    topo = Topology.simulated(num_gpus=gpus, gpus_per_node=per_node, nodes_per_level=levels)
    allowed, why_not = deepspeed_auto_dims(ZERO_STAGE)  # what job.choose_plan allows the DeepSpeed path
    plan, reason = auto_plan(gpus, topo, HINTS, zero_stage=ZERO_STAGE, allowed=allowed, why_not=why_not)
    unaware_plan = ParallelPlan(world_size=gpus, dp_replicate=1, dp_shard=-1, ep=plan.ep, cp=plan.cp, tp=plan.tp,
                                sparse_shard=plan.sparse_shard, zero_stage=plan.zero_stage)
    shuffled = shuffled_nodes(topo.num_nodes, seed=0)
    chosen = {**_measure(plan, topo), "reason": reason, "groupLevels": plan.group_levels(topo)}
    unaware = {**_measure(unaware_plan, topo, node_order=shuffled),
               "description": "ZeRO-3 over every data rank (no HSDP, so no hpZ), nodes in arbitrary order"}
    variants = {
        "chosenPlanArbitraryPlacement": _measure(plan, topo, node_order=shuffled),
        "chosenDegreesReversedAxes": _measure(plan, topo, axis_order=tuple(reversed(MESH_AXES))),
        "unawarePlanTopologyPlacement": _measure(unaware_plan, topo),
    }
    base = chosen["crossBlockBytes"]
    for v in (unaware, *variants.values()):
        v["crossBlockBytesRatio"] = v["crossBlockBytes"] / base if base else None
    hsdp = {}
    for key, p, layout in (("chosen", plan, {}), ("unaware", unaware_plan, {"node_order": shuffled})):
        m = _measure(p, topo, zero_model="hsdp", **layout)
        hsdp[key + "CrossBlockBytes"] = m["crossBlockBytes"]
        hsdp[key + "BusiestRankCrossBlockBytes"] = m["busiestRankCrossBlockBytes"]
    hsdp["crossBlockBytesRatio"] = hsdp["unawareCrossBlockBytes"] / hsdp["chosenCrossBlockBytes"]
    return {"name": name, "topology": topo.to_dict(), "chosen": chosen, "unaware": unaware, "variants": variants,
            "hsdpModel": hsdp, "cross_block_bytes_ratio": unaware["crossBlockBytesRatio"]}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.5), squeeze=False)
    for ax, res in zip(axes[0], results):
        levels = [lv["name"] for lv in res["topology"]["levels"]]
        rows = [("chosen", res["chosen"]), ("unaware", res["unaware"]),
                ("chosen plan,\narbitrary nodes", res["variants"]["chosenPlanArbitraryPlacement"]),
                ("reversed\naxes", res["variants"]["chosenDegreesReversedAxes"]),
                ("unaware plan,\nTAS nodes", res["variants"]["unawarePlanTopologyPlacement"])]
        bottom = [0.0] * len(rows)
        for level in levels:
            vals = [r["levelTotals"].get(level, 0.0) / 1e12 for _, r in rows]
            ax.bar([n for n, _ in rows], vals, bottom=bottom, label=level, color=COLORS.get(level))
            bottom = [b + v for b, v in zip(bottom, vals)]
        busiest = res["unaware"]["busiestRankCrossBlockBytes"] / res["chosen"]["busiestRankCrossBlockBytes"]
        ax.set_title(f"{res['name']} (DeepSpeed ZeRO-{res['chosen']['plan']['zeroStage']})\ncross-block bytes ratio "
                     f"{res['cross_block_bytes_ratio']:.1f}x, busiest rank {busiest:.1f}x", fontsize=9)
        ax.set_ylabel("TB per step (all ranks)")
        ax.tick_params(axis="x", labelsize=8)
        ax.legend(title="link level", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="only the 1024-GPU cluster")
    p.add_argument("--out", type=Path, default=RESULTS / "parallel.json")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    results = [run_cluster(*c) for c in (QUICK if args.quick else CLUSTERS)]
    doc = {
        "benchmark": "parallel",
        "model": "DeepSpeed 0.19 ZeRO groups (comm_model.py); ring collectives in group order; bytes counted at "
                 "the innermost level holding both ends; bf16",
        "zeroStage": ZERO_STAGE,
        "hints": asdict(HINTS),
        "workload": asdict(WORKLOAD),
        "clusters": results,
        # headline: the first (1024-GPU) cluster; every cluster also has its own
        "cross_block_bytes_ratio": results[0]["cross_block_bytes_ratio"],
        "seconds": round(time.perf_counter() - t0, 2),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    plot(results, args.out.with_suffix(".png"))
    for res in results:
        c, u = res["chosen"], res["unaware"]
        print(f"{res['name']}: chosen {c['plan']} cross-block {c['crossBlockBytes'] / 1e12:.2f} TB/step, "
              f"unaware {u['crossBlockBytes'] / 1e12:.2f} TB/step -> ratio {res['cross_block_bytes_ratio']:.1f}x "
              f"(ideal HSDP: {res['hsdpModel']['crossBlockBytesRatio']:.1f}x)")
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The GEM model's speed on this machine, measured side by side in one process.

    python -m benchmarks.model [--quick | --smoke] [--out benchmarks/results/model.json]

Every figure is a ratio of two things timed in the same process and the same rounds: each
round runs every contender once, in turn, and each contender's time is its best round (the
least disturbed by other processes on a shared machine; medians are in the details). Each
measured figure has its ideal beside it, from FLOP counts (gem/modules FLOP counters, matmul
work only). The machine's load average before and after is recorded: with more runnable
processes than cores, every multi-threaded op can wait a scheduler slice for its second thread,
which penalises many small ops (the jagged side) far more than a few big ones.

Reference workload (the issue's): batch 64, 4 heads, head dim 32, history lengths
LogNormal(mu=5, sigma=1) rounded and clipped to [8, 2048], seed 0. `--smoke` (a structure check
whose figures mean nothing) runs every contender once, without a warm-up, on 8 sequences clipped
to 256 events and block-attention lengths 8x shorter.

  jagged_attention_speedup      padded SDPA / jagged full attention (tiled, length buckets)
  block_attention_scaling       block attention time per sequence, L=16384 over L=2048
  compskip_flop_reduction       1 - FLOPs(CompSkip on) / FLOPs(off), `small`, counted
  pffn_forward_speedup          forward of `small` with a 4d-wide per-token FFN / with the PFFN
                                (the same block, norms and activation; only the FFN differs)
  train_step_speedup_vs_padded  padded-attention GEM step / GEM step (`small`, fwd+bwd+AdamW)
  mfu                           GEM step FLOPs (3 x forward) / time / fastest measured matmul peak

Precision: every model and kernel is timed in fp32 and in bf16 (autocast) in the same rounds;
both sides of a ratio use the one precision in which they are fastest together (`chosen`), and
MFU uses GEM's faster step; all times are in the JSON. A CPU without native bf16 matmuls (AVX2 only:
PyTorch then runs bf16 GEMMs at ~0.25 GFLOP/s, hundreds of times slower than fp32) would spend hours
on contenders that can never win: a probe matmul decides first, and bf16 is skipped (and the
reason recorded) when it is more than 2x slower than fp32. MFU is measured against the fastest
dense matmul the machine ran (bf16 where it has it). Writes the JSON and a PNG beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import machine  # noqa: E402
from gem.baselines import PaddedKunlunModel  # noqa: E402
from gem.modules import PRESETS, KunlunModel  # noqa: E402
from gem.modules.inputs import random_inputs  # noqa: E402
from gem.ops import block_attention, jagged_attention, plan_blocks, plan_buckets  # noqa: E402
from gem.ops.common import offsets_of, with_zero_row  # noqa: E402
from gem.ops.rotary import rotary_cos_sin  # noqa: E402
from gem.ops.testing import random_lengths  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
BATCH, HEADS, HEAD_DIM, SEED = 64, 4, 32, 0
MAX_LEN = 2048
SMOKE_BATCH, SMOKE_MAX_LEN = 8, 256
BLOCK_LENGTHS, SMOKE_BLOCK_LENGTHS = (2048, 16384), (256, 2048)  # short, long: block_attention_scaling
EVENT_TYPE_PROBS = (0.5, 0.35, 0.15)  # impression, click, conversion: half the events in each tier

TARGETS = {
    "jagged_attention_speedup": (">=", 10.0),
    "block_attention_scaling": ("<=", 10.0),
    "compskip_flop_reduction": (">=", 0.40),
    "pffn_forward_speedup": (">=", 2.0),
    "train_step_speedup_vs_padded": (">=", 3.0),
    "mfu": (">=", 0.20),
}


# --------------------------------------------------------------------------- timing


WARMUP = 1  # calls of every contender before the timed rounds; set by main() (0 for --smoke)


def rounds(fns: dict[str, Callable[[], object]], *, num_rounds: int, warmup: int | None = None) -> dict[str, list[float]]:
    """Seconds per call of every fn, num_rounds times, interleaved (one call of each per round)."""
    for _ in range(WARMUP if warmup is None else warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(num_rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def paired_ratio(times: dict[str, list[float]], num: str, den: str) -> float:
    """best(times[num]) / best(times[den])."""
    return best(times, num) / best(times, den)


def best(times: dict[str, list[float]], name: str) -> float:
    return min(times[name])


def summary(times: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {k: {"best_s": min(v), "median_s": statistics.median(v)} for k, v in times.items()}


def matmul_peak_fns(dtypes: tuple[str, ...]) -> dict[str, Callable[[], object]]:
    """A large square matmul in every timed precision: the machine's measured matmul peak."""
    n = 2048
    a32, b32 = torch.randn(n, n), torch.randn(n, n)
    fns = {"peak_fp32": lambda: a32 @ b32}
    if "bf16" in dtypes:
        a16, b16 = a32.bfloat16(), b32.bfloat16()
        fns["peak_bf16"] = lambda: a16 @ b16
    return fns


PEAK_FLOPS = 2.0 * 2048**3
BF16_MAX_SLOWDOWN = 2.0  # native bf16 (AMX, AVX512-BF16) is faster than fp32; emulated is not


def precision_probe(n: int = 512, reps: int = 3) -> dict:
    """Which precisions to time: bf16 only where its matmul is not far slower than fp32's."""
    a = torch.randn(n, n)
    b = a.bfloat16()
    times = {}
    for name, x in (("fp32", a), ("bf16", b)):
        x @ x
        t = []
        for _ in range(reps):
            t0 = time.perf_counter()
            x @ x
            t.append(time.perf_counter() - t0)
        times[name] = min(t)
    slowdown = times["bf16"] / times["fp32"]
    use = slowdown <= BF16_MAX_SLOWDOWN
    return {"dtypes": ["fp32", "bf16"] if use else ["fp32"], "probe_matmul": n,
            "probe_seconds": times, "bf16_over_fp32": slowdown,
            "bf16": "timed" if use else (f"skipped: a {n}^3 bf16 matmul is {slowdown:.0f}x slower than fp32 "
                                         f"(no native bf16 on this CPU: {torch.backends.cpu.get_cpu_capability()})")}


DTYPES: tuple[str, ...] = ("fp32", "bf16")  # set by main() from precision_probe()
TORCH_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}


def fastest(times: dict[str, list[float]], prefix: str) -> str:
    """The faster of f"{prefix}_{dtype}" over the timed precisions."""
    return min((f"{prefix}_{dt}" for dt in DTYPES), key=lambda k: best(times, k))


def common_precision(times: dict[str, list[float]], *prefixes: str) -> dict[str, str]:
    """f"{prefix}_{dtype}" of every prefix in the one precision where they are fastest together.
    A ratio of two sides timed in different precisions would credit one side with the precision
    change (e.g. bf16 jagged over fp32 padded), not with its algorithm."""
    dt = min(DTYPES, key=lambda d: sum(best(times, f"{p}_{d}") for p in prefixes))
    return {p: f"{p}_{dt}" for p in prefixes}


# --------------------------------------------------------------------------- workloads


def reference_lengths(batch: int = BATCH, max_len: int = MAX_LEN) -> torch.Tensor:
    return random_lengths(torch.Generator().manual_seed(SEED), batch, max_len=max_len)


def bench_jagged_attention(num_rounds: int, batch: int = BATCH, max_len: int = MAX_LEN) -> dict:
    lengths = reference_lengths(batch, max_len)
    offsets = offsets_of(lengths)
    total, max_len = int(offsets[-1]), int(lengths.max())
    g = torch.Generator().manual_seed(SEED)
    q, k, v = (torch.randn(total, HEADS, HEAD_DIM, generator=g) for _ in range(3))
    qkv = {torch.float32: (q, k, v), torch.bfloat16: tuple(x.bfloat16() for x in (q, k, v))}
    loop_dtype = TORCH_DTYPE[DTYPES[-1]]
    p = torch.arange(max_len)
    valid = p[None, :] < lengths[:, None]  # [B, Lmax]
    rows = torch.where(valid, offsets[:-1, None] + p[None, :], total)

    def padded(dtype):
        def run():
            qp, kp, vp = (with_zero_row(x).index_select(0, rows.reshape(-1)).view(batch, max_len, HEADS, HEAD_DIM)
                          .transpose(1, 2) for x in qkv[dtype])
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=valid[:, None, None, :])
            return o.transpose(1, 2).reshape(-1, HEADS, HEAD_DIM)[valid.reshape(-1)]
        return run

    def jagged(dtype):
        return lambda: jagged_attention(*qkv[dtype], offsets)  # bucket planning included

    def loop():
        return torch.cat([F.scaled_dot_product_attention(*(x[int(offsets[b]):int(offsets[b + 1])].transpose(0, 1)
                                                           for x in qkv[loop_dtype])).transpose(0, 1)
                          for b in range(batch)])

    fns = {f"{name}_{dt}": make(TORCH_DTYPE[dt]) for name, make in (("padded", padded), ("jagged", jagged))
           for dt in DTYPES}
    fns[f"per_sequence_loop_{DTYPES[-1]}"] = loop
    times = rounds(fns, num_rounds=num_rounds)
    chosen = common_precision(times, "padded", "jagged")
    best_padded, best_jagged = chosen["padded"], chosen["jagged"]
    # Same outputs: the fast path against the padded one, in fp32 and in the precision the ratio timed.
    timed = best_jagged.removeprefix("jagged_")
    err = {f"jagged_attention_max_abs_err_{dt}": (jagged(TORCH_DTYPE[dt])().float() - padded(TORCH_DTYPE[dt])().float())
           .abs().max().item() for dt in dict.fromkeys(("fp32", timed))}
    pairs = float((lengths.double() ** 2).sum())
    buckets = plan_buckets(offsets)
    tiled_pairs = sum(bk.size * bk.q_len * bk.k_len for bk in buckets.buckets)
    return {
        "jagged_attention_speedup": paired_ratio(times, best_padded, best_jagged),
        "jagged_attention_ideal": batch * max_len**2 / pairs,
        "jagged_attention_tile_ideal": batch * max_len**2 / tiled_pairs,
        **err,
        "jagged_attention_num_buckets": len(buckets),
        "seconds": summary(times),
        "chosen": {"padded": best_padded, "jagged": best_jagged},
        "total_tokens": total, "max_len": max_len,
    }


def bench_block_scaling(num_rounds: int, short: int = 2048, long: int = 16384) -> dict:
    n_short = long // short  # the same number of tokens on both sides
    out: dict = {}
    fns = {}
    for name, L, n in (("short", short, n_short), ("long", long, 1)):
        offsets = offsets_of(torch.full((n,), L, dtype=torch.int64))
        g = torch.Generator().manual_seed(SEED)
        q, k, v = (torch.randn(n * L, HEADS, HEAD_DIM, generator=g).bfloat16() for _ in range(3))
        phase = torch.rand(n * L, generator=g) * 100
        plan, cs = plan_blocks(offsets, 64), rotary_cos_sin(phase, HEAD_DIM, base=10000.0, dtype=torch.bfloat16)
        for dt in DTYPES:
            x = tuple(t.to(TORCH_DTYPE[dt]) for t in (q, k, v))
            cs_d = tuple(t.to(TORCH_DTYPE[dt]) for t in cs)
            fns[f"{name}_{dt}"] = (
                lambda x=x, o=offsets, p=phase, pl=plan, c=cs_d: block_attention(*x, o, rotary_phase=p, plan=pl,
                                                                                    rotary_cos_sin=c))
    times = rounds(fns, num_rounds=num_rounds)
    dt = min(DTYPES, key=lambda d: best(times, f"long_{d}") + best(times, f"short_{d}"))
    # time per sequence: long / 1 over short / n_short
    out["block_attention_scaling"] = paired_ratio(times, f"long_{dt}", f"short_{dt}") * n_short
    out["block_attention_ideal"] = long / short
    out["seconds"] = summary(times)
    out["dtype"] = dt
    return out


def _inputs(cfg, batch: int = BATCH, max_len: int = MAX_LEN):
    return random_inputs(cfg, reference_lengths(batch, max_len), seed=SEED, type_probs=EVENT_TYPE_PROBS)


def bench_compskip(batch: int = BATCH, max_len: int = MAX_LEN) -> dict:
    cfg = PRESETS["small"]
    inputs = _inputs(cfg, batch, max_len)
    torch.manual_seed(0)
    on, off = KunlunModel(cfg), KunlunModel(dataclasses.replace(cfg, compskip=False))
    lengths = on.tier_lengths(inputs)
    f_on, f_off = on.flops(lengths), off.flops(lengths)
    return {
        "compskip_flop_reduction": 1 - sum(f_on.values()) / sum(f_off.values()),
        "flops_per_example_on": {k: v / batch for k, v in f_on.items()},
        "flops_per_example_off": {k: v / batch for k, v in f_off.items()},
    }


def _autocast(dtype: str):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")


def bench_pffn(num_rounds: int, batch: int = BATCH, max_len: int = MAX_LEN) -> dict:
    cfg = PRESETS["small"]
    inputs = _inputs(cfg, batch, max_len)
    models = {}
    for name, c in (("pffn", cfg), ("token_ffn_4d", dataclasses.replace(cfg, seq_ffn="token_ffn", token_ffn_mult=4)),
                    ("token_ffn_1d", dataclasses.replace(cfg, seq_ffn="token_ffn", token_ffn_mult=1))):
        torch.manual_seed(0)
        models[name] = KunlunModel(c).eval()
    lengths = models["pffn"].tier_lengths(inputs)
    flops = {k: sum(m.flops(lengths).values()) for k, m in models.items()}

    def fwd(model, dtype):
        def run():
            with torch.no_grad(), _autocast(dtype):
                return model(inputs)
        return run

    fns = {f"{k}_{dt}": fwd(m, dt) for k, m in models.items() for dt in DTYPES}
    times = rounds(fns, num_rounds=num_rounds)
    best = common_precision(times, *models)
    return {
        "pffn_forward_speedup": paired_ratio(times, best["token_ffn_4d"], best["pffn"]),
        "pffn_forward_ideal": flops["token_ffn_4d"] / flops["pffn"],
        "pffn_forward_speedup_vs_ffn_hidden_d": paired_ratio(times, best["token_ffn_1d"], best["pffn"]),
        "pffn_forward_ideal_vs_ffn_hidden_d": flops["token_ffn_1d"] / flops["pffn"],
        "forward_flops": flops, "seconds": summary(times), "chosen": best,
    }


def _train_step(model, inputs, dtype: str):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        with _autocast(dtype):
            loss, _ = model.loss(inputs)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def bench_train_step(num_rounds: int, batch: int = BATCH, max_len: int = MAX_LEN) -> dict:
    cfg = PRESETS["small"]
    inputs = _inputs(cfg, batch, max_len)
    torch.manual_seed(0)
    gem = KunlunModel(cfg)
    torch.manual_seed(0)
    padded = PaddedKunlunModel(cfg)
    lengths = gem.tier_lengths(inputs)
    step_flops = {"gem": 3 * sum(gem.flops(lengths).values()), "padded": 3 * sum(padded.flops(lengths).values())}
    fns = {f"{name}_{dt}": _train_step(m, inputs, dt) for name, m in (("gem", gem), ("padded", padded))
           for dt in DTYPES}
    fns.update(matmul_peak_fns(DTYPES))
    times = rounds(fns, num_rounds=num_rounds)
    chosen = common_precision(times, "gem", "padded")
    best_gem, best_padded = chosen["gem"], chosen["padded"]
    # MFU: GEM's fastest step's achieved FLOP rate over the fastest matmul peak measured in the same rounds.
    mfu_step, peak = fastest(times, "gem"), fastest(times, "peak")
    mfu = (step_flops["gem"] / best(times, mfu_step)) / (PEAK_FLOPS / best(times, peak))
    return {
        "train_step_speedup_vs_padded": paired_ratio(times, best_padded, best_gem),
        "train_step_ideal_vs_padded": step_flops["padded"] / step_flops["gem"],
        "mfu": mfu,
        "mfu_ideal": 1.0,
        "step_flops": step_flops,
        "achieved_gflops": step_flops["gem"] / best(times, mfu_step) / 1e9,
        "peak_dtype": peak.removeprefix("peak_"),
        **{f"{k}_gflops": PEAK_FLOPS / best(times, k) / 1e9 for k in fns if k.startswith("peak_")},
        "seconds": summary(times), "chosen": {"gem": best_gem, "padded": best_padded, "mfu_step": mfu_step},
        "tokens_per_tier": {k: int(v.sum()) for k, v in lengths.items()},
    }


# --------------------------------------------------------------------------- report


def check(results: dict) -> dict[str, dict]:
    out = {}
    for key, (op, target) in TARGETS.items():
        value = results[key]
        ok = value >= target if op == ">=" else value <= target
        out[key] = {"value": value, "target": f"{op} {target}", "met": bool(ok)}
    return out


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [("jagged attention\nspeedup", "jagged_attention_speedup", "jagged_attention_ideal"),
            ("block attention\nscaling {long}/{short}", "block_attention_scaling", "block_attention_ideal"),
            ("PFFN forward\nspeedup", "pffn_forward_speedup", "pffn_forward_ideal"),
            ("train step vs\npadded", "train_step_speedup_vs_padded", "train_step_ideal_vs_padded")]
    r = doc["results"]
    rows = [(n.format(**doc["workload"].get("block_attention_lengths", {})), m, i) for n, m, i in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1]})
    ax = axes[0]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r[m] for _, m, _ in rows], 0.4, label="measured")
    ax.bar([i + 0.2 for i in x], [r[i_] for _, _, i_ in rows], 0.4, label="ideal (FLOP count)", alpha=0.6)
    for i, (_, m, _) in enumerate(rows):
        op, t = TARGETS[m]
        ax.hlines(t, i - 0.4, i + 0.4, colors="k", linestyles="dashed")
    ax.set_xticks(list(x), [n for n, _, _ in rows])
    ax.set_yscale("log")
    ax.set_ylabel("ratio (dashed: target)")
    ax.legend()
    ax = axes[1]
    ax.bar([0, 1], [r["compskip_flop_reduction"], r["mfu"]], color=["tab:green", "tab:purple"])
    ax.hlines([0.40, 0.20], [-0.4, 0.6], [0.4, 1.4], colors="k", linestyles="dashed")
    ax.set_xticks([0, 1], ["CompSkip\nFLOP cut", "MFU"])
    ax.set_ylim(0, 1)
    fig.suptitle(f"GEM model benchmarks ({doc['machine']['cpu_threads']} threads, {doc['machine']['torch']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds (noisier figures)")
    p.add_argument("--smoke", action="store_true",
                   help=f"a structure check: one call of each contender, batch {SMOKE_BATCH} clipped to "
                        f"{SMOKE_MAX_LEN}, block attention {SMOKE_BLOCK_LENGTHS[1]}/{SMOKE_BLOCK_LENGTHS[0]} "
                        "(the figures mean nothing)")
    p.add_argument("--out", type=Path, default=RESULTS / "model.json")
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op threads (default: PyTorch's). On a machine loaded past its cores, 1 thread "
                        "never waits a scheduler slice for a second one, so its ratios are far less noisy")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    n = 1 if args.smoke else 2 if args.quick else 5
    batch, max_len = (SMOKE_BATCH, SMOKE_MAX_LEN) if args.smoke else (BATCH, MAX_LEN)
    short, long = SMOKE_BLOCK_LENGTHS if args.smoke else BLOCK_LENGTHS
    t0 = time.time()
    load_before = os.getloadavg()
    global DTYPES, WARMUP
    WARMUP = 0 if args.smoke else 1
    precision = precision_probe()
    DTYPES = tuple(precision["dtypes"])
    print(f"precisions timed: {DTYPES} (bf16 {precision['bf16']})", flush=True)
    parts = {}
    parts["jagged_attention"] = bench_jagged_attention(n, batch, max_len)
    print("jagged attention done", flush=True)
    parts["block_attention"] = bench_block_scaling(n, short, long)
    print("block attention done", flush=True)
    parts["compskip"] = bench_compskip(batch, max_len)
    parts["pffn"] = bench_pffn(n, batch, max_len)
    print("pffn done", flush=True)
    parts["train_step"] = bench_train_step(1 if args.smoke else max(2, n - 1), batch, max_len)
    results = {k: v for part in parts.values() for k, v in part.items() if isinstance(v, (int, float))}
    doc = {
        "command": "python -m benchmarks.model" + (" --smoke" if args.smoke else " --quick" if args.quick else "")
                   + (f" --threads {args.threads}" if args.threads else ""),
        "machine": {"cpu_threads": torch.get_num_threads(), "torch": torch.__version__,
                    **machine.cpu(), "precision": precision,
                    "load_average_before": [round(x, 2) for x in load_before],
                    "load_average_after": [round(x, 2) for x in os.getloadavg()]},
        "workload": {"batch": batch, "heads": HEADS, "head_dim": HEAD_DIM, "seed": SEED,
                     "block_attention_lengths": {"short": short, "long": long},
                     "lengths": f"LogNormal(5, 1) rounded, clipped to [8, {max_len}]", "model": "small",
                     "event_type_probs": dict(zip(("impression", "click", "conversion"), EVENT_TYPE_PROBS))},
        "targets": check(results),
        "results": results,
        "details": parts,
        "wall_seconds": round(time.time() - t0, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1, allow_nan=False, default=float) + "\n")
    plot(doc, args.out.with_suffix(".png"))
    print(json.dumps(doc["targets"], indent=1))
    return 0 if all(t["met"] for t in doc["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Precision (gem/train/precision.py): MXFP8 via torchao close to bf16; bf16/mxfp8 training under ZeRO 0-3."""

import copy
import json
import re

import pytest
import torch
import yaml

from gem.api.types import ModelSpec, SyntheticDataSpec
from gem.data import build_splits, make_batch
from gem.model import GEMModel, config_from_spec

torchao = pytest.importorskip("torchao")

from gem.train.precision import MXFP8Linear, apply_precision  # noqa: E402


def tiny_model_and_batch():
    torch.manual_seed(0)
    model = GEMModel(config_from_spec(ModelSpec(preset="tiny"))).eval()
    train, _ = build_splits(SyntheticDataSpec(num_users=100, num_ads=40, num_train_examples=256,
                                              num_eval_examples=8, mean_history_len=16))
    return model, make_batch(train, torch.arange(256).numpy(), max_seq_len=64)


def test_mxfp8_swaps_attention_and_mlp_linears_only():
    model, _ = tiny_model_and_batch()
    keys = set(model.state_dict())
    apply_precision(model, "mxfp8")
    swapped = [n for n, m in model.named_modules() if isinstance(m, MXFP8Linear)]
    # attention projections (w_q / w_kv / w_qkv / wq / wkv, whatever the model calls them) are in MXFP8
    assert any(re.search(r"(^|\.)w_?(q|kv|qkv)$", n) for n in swapped), swapped
    # every linear with MX-sized widths is swapped; the others (e.g. 2 -> d dense input) are not
    for n, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            eligible = m.in_features % 32 == 0 and m.out_features % 32 == 0
            assert isinstance(m, MXFP8Linear) == eligible, n
    assert set(model.state_dict()) == keys  # checkpoints unchanged
    assert apply_precision(model, "bf16") is model


def test_mxfp8_outputs_close_to_bf16_and_gradients_flow():
    model, batch = tiny_model_and_batch()
    mx = apply_precision(copy.deepcopy(model), "mxfp8")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model(batch)
        out = mx(batch)
    with torch.no_grad():
        fp32 = model(batch)
    for task in ref:
        r, o, f = ref[task].float(), out[task].float(), fp32[task].float()
        # errors relative to the spread of the logits over the batch (their mean is mostly a bias)
        rel_mx = float((o - r).std() / r.std())
        rel_bf16 = float((r - f).std() / f.std())
        dp = float((torch.sigmoid(o) - torch.sigmoid(r)).abs().max())
        corr = float(torch.corrcoef(torch.stack([r, o]))[0, 1])
        print(f"{task}: std(mxfp8 - bf16) / std(bf16) = {rel_mx:.4f} (bf16 vs fp32: {rel_bf16:.4f}); "
              f"max |p_mxfp8 - p_bf16| = {dp:.4f}; corr = {corr:.4f}; logit std {float(r.std()):.4f}")
        assert dp < 0.02 and rel_mx < 0.25 and corr > 0.97, (task, dp, rel_mx, corr)
    mx.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = sum(v.float().mean() for v in mx(batch).values())
    loss.backward()
    grads = [p.grad for p in mx.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads if g is not None)
    first = next(m for m in mx.modules() if isinstance(m, MXFP8Linear))
    assert first.weight.grad is not None and first.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("precision,zero", [("bf16", 0), ("bf16", 1), ("bf16", 2), ("bf16", 3),
                                            ("mxfp8", 3)])
def test_training_runs(tmp_path, trainer_env, precision, zero):
    from gem import cli

    name = f"p-{precision}-z{zero}"
    obj = {"apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": name},
           "spec": {"model": {"preset": "tiny"},
                    "data": {"synthetic": {"numUsers": 100, "numAds": 64, "numTrainExamples": 512,
                                           "numEvalExamples": 128, "meanHistoryLen": 8}},
                    "training": {"steps": 4, "batchSize": 32, "warmupSteps": 1, "precision": precision},
                    "parallelism": {"zeroStage": zero},
                    "checkpoint": {"path": str(tmp_path / "ckpt"), "everySteps": 100},
                    "mlflow": {"enabled": False}}}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(obj))
    assert cli.main(["train", "--config", str(path)]) == 0
    report = json.loads((tmp_path / "termination-log").read_text())
    assert report["step"] == 4 and report["metrics"]["loss"] is not None and report["metrics"]["loss"] < 5


def _tp_shards_of_an_mxfp8_linear(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.nn import functional as F

    from gem.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    linear = MXFP8Linear.from_linear(torch.nn.Linear(64, 64))
    x = torch.randn(16, 64)
    col = ColumnParallelLinear.from_linear(linear, dist.group.WORLD, gather_output=True)  # 32 outputs each
    row = RowParallelLinear.from_linear(linear, dist.group.WORLD)  # 32 inputs each
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        full, plain = linear(x).float(), F.linear(x, linear.weight, linear.bias).float()
        col_out, row_out = col(x).float(), row(x.chunk(world, dim=-1)[rank]).float()

    def rel(a: torch.Tensor) -> float:
        return float((a - full).norm() / full.norm())

    return {"column": rel(col_out), "row": rel(row_out), "plain": rel(plain)}


def test_tensor_parallel_shards_of_an_mxfp8_linear_stay_mxfp8():
    """tp replaces the layers it splits: their shards must keep the MXFP8 matmul (the attention
    projections and FFNs tp splits are the layers mxfp8 is for), not fall back to a bf16 F.linear."""
    from gem.parallel.testing import run_distributed

    for res in run_distributed(_tp_shards_of_an_mxfp8_linear, 2, timeout=120):
        assert res["plain"] > 0.01, res  # MXFP8's own error: what a bf16 shard would differ by
        assert res["column"] == 0.0, res  # the same blocks of 32 along the inputs: the same numbers
        assert res["row"] < 0.2 * res["plain"], res  # bf16 partial sums, all-reduced

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
    # every linear with MX-sized widths outside the prediction heads is swapped; the others
    # (e.g. the 2 -> d dense input, the heads' input projections) are not
    for n, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            eligible = m.in_features % 32 == 0 and m.out_features % 32 == 0
            in_heads = any(part.endswith("heads") for part in n.split("."))
            assert isinstance(m, MXFP8Linear) == (eligible and not in_heads), n
    assert set(model.state_dict()) == keys  # checkpoints unchanged
    assert apply_precision(model, "bf16") is model


def test_mxfp8_keeps_a_loopfm_students_memory_reader_out():
    """A LoopFM student's `memory_score` B_t gives the logit term cand · B_t mem directly, like a head:
    it stays bf16 under mxfp8 even at MX-sized widths, while the student's MLP goes to MXFP8."""
    from gem.api.types import StudentSpec
    from gem.loopfm.student import LoopFMStudent

    student = LoopFMStudent(StudentSpec(embedding_dim=32, hidden_dim=64, max_seq_len=8), memory_dim=32)
    assert student.memory_score is not None
    apply_precision(student, "mxfp8")
    readers = dict(student.memory_score.items())
    assert readers and all(type(lin) is torch.nn.Linear for lin in readers.values()), readers
    assert any(isinstance(m, MXFP8Linear) for n, m in student.named_modules() if n.startswith("mlp")), \
        [n for n, m in student.named_modules() if isinstance(m, torch.nn.Linear)]


def test_mxfp8_keeps_the_prediction_heads_out():
    """The heads' input projection (flattened summary tokens -> head hidden) reaches the logits with no
    norm in between: torchtitan keeps its final projection ("output") out of MX for the same reason.
    It must stay bf16 even where its widths happen to be multiples of 32 (736 -> 64 in tiny)."""
    model, batch = tiny_model_and_batch()
    heads = [(n, m) for n, m in model.named_modules() if n in ("heads.inp", "wide_heads.inp")]
    assert len(heads) == 2 and all(m.in_features % 32 == 0 and m.out_features % 32 == 0 for _, m in heads)
    mx = apply_precision(copy.deepcopy(model), "mxfp8")
    assert not any(isinstance(m, MXFP8Linear) for n, m in mx.named_modules() if n.split(".")[0].endswith("heads"))
    # much of MXFP8's logit error came from them: 6.7-8.1% of the logits' spread with the heads in
    # MXFP8, 4.9-5.1% without (tiny preset, this batch)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref, out = model(batch), mx(batch)
    for task in ref:
        r, o = ref[task].float(), out[task].float()
        assert float((o - r).std() / r.std()) < 0.06, task


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


def _manifest(tmp_path, name: str, precision: str, zero: int = 1):
    obj = {"apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": name},
           "spec": {"model": {"preset": "tiny"},
                    "data": {"synthetic": {"numUsers": 100, "numAds": 64, "numTrainExamples": 512,
                                           "numEvalExamples": 128, "meanHistoryLen": 8}},
                    "training": {"steps": 4, "batchSize": 32, "warmupSteps": 1, "precision": precision},
                    "parallelism": {"zeroStage": zero},
                    "checkpoint": {"path": str(tmp_path / "ckpt"), "everySteps": 2},
                    "mlflow": {"enabled": False}}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(obj))
    return path


def test_mxfp8_with_a_torchao_lacking_the_mx_api_is_a_config_error(tmp_path, trainer_env, monkeypatch, capsys):
    """torchao installed but without the MXFP8 training op precision.py calls (an older or newer
    torchao: it is prototype API): exit 2 naming spec.training.precision at setup, not an ImportError
    from the first forward (exit 1, and a restart loop under the operator)."""
    import sys

    from gem import cli

    monkeypatch.setitem(sys.modules, "torchao.prototype.moe_training.mxfp8_linear", None)  # its import fails
    assert cli.main(["train", "--config", str(_manifest(tmp_path, "old-ao", "mxfp8"))]) == 2
    err = capsys.readouterr().err
    assert "spec.training.precision" in err and "mxfp8" in err and "torchao" in err, err
    report = json.loads((tmp_path / "termination-log").read_text())
    assert "spec.training.precision" in json.dumps(report)


def _last_json(out: str) -> dict:
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def test_mxfp8_resume_matches_an_uninterrupted_run_and_gem_eval_reproduces_it(tmp_path, trainer_env, monkeypatch,
                                                                              capsys):
    """mxfp8 at ZeRO-1: a run failed after step 2 and resumed ends with the weights and metrics of one
    that was not interrupted; `gem eval` of its checkpoint reports the trainer's final metrics (it
    evaluates in the precision the checkpoint trained in: MX Linears, bf16 weights, bf16 autocast)."""
    from gem import cli
    from gem.train import checkpoint
    from gem.train.trainer import Trainer

    steps_run = []
    train_step = Trainer._train_step
    monkeypatch.setattr(Trainer, "_train_step", lambda self, batch: steps_run.append(1) or train_step(self, batch))
    runs = {}
    for name in ("straight", "resumed"):
        config = _manifest(tmp_path, name, "mxfp8")
        if name == "resumed":
            monkeypatch.setenv("GEM_FAULT_AT_STEP", "2")
            assert cli.main(["train", "--config", str(config)]) == 1
            monkeypatch.delenv("GEM_FAULT_AT_STEP")
        capsys.readouterr()
        steps_run.clear()
        assert cli.main(["train", "--config", str(config)]) == 0
        assert len(steps_run) == (2 if name == "resumed" else 4)  # the resumed run went on from step 2
        report = _last_json(capsys.readouterr().out)
        runs[name] = (report, torch.load(checkpoint.latest_complete(tmp_path / "ckpt/local" / name) / "model.pt"),
                      config)
    (straight, weights, config), (resumed, resumed_weights, _) = runs["straight"], runs["resumed"]
    assert resumed["step"] == 4 and resumed["checkpoint"].endswith("step-00000004")
    assert weights.keys() == resumed_weights.keys()
    assert all(torch.equal(weights[k], resumed_weights[k]) for k in weights)
    assert resumed["metrics"] == straight["metrics"]
    assert cli.main(["eval", "--config", str(config)]) == 0
    evaluated = _last_json(capsys.readouterr().out)
    for key in ("ne", "loss", "ne/click", "auc/click", "ne/conversion"):
        assert evaluated["metrics"][key] == pytest.approx(straight["metrics"][key], abs=1e-6), key


@pytest.mark.parametrize("capability,cuda,kernels,warned", [
    ((9, 0), "12.8", True, "sm_90"),  # H100: no MX tensor cores
    ((10, 0), "12.6", True, "CUDA 12.6"),  # B200 under a CUDA 12.6 torch (the trainer image's default base)
    ((10, 0), "12.8", False, "Triton"),  # torchao defined no MX cast kernels (no Triton)
    ((10, 0), "12.8", True, None),  # B200, CUDA 12.8: the real kernels
])
def test_mxfp8_on_a_gpu_without_mx_kernels_warns_that_it_is_emulated(monkeypatch, caplog, capability, cuda, kernels,
                                                                      warned):
    """An H100 (sm_90) runs mxfp8 emulated, slower than bf16: said at setup, not silently. A B200 (sm_100)
    gets torchao's real kernels only with a torch built for CUDA >= 12.8: torchao defines its MX cast kernels
    only there (and with Triton), and its stubs raise "needs triton" at the first forward; before, any
    sm_100 asked for them. (No GPU here: the device is only asked for its capability and name.)"""
    import logging

    from torchao.prototype.mx_formats import kernels as mx_kernels
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    from gem.train.precision import mx_kernel_preference

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA B200")
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(mx_kernels, "_triton_kernels_available", kernels, raising=False)
    monkeypatch.setattr(mx_kernels, "_mxfp8_cuda_kernels_available", kernels, raising=False)
    model, _ = tiny_model_and_batch()
    gpu = torch.device("cuda", 0)
    with caplog.at_level(logging.INFO, logger="gem.train"):
        apply_precision(model, "mxfp8", device=gpu)
    warnings = [r.getMessage() for r in caplog.records if r.name == "gem.train" and r.levelno == logging.WARNING]
    assert bool(warnings) == bool(warned), warnings
    assert mx_kernel_preference(gpu) == (KernelPreference.EMULATED if warned else KernelPreference.AUTO)
    if warned:
        assert warned in warnings[0] and "emulated" in warnings[0] and "B200" in warnings[0], warnings[0]
    assert mx_kernel_preference(torch.device("cpu")) == KernelPreference.EMULATED


def _fp32_masters_by_name(engine) -> dict:
    """What the optimizer steps, by parameter name: the fp32 tensors the wrapped AdamW updates
    (ZeRO-0: FP16_UnfusedOptimizer hands it fp32 copies, parallel to the module's bf16 parameters),
    or DeepSpeed's assembled fp32 partitions (ZeRO-1 and up)."""
    from deepspeed.utils import safe_get_full_fp32_param

    names = {id(p): n for n, p in engine.module.named_parameters()}
    opt = engine.optimizer
    if engine.zero_optimization_stage() == 0:
        assert type(opt).__name__ == "FP16_UnfusedOptimizer", type(opt)
        pairs = [(lp, hp) for lps, group in zip(opt.fp16_groups, opt.optimizer.param_groups)
                 for lp, hp in zip(lps, group["params"], strict=True)]
        return {names[id(lp)]: hp.detach().float().cpu().clone() for lp, hp in pairs}
    return {n: safe_get_full_fp32_param(p).detach().float().cpu().clone()
            for n, p in engine.module.named_parameters()}


@pytest.mark.parametrize("precision,zero", [("bf16", 0), ("mxfp8", 0), ("bf16", 1)])
def test_model_pt_holds_the_fp32_master_weights(tmp_path, trainer_env, monkeypatch, precision, zero):
    """model.pt (serving, gem eval, distillation teachers, the registry) is the optimizer's fp32 master
    weights, not the bf16 module parameters. At ZeRO-0 DeepSpeed's FP16_UnfusedOptimizer links no
    master to its parameter (safe_get_full_fp32_param returns None): model.pt held the bf16 weights,
    every value of it exactly representable in bf16."""
    from gem import cli
    from gem.train import checkpoint

    masters = {}
    save = checkpoint.save

    def recording_save(engine, env, job, *, step, **kwargs):
        masters[step] = _fp32_masters_by_name(engine)
        for name, p in engine.module.named_parameters():  # the module holds the masters rounded to bf16
            assert p.dtype == torch.bfloat16 and torch.equal(masters[step][name].bfloat16(), p.detach().cpu()), name
        return save(engine, env, job, step=step, **kwargs)

    monkeypatch.setattr(checkpoint, "save", recording_save)
    path = _manifest(tmp_path, f"m-{precision}-z{zero}", precision, zero)
    assert cli.main(["train", "--config", str(path)]) == 0
    ckpt = checkpoint.latest_complete(tmp_path / f"ckpt/local/m-{precision}-z{zero}")
    assert ckpt is not None and ckpt.name == "step-00000004"
    weights = torch.load(ckpt / "model.pt", weights_only=True)
    expected = masters[4]
    assert expected.keys() <= weights.keys()
    for name, master in expected.items():
        assert weights[name].dtype == torch.float32 and torch.equal(weights[name], master), name
    # the masters moved off the bf16 grid (so the check above tells them from the module's weights)
    values = torch.cat([master.flatten() for master in expected.values()])
    assert float((values.bfloat16().float() != values).float().mean()) > 0.3

"""The model on an accelerator, checked without one: every tensor the ops and modules make must live
on the device of the data, and the fast path's per-call work must not wait on the device.

`HostMode` stands the data's device in for CUDA on a CPU-only machine. Under it, every tensor the
code under test did not itself create on the host (inputs, parameters, gradients) reports
`device == meta` (so `x.device.type == "cpu"` branches take their device path), a factory asked for
`device=meta` builds on CPU but counts as a device tensor, and a factory given no device (or
`.cpu()`) makes a host tensor. It records

* `mix`: an op that reads a host tensor (not a 0-dim scalar) beside device tensors, which raises on
  CUDA ("Expected all tensors to be on the same device") — indexing with host indices excepted,
  CUDA copies those;
* `sync`: `int()`, `bool()`, `.item()`, `.tolist()`, `.cpu()` of a device tensor, an op whose output
  size is device data, or a blocking copy of host data to the device (`torch.tensor(..., device=)`):
  each waits for the stream to drain;

each with the first line under gem/ that made it.
"""

from __future__ import annotations

import collections
import traceback

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from gem.api.types import SyntheticDataSpec
from gem.baselines import DLRMConfig, DLRMModel, PaddedKunlunModel
from gem.data import build_splits, make_batch
from gem.modules import PRESETS, KunlunModel, from_v1_batch, set_kernel
from gem.ops import (Kernel, block_attention, gdpa, jagged_attention, jagged_last_k, oneseq_merge, segment_mean,
                     segment_sum, time_rotary)
from gem.ops.common import plan_blocks, plan_buckets
from gem.ops.testing import make_offsets

_DEV, _CPU = torch.device("meta"), torch.device("cpu")
_FACTORIES = {"arange", "zeros", "ones", "empty", "full", "tensor", "as_tensor", "asarray", "from_numpy", "randn",
              "rand", "randint", "randperm", "linspace", "logspace", "eye", "triu_indices", "tril_indices",
              "empty_strided", "scalar_tensor"}
_SYNCS = {"__int__", "__bool__", "__float__", "__index__", "item", "tolist", "cpu"}
_MOVES = {"to", "new_tensor", "new_zeros", "new_ones", "new_empty", "new_full"}


def _host(t: torch.Tensor) -> bool:
    return getattr(t, "_on_host", False)


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _is_dev(d) -> bool:
    return d == "meta" or (isinstance(d, torch.device) and d.type == "meta")


def _where() -> str:
    for fr in reversed(traceback.extract_stack()[:-2]):
        if "/gem/" in fr.filename:
            return f"gem/{fr.filename.split('/gem/')[-1]}:{fr.lineno} in {fr.name}: {fr.line}"
    return "?"


def _sizes_from_device(name: str, args, kwargs) -> bool:
    """Ops whose output size is data on the device: CUDA reads it back before it can allocate."""
    if name == "repeat_interleave":
        return len(args) > 1 and isinstance(args[1], torch.Tensor) and not _host(args[1]) \
            and kwargs.get("output_size") is None
    if name in ("nonzero", "bincount", "masked_select", "unique"):
        return not _host(args[0])
    if name == "__getitem__":
        return any(t.dtype == torch.bool and not _host(t) for t in _tensors(args[1:]))
    return False


class HostMode(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.events: dict[tuple[str, str], int] = collections.Counter()

    def of(self, kind: str) -> list[str]:
        return [f"{where} ({name}, x{n})" for (k, name, where), n in self.events.items() if k == kind]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "?")
        owner = getattr(func, "__self__", None)
        if owner is torch._C.TensorBase.device:
            return _CPU if _host(args[0]) else _DEV
        if owner is torch._C.TensorBase.is_cpu:
            return _host(args[0])
        on_dev = None  # where a device argument puts the result: None (none given), True or False
        if "device" in kwargs and kwargs["device"] is not None:
            on_dev = _is_dev(kwargs["device"])
            kwargs["device"] = _CPU
        args = list(args)
        if name in _MOVES:
            for i, a in enumerate(args):
                if not isinstance(a, torch.Tensor) and (_is_dev(a) or a == _CPU or a == "cpu"):
                    on_dev, args[i] = _is_dev(a), _CPU
        ins = list(_tensors(args)) + list(_tensors(kwargs))
        host_in = [t for t in ins if _host(t) and t.dim() > 0]
        if on_dev and (name in ("tensor", "as_tensor", "asarray") or name == "to" and host_in):
            self.events[("sync", name, _where())] += 1  # a blocking host -> device copy waits for the stream
        if name in _SYNCS and ins and not _host(ins[0]) or _sizes_from_device(name, args, kwargs):
            self.events[("sync", name, _where())] += 1
        if host_in and len(host_in) < len(ins) and name not in ("to", "copy_", "__getitem__"):
            self.events[("mix", name, _where())] += 1
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and any(out is t for t in ins):
            out = out.view(out.shape)  # a no-op move returns its input: tag an alias, not the input
        if name in ("cpu", "numpy", "tolist"):
            host = True
        elif on_dev is not None:
            host = not on_dev
        elif name in _FACTORIES:
            host = True
        elif name.endswith("_like") or name.startswith("new_") or name == "to":
            host = bool(ins) and _host(ins[0])
        else:
            host = bool(ins) and all(_host(t) for t in ins)
        for t in _tensors(out):
            try:
                t._on_host = host
            except (AttributeError, RuntimeError):
                pass
        return out


def _check_outputs(mode: HostMode, outs) -> None:
    assert not mode.of("mix"), "host tensors mixed into device ops:\n" + "\n".join(mode.of("mix"))
    on_host = [i for i, t in enumerate(_tensors(outs)) if _host(t)]
    assert not on_host, f"outputs {on_host} were made on the host"


# ---------------------------------------------------------------------------- the model

CFG = PRESETS["tiny"]


@pytest.fixture(scope="module")
def v1_batch():
    train, _ = build_splits(SyntheticDataSpec(num_users=50, num_ads=40, num_train_examples=64, num_eval_examples=8))
    return make_batch(train, np.arange(6), max_seq_len=CFG.tiers[0].max_seq_len)


@pytest.fixture(scope="module")
def batch(v1_batch):
    return from_v1_batch(v1_batch)


def test_the_v1_batch_is_split_by_event_type_with_one_read_from_the_device(v1_batch):
    """GEMModel splits the trainer's batch on its device every step: the range check, a nonzero and a
    bincount per event type each waited for the stream."""
    mode = HostMode()
    with mode:
        inputs = from_v1_batch(v1_batch)
    syncs = mode.of("sync")
    assert len(syncs) == 1 and syncs[0].endswith("x1)"), syncs
    _check_outputs(mode, [(s.offsets, s.timestamps, s.ids, s.surface) for s in inputs.sequences.values()])


@pytest.mark.parametrize("model", ["tiled", "pytorch", "padded", "dlrm"])
def test_forward_and_backward_keep_every_tensor_on_the_device_of_the_data(batch, model):
    """Kernel.PYTORCH (the references the module tests and debugging run) built its merge indices, the
    last-k mask, the rotary frequencies and the block ids on the CPU: on a GPU its first forward raised."""
    torch.manual_seed(0)
    m = {"tiled": lambda: KunlunModel(CFG), "pytorch": lambda: set_kernel(KunlunModel(CFG), Kernel.PYTORCH),
         "padded": lambda: PaddedKunlunModel(CFG), "dlrm": lambda: DLRMModel(DLRMConfig(base=CFG))}[model]()
    mode = HostMode()
    with mode:
        loss, parts = m.loss(batch)
        loss.backward()
    _check_outputs(mode, [loss, parts])


# Where the tiled model reads the device on purpose: planning (once per batch and plan, memoised in
# TierBatch), the events the OneSeq merge keeps and the per-type split sizes of its projection.
_PLANNING = ("in plan_buckets:", "in _layout:", "in plan_blocks:", "in tiled_oneseq_merge_index:",
             "in _project_by_type:")


def test_the_tiled_model_syncs_only_where_it_plans(batch):
    """The sparse-feature lookup synced once per feature and forward to see whether a bag held one id,
    segment_ids once per call (repeat_interleave reads its output size back from the device), and the
    PFFN's GDPA copied two small host lists to the device per call."""
    torch.manual_seed(0)
    m = KunlunModel(CFG)
    mode = HostMode()
    with mode:
        m.loss(batch)[0].backward()
    others = [s for s in mode.of("sync") if not any(p in s for p in _PLANNING)]
    assert not others, "host syncs outside planning:\n" + "\n".join(others)


# ---------------------------------------------------------------------------- the ops


def _op_calls(kernel: Kernel):
    torch.manual_seed(0)
    off = make_offsets([5, 0, 70, 9])
    n, H, dh = int(off[-1]), 2, 8
    q, k, v = (torch.randn(n, H, dh, requires_grad=True) for _ in range(3))
    kd, vd = (torch.randn(4, 3, H, dh, requires_grad=True) for _ in range(2))
    seeds = torch.randn(6, H, dh, requires_grad=True)
    phase = torch.rand(n) * 50
    off2, ts1, ts2 = make_offsets([1, 2, 0, 3]), torch.arange(n), torch.tensor([3, 1, 2, 7, 8, 9])
    kw = {"kernel": kernel}
    return {
        "jagged_attention": lambda: jagged_attention(q, k, v, off, **kw),
        "gdpa window": lambda: gdpa(q, k, v, q_offsets=off, k_offsets=off, window=4, **kw),
        "gdpa per-head": lambda: gdpa(q, k, v, q_offsets=off, k_offsets=off, activation=("relu", "silu"), **kw),
        "gdpa dense kv": lambda: gdpa(q, kd, vd, q_offsets=off, **kw),
        "gdpa dense kv window": lambda: gdpa(q, kd, vd, q_offsets=off, window=2, **kw),
        "gdpa broadcast": lambda: gdpa(seeds, k, v, k_offsets=off, broadcast_q=True, qk_scale=0.5, **kw),
        "block_attention rotary": lambda: block_attention(q, k, v, off, block_size=16, shift=3, align="end",
                                                          rotary_phase=phase, **kw),
        "segment_sum": lambda: segment_sum(q, off, **kw),
        "segment_mean": lambda: segment_mean(q, off, **kw),
        "jagged_last_k": lambda: jagged_last_k(q, off, 4, **kw),
        "time_rotary": lambda: time_rotary(q, phase, **kw),
        "oneseq_merge": lambda: oneseq_merge([q, q[:6]], [ts1, ts2], [off, off2], max_seq_len=7, **kw),
    }


@pytest.mark.parametrize("kernel", list(Kernel))
def test_ops_make_their_outputs_and_gradients_on_the_device_of_the_data(kernel):
    failed = []
    for name, call in _op_calls(kernel).items():
        mode = HostMode()
        with mode:
            outs = call()
            sum(t.float().sum() for t in _tensors(outs) if t.is_floating_point()).backward()
        try:
            _check_outputs(mode, outs)
        except AssertionError as e:
            failed.append(f"{name} ({kernel.value}): {str(e).splitlines()[:4]}")
    assert not failed, "\n".join(failed)


def test_fast_path_with_plans_made_does_not_wait_on_the_device():
    """Plans are made once per batch (that is where the host reads the lengths); after that, a layer's
    ops must not sync: block attention read `bool(plan.valid.all())` and the last-k gather
    `int(offsets[-1])` on every call, the PFFN's GDPA copied its tile starts to the device on every
    call, and planning synced once per bucket for its key mask."""
    off = make_offsets([5, 0, 70, 9, 64])
    n, H, dh = int(off[-1]), 2, 8
    q, k, v = (torch.randn(n, H, dh, requires_grad=True) for _ in range(3))
    kd, vd = (torch.randn(5, 3, H, dh) for _ in range(2))
    k_off = make_offsets([3] * 5)
    mode = HostMode()
    with mode:
        blocks = {align: plan_blocks(off, 16, align=align) for align in ("start", "end")}
        buckets = plan_buckets(off, k_off)
    planning = set(mode.of("sync"))
    mode = HostMode()
    with mode:
        outs = [block_attention(q, k, v, off, block_size=16, align=a, plan=p) for a, p in blocks.items()]
        outs.append(jagged_last_k(q, off, 4)[0])
        outs.append(gdpa(q, kd, vd, q_offsets=off, buckets=buckets))
        sum(o.sum() for o in outs).backward()
    assert not mode.of("sync"), "per-call host syncs:\n" + "\n".join(mode.of("sync"))
    assert not [s for s in planning if "kv.all()" in s], planning


def test_planning_buckets_waits_on_the_device_a_fixed_number_of_times():
    """plan_buckets copied every bucket's examples to the device on their own (~20 blocking copies per
    plan on the reference workload)."""
    off = make_offsets([8 * (i + 1) for i in range(12)] * 2)
    mode = HostMode()
    with mode:
        plan = plan_buckets(off, overhead=1.0)
    assert len(plan) == 12
    assert sum(int(s.rsplit(" x", 1)[1].rstrip(")")) for s in mode.of("sync")) <= 4, mode.of("sync")

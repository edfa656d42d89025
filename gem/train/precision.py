"""Matmul precision applied from outside the model: `apply_precision(model, precision, device)`.

- `fp32`, `bf16`: the model is left alone (bf16 is DeepSpeed's bf16 mode + autocast, see trainer.py).
- `mxfp8`: every `nn.Linear` whose in and out widths are multiples of 32 (the MX block size),
  outside the prediction heads -- the attention projections and the MLPs; not the tiny input
  projections (widths not multiples of 32: skipped, and logged) nor anything under a module named
  `*heads` (`heads`, `wide_heads`, a student's `heads` / `aux_heads`, whatever their widths) or
  named `memory_score` (a LoopFM student's memory reader, a logit term of its own) (like
  torchtitan's default `filter_fqns=["output"]`, the layers whose error goes straight into the
  logits stay bf16) -- is swapped in place for `MXFP8Linear`, which keeps the same parameters (so
  DeepSpeed/ZeRO, checkpoints and `model.pt` are unchanged) and computes
  `x @ W.T` with torchao's MX formats: activations, weights and output gradients are cast to
  float8_e4m3 in blocks of 32 with an e8m0 (power-of-two) scale per block; the weight gradient
  is computed in high precision (torchao's MXFP8_RCEIL_WGRAD_WITH_HP recipe), which also
  lifts the "tokens % 32 == 0" constraint of an MX weight gradient. Inputs arrive in bf16
  (the trainer runs mxfp8 under bf16 autocast); everything else stays bf16.
  Kernels: torchao's real MXFP8 GEMMs on GPUs that have them (compute capability >= 10.0,
  e.g. B200) with a torch built for CUDA >= 12.8 (`mx_kernels_missing`: torchao defines its MX
  cast kernels only there); elsewhere (CPU, H100/H200, a CUDA 12.6 build) the emulated path
  (quantise -> dequantise -> bf16 matmul), which is numerically the same and useful for accuracy
  checks, not speed (on such a GPU apply_precision logs a warning).
  Tensor parallelism (gem/parallel/tensor_parallel.py) replaces the Linears it splits by their
  shards, which keep `MXFP8Linear.matmul` while their widths stay multiples of 32.

torchao is optional (the `train` extra pins it); without it, or with one that lacks the MX training
op used here (prototype API), `mxfp8` is a config error naming spec.training.precision (exit 2).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from gem.data.errors import SpecError

log = logging.getLogger("gem.train")

MX_BLOCK = 32
#: Modules whose Linears stay bf16 under mxfp8, matched by name (any component ending in it).
MX_SKIP_SUFFIX = "heads"
#: ...and by exact component: a LoopFM student's memory reader, whose `cand · B_t mem` is a logit term.
MX_SKIP_NAMES = frozenset({"memory_score"})


#: torch.version.cuda the real MXFP8 kernels need: torchao defines its MX cast kernels (Triton dim0,
#: CUDA dim1) only from CUDA 12.8 on, and cuBLAS's block-scaled MX GEMM (torch._scaled_mm) came with it.
MX_MIN_CUDA = (12, 8)


def mx_kernels_missing(device: torch.device | None = None) -> str | None:
    """Why torchao's real MXFP8 kernels cannot run on `device` (None: they can). They need a GPU with MX tensor
    cores (compute capability >= 10.0, e.g. B200), a torch built for CUDA >= 12.8, and torchao's cast kernels
    defined for it (it defines them at import, from the same checks and Triton's presence: on a build
    without them its stubs raise "needs triton" at the first forward instead of running)."""
    if device is None or device.type != "cuda":
        return "not a CUDA GPU"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 10:
        return f"compute capability {major}.{minor} < 10.0"
    cuda = torch.version.cuda
    try:
        built = tuple(int(v) for v in cuda.split(".")[:2]) if cuda else None
    except ValueError:
        built = None
    if built is None or built < MX_MIN_CUDA:
        return (f"torch is built for CUDA {cuda or 'none (ROCm?)'}, torchao's MXFP8 kernels need CUDA "
                f">= {MX_MIN_CUDA[0]}.{MX_MIN_CUDA[1]}")
    from torchao.prototype.mx_formats import kernels

    if not (getattr(kernels, "_triton_kernels_available", False)
            and getattr(kernels, "_mxfp8_cuda_kernels_available", False)):
        return "torchao did not define its MXFP8 cast kernels for this setup (is Triton installed?)"
    return None


def mx_kernel_preference(device: torch.device | None = None) -> Any:
    """AUTO (real kernels) where torchao's MXFP8 kernels run (`mx_kernels_missing`), else EMULATED."""
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    return KernelPreference.EMULATED if mx_kernels_missing(device) else KernelPreference.AUTO


def mxfp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 kernel_preference: Any = None) -> torch.Tensor:
    """F.linear(x, weight, bias) with the matmul in MXFP8 (blocks of 32 along both widths of `weight`)."""
    from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    pref = kernel_preference or mx_kernel_preference(weight.device)
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    if dtype not in (torch.bfloat16, torch.float32):
        dtype = torch.bfloat16
    with torch.autocast(x.device.type, enabled=False):
        y = _to_mxfp8_then_scaled_mm(x.to(dtype), weight.to(dtype), pref, ScaleCalculationMode.RCEIL, True)
        if bias is not None:
            y = y + bias.to(y.dtype)
    return y


class MXFP8Linear(nn.Linear):
    """nn.Linear whose matmul runs in MXFP8 (same parameters, same state dict).

    `matmul` is the matmul itself: gem.parallel's tensor-parallel layers, which replace a Linear
    by its shard, take it over (gem/parallel/tensor_parallel.py), so a tp-split layer stays MXFP8.
    """

    kernel_preference: Any = None
    matmul_block = MX_BLOCK  # a tp shard keeps `matmul` while its widths stay multiples of this

    @staticmethod
    def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return mxfp8_linear(x, weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mxfp8_linear(x, self.weight, self.bias, self.kernel_preference)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "MXFP8Linear":
        linear.__class__ = cls  # in place: parameters, hooks and device stay as they are
        return linear  # type: ignore[return-value]


def mx_eligible(module: nn.Module, name: str = "") -> bool:
    """A Linear mxfp8 swaps: MX-sized widths (else torchao's blocks of 32 do not tile it) and not in a head."""
    return (isinstance(module, nn.Linear) and not isinstance(module, MXFP8Linear)
            and module.in_features % MX_BLOCK == 0 and module.out_features % MX_BLOCK == 0
            and not feeds_logits(name))


def feeds_logits(name: str) -> bool:
    """Whether a module's output goes straight into the logits (a prediction head, the memory reader)."""
    return any(part.endswith(MX_SKIP_SUFFIX) or part in MX_SKIP_NAMES for part in name.split("."))


def _check_torchao() -> None:
    """Import what mxfp8_linear calls now, so a missing or incompatible torchao is a config error at setup."""
    try:
        from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm  # noqa: F401
        from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: F401
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference  # noqa: F401
    except ImportError as e:
        try:
            from importlib.metadata import version

            found = f"torchao {version('torchao')} is installed but lacks its MXFP8 training op ({e})"
        except Exception:  # noqa: BLE001 - not installed at all
            found = "torchao is not installed"
        raise SpecError(f"spec.training.precision mxfp8 needs torchao >= 0.18 with "
                        f"torchao.prototype.moe_training.mxfp8_linear: {found}. Install gem-platform[train] "
                        "(it pins torchao), or set spec.training.precision to bf16") from e


def apply_precision(model: nn.Module, precision: str, device: torch.device | None = None) -> nn.Module:
    """Prepare `model` for `precision` (fp32 | bf16 | mxfp8), in place; returns it.

    `device`: where it will train; a GPU without MX tensor cores gets a warning (emulated, slow)."""
    precision = str(getattr(precision, "value", precision))
    if precision in ("fp32", "bf16"):
        return model
    if precision != "mxfp8":
        raise ValueError(f"unknown training.precision {precision!r}: use fp32, bf16 or mxfp8")
    _check_torchao()
    chosen = [(name, m) for name, m in model.named_modules() if mx_eligible(m, name)]
    for _, m in chosen:
        MXFP8Linear.from_linear(m)
    swapped = [name for name, _ in chosen]
    kept = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not isinstance(m, MXFP8Linear)]
    log.info("mxfp8: %d linear layers in MXFP8 (%s); %d kept in bf16 (layers feeding the logits, or widths not "
             "multiples of %d: %s)", len(swapped), ", ".join(swapped[:8]) + ("..." if len(swapped) > 8 else ""),
             len(kept), MX_BLOCK, ", ".join(kept[:8]))
    if device is not None and device.type == "cuda":
        missing = mx_kernels_missing(device)
        if missing:
            # torchtitan refuses mxfp8 below sm100; here emulation stays allowed (accuracy checks), but said
            major, minor = torch.cuda.get_device_capability(device)
            log.warning("mxfp8 on %s (sm_%d%d): torchao's MXFP8 GEMMs need compute capability >= 10.0 "
                        "(e.g. B200) and a torch built for CUDA >= %d.%d; here %s, so the MX numerics are "
                        "emulated (quantise, dequantise, bf16 matmul): slower than bf16, right for accuracy "
                        "checks only", torch.cuda.get_device_name(device), major, minor, *MX_MIN_CUDA, missing)
    return model

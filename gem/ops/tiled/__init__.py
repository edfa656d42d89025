"""Fast kernels of the jagged ops, written in PyTorch over dense tiles (see gem/ops/common.py).

They are fast on CPU (the matmuls run on contiguous bf16/fp32 tiles with bounded padding) and
run unchanged on GPU; fused Triton/CUDA kernels would slot in beside them as another Kernel.
"""

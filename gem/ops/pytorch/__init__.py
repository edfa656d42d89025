"""Plain-PyTorch references of every op: padded to the longest segment, masked, fp32, readable.

Tests compare the fast kernels in gem/ops/tiled/ against these; they are also the fallback
kernel (`Kernel.PYTORCH`) when debugging.
"""

"""What a benchmark's JSON records about the CPU it ran on."""

from __future__ import annotations

import platform
from pathlib import Path

import torch


def cpu() -> dict[str, str]:
    """The CPU model and the kernel set torch picked for it. Seeded single-thread runs reproduce to
    the last digit only on the same kind of CPU: another CPU's kernels round fp32 sums differently,
    and over a thousand steps that moves a run's NE by about as much as another seed does."""
    name = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        name = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                     if line.startswith("model name")), "")
    return {"processor": name or platform.processor() or platform.machine(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}

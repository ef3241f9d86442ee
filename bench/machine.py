"""What the benchmarks print about the machine they ran on (shared by the bench scripts)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

# Environment variables that make torch, oneDNN and MKL use fewer instructions than the CPU
# has: set together (to avx2 / AVX2 / AVX2), a CPU with AVX-512 computes as an AVX2-only
# CPU would (its clock and caches stay its own). bench/README.md, "Measuring as an
# AVX2-only CPU".
INSTRUCTION_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA",
                    "MKL_ENABLE_INSTRUCTIONS")


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def instruction_caps() -> dict[str, str]:
    """The instruction-set caps set in the environment (see INSTRUCTION_CAPS); {} if none."""
    return {name: os.environ[name] for name in INSTRUCTION_CAPS if os.environ.get(name)}


def describe_caps() -> str:
    """'' when nothing is capped, else ', capped by NAME=VALUE ...' for a figure's header."""
    caps = instruction_caps()
    return f", capped by {' '.join(f'{k}={v}' for k, v in caps.items())}" if caps else ""

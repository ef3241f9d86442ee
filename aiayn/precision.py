"""The precision a run computes in: bf16 autocast where the hardware runs bf16 natively.

``precision: auto`` (training and decoding) means bf16 autocast on a GPU that computes in
bf16 natively (Ampere and later; on a V100 or older it means fp32), and on a CPU only
where the CPU multiplies bf16 matrices in hardware: x86 with AVX512-BF16 or AMX, Arm with
the BF16 extension, where bf16 matmuls are faster than fp32. A CPU without them (an
AVX2-only x86, for instance) emulates bf16 in software, orders of magnitude slower than
fp32 (bench/README.md, "Measuring as an AVX2-only CPU"). So ``auto`` means fp32 there, and
an explicit ``bf16`` gets a warning.

The check reads CPU feature flags instead of timing a product, so that the same machine
always picks the same precision (a timing on a busy machine could flip between runs, and
a resumed run would then compute differently from its first part).

oneDNN's ``ONEDNN_MAX_CPU_ISA`` (or ``DNNL_MAX_CPU_ISA``) can cap the instructions oneDNN
uses below the hardware's, e.g. ``AVX2`` to run as an AVX2-only CPU would; bf16 products
are then emulated like on such a CPU, so ``auto`` means fp32 under such a cap too.

``precision: fp16`` is float16 autocast, asked for explicitly: for GPUs without bf16 (V100
and T4 multiply fp16 on their tensor cores; the paper trained on P100s), with dynamic loss
scaling in training (``torch.amp.GradScaler``, as fairseq's ``--fp16``), since float16's
range is far narrower than bf16's. CPUs have no fast fp16 products here (it works, slowly:
for tests); ``auto`` never picks it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
from pathlib import Path

import torch

X86 = {"x86_64", "amd64", "i386", "i686"}
# /proc/cpuinfo feature names of native bf16 matrix arithmetic (x86 "flags", Arm "Features").
BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA values) under which oneDNN has no bf16 dot-product
# instructions: bf16 products are emulated even on a CPU that has them.
ONEDNN_ISAS_WITHOUT_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
                            "AVX512_CORE_VNNI", "AVX512_MIC", "AVX512_MIC_4OPS"}
# Environment variables that make torch, oneDNN and MKL use fewer instructions than the CPU
# has: set together (to avx2 / AVX2 / AVX2), a CPU with AVX-512 computes as an AVX2-only
# CPU would (its clock and caches stay its own). bench/README.md, "Measuring as an
# AVX2-only CPU". A run records them (metrics/train.json, MLflow tags), so that a figure
# measured under a cap cannot pass for one of the hardware.
INSTRUCTION_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA",
                    "MKL_ENABLE_INSTRUCTIONS")


def _cpuinfo_flags(path: Path = Path("/proc/cpuinfo")) -> set[str]:
    try:
        text = path.read_text()
    except OSError:
        return set()
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return flags


def cpu_model(path: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name from /proc/cpuinfo, else what ``platform`` knows."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def instruction_caps() -> dict[str, str]:
    """The instruction-set caps set in the environment (see INSTRUCTION_CAPS); {} if none."""
    return {name: os.environ[name] for name in INSTRUCTION_CAPS if os.environ.get(name)}


def instruction_caps_text() -> str:
    """The caps in force as 'NAME=VALUE NAME=VALUE', in INSTRUCTION_CAPS order; '' if none."""
    return " ".join(f"{k}={v}" for k, v in instruction_caps().items())


def hardware(device: torch.device) -> dict[str, str]:
    """What a run computed on, for its metrics and MLflow tags: the GPU's or the CPU's name,
    whether it has native bf16, and the instruction caps in force ('none' without)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
    return {"hardware": name,
            "native_bf16": "yes" if has_native_bf16(device) else "no",
            "instruction_caps": instruction_caps_text() or "none"}


def onednn_isa_cap() -> str | None:
    """The ISA cap oneDNN reads from the environment (upper case), or None when uncapped."""
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        value = os.environ.get(name, "").strip()
        if value:
            return value.upper()
    return None


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True where this CPU multiplies bf16 matrices in hardware and oneDNN may use those
    instructions (see the module docstring)."""
    if onednn_isa_cap() in ONEDNN_ISAS_WITHOUT_BF16:
        return False
    if platform.machine().lower() in X86:
        # The checks oneDNN itself relies on; private in torch, hence the fallback.
        checks = [getattr(torch.cpu, name, None)
                  for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
        if all(callable(c) for c in checks):
            return any(c() for c in checks)
    return bool(_cpuinfo_flags() & BF16_FLAGS)


CPU_KINDS = ("amx", "bf16", "fp32")


@functools.cache
def cpu_kind() -> str:
    """What this CPU computes a training step in, as oneDNN may use it under the caps in force:
    'amx' (bf16 products in AMX tiles), 'bf16' (native bf16 without AMX, e.g. AVX512-BF16)
    or 'fp32' (no native bf16: AVX2-only CPUs and the rest; ``precision: auto`` is fp32)."""
    if not cpu_has_native_bf16():
        return "fp32"
    cap = onednn_isa_cap()
    if cap not in (None, "ALL") and "AMX" not in cap:
        return "bf16"  # e.g. AVX512_CORE_BF16: the AMX tiles are out of oneDNN's reach
    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    amx = check() if callable(check) else "amx_bf16" in _cpuinfo_flags()
    return "amx" if amx else "bf16"


def gpu_has_native_bf16() -> bool:
    """True where the current CUDA device computes in bf16 natively (Ampere and later)."""
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)


def has_native_bf16(device: torch.device) -> bool:
    return gpu_has_native_bf16() if device.type == "cuda" else cpu_has_native_bf16()


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for ``precision`` ('auto', 'fp32', 'bf16' or 'fp16') on ``device``;
    None means fp32 without autocast."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    if precision == "fp32":
        return None
    if precision == "fp16":
        return torch.float16
    if precision == "bf16" or has_native_bf16(device):
        return torch.bfloat16
    return None


def precision_name(dtype: torch.dtype | None) -> str:
    """What a run computes in, as its metrics and tags say it: 'bf16', 'fp16' or 'fp32'."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


def slow_bf16_warning(precision: str, device: torch.device, key: str) -> str | None:
    """A warning for bf16 forced on a device that only emulates it, or fp16 on a CPU, naming
    the setting ``key``."""
    if precision == "fp16" and device.type == "cpu":
        return (f"{key} is fp16 on a CPU: its fp16 products are slow here (fp16 is meant "
                f"for GPUs without bf16, such as the V100 or T4). Set {key} to auto or fp32.")
    if precision != "bf16" or has_native_bf16(device):
        return None
    if device.type == "cuda":
        return (f"{key} is bf16, but this GPU has no native bf16 (it needs compute capability "
                f"8.0 or later): bf16 is emulated and slower than fp32. Set {key} to auto "
                f"(bf16 only where it is fast) or fp32.")
    return (f"{key} is bf16, but this CPU has no native bf16 (no AVX512-BF16, AMX or Arm "
            f"BF16): it emulates bf16 matmuls, typically ~100x slower than fp32. Set "
            f"{key} to auto (bf16 only where it is fast) or fp32.")


def step_casts(device_type: str, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """One autocast scope around all the micro-batches of an optimizer step, so that each
    weight is cast to ``dtype`` once per step, not once per micro-batch.

    Autocast keeps its copies of the fp32 weights it has cast (leaf tensors that need a
    gradient) until the outermost autocast scope exits; the forward's own scope, nested in
    this one, then reuses them, and their gradients flow back to the fp32 weights as before,
    bit for bit. Run each backward inside :func:`no_autocast`, and leave this scope before
    the optimizer changes the weights. A no-op without autocast (``dtype`` None).
    """
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)


def no_autocast(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast off (for a backward inside :func:`step_casts`): a nested scope, so leaving
    it keeps the step's cast weights."""
    return torch.autocast(device_type, enabled=False)

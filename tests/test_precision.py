"""aiayn.precision: bf16 autocast only where the hardware runs it natively."""

from __future__ import annotations

import logging
import platform
from pathlib import Path

import pytest
import torch

import aiayn.precision as precision
from aiayn.precision import BF16_FLAGS, _cpuinfo_flags, autocast_dtype, slow_bf16_warning

CPU, CUDA = torch.device("cpu"), torch.device("cuda")

X86_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile
bugs\t\t: sysret_ss_attrs

processor\t: 1
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile
"""
ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes sve bf16 i8mm
CPU implementer\t: 0x41
"""


@pytest.fixture
def native(monkeypatch):
    """Pretend the CPU has (True) or lacks (False) native bf16; the GPU has it."""
    def set_native(value: bool) -> None:
        monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: value)
    monkeypatch.setattr(precision, "gpu_has_native_bf16", lambda: True)
    return set_native


def test_cpuinfo_flags_of_x86_and_arm(tmp_path):
    (tmp_path / "x86").write_text(X86_CPUINFO)
    (tmp_path / "arm").write_text(ARM_CPUINFO)
    assert {"avx2", "avx512_bf16", "amx_tile"} <= _cpuinfo_flags(tmp_path / "x86")
    assert "bugs" not in _cpuinfo_flags(tmp_path / "x86")  # only the flags line counts
    assert {"sve", "bf16", "i8mm"} <= _cpuinfo_flags(tmp_path / "arm")
    assert _cpuinfo_flags(tmp_path / "missing") == set()


@pytest.mark.skipif(platform.system() != "Linux", reason="reads /proc/cpuinfo")
def test_the_answer_agrees_with_the_kernels_cpu_flags():
    flags = _cpuinfo_flags(Path("/proc/cpuinfo"))
    uncapped = precision.onednn_isa_cap() not in precision.ONEDNN_ISAS_WITHOUT_BF16
    assert precision.cpu_has_native_bf16() == (bool(flags & BF16_FLAGS) and uncapped)


@pytest.fixture
def bf16_cpu(monkeypatch):
    """An x86 CPU whose hardware has AVX512-BF16, with the answer's cache cleared around."""
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    precision.cpu_has_native_bf16.cache_clear()
    yield monkeypatch
    precision.cpu_has_native_bf16.cache_clear()


@pytest.mark.parametrize("name", ["ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"])
def test_a_onednn_cap_below_bf16_means_no_native_bf16(bf16_cpu, name):
    assert precision.cpu_has_native_bf16()  # the hardware's answer, uncapped
    for cap, native in [("avx2", False), ("AVX512_CORE_VNNI", False), ("SSE41", False),
                        ("AVX512_CORE_BF16", True), ("AVX512_CORE_AMX", True), ("ALL", True)]:
        bf16_cpu.setenv(name, cap)
        precision.cpu_has_native_bf16.cache_clear()
        assert precision.cpu_has_native_bf16() is native, cap
        assert (autocast_dtype("auto", CPU) is torch.bfloat16) is native, cap


def test_cpu_model_reads_the_model_name_or_falls_back(tmp_path):
    (tmp_path / "x86").write_text(X86_CPUINFO)
    (tmp_path / "arm").write_text(ARM_CPUINFO)  # Arm kernels print no model name
    assert precision.cpu_model(tmp_path / "x86") == "AMD EPYC 9R14 96-Core Processor"
    fallback = platform.processor() or platform.machine()
    assert precision.cpu_model(tmp_path / "arm") == fallback
    assert precision.cpu_model(tmp_path / "missing") == fallback


def test_hardware_records_the_cpu_and_the_caps_in_force(bf16_cpu):
    for name in precision.INSTRUCTION_CAPS:
        bf16_cpu.delenv(name, raising=False)
    assert precision.hardware(CPU) == {"hardware": precision.cpu_model(), "native_bf16": "yes",
                                       "instruction_caps": "none"}
    # The caps bench/README.md sets to measure as an AVX2-only CPU, in INSTRUCTION_CAPS order.
    bf16_cpu.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    bf16_cpu.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    bf16_cpu.setenv("ATEN_CPU_CAPABILITY", "avx2")
    bf16_cpu.setenv("DNNL_MAX_CPU_ISA", "")  # set but empty: not a cap
    precision.cpu_has_native_bf16.cache_clear()
    assert precision.hardware(CPU) == {
        "hardware": precision.cpu_model(), "native_bf16": "no",
        "instruction_caps": "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 "
                            "MKL_ENABLE_INSTRUCTIONS=AVX2"}


def test_onednn_reads_its_new_name_before_the_old(bf16_cpu):
    bf16_cpu.setenv("DNNL_MAX_CPU_ISA", "AVX2")
    bf16_cpu.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert precision.onednn_isa_cap() == "AVX512_CORE_BF16"
    assert precision.cpu_has_native_bf16()


def test_fp32_and_bf16_are_what_they_say(native):
    for has in (True, False):
        native(has)
        for dev in (CPU, CUDA):
            assert autocast_dtype("fp32", dev) is None
            assert autocast_dtype("bf16", dev) is torch.bfloat16


def test_auto_is_bf16_on_gpu_and_on_cpus_with_native_bf16(native):
    native(True)
    assert autocast_dtype("auto", CPU) is torch.bfloat16
    assert autocast_dtype("auto", CUDA) is torch.bfloat16
    native(False)
    assert autocast_dtype("auto", CPU) is None
    assert autocast_dtype("auto", CUDA) is torch.bfloat16


def test_auto_is_fp32_on_a_gpu_without_native_bf16(native, monkeypatch):
    native(True)
    monkeypatch.setattr(precision, "gpu_has_native_bf16", lambda: False)  # a V100, say
    assert autocast_dtype("auto", CUDA) is None
    assert autocast_dtype("bf16", CUDA) is torch.bfloat16
    assert "compute capability 8.0" in slow_bf16_warning("bf16", CUDA, "train.precision")
    assert autocast_dtype("auto", CPU) is torch.bfloat16


def test_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="auto, fp32, bf16, fp16, not 'int8'"):
        autocast_dtype("int8", CPU)


def test_forced_bf16_on_an_emulating_cpu_warns(native):
    native(False)
    msg = slow_bf16_warning("bf16", CPU, "train.precision")
    assert msg and "train.precision" in msg and "auto" in msg
    assert slow_bf16_warning("auto", CPU, "train.precision") is None
    assert slow_bf16_warning("bf16", CUDA, "train.precision") is None
    native(True)
    assert slow_bf16_warning("bf16", CPU, "train.precision") is None


def test_trainer_follows_the_cpu(native, toy_workspace, tmp_path, caplog):
    from tests.test_training import make_trainer

    native(False)
    assert make_trainer(toy_workspace, tmp_path / "a", {"train": {"precision": "auto"}}
                        ).amp_dtype is None
    native(True)
    assert make_trainer(toy_workspace, tmp_path / "b", {"train": {"precision": "auto"}}
                        ).amp_dtype is torch.bfloat16
    native(False)
    with caplog.at_level(logging.WARNING, logger="aiayn"):
        trainer = make_trainer(toy_workspace, tmp_path / "c", {"train": {"precision": "bf16"}})
    assert trainer.amp_dtype is torch.bfloat16
    assert "train.precision is bf16, but this CPU has no native bf16" in caplog.text


def test_fp16_is_float16_autocast_asked_for_explicitly():
    from aiayn.precision import autocast_dtype, precision_name, slow_bf16_warning

    cpu = torch.device("cpu")
    assert autocast_dtype("fp16", cpu) is torch.float16
    assert autocast_dtype("auto", cpu) in (None, torch.bfloat16)  # auto never picks fp16
    assert [precision_name(d) for d in (None, torch.bfloat16, torch.float16)] == [
        "fp32", "bf16", "fp16"]
    warning = slow_bf16_warning("fp16", cpu, "train.precision")
    assert "train.precision is fp16 on a CPU" in warning and "auto or fp32" in warning


def test_cpu_kind_names_amx_native_bf16_or_fp32_under_the_caps_in_force(bf16_cpu):
    def kind(amx: bool, cap: str | None = None) -> str:
        bf16_cpu.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
        if cap is None:
            bf16_cpu.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
        else:
            bf16_cpu.setenv("ONEDNN_MAX_CPU_ISA", cap)
        precision.cpu_has_native_bf16.cache_clear()
        precision.cpu_kind.cache_clear()
        return precision.cpu_kind()

    try:
        assert kind(amx=False) == "bf16"  # AVX512-BF16 without AMX
        assert kind(amx=True) == "amx"
        assert kind(amx=True, cap="ALL") == "amx"
        assert kind(amx=True, cap="AVX512_CORE_AMX") == "amx"
        assert kind(amx=True, cap="AVX512_CORE_BF16") == "bf16"  # AMX out of oneDNN's reach
        assert kind(amx=True, cap="AVX2") == "fp32"
        bf16_cpu.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
        assert kind(amx=False) == "fp32"  # AVX2 only
    finally:
        precision.cpu_kind.cache_clear()

"""The C++ CPU kernels (``csrc/cpu_kernels.cpp``): the residual block, attention, the loss's
softmax and the FFN's ReLU gradient, built with torch's own extension builder the first time
a process needs them (once per machine and instruction set, cached by torch), or None where
they cannot be built: then every kernel takes PyTorch's own ops.

Attention splits its (sequence, head) tasks, and the row kernels their rows, over torch's
threads with ``at::parallel_for``, whose code is OpenMP pragmas: hence ``-fopenmp``
(bench/README.md, "the row kernels on two threads")."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import sys
import warnings
from pathlib import Path

import torch

# Set to 0 to build nothing and keep PyTorch's own ops for every kernel of the extension.
EXTENSION_ENV = "AIAYN_CPU_EXTENSION"
SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.cpp"
# What the compiler may target, by the instruction set torch's own kernels dispatch to
# (torch.backends.cpu.get_cpu_capability(), which ATEN_CPU_CAPABILITY caps): one build each,
# so a cache shared by machines of different kinds never runs an instruction one lacks.
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx2", "-mfma",
               "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}
# -fassociative-math (and what gcc needs beside it) lets the compiler vectorize the rows'
# sums; -ffast-math's finite-math assumptions are left out, so NaN and inf propagate.
CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
          "-fno-trapping-math"]


def cpu_extension():
    """The compiled module of :data:`SOURCE` (see :func:`load`)."""
    return load(SOURCE)


@functools.cache
def load(source: Path):
    """The compiled module of ``source``, built on first call (about 30 s, once per machine
    and instruction set, cached by torch under ``TORCH_EXTENSIONS_DIR``, default
    ``~/.cache/torch_extensions``); None where it cannot be built (no C++ compiler or Python
    headers; a warning says so, once) or where ``AIAYN_CPU_EXTENSION=0``."""
    if os.environ.get(EXTENSION_ENV, "1") == "0":
        return None
    isa = torch.backends.cpu.get_cpu_capability()
    flags = CFLAGS + ISA_FLAGS.get(isa, [])
    try:
        from torch.utils import cpp_extension

        text = source.read_text()
        name = build_name(text, isa, flags)
        _say_if_building(cpp_extension, name, isa, source)
        # warnings: torch's note that the compiler differs from the one it was built with
        with project_ninja(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # load_inline copies the source into the build folder, so that checkouts in other
            # places (a `dvc exp run --queue` runs in a temporary copy) build nothing again.
            return cpp_extension.load_inline(name, [text], extra_cflags=flags)
    except Exception as e:  # noqa: BLE001 - any build failure means the eager path
        warnings.warn(
            f"aiayn: could not build the CPU kernels {source.name} ({type(e).__name__}: "
            f"{build_error(str(e))}); the loss's softmax, attention, the residual "
            f"blocks and the FFN's ReLU gradient run on PyTorch's own ops instead (slower "
            f"steps on CPU). It "
            f"needs a C++ compiler and Python's headers (Debian/Ubuntu: apt install g++ "
            f"python3-dev); set {EXTENSION_ENV}=0 to skip the build and this warning.",
            RuntimeWarning,
            stacklevel=2)
        return None


def build_error(message: str) -> str:
    """The line of a failed build's output that says why: the compiler's first error, else
    the last line."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return next((line for line in lines if "error:" in line), lines[-1] if lines else "?")


def build_name(source: str, isa: str, flags: list[str]) -> str:
    """The build's name, hence its folder under torch's cache: the instruction set, and a
    digest of what the compiled module depends on (the source, the flags, and the torch
    and Python whose headers and libraries it is built against). One build per version of
    each; never one folder that two environments take turns rebuilding."""
    import sysconfig

    digest = hashlib.sha256("\0".join([
        source, " ".join(flags), torch.__version__, str(Path(torch.__file__).parent),
        sysconfig.get_paths()["include"]]).encode()).hexdigest()[:12]
    return f"aiayn_cpu_kernels_{isa.lower().replace(' ', '_')}_{digest}"


@contextlib.contextmanager
def project_ninja():
    """The ``ninja`` package's binary (a dependency, installed beside the interpreter) first
    on PATH while torch builds, whether or not the environment is activated: ninja versions
    hash a build's command differently, so a system ninja and the package's taking turns
    rebuilt the kernels at every switch between an activated and a bare
    ``.venv/bin/python``. Where the package is missing, the ninja on PATH builds."""
    old = os.environ.get("PATH", "")
    try:
        import ninja
    except ImportError:
        yield
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + old
    try:
        yield
    finally:
        os.environ["PATH"] = old


def _say_if_building(cpp_extension, name: str, isa: str, source: Path) -> None:
    """One line on stderr before a build (not before a load from torch's cache), so that
    the pause is explained."""
    try:
        built = Path(cpp_extension._get_build_directory(name, False)) / f"{name}.so"
    except Exception:  # noqa: BLE001 - a private helper; without it, say nothing
        return
    if not built.exists():
        print(f"aiayn: building the CPU kernels {source.name} for {isa} (once per machine, "
              f"~30 s; cached in {built.parent})", file=sys.stderr, flush=True)

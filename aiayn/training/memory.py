"""The C heap of CPU training: another allocator where one is installed, else glibc's malloc
with freed memory handed back to the operating system.

**tcmalloc or jemalloc** (``train.allocator: auto``, the default, on a CPU). ``aiayn train``
re-launches itself with the first of AUTO_ORDER that the dynamic loader finds preloaded
(LD_PRELOAD; Debian/Ubuntu: ``apt install libtcmalloc-minimal4`` or ``libjemalloc2``).
Token-bucket batches bring activations of new shapes at almost every step; these allocators
reuse freed memory without fragmenting it, so that steps take less time and the resident
memory stays flat where glibc's grows (measured side by side on each CPU kind:
bench/README.md, "train_memory.py"). On a GPU ``auto`` keeps glibc (the host's heap does
not bound those steps).

**glibc** (no other allocator installed, or ``train.allocator: glibc``): glibc's malloc
keeps the freed blocks in its heap, fragmented, so the resident memory of a run grows for
hours. Calling ``malloc_trim(0)`` every few steps returns the free pages (those inside the
heap too, not only at its top) and keeps it flat; ``MALLOC_ARENA_MAX`` did not help, and a
low ``MALLOC_MMAP_THRESHOLD_`` slowed the steps (bench/README.md, "glibc's trim" and "trim
only once the heap has grown"). ``bench/train_memory.py`` measures both modes side by side.

``malloc_trim`` has no library of its own; ``ctypes`` reaches the C library the process
already runs on. Elsewhere (macOS, Windows, musl) there is no ``malloc_trim`` and nothing
is done. The allocators are the libraries made for the job (as Intel's and PyTorch's CPU
performance guides advise, and ``torch.backends.xeon.run_cpu`` preloads); a process can
only get one at its start, hence the re-launch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Callable
from pathlib import Path

TRIM_EVERY_STEPS = 10

# Other allocators, loaded with LD_PRELOAD at a process's start: each by the library names
# the dynamic loader knows it by (ctypes.util.find_library), first found wins.
ALLOCATORS = {"jemalloc": ("jemalloc",), "tcmalloc": ("tcmalloc", "tcmalloc_minimal")}
# The Debian/Ubuntu package of each (the one place these names are written).
PACKAGES = {"jemalloc": "libjemalloc2", "tcmalloc": "libtcmalloc-minimal4"}
# jemalloc returns freed pages to the kernel after 10 s by default, and a training step that
# allocates them again pays a page fault per 4 KiB; -1 keeps them for reuse.
ALLOCATOR_ENV = {"jemalloc": {"MALLOC_CONF": "dirty_decay_ms:-1,muzzy_decay_ms:-1"}}
# train.allocator: auto takes the first installed (bench/README.md, "train_memory.py").
AUTO_ORDER = ("tcmalloc", "jemalloc")


def install_hint(*names: str) -> str:
    """How to install allocators ``names`` (default: all), e.g. "`apt install
    libtcmalloc-minimal4`" (Debian/Ubuntu)."""
    return f"`apt install {' '.join(PACKAGES[n] for n in names or AUTO_ORDER)}`"


def allocator_library(name: str) -> str | None:
    """The shared library of allocator ``name`` (a key of ALLOCATORS) as the dynamic loader
    finds it (e.g. 'libjemalloc.so.2'), or None where it is not installed."""
    for lib in ALLOCATORS[name]:
        found = ctypes.util.find_library(lib)
        if found:
            return found
    return None


def library_allocator(text: str) -> str | None:
    """The allocator of ALLOCATORS whose library ``text`` names (a file name, a path or a
    memory map's lines; 'libtcmalloc_minimal.so.4' is tcmalloc), else None."""
    for name in ALLOCATORS:
        if f"lib{name}" in text:
            return name
    return None


def allocator_env(name: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) for a child process that runs on allocator
    ``name``: its library first in LD_PRELOAD, and its settings (ALLOCATOR_ENV) unless
    ``env`` sets them; for 'glibc', LD_PRELOAD without any library of ALLOCATORS. Raises
    FileNotFoundError where the library is not installed."""
    out = dict(os.environ if env is None else env)
    preload = [x for x in out.get("LD_PRELOAD", "").replace(":", " ").split()
               if library_allocator(Path(x).name) is None]
    if name != "glibc":
        lib = allocator_library(name)
        if lib is None:
            raise FileNotFoundError(
                f"no {name} library here ({', '.join('lib' + x for x in ALLOCATORS[name])}): "
                f"install it, e.g. {install_hint(name)} (Debian/Ubuntu)")
        preload.insert(0, lib)
        for key, value in ALLOCATOR_ENV.get(name, {}).items():
            out.setdefault(key, value)
    if preload:
        out["LD_PRELOAD"] = " ".join(preload)
    else:
        out.pop("LD_PRELOAD", None)
    return out


def choose_allocator(choice: str, on_cpu: bool) -> str:
    """The allocator ``train.allocator`` ``choice`` means here: 'auto' is the first of
    AUTO_ORDER that is installed when training on a CPU, else 'glibc' (on a GPU the host's
    heap is not what bounds a step); a named allocator must be installed."""
    if choice == "auto":
        if on_cpu:
            for name in AUTO_ORDER:
                if allocator_library(name):
                    return name
        return "glibc"
    if choice != "glibc" and allocator_library(choice) is None:
        raise FileNotFoundError(
            f"train.allocator is {choice} but no lib{ALLOCATORS[choice][-1]} is installed: "
            f"install it (Debian/Ubuntu: {install_hint(choice)}) or set train.allocator: auto")
    return choice


def loaded_allocator(pid: int | str = "self") -> str:
    """Which allocator process ``pid`` (default: this one) runs on: 'jemalloc', 'tcmalloc'
    or 'glibc' (read from the libraries mapped into it, /proc/PID/maps; 'glibc' where that
    cannot be read)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            maps = f.read()
    except OSError:
        return "glibc"
    return library_allocator(maps) or "glibc"


def malloc_trim() -> Callable[[], int] | None:
    """glibc's ``malloc_trim(0)`` as a function, or None where the C library has none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return lambda: fn(0)


class HeapTrimmer:
    """Calls ``malloc_trim(0)`` after every ``every``-th step (when the platform has it)."""

    def __init__(self, every: int = TRIM_EVERY_STEPS, enabled: bool = True):
        self.every = every
        self._trim = malloc_trim() if enabled else None

    @property
    def active(self) -> bool:
        return self._trim is not None

    def after_step(self, step: int) -> None:
        if self._trim is not None and step % self.every == 0:
            self._trim()

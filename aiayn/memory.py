"""Hand freed heap memory back to the operating system during CPU training.

Training on CPU with token-bucket batches allocates activations of a different shape at
almost every step. glibc's malloc keeps the freed blocks in its heap, fragmented, so the
resident memory of a run grows for hours: from 2.1 to 3.3 GiB over 400 steps of the
`multi30k` model with varied shapes (bf16 autocast, 2 cores), against a flat 1.0 GiB with
one fixed shape. Calling glibc's ``malloc_trim(0)`` every few steps returns the free pages
(it also releases pages inside the heap, not only at its top) and keeps the run flat at
~1.05 GiB at no measurable cost per step. ``MALLOC_ARENA_MAX=2`` did not help; a low
``MALLOC_MMAP_THRESHOLD_`` did, but made steps 40% slower. In fp32 (on a CPU without
native bf16) the heap did not grow, and the trim cost nothing there either. (Those figures
are from AMD CPUs and an earlier benchmark harness. On an Intel CPU with AMX, the real
trainer's peaks still climbed with the trim, 2.1 to 3.4 GiB over 150 steps against 4.3
without, and the trim every 10 steps cost ~12% of a step: bench/README.md.)
``bench/train_memory.py`` measures both modes side by side.

There is no library for this; ``ctypes`` reaches the C library the process already runs
on. Elsewhere (macOS, Windows, musl) there is no ``malloc_trim`` and nothing is done.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable

TRIM_EVERY_STEPS = 10


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

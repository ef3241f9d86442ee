"""aiayn.training.memory: freed heap memory goes back to the operating system."""

from __future__ import annotations

import subprocess
import sys

import pytest

from aiayn.training.memory import HeapTrimmer, malloc_trim

pytestmark = pytest.mark.skipif(malloc_trim() is None, reason="the C library has no malloc_trim")

# A fragmented heap: 400 MB of blocks below the mmap threshold are freed while one block
# allocated after them still sits at the heap's top, so free() alone cannot shrink it.
FRAGMENT = r"""
import sys
from aiayn.training.memory import HeapTrimmer
def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
blocks = [bytearray(4000) for _ in range(100_000)]
pin = bytearray(4000)
del blocks
freed = rss_mb()
trimmer = HeapTrimmer(every=int(sys.argv[1]))
for step in range(1, 4):
    trimmer.after_step(step)
print(freed, rss_mb())
"""


def rss_after(every: int) -> tuple[float, float]:
    res = subprocess.run([sys.executable, "-c", FRAGMENT, str(every)], capture_output=True,
                         text=True, check=True)
    freed, after = map(float, res.stdout.split())
    return freed, after


def test_a_trim_step_returns_the_freed_heap():
    freed, after = rss_after(every=3)  # step 3 trims
    assert freed > 300, "the freed blocks must still be resident before the trim"
    assert after < freed - 300


def test_no_trim_between_trim_steps():
    freed, after = rss_after(every=10)  # steps 1-3: none is a trim step
    assert freed > 300
    assert after > freed - 50


def test_disabled_does_nothing():
    assert not HeapTrimmer(enabled=False).active
    assert HeapTrimmer().active

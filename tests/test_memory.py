"""aiayn.memory: freed heap memory goes back to the operating system."""

from __future__ import annotations

import subprocess
import sys

import pytest

from aiayn.memory import HeapTrimmer, malloc_trim

pytestmark = pytest.mark.skipif(malloc_trim() is None, reason="the C library has no malloc_trim")

# A fragmented heap: 400 MB of blocks below the mmap threshold are freed while one block
# allocated after them still sits at the heap's top, so free() alone cannot shrink it.
# argv: every, above, "early" (a check before the fragmenting, on the small heap) or
# "late", then the steps checked after it.
FRAGMENT = r"""
import sys
from aiayn.memory import HeapTrimmer, resident_bytes
every, above, when, *steps = sys.argv[1:]
trimmer = HeapTrimmer(every=int(every), above=float(above))
if when == "early":
    trimmer.after_step(int(every))
blocks = [bytearray(4000) for _ in range(100_000)]
pin = bytearray(4000)
del blocks
freed = resident_bytes() / 2**20
for step in steps:
    trimmer.after_step(int(step))
print(freed, resident_bytes() / 2**20, trimmer.trims)
"""


def rss_after(every: int, *steps: int, above: float = 0.0,
              when: str = "late") -> tuple[float, float, int]:
    """(MB resident after the freeing, MB after the steps, trims made)."""
    res = subprocess.run([sys.executable, "-c", FRAGMENT, str(every), str(above), when,
                          *map(str, steps)], capture_output=True, text=True, check=True)
    freed, after, trims = res.stdout.split()
    return float(freed), float(after), int(trims)


def test_a_trim_step_returns_the_freed_heap():
    freed, after, trims = rss_after(3, 1, 2, 3)  # step 3 checks; above=0 always trims
    assert freed > 300, "the freed blocks must still be resident before the trim"
    assert after < freed - 300
    assert trims == 1


def test_no_trim_between_trim_steps():
    freed, after, trims = rss_after(10, 1, 2, 3)  # steps 1-3: none is a check
    assert freed > 300
    assert after > freed - 50
    assert trims == 0


def test_trims_once_the_heap_has_grown_past_the_first_check():
    # the first check saw the small heap; 400 MB more is far past 1.25x it
    freed, after, trims = rss_after(3, 4, 5, 6, above=1.25, when="early")
    assert freed > 300
    assert after < freed - 300
    assert trims == 1


def test_no_trim_while_the_heap_holds_its_first_size():
    # the first check (step 3) saw the fragmented heap; at step 6 it has not grown
    freed, after, trims = rss_after(3, 3, 4, 5, 6, above=1.25)
    assert after > freed - 50
    assert trims == 0


def test_trims_at_the_checks_above_the_limit(monkeypatch):
    calls = []
    monkeypatch.setattr("aiayn.memory.malloc_trim", lambda: lambda: calls.append(1) or 1)
    sizes = iter([100, 120, 130, 90, 126, 125])
    trimmer = HeapTrimmer(every=2, above=1.25, resident=lambda: next(sizes))
    checked = []
    for step in range(1, 13):
        before = len(calls)
        trimmer.after_step(step)
        if len(calls) > before:
            checked.append(step)
    assert trimmer.limit == 125  # 1.25 x the first check's 100
    assert checked == [6, 10]  # 130 and 126 exceed 125; 120, 90 and 125 do not
    assert trimmer.trims == 2


def test_disabled_does_nothing():
    assert not HeapTrimmer(enabled=False).active
    assert HeapTrimmer().active

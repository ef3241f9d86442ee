"""When a training run checkpoints and stops, and how its time is counted.

:class:`Clock` is the run's time over all its sessions (a resumed run goes on from the
checkpoint's), the time budget (``train.max_minutes``, as fairseq's --stop-time-hours), and
the open log row's window: the training seconds a row's tokens/s is computed over, with
validation and checkpoints paused out. :class:`CheckpointPolicy` says when a checkpoint is
due (every N steps and/or T minutes). Every reading of time in training goes through here,
so that a test can run a whole loop on a clock of its own.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field


class Clock:
    """``elapsed_s``: the run's training time before this process; ``max_minutes``: its
    budget (0: none); ``window_s``: the open log row's training seconds before this process
    (a checkpoint saves them, so that the row after a resume holds an unbroken run's rate).
    """

    def __init__(self, elapsed_s: float = 0.0, max_minutes: float = 0.0,
                 window_s: float = 0.0):
        self._start = time.perf_counter()
        self._before = elapsed_s
        self.budget_s = 60 * max_minutes if max_minutes else math.inf
        self._window_start = self._start - window_s
        self._paused = 0.0  # seconds paused in the open window
        self._pause_start: float | None = None

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    def elapsed(self) -> float:
        """The run's training time so far, over all its sessions."""
        return self._before + time.perf_counter() - self._start

    def spent(self, elapsed_s: float) -> bool:
        """Whether a run at ``elapsed_s`` has used its budget."""
        return elapsed_s >= self.budget_s

    def pause(self) -> None:
        """Validation or a checkpoint starts: its time is the run's, not the window's."""
        self._pause_start = time.perf_counter()

    def resume(self) -> None:
        if self._pause_start is not None:
            self._paused += time.perf_counter() - self._pause_start
            self._pause_start = None

    def window_s(self) -> float:
        """The open window's training seconds so far (up to a pause that is under way)."""
        end = self._pause_start if self._pause_start is not None else time.perf_counter()
        return end - self._window_start - self._paused

    def close_window(self) -> float:
        """The closing row's training seconds; the next window starts now."""
        now = time.perf_counter()
        seconds = now - self._window_start - self._paused
        self._window_start, self._paused = now, 0.0
        return seconds


@dataclass
class CheckpointPolicy:
    """A checkpoint is due every ``every_steps`` steps and/or every ``every_minutes`` minutes
    since the last one (0: not by that rule)."""

    every_steps: int = 0
    every_minutes: float = 0.0
    _last: float = field(default_factory=time.monotonic)

    def due(self, step: int) -> bool:
        by_steps = bool(self.every_steps) and step % self.every_steps == 0
        by_time = (bool(self.every_minutes)
                   and time.monotonic() - self._last >= 60 * self.every_minutes)
        return by_steps or by_time

    def saved(self) -> None:
        self._last = time.monotonic()

"""What the benchmarks print about the machine they ran on (shared by the bench scripts).

The CPU's name and the instruction caps come from ``aiayn.precision``, which records the
same in a training's metrics."""

from __future__ import annotations

from aiayn.precision import INSTRUCTION_CAPS, cpu_model, instruction_caps, instruction_caps_text

__all__ = ["INSTRUCTION_CAPS", "cpu_model", "describe_caps", "instruction_caps"]


def describe_caps() -> str:
    """'' when nothing is capped, else ', capped by NAME=VALUE ...' for a figure's header."""
    caps = instruction_caps_text()
    return f", capped by {caps}" if caps else ""

"""bench/gpu_session.sh: which parts a PARTS list runs (its `want` function, run by bash),
and the script's syntax. The parts themselves need a GPU machine and are not run here."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu_session.sh"


def script_function(name: str, calls: str, args: list[str], env: dict | None = None) -> list[str]:
    """The words printed by ``calls`` (bash, the arguments in "$@") with the script's function
    ``name`` defined, as the script defines it, and nothing else of the script run."""
    probe = f'source <(sed -n "/^{name}() {{/,/^}}/p" "$1"); shift; {calls}'
    out = subprocess.run(["bash", "-c", probe, "probe", str(SCRIPT), *args],
                         env={**(env or {}), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, check=True)
    return out.stdout.split()


def wanted(parts: str, names: list[str]) -> list[str]:
    """The names among ``names`` that the script's `want` selects under PARTS=``parts``."""
    return script_function("want", 'for n in "$@"; do want "$n" && echo "$n"; done; true',
                           names, {"PARTS": parts})


@pytest.mark.parametrize("parts, expected", [
    ("1 2 3", ["1a", "1c", "2", "3"]),  # part 1 whole runs its sub-parts, not part 11
    ("1c 3", ["1c", "3"]),
    ("9 11", ["9", "11"]),  # part 11 is not part 1's
    ("4 6 7 8", ["4", "6", "7", "8"]),
])
def test_parts_select_what_they_name(parts, expected):
    names = ["1a", "1c", "2", "3", "4", "6", "7", "8", "9", "11"]
    assert wanted(parts, names) == [n for n in names if n in expected]


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_every_part_the_header_lists_has_its_block_and_no_other():
    """The header's list of parts (one line each) names exactly the parts the script runs."""
    import re

    text = SCRIPT.read_text()
    listed = re.findall(r"^#\s+(\d+[a-z]?)\.\s", text, re.M)
    blocks = re.findall(r"^if want (\S+); then", text, re.M)
    assert sorted(listed) == sorted(blocks) and len(set(blocks)) == len(blocks)


def own_data(settings: str) -> list[str]:
    """What the script's `own_data` picks out of an arm's settings ``settings``."""
    return script_function("own_data", 'own_data "$1"', [settings])


@pytest.mark.parametrize("settings, expected", [
    ("model.dropout=0.3", []),  # trains on the part's shared data
    ("model.dropout=0.3 vocab.vocab_size=10260", ["vocab.vocab_size=10260"]),
    # every data stage's section, in the arm's order; train.* and model.* stay out
    ("shard.max_len=64 train.steps=5 data.src_lang=de survey.max_len_candidates=[32] "
     "model.d_model=128", ["shard.max_len=64", "data.src_lang=de",
                           "survey.max_len_candidates=[32]"]),
    ("", []),
])
def test_an_arm_that_sets_the_data_stages_gets_its_own_data(settings, expected):
    assert own_data(settings) == expected


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


@pytest.mark.skipif(_cuda_available(), reason="the check lets a machine with a GPU through")
def test_without_a_gpu_the_script_stops_before_any_part(tmp_path):
    """Where torch sees no CUDA device, the script says so and exits 1 before part 1a,
    instead of writing CPU measurements under the GPU parts' names."""
    import sys
    out = tmp_path / "out"
    run = subprocess.run(["bash", str(SCRIPT)], cwd=SCRIPT.parent.parent, capture_output=True,
                         text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PY": sys.executable, "OUT": str(out),
                              "PARTS": "1a", "HOME": str(tmp_path)})
    assert run.returncode == 1
    log = (out / "session.log").read_text()
    assert "NO GPU: torch sees no CUDA device here" in log
    assert "=== 1a." not in log and not list(out.glob("gpu_step*.json"))

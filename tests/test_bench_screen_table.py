"""bench/screen_table.py: the summary lines of a recipe screen's runs, read back into a table
of per-arm means and seed-paired differences."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import screen_table


def run_folder(root: Path, name: str, bleu: float | None, steps: int = 1750,
               nll: float = 1.87) -> Path:
    """A run folder as the screen's stages leave it; bleu None: scoring never ran."""
    metrics = root / name / "metrics"
    metrics.mkdir(parents=True)
    (metrics / "train.json").write_text(json.dumps(
        {"steps": steps, "stopped_by": "steps", "valid_nll": nll}))
    (metrics / "average.json").write_text(json.dumps(
        {"averaged": 3, "candidates": {"1": 37.9, "3": 38.0}}))
    if bleu is not None:
        (metrics / "bleu_valid.json").write_text(json.dumps({"sacrebleu": {"score": bleu}}))
    return root / name


def test_summary_lines_read_back_into_means_and_paired_differences(tmp_path):
    scores = {("preset", 1): 39.5, ("preset", 2): 39.0, ("preset", 3): 39.3,
              ("dropout0.1", 1): 40.0, ("dropout0.1", 2): 38.8,
              ("lr0.7", 4): 38.0}  # a seed the baseline never ran: no pair
    runs = [run_folder(tmp_path, f"{arm}-s{seed}", bleu, nll=1.8 + seed / 100)
            for (arm, seed), bleu in scores.items()]
    runs.append(run_folder(tmp_path, "warmup300-s1", None))  # unfinished: left out
    lines = [screen_table.summary_line(r) for r in runs]
    log = tmp_path / "session.log"
    log.write_text("\n".join(["=== 4. recipe screen (09:00:00)", *lines, "=== done"]) + "\n")

    read = screen_table.read_runs([log])
    assert set(read) == {"preset", "dropout0.1", "lr0.7"}
    for (arm, seed), bleu in scores.items():
        assert read[arm][seed] == {"steps": 1750, "end": "steps", "nll": 1.8 + seed / 100,
                                   "averaged": 3, "bleu": bleu}

    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")
            for line in screen_table.table(read, "preset").splitlines()[2:]}
    assert list(rows) == ["preset", "dropout0.1", "lr0.7"]  # the baseline first
    assert rows["preset"][3] == f"{(39.5 + 39.0 + 39.3) / 3:.2f}"
    # dropout0.1 against preset on seeds 1 and 2: +0.5 and -0.2, mean +0.15;
    # standard error = stdev(0.5, -0.2) / sqrt(2) = 0.35
    assert rows["dropout0.1"][4] == "+0.15 ± 0.35 over 2 (1 of 2 higher)"
    assert rows["lr0.7"][4] == ""  # no seed in common with the baseline
    with pytest.raises(SystemExit, match="no runs of the baseline arm 'tiny'"):
        screen_table.table(read, "tiny")

"""bench/sweep_table.py: a `dvc exp show --json` as the sweep's Markdown and CSV table.

The JSON here has the layout dvc 3 prints (a workspace entry, then each baseline commit with
its experiments, each experiment's data under ``revs[0]``); the queued sweep in
tests/test_experiments.py runs the script on real `dvc exp show` output.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from bench import sweep_table


def entry(params: dict, valid: float | None, test: float | None = None,
          minutes: float | None = None) -> dict:
    metrics = {}
    if valid is not None:
        metrics["metrics/bleu_valid.json"] = {"data": {
            "sacrebleu": {"score": valid}, "lowercase_bleu": {"score": valid + 0.25}}}
    if test is not None:
        metrics["metrics/bleu.json"] = {"data": {
            "sacrebleu": {"score": test}, "lowercase_bleu": {"score": test + 0.5},
            "chrf": {"score": 60.0 + test / 10}}}
    if minutes is not None:
        metrics["metrics/train.json"] = {"data": {
            "wall_time_s": minutes * 60, "steps": 3009, "stopped_by": "steps",
            "best_valid_bleu": valid - 1.0, "best_valid_bleu_step": 3000}}
    return {"rev": "workspace", "name": None, "error": None, "experiments": None,
            "data": {"params": {"params.yaml": {"data": params}}, "metrics": metrics}}


def params(ls: float = 0.1, seed: int = 1, beam: int = 8) -> dict:
    return {"seed": seed, "data": {"local": {"dir": "/somewhere/else"}},
            "train": {"label_smoothing": ls, "steps": 3009}, "decode": {"beam": beam}}


def experiment(name: str, rev: str, data: dict) -> dict:
    return {"name": name, "executor": None, "revs": [{**data, "rev": rev, "name": name}]}


@pytest.fixture
def shown(tmp_path: Path) -> Path:
    """The workspace (no scores yet), a baseline commit and five experiments of it."""
    base = entry(params(), valid=40.21, test=38.0, minutes=55.0)
    base["rev"] = "9e4e6871234567"
    base["experiments"] = [
        experiment("ls0.2", "aaaaaaa1", entry(params(0.2), 40.91, test=39.92, minutes=62.1)),
        experiment("ls0.3", "bbbbbbb2", entry(params(0.3), 41.22, test=39.44, minutes=63.6)),
        experiment("ls0.3-seed2", "ccccccc3",
                   entry(params(0.3, seed=2), 40.80, test=39.66, minutes=60.0)),
        # decoding only: no training metrics of its own
        experiment("ls0.3-b4", "ddddddd4", entry(params(0.3, beam=4), 40.50, test=39.0)),
        # queued or failed: no scores, so no row
        experiment("queued", "eeeeeee5", entry(params(0.4), None)),
    ]
    # The workspace holds whatever ran last; it is no reference for what changed.
    workspace = entry(params(0.4), valid=None)
    path = tmp_path / "shown.json"
    path.write_text(json.dumps([workspace, base]))
    return path


def rows_by_name(text: str) -> dict[str, list[str]]:
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    return {row[0].strip("*"): row for row in cells[1:]}


def test_one_row_per_scored_experiment_with_what_it_changed(shown, capsys):
    text = sweep_table.main(["--json", str(shown), "--chosen", "ls0.3,ls0.3-seed2"])
    assert capsys.readouterr().out == text
    rows = rows_by_name(text)
    assert list(rows) == ["baseline 9e4e687", "ls0.2", "ls0.3", "ls0.3-seed2", "ls0.3-b4"]
    # Changed params against the first row; the corpus folder (machine-specific) never shows.
    assert rows["baseline 9e4e687"][1] == "(baseline)"
    assert rows["ls0.2"][1] == "train.label_smoothing=0.2"
    assert rows["ls0.3-seed2"][1] == "seed=2, train.label_smoothing=0.3"
    assert rows["ls0.3-b4"][1] == "train.label_smoothing=0.3, decode.beam=4"
    # Valid scores for every row; minutes and steps where a training ran.
    assert rows["ls0.3"][2:7] == ["41.22", "41.47", "40.22 (3000)", "63.6", "3009 (steps)"]
    assert rows["ls0.3-b4"][2:7] == ["40.50", "40.75", "– (–)", "–", "– (–)"]
    # Test scores for the chosen rows only, in bold; the others say they were not read.
    assert rows["ls0.3"][7:] == ["39.44", "39.94", "63.94"]
    assert rows["ls0.3-seed2"][7:] == ["39.66", "40.16", "63.97"]
    assert rows["ls0.2"][7:] == ["not read"] * 3
    assert "| **ls0.3** |" in text and "| ls0.2 |" in text


def test_base_and_names_choose_the_reference_row_and_the_order(shown):
    text = sweep_table.main(["--json", str(shown), "--base", "ls0.3",
                             "--names", "ls0.3-b4,ls0.3,ls0.2"])
    rows = rows_by_name(text)
    assert list(rows) == ["ls0.3-b4", "ls0.3", "ls0.2"]
    assert rows["ls0.3"][1] == "(baseline)"
    assert rows["ls0.3-b4"][1] == "decode.beam=4"
    assert rows["ls0.2"][1] == "train.label_smoothing=0.2"


def test_markdown_and_csv_files_hold_the_printed_rows(shown, tmp_path):
    out, table_csv = tmp_path / "out" / "sweep.md", tmp_path / "out" / "sweep.csv"
    text = sweep_table.main(["--json", str(shown), "--chosen", "ls0.3",
                             "--out", str(out), "--csv", str(table_csv)])
    assert out.read_text() == text
    with table_csv.open(newline="") as f:
        read = list(csv.reader(f))
    printed = rows_by_name(text)
    assert read[0][0] == "experiment" and len(read) == 1 + len(printed)
    for row in read[1:]:
        assert row == [c.strip("*") for c in printed[row[0]]]  # no Markdown bold in the CSV
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(".")]


def test_a_scored_workspace_is_a_row_of_its_own(shown):
    data = json.loads(shown.read_text())
    data[0] = entry(params(0.4), valid=41.03, minutes=61.0)
    shown.write_text(json.dumps(data))
    rows = rows_by_name(sweep_table.main(["--json", str(shown)]))
    assert rows["workspace"][1:3] == ["train.label_smoothing=0.4", "41.03"]
    rows = rows_by_name(sweep_table.main(["--json", str(shown), "--base", "workspace"]))
    assert rows["workspace"][1] == "(baseline)"
    assert rows["baseline 9e4e687"][1] == "train.label_smoothing=0.1"


@pytest.mark.parametrize("argv, says", [
    (["--base", "ls9"], "--base ls9: no such row; the rows are workspace, baseline 9e4e687, ls0.2"),
    (["--names", "ls0.3,nope"], "no experiment named nope"),
])
def test_an_unknown_row_is_an_error_and_writes_nothing(shown, tmp_path, argv, says):
    out = tmp_path / "sweep.md"
    with pytest.raises(SystemExit) as exc:
        sweep_table.main(["--json", str(shown), "--out", str(out), *argv])
    assert says in str(exc.value)
    assert not out.exists()


def test_without_dvc_on_path_it_says_how_to_run_it(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no dvc there
    with pytest.raises(SystemExit) as exc:
        sweep_table.main([])
    assert "no `dvc` on PATH" in str(exc.value) and "--json" in str(exc.value)

"""bench/sweep_table.py: a sweep's experiments, read by aiayn.experiments.dvc_exps, as one
Markdown and CSV table.

The rows here have the layout dvc.api.exp_show returns (the workspace, a baseline commit,
its experiments; see tests/test_table3.py), each finished experiment's files those of its
commit; the queued sweep in tests/test_experiments.py runs the script on a real repository.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml

from aiayn.experiments import dvc_exps
from bench import sweep_table


def files(params: dict, valid: float | None, test: float | None = None,
          minutes: float | None = None) -> dict[str, bytes]:
    """A commit's params.yaml and metrics files, as `git show REV:PATH` gives them."""
    out = {"params.yaml": yaml.safe_dump(params, sort_keys=False).encode()}
    if valid is not None:
        out["metrics/bleu_valid.json"] = json.dumps({
            "sacrebleu": {"score": valid}, "lowercase_bleu": {"score": valid + 0.25}}).encode()
    if test is not None:
        out["metrics/bleu.json"] = json.dumps({
            "sacrebleu": {"score": test}, "lowercase_bleu": {"score": test + 0.5},
            "chrf": {"score": 60.0 + test / 10}}).encode()
    if minutes is not None:
        out["metrics/train.json"] = json.dumps({
            "wall_time_s": minutes * 60, "steps": 3009, "stopped_by": "steps",
            "best_valid_bleu": valid - 1.0, "best_valid_bleu_step": 3000}).encode()
    return out


def params(ls: float = 0.1, seed: int = 1, beam: int = 8) -> dict:
    return {"seed": seed, "data": {"local": {"dir": "/somewhere/else"}},
            "train": {"label_smoothing": ls, "steps": 3009}, "decode": {"beam": beam}}


def row(name: str | None, rev: str, state: str | None = None,
        typ: str = "branch_commit") -> dict:
    """A row of dvc.api.exp_show (its metrics and params cells left out: not read)."""
    return {"Experiment": name, "rev": rev, "typ": typ,
            "Created": None if rev == "workspace" else "Jun 02, 2025", "parent": None,
            "State": state, "Executor": "Dvc-task" if state else None}


@pytest.fixture
def repo(tmp_path: Path, monkeypatch) -> dict:
    """The workspace (no scores yet), a baseline commit and six experiments of it, read
    through aiayn.experiments.dvc_exps; what exp_show was asked is recorded."""
    commits = {
        "9e4e687": files(params(), valid=40.21, test=38.0, minutes=55.0),
        "aaaaaaa": files(params(0.2), 40.91, test=39.92, minutes=62.1),
        "bbbbbbb": files(params(0.3), 41.22, test=39.44, minutes=63.6),
        "ccccccc": files(params(0.3, seed=2), 40.80, test=39.66, minutes=60.0),
        # decoding only: no training metrics of its own
        "ddddddd": files(params(0.3, beam=4), 40.50, test=39.0),
        # queued, or failed: their commits hold the baseline's scores, which are not theirs
        "eeeeeee": files(params(0.4), 40.21, test=38.0, minutes=55.0),
        "fffffff": files(params(0.5), 40.21, test=38.0, minutes=55.0),
    }
    rows = [row(None, "workspace", typ="baseline"), row(None, "9e4e687", typ="baseline"),
            row("ls0.2", "aaaaaaa", "Success"), row("ls0.3", "bbbbbbb"),
            row("ls0.3-seed2", "ccccccc", "Success"), row("ls0.3-b4", "ddddddd"),
            row("queued", "eeeeeee", "Queued"), row("failed", "fffffff", "Failed")]
    # The workspace holds whatever ran last; it is no reference for what changed.
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params(0.4)))
    asked: dict = {}

    def exp_show(root: Path, all_commits: bool = False) -> list[dict]:
        asked.update(root=root, all_commits=all_commits)
        return [dict(r) for r in rows]

    monkeypatch.setattr(dvc_exps, "dvc_root", lambda: tmp_path)
    monkeypatch.setattr(dvc_exps, "exp_show", exp_show)
    monkeypatch.setattr(dvc_exps, "git_file",
                        lambda rev, path, root: commits[rev].get(path))
    return {"asked": asked, "root": tmp_path}


def rows_by_name(text: str) -> dict[str, list[str]]:
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    return {row[0].strip("*"): row for row in cells[1:]}


def test_one_row_per_scored_experiment_with_what_it_changed(repo, capsys):
    text = sweep_table.main(["--chosen", "ls0.3,ls0.3-seed2"])
    assert capsys.readouterr().out == text
    assert repo["asked"] == {"root": repo["root"], "all_commits": False}
    rows = rows_by_name(text)
    # Neither the queued nor the failed one: DVC lists them with the baseline's scores.
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
    sweep_table.main(["-A"])
    assert repo["asked"]["all_commits"] is True


def test_base_and_names_choose_the_reference_row_and_the_order(repo):
    text = sweep_table.main(["--base", "ls0.3", "--names", "ls0.3-b4,ls0.3,ls0.2"])
    rows = rows_by_name(text)
    assert list(rows) == ["ls0.3-b4", "ls0.3", "ls0.2"]
    assert rows["ls0.3"][1] == "(baseline)"
    assert rows["ls0.3-b4"][1] == "decode.beam=4"
    assert rows["ls0.2"][1] == "train.label_smoothing=0.2"


def test_markdown_and_csv_files_hold_the_printed_rows(repo, tmp_path):
    out, table_csv = tmp_path / "out" / "sweep.md", tmp_path / "out" / "sweep.csv"
    text = sweep_table.main(["--chosen", "ls0.3", "--out", str(out), "--csv", str(table_csv)])
    assert out.read_text() == text
    with table_csv.open(newline="") as f:
        read = list(csv.reader(f))
    printed = rows_by_name(text)
    assert read[0][0] == "experiment" and len(read) == 1 + len(printed)
    for row in read[1:]:
        assert row == [c.strip("*") for c in printed[row[0]]]  # no Markdown bold in the CSV
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(".")]


def test_saved_experiments_give_the_same_table_elsewhere(repo, tmp_path, monkeypatch):
    saved = tmp_path / "saved" / "experiments.json"
    text = sweep_table.main(["--chosen", "ls0.3", "--save-json", str(saved)])
    monkeypatch.setattr(dvc_exps, "exp_show", None)  # --json reads no repository
    assert sweep_table.main(["--json", str(saved), "--chosen", "ls0.3"]) == text
    legacy = tmp_path / "shown.json"  # a `dvc exp show --json`: said, not misread
    legacy.write_text(json.dumps([{"rev": "workspace", "name": None, "experiments": None}]))
    with pytest.raises(SystemExit, match="not the experiments --save-json writes"):
        sweep_table.main(["--json", str(legacy)])


def test_a_scored_workspace_is_a_row_of_its_own(repo):
    (repo["root"] / "metrics").mkdir()
    for path, data in files(params(0.4), valid=41.03, minutes=61.0).items():
        (repo["root"] / path).write_bytes(data)
    rows = rows_by_name(sweep_table.main([]))
    assert rows["workspace"][1:3] == ["train.label_smoothing=0.4", "41.03"]
    rows = rows_by_name(sweep_table.main(["--base", "workspace"]))
    assert rows["workspace"][1] == "(baseline)"
    assert rows["baseline 9e4e687"][1] == "train.label_smoothing=0.1"


@pytest.mark.parametrize("argv, says", [
    (["--base", "ls9"], "--base ls9: no such row; the rows are workspace, baseline 9e4e687, ls0.2"),
    (["--names", "ls0.3,nope"], "no experiment named nope"),
])
def test_an_unknown_row_is_an_error_and_writes_nothing(repo, tmp_path, argv, says):
    out = tmp_path / "sweep.md"
    with pytest.raises(SystemExit) as exc:
        sweep_table.main(["--out", str(out), *argv])
    assert says in str(exc.value)
    assert not out.exists()


def test_outside_a_dvc_repository_it_says_how_to_run_it(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        sweep_table.main([])
    assert "not inside a DVC repository" in str(exc.value) and "--json" in str(exc.value)

"""The umbrella command: every stage is a subcommand whose --help says what it reads and writes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from stages.cli import app

SUBCOMMANDS = ("params", "download", "vocab", "survey", "shard", "train", "average",
               "translate", "score", "export", "attention", "results", "table3")


def help_text(*args: str) -> str:
    result = CliRunner().invoke(app, [*args, "--help"], terminal_width=200,
                                env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    return re.sub(r"\s+", " ", result.output.replace("│", " "))


def test_the_umbrella_lists_every_stage():
    text = help_text()
    for name in SUBCOMMANDS:
        assert re.search(rf"\b{name}\b", text), name


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_each_help_says_what_it_reads_and_writes(name):
    text = help_text(name)
    assert "Reads:" in text and "Writes:" in text, text
    # Every option and argument of the command is in its help.
    command = typer.main.get_command(app).commands[name]
    assert command.params
    for param in command.params:
        shown = param.opts[0] if param.opts[0].startswith("-") else param.name
        assert shown in text, (name, shown)


# Runs `aiayn <args>` through the console entry point, then reports which heavy libraries
# the process had loaded.
IMPORT_PROBE = r"""
import sys
from stages.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    assert exc.code in (0, None), exc.code
print(sorted(m for m in ("torch", "mlflow") if m in sys.modules))
"""


def loaded_by(*args: str) -> list[str]:
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", IMPORT_PROBE, *args], capture_output=True,
                         text=True, env={"COLUMNS": "200", "NO_COLOR": "1", "PATH": ""})
    assert res.returncode == 0, res.stderr
    return eval(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ("download", "vocab", "survey", "shard"))
def test_a_data_stage_loads_neither_torch_nor_mlflow(name):
    assert loaded_by(name, "--help") == []


def test_the_training_stage_and_the_full_help_load_torch():
    # The probe can see torch: a stage that needs it, and the listing of all stages, load it.
    assert "torch" in loaded_by("train", "--help")
    assert "torch" in loaded_by("--help")


def test_a_single_loaded_stage_parses_like_the_full_app():
    from stages.cli import build_app

    lone = typer.main.get_command(build_app(["vocab"])).commands["vocab"]
    full = typer.main.get_command(app).commands["vocab"]
    assert [p.opts for p in lone.params] == [p.opts for p in full.params]
    assert help_text("vocab") == re.sub(r"\s+", " ", CliRunner().invoke(
        build_app(["vocab"]), ["vocab", "--help"], terminal_width=200,
        env={"COLUMNS": "200", "NO_COLOR": "1"}).output.replace("│", " "))


def test_results_prints_the_numbers_of_the_metrics_files(tmp_path):
    from aiayn.io import write_json

    metrics = tmp_path / "metrics"
    write_json(metrics / "bleu.json", {
        "direction": "en-de", "split": "test", "sentences": 1000,
        "hypotheses": "data/translations/test.de",
        "sacrebleu": {"score": 39.2188, "signature": "nrefs:1|case:mixed|tok:13a"},
        "chrf": {"score": 62.7, "signature": "chrF2"},
        "tokenized_bleu": {"score": 39.31}, "lowercase_bleu": {"score": 39.63}})
    write_json(metrics / "average.json", {
        "average": "last", "averaged": 1, "first_step": 1683, "last_step": 1683,
        "candidates": {"1": 38.0536, "3": 37.79, "10": 36.05}})
    result = CliRunner().invoke(app, ["results", "--metrics", str(metrics),
                                      "--checkpoints", str(tmp_path / "none"),
                                      "--model", str(tmp_path / "none")])
    assert result.exit_code == 0, result.output
    assert re.search(r"sacreBLEU\s+39\.22\s+nrefs:1\|case:mixed\|tok:13a", result.output)
    assert re.search(r"lowercased BLEU\s+39\.63", result.output)
    assert "the last 1 checkpoint(s), step 1683" in result.output
    assert "(1: 38.05, 3: 37.79, 10: 36.05)" in result.output
    assert "MLflow run      none recorded" in result.output


@pytest.mark.parametrize("stopped_by,last_step,note", [
    ("steps", 1683, None),
    ("interrupted", 1500, "training was interrupted at step 1683"),
    ("time budget", 1500, "the model averages checkpoints up to step 1500, but training is at "
     "step 1683"),
])
def test_results_say_when_the_scores_are_not_those_of_the_last_training(
        tmp_path, stopped_by, last_step, note):
    from aiayn.io import write_json

    metrics = tmp_path / "metrics"
    write_json(metrics / "bleu.json", {
        "direction": "en-de", "split": "test", "sentences": 10, "hypotheses": "h",
        "sacrebleu": {"score": 30.0, "signature": "s"}, "chrf": {"score": 50.0, "signature": "c"},
        "tokenized_bleu": {"score": 30.0}})
    # stopped before its first validation: no perplexity yet
    ppl = None if stopped_by == "interrupted" else 5.0
    write_json(metrics / "train.json", {
        "steps": 1683, "valid_ppl": ppl, "wall_time_s": 60.0, "tokens_per_s": 1000.0,
        "precision": "fp32", "device": "cpu", "stopped_by": stopped_by, "max_minutes": 55})
    write_json(metrics / "average.json", {
        "average": "last", "averaged": 1, "first_step": last_step, "last_step": last_step,
        "candidates": {"1": 30.0, "3": 29.0}, "candidates_beam": 4})
    result = CliRunner().invoke(app, ["results", "--metrics", str(metrics),
                                      "--checkpoints", str(tmp_path / "none"),
                                      "--model", str(tmp_path / "none")])
    assert result.exit_code == 0, result.output
    assert "chosen by beam-4 valid sacreBLEU of each count" in result.output
    assert ("1683 steps, no validation yet" if ppl is None
            else "1683 steps, valid perplexity 5.00") in result.output
    if note is None:
        assert "note:" not in result.output
    else:
        assert "note: " + note in " ".join(result.output.split())


def write_scores(metrics: Path, sacrebleu: float) -> Path:
    """A METRICS/bleu.json with this test sacreBLEU (the rest as the score stage writes it)."""
    from aiayn.io import write_json

    write_json(metrics / "bleu.json", {
        "direction": "en-de", "split": "test", "sentences": 10, "hypotheses": "h",
        "sacrebleu": {"score": sacrebleu, "signature": "s"},
        "chrf": {"score": 50.0, "signature": "c"}, "tokenized_bleu": {"score": 30.0}})
    return metrics


@pytest.mark.parametrize("uri,how", [
    ("http://tracker:5000", "open http://tracker:5000 in a browser"),
    ("sqlite:////work/mlflow.db", "mlflow ui --backend-store-uri sqlite:////work/mlflow.db"),
])
def test_results_say_where_the_mlflow_run_is_and_how_to_open_it(tmp_path, uri, how):
    from aiayn.io import write_json
    from aiayn.tracking import RUN_FILE

    metrics = write_scores(tmp_path / "metrics", 30.0)
    write_json(tmp_path / "checkpoints" / RUN_FILE, {"run_id": "0123abcd", "tracking_uri": uri})
    result = CliRunner().invoke(app, ["results", "--metrics", str(metrics), "--checkpoints",
                                      str(tmp_path / "checkpoints"), "--model",
                                      str(tmp_path / "none")])
    assert result.exit_code == 0, result.output
    assert f"MLflow run      0123abcd in {uri}" in result.output
    assert how in result.output


@pytest.mark.parametrize("min_bleu,code", [(None, 0), ("39.2", 0), ("39.3", 1)])
def test_results_fail_below_the_bleu_a_run_must_reach(tmp_path, min_bleu, code):
    metrics = write_scores(tmp_path / "metrics", 39.2188)
    args = ["results", "--metrics", str(metrics), "--checkpoints", str(tmp_path / "none"),
            "--model", str(tmp_path / "none")]
    result = CliRunner().invoke(app, args + (["--min-bleu", min_bleu] if min_bleu else []))
    assert result.exit_code == code, result.output
    assert re.search(r"sacreBLEU\s+39\.22", result.output)  # printed either way
    said = "test sacreBLEU 39.22 is below --min-bleu 39.3"
    assert (said in " ".join(result.output.split())) == (code == 1)


def test_results_before_any_run_says_what_to_run(tmp_path):
    result = CliRunner().invoke(app, ["results", "--metrics", str(tmp_path)])
    assert result.exit_code == 1
    assert "no scores yet; run the pipeline" in result.output

"""The umbrella command: every stage is a subcommand whose --help says what it reads and writes."""

from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

from stages.cli import app

SUBCOMMANDS = ("params", "download", "vocab", "survey", "shard", "train", "average",
               "translate", "score", "attention", "results")


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

"""The umbrella command `aiayn`: one subcommand per pipeline stage."""

from __future__ import annotations

import typer

from stages.attention import attention
from stages.average import average
from stages.download import download
from stages.params import params
from stages.results import results
from stages.score import score
from stages.shard import shard
from stages.survey import survey
from stages.train import train
from stages.translate import translate
from stages.vocab import vocab

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    help=(
        "aiayn: the Transformer of 'Attention Is All You Need' as a DVC pipeline.\n\n"
        "Each subcommand is one stage of dvc.yaml and reads params.yaml (--params to change). "
        "Run the whole pipeline with `dvc repro`; run one stage by hand with its subcommand."
    ),
)
app.command("params")(params)
app.command("download")(download)
app.command("vocab")(vocab)
app.command("survey")(survey)
app.command("shard")(shard)
app.command("train")(train)
app.command("average")(average)
app.command("translate")(translate)
app.command("score")(score)
app.command("attention")(attention)
app.command("results")(results)

if __name__ == "__main__":
    app()

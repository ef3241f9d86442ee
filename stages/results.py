"""results: where the last pipeline run's numbers, curves, MLflow run and model are."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from aiayn.io import read_json
from stages.common import single_command_app


def _read(path: Path) -> dict | None:
    """The JSON at ``path``; None if it is missing or unreadable (not yet run)."""
    try:
        return read_json(path)
    except (OSError, ValueError):
        return None


def results(
    metrics: Annotated[Path, typer.Option(help="The metrics folder the stages wrote.")] = Path("metrics"),
    checkpoints: Annotated[Path, typer.Option(help="The train stage's checkpoint folder (holds the MLflow run id).")] = Path("data/checkpoints"),
    model: Annotated[Path, typer.Option(help="The averaged model folder.")] = Path("data/model"),
    table3: Annotated[bool, typer.Option("--table3", help="Instead: the paper's Table 3 from the `table3-*` DVC experiments of this commit (`aiayn table3 --queue`), beside the paper's values; written to METRICS/table3.md and printed, and drawn as each row's change from the base in METRICS/table3.png.")] = False,
    runs: Annotated[list[Path] | None, typer.Option("--runs", help="With --table3: read these run folders (`table3-<row>/` with params.yaml and metrics/, as bench/gpu_session.sh runs them without DVC, or as --save-runs writes them) instead of the DVC experiments.")] = None,
    min_bleu: Annotated[float | None, typer.Option("--min-bleu", help="Exit 1 (after printing) when the test sacreBLEU is below MIN_BLEU: a check that the run learned. `make demo` gives 60 (the demo preset reaches ~86-89 on a CPU; far below it, something in the install or the code is broken).")] = None,
    save_runs: Annotated[Path | None, typer.Option("--save-runs", help="With --table3, from the DVC experiments: also write each finished row as a run folder SAVE_RUNS/table3-<row>/ (params.yaml, metrics/ with the table's metrics and the training curves, copied from the experiment's commit), to be committed as a record or put in one table with rows run on other days or machines: `aiayn results --table3 --runs SAVE_RUNS/table3-*/`. A row whose folder exists stops it before anything is written.")] = None,
) -> None:
    """Print the last run's results and where everything is (not a DVC stage; reads only).

    Reads: METRICS/bleu.json, METRICS/bleu_valid.json, METRICS/train.json,
    METRICS/average.json, CHECKPOINTS/mlflow_run.json. Writes:
    nothing (standard output only). Exits non-zero when there are no scores yet (run
    `dvc repro` first), or when the test sacreBLEU is below --min-bleu.

    With --table3: reads the experiments of HEAD (DVC's Python API, and each finished
    one's params.yaml and metrics from its commit) and writes
    METRICS/table3.md, the paper's Table 3 layout with each row's experiment (params, steps,
    valid perplexity, valid BLEU, parameters) beside the paper's numbers; rows that have
    not run show –. Once the base row has run, METRICS/table3.png draws each row's change
    from the base in dev BLEU and perplexity, ours beside the paper's. A row that is the
    base on the base's params (multi30k's A-h4) shows the base's run, marked "(= base)".
    --save-runs keeps each finished row as a folder of its own, so that a table run in parts
    (a row a day, on several machines) is assembled with --runs.
    """
    if save_runs is not None and (not table3 or runs):
        typer.secho("error: --save-runs: give it with --table3 and without --runs (it saves "
                    "the rows of the DVC experiments as run folders)",
                    fg=typer.colors.RED, err=True)
        raise typer.Exit(code=2)
    if table3:
        _table3(metrics / "table3.md", runs, save_runs)
        return
    from aiayn.tracking import RUN_FILE, resolve_tracking_uri

    bleu, train = _read(metrics / "bleu.json"), _read(metrics / "train.json")
    if bleu is None:
        typer.secho(f"error: {metrics / 'bleu.json'}: no scores yet; run the pipeline "
                    "(`dvc repro`, or `make demo`)", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=1)
    echo = typer.echo
    average = _read(metrics / "average.json")
    if stale := _stale(train, average):
        typer.secho(f"note: {stale}", fg=typer.colors.YELLOW)
    echo(f"Results of the last run ({bleu['direction']}, {bleu['split']} split, "
         f"{bleu['sentences']} sentences):")
    echo(f"  sacreBLEU       {bleu['sacrebleu']['score']:6.2f}  {bleu['sacrebleu']['signature']}")
    echo(f"  chrF2           {bleu['chrf']['score']:6.2f}  {bleu['chrf']['signature']}")
    echo(f"  tokenized BLEU  {bleu['tokenized_bleu']['score']:6.2f}  (the paper's procedure; "
         "compare only with its 27.3/28.4)")
    if "lowercase_bleu" in bleu:
        echo(f"  lowercased BLEU {bleu['lowercase_bleu']['score']:6.2f}  (Moses tokens, "
             "multi-bleu -lc: the Multi30k papers' scale)")
    valid = _read(metrics / "bleu_valid.json")
    if valid:
        echo(f"  valid sacreBLEU {valid['sacrebleu']['score']:6.2f}  the same model on the "
             f"{valid['sentences']} valid sentences (choose recipes by this, not by test)")
    if train:
        ppl = ("no validation yet" if train.get("valid_ppl") is None
               else f"valid perplexity {train['valid_ppl']:.2f}")
        echo(f"  training        {train['steps']} steps, {ppl}, "
             f"{train['wall_time_s'] / 60:.1f} min, "
             f"{train['tokens_per_s']:,.0f} target tokens/s ({train['precision']}, "
             f"{train['device']}, {train.get('kernels', 'plain')} kernels)")
        if train.get("stopped_by") == "time budget":
            echo(f"                  stopped by the time budget (train.max_minutes "
                 f"{train['max_minutes']:g})")
        elif train.get("stopped_by") == "interrupted":
            echo("                  interrupted (run the train stage again to resume)")
        if train.get("best_valid_bleu") is not None:
            echo(f"  valid BLEU      {train['best_valid_bleu']:6.2f}  best while training, at "
                 f"step {train['best_valid_bleu_step']} (last {train['valid_bleu']:.2f}; "
                 f"{train['valid_bleu_share']:.1%} of the training time)")
    if average:
        steps = (f"step {average['last_step']}" if average["averaged"] == 1 else
                 f"steps {average['first_step']}..{average['last_step']}")
        echo(f"  averaged        the {average['average']} {average['averaged']} "
             f"checkpoint(s), {steps}")
        if average.get("candidates"):
            tried = ", ".join(f"{n}: {score:.2f}" for n, score in
                              sorted(average["candidates"].items(), key=lambda kv: int(kv[0])))
            beam = average.get("candidates_beam")
            how = ("greedy" if beam == 1 else f"beam-{beam}" if beam else "the") + " valid"
            echo(f"                  chosen by {how} sacreBLEU of each count ({tried})")
    echo("Where things are:")
    echo(f"  numbers         {metrics}/*.json   (dvc metrics show; dvc exp show)")
    echo(f"  curves          {metrics}/training_curves.png, {metrics}/survey_hist.png   "
         "(dvc plots show: all plots as HTML)")
    echo(f"  translations    {bleu['hypotheses']}")
    if model.is_dir():
        echo(f"  model           {model}/   (aiayn translate \"A man is walking his dog.\")")
    run = _read(checkpoints / RUN_FILE)
    if run and run.get("run_id"):
        uri = run.get("tracking_uri") or resolve_tracking_uri()
        echo(f"  MLflow run      {run['run_id']} in {uri}")
        if uri.startswith(("http://", "https://")):
            echo(f"                  open {uri} in a browser")
        else:
            echo(f"                  mlflow ui --backend-store-uri {uri}   "
                 "(then http://127.0.0.1:5000/#/experiments?workflowType=machine_learning, experiment 'aiayn': MLflow's model-training view)")
    else:
        echo("  MLflow run      none recorded (trained with --no-mlflow?)")
    if min_bleu is not None and (score := bleu["sacrebleu"]["score"]) < min_bleu:
        typer.secho(f"error: {metrics / 'bleu.json'}: test sacreBLEU {score:.2f} is below "
                    f"--min-bleu {min_bleu:g}: this run did not learn what it should. Look at "
                    f"{metrics}/training_curves.png (does the loss fall?) and "
                    "docs/troubleshooting.md", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=1)


def _stale(train: dict | None, average: dict | None) -> str | None:
    """Why the scores may not be those of the training in METRICS/train.json (None: no
    sign of it): training was interrupted after the model was averaged, or it went on past
    the checkpoints the model averages."""
    if not train:
        return None
    if train.get("stopped_by") == "interrupted":
        return (f"training was interrupted at step {train['steps']}; the scores below are "
                "those of the model averaged before it. Run `dvc repro` (training resumes) "
                "to bring them up to date.")
    if average and average.get("average") == "last" and average["last_step"] != train["steps"]:
        return (f"the model averages checkpoints up to step {average['last_step']}, but "
                f"training is at step {train['steps']}; run `dvc repro` to bring the scores "
                "up to date.")
    return None


def _table3(out: Path, runs: list[Path] | None = None, save: Path | None = None) -> None:
    from aiayn.experiments import table3 as t3

    if runs:
        names = {row.name for row in t3.PAPER_ROWS}
        for folder in runs:
            if not folder.is_dir():
                typer.secho(f"error: --runs {folder}: no such folder (give the run folders, "
                            "table3-<row>/, that hold params.yaml and metrics/)",
                            fg=typer.colors.RED, err=True)
                raise typer.Exit(code=2)
            if folder.name not in names:
                typer.secho(f"warning: --runs {folder}: not named after a row of the table "
                            f"(table3-base, table3-A-h1, ...; see `aiayn table3 --dry-run`): "
                            "left out", fg=typer.colors.YELLOW, err=True)
        _write_table3(out, t3.results_from_folders(runs))
        return
    from aiayn.errors import AiaynError
    from aiayn.experiments import dvc_exps

    try:
        root = dvc_exps.dvc_root()
        found = t3.results_from_experiments(dvc_exps.read(t3.REQUIRED_RUN_FILES))
    except AiaynError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=2) from None
    if save is not None:
        try:
            saved = t3.save_runs(found, save,
                                 lambda rev, path: dvc_exps.git_file(rev, path, root))
        except (t3.RunFolderError, AiaynError) as exc:
            typer.secho(f"error: --save-runs: {exc}", fg=typer.colors.RED, err=True)
            raise typer.Exit(code=2) from None
        typer.echo(f"saved {len(saved)} row(s) as run folders in {save}: "
                   + (", ".join(p.name for p in saved) or "none has finished"), err=True)
    _write_table3(out, found)


def _write_table3(out: Path, found: dict) -> None:
    from aiayn.experiments import table3 as t3
    from aiayn.io import write_text

    ran = sum(row.name in found for row in t3.PAPER_ROWS)
    found = t3.with_rows_equal_to_base(found)
    same = sum(row.name in found for row in t3.PAPER_ROWS) - ran
    text = t3.render_table(found)
    write_text(out, text)
    typer.echo(text, nl=False)
    written = str(out)
    if t3.BASE in found:  # the picture compares each row with the base
        from aiayn.plots import plot_table3_changes

        picture = out.with_suffix(".png")
        plot_table3_changes(t3.changes_from_base(found), t3.base_summary(found), picture)
        written += f" and {picture}"
    typer.echo(f"({ran} of {len(t3.PAPER_ROWS)} rows have run"
               + (f", {same} more equal the base" if same else "")
               + f"; written to {written})")


app = single_command_app(results, "Print the last run's results and where they are.")

if __name__ == "__main__":
    app()

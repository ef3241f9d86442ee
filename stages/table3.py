"""table3: queue the paper's Table 3 as DVC experiments on top of the current params.

Not a pipeline stage: it reads params.yaml and conf/, and calls `dvc exp run --queue` once
per row (`dvc queue start` runs them; `aiayn results --table3` shows the table).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from aiayn.errors import AiaynError, ParamsError
from stages.common import log, single_command_app, stage

PLAIN = re.compile(r"^[A-Za-z0-9_./-]+$")


def hydra_value(value: Any) -> str:
    """``value`` in Hydra's override grammar (what `dvc exp run -S key=VALUE` parses)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if PLAIN.match(text) and isinstance(yaml.safe_load(text), str):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def base_of(params: Path, conf: Path, experiment: str | None) -> tuple[str, list[str]]:
    """The preset and the Hydra overrides that compose ``params`` from ``conf`` (what every
    row starts from: `dvc exp run` composes params.yaml from conf/ again, so the current
    params must be said as a preset plus overrides). Checked by composing them."""
    from stages.params import compose, nearest_preset

    if not params.is_file():
        raise ParamsError(f"{params}: no such params file; run from the repository root")
    current = yaml.safe_load(params.read_text(encoding="utf-8"))
    found = nearest_preset(current, conf, [experiment] if experiment else None)
    if found is None:
        raise ParamsError(f"{conf}/experiment: no presets")
    preset, changed = found
    overrides = [f"{key}={hydra_value(value)}" for key, value in changed.items()]
    if yaml.safe_load(compose(conf, preset, overrides)) != current:
        raise ParamsError(
            f"{params} is not the composition of {conf}/ with preset {preset!r} and the "
            f"overrides {overrides}; compose it with `aiayn params PRESET KEY=VALUE ...` "
            "(the rows are queued as `dvc exp run`, which composes params.yaml from conf/)")
    return preset, overrides


def dvc(args: list[str]) -> subprocess.CompletedProcess:
    try:
        result = subprocess.run(["dvc", *args], capture_output=True, text=True)
    except FileNotFoundError:
        raise AiaynError("dvc: command not found; activate the virtualenv "
                         "(source .venv/bin/activate)") from None
    if result.returncode != 0:
        raise AiaynError(f"dvc {' '.join(args[:3])} ... failed: "
                         f"{' '.join((result.stderr or result.stdout).split())[:600]}")
    return result


def existing() -> dict[str, str]:
    """HEAD's experiments by name and state (Queued, Running, Failed, Success), from DVC's
    Python API (aiayn.experiments.dvc_exps): `dvc queue status` lists the tasks of every commit, and
    a row queued or run on an earlier commit is not in HEAD's table (`aiayn results
    --table3`)."""
    from aiayn.experiments.dvc_exps import read, states

    return states(read())


@stage
def table3(
    queue: Annotated[bool, typer.Option("--queue", help="Queue the rows as DVC experiments (without it, or with --dry-run: print the plan only).")] = False,
    rows: Annotated[str | None, typer.Option(help="Rows to queue: groups (base, A, B, C, D, E, big) or row names (C-N2), comma-separated; default: all 20.")] = None,
    budget_steps: Annotated[int | None, typer.Option(help="Train every row this many steps (sets train.steps, and train.max_minutes 0). Default: as the params say (big: 3x).")] = None,
    budget_minutes: Annotated[float | None, typer.Option(help="Train every row this many minutes (sets train.max_minutes; train.steps stays a cap).")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="KEY=VALUE (YAML value) set on every row, the base included, e.g. train.average_last=1 (the paper's Table 3 had no checkpoint averaging). Repeatable.")] = None,
    experiment: Annotated[str | None, typer.Option(help="The preset the current params are composed from (default: found by composing each preset of CONF/experiment).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the rows and the `dvc exp run` commands; queue nothing.")] = False,
    params: Annotated[Path, typer.Option("--params", "-p", help="The current params (each row starts from them).")] = Path("params.yaml"),
    conf: Annotated[Path, typer.Option(help="Folder of Hydra configs.")] = Path("conf"),
) -> None:
    """Queue the paper's Table 3 (variations on the base model) as one DVC experiment per
    row, on top of the current params and whatever data they name.

    **How a row is defined.** The current params are the base. Each row changes what the
    paper's row changes, the way the paper changes its base, and leaves everything else as
    the params say: (A) heads 1, 4, 16, 32 with d_k = d_v = d_model / heads; (B) d_k a
    quarter and a half of the base's, d_v kept; (C) 2, 4, 8 layers (encoder and decoder),
    d_model halved and doubled (d_k = d_v = d_model / heads), d_ff halved and doubled; (D)
    dropout 0.0 / 0.2, label smoothing 0.0 / 0.2; (E) learned positional embeddings; big:
    d_model, d_ff and heads doubled, dropout 0.3, 3x the steps (and minutes). Counts and
    probabilities are the paper's values, sizes scale with the base: on the paper's base
    (wmt14_base) these are exactly its rows; on multi30k they vary the multi30k model. A row
    that cannot be built on the current base (heads that do not divide d_model) is left out
    with the reason. A row that is the base on the current params (multi30k has 4 heads,
    so its A-h4 is its base) is not queued: it would train the same model again, and the
    table shows the base's run on its line.

    Each row is queued as `dvc exp run --queue -n table3-ROW -S experiment=PRESET -S ...`
    (the current params said as a preset plus overrides, then the row's settings); a row
    already queued, running or finished for this commit is not queued again (a failed one
    is). Run them with `dvc queue start -j 1` (each is one MLflow run, named after it), then
    `aiayn results --table3` writes and shows the table. docs/table3.md says more.

    Reads: PARAMS, CONF/. Writes: nothing but DVC's queue.
    """
    from aiayn.config import load_params
    from aiayn.experiments import table3 as t3

    load_params(params)  # a broken params file stops here, with its own message
    try:
        chosen = t3.select_rows(rows)
        common = t3.budget(budget_steps, budget_minutes)
    except ValueError as exc:
        raise ParamsError(str(exc)) from None
    for item in set_ or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ParamsError(f"--set {item!r}: write KEY=VALUE, e.g. train.average_last=1")
        common[key.strip()] = yaml.safe_load(value)
    raw = yaml.safe_load(params.read_text(encoding="utf-8"))
    preset, base = base_of(params, conf, experiment)
    planned = t3.build_rows(raw, chosen, common)
    log.info("table3: the base is preset %r%s", preset,
             f" with {' '.join(base)}" if base else "")

    found = existing() if queue and not dry_run else {}
    commands = []
    for plan in planned:
        name = plan.row.name
        if plan.error:
            log.warning("table3: %s left out: %s", name, plan.error)
            continue
        settings = " ".join(f"{k}={v}" for k, v in plan.overrides.items()) or "(the base)"
        if plan.same_as_base:
            log.info("table3: %s: %s is the base on these params (the same model and "
                     "training): not queued; `aiayn results --table3` shows the base's run on "
                     "its line", name, settings)
            continue
        if found.get(name) in ("Queued", "Running", "Success"):
            log.info("table3: %s already %s, not queued again", name,
                     {"Success": "finished"}.get(found[name], found[name].lower()))
            continue
        log.info("table3: %s: %s", name, settings)
        if plan.warning:
            log.warning("table3: %s: %s", name, plan.warning.removeprefix("train: "))
        args = ["exp", "run", "--queue", "-n", name, "-S", f"experiment={preset}"]
        kept = [item for item in base if item.partition("=")[0] not in plan.overrides]
        for item in kept + [f"{k}={hydra_value(v)}" for k, v in plan.overrides.items()]:
            args += ["-S", item]
        commands.append(args)

    if not queue or dry_run:
        for args in commands:
            typer.echo("dvc " + " ".join(_quoted(a) for a in args))
        typer.echo(f"{len(commands)} experiment(s); queue them with `aiayn table3 --queue`"
                   + (" and the same options" if rows or common else ""))
        return
    for args in commands:
        dvc(args)
        log.info("table3: queued %s", args[4])
    typer.echo(f"queued {len(commands)} experiment(s); run them with `dvc queue start -j 1` "
               "(`dvc queue status` to follow), then `aiayn results --table3`")


def _quoted(arg: str) -> str:
    return arg if re.match(r"^[A-Za-z0-9_./=@,:+-]+$", arg) else "'" + arg.replace(
        "'", "'\\''") + "'"


app = single_command_app(table3, "Queue the paper's Table 3 as DVC experiments.")

if __name__ == "__main__":
    app()

"""A DVC experiment sweep as one Markdown table: what changed, valid BLEU, minutes.

Usage (in the repository that ran the sweep)::

    python -m bench.sweep_table                          # every experiment of HEAD
    python -m bench.sweep_table --chosen tiny-d128 --out docs/results/multi30k/sweep.md

Reads the experiments of HEAD (``-A``: of every commit) through DVC's Python API
(``aiayn.experiments.dvc_exps``: each finished one's files from its commit), and prints one
row per commit and per finished experiment that has scores: its name, the params that differ from
the baseline row, the valid scores that recipes are chosen by (``metrics/bleu_valid.json``:
sacreBLEU and lowercased tokenized BLEU when present), the best greedy validation BLEU during
training and its step, the training minutes, the steps reached and why training stopped.
Test scores (``metrics/bleu.json``) are printed for the ``--chosen`` rows only (the chosen
recipe, one row per seed): recipes are chosen on valid, and the test set is read for the
chosen one. ``--csv`` also writes the rows; ``--save-json`` keeps the experiments read, from
which ``--json`` makes the table elsewhere.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import sys
from pathlib import Path

from aiayn.config import flatten
from aiayn.errors import AiaynError
from aiayn.experiments import dvc_exps
from aiayn.io import write_text
from bench import harness

PARAMS, METRICS = "params.yaml", ("metrics/bleu_valid.json", "metrics/bleu.json",
                                  "metrics/train.json")


def rows_of(exps: list[dvc_exps.Experiment]) -> list[dict]:
    """(name, params, metrics) of each baseline and each experiment, in DVC's order."""
    rows = []
    for exp in exps:
        name = exp.name if not exp.baseline else (
            "workspace" if exp.rev == dvc_exps.WORKSPACE else f"baseline {exp.rev}")
        rows.append({"name": name, "params": flatten(exp.files.get(PARAMS)),
                     "metrics": {path: exp.files[path] for path in METRICS if path in exp.files}})
    return rows


def load(path: Path) -> list[dvc_exps.Experiment]:
    """The experiments --save-json wrote to ``path``."""
    saved = json.loads(path.read_text())
    fields = {f.name for f in dataclasses.fields(dvc_exps.Experiment)}
    if not (isinstance(saved, list) and all(isinstance(e, dict) and set(e) == fields
                                            for e in saved)):
        sys.exit(f"error: --json {path}: not the experiments --save-json writes (a `dvc exp "
                 "show --json`? run this in the repository instead, or save them there with "
                 "--save-json)")
    return [dvc_exps.Experiment(**e) for e in saved]


def score(metrics: dict, path: str, key: str) -> float | None:
    value = (metrics.get(path) or {}).get(key)
    return value.get("score") if isinstance(value, dict) else None


def fmt(x, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def table(rows: list[dict], chosen: set[str],
          base_name: str | None = None) -> tuple[list[str], list[list[str]]]:
    if base_name is None:  # the first commit, not the workspace (whatever ran last)
        base = next((r for r in rows if r["name"] != "workspace"), rows[0])["params"]
    else:
        base = next((r["params"] for r in rows if r["name"] == base_name), None)
        if base is None:
            raise SystemExit(f"error: --base {base_name}: no such row; the rows are "
                             + ", ".join(r["name"] for r in rows))
    ignore = ("data.local.dir",)
    head = ["experiment", "changed params", "valid sacreBLEU", "valid lc-tok BLEU",
            "best greedy valid BLEU (step)", "train min", "steps (stopped by)",
            "test sacreBLEU", "test lc-tok BLEU", "test chrF2"]
    body = []
    seen = set()
    for row in rows:
        if row["name"] in seen:  # a commit shown twice (a branch and its hash, or -A)
            continue
        seen.add(row["name"])
        m = row["metrics"]
        bleu_valid = "metrics/bleu_valid.json"
        if score(m, bleu_valid, "sacrebleu") is None:
            continue
        changed = [f"{k}={v}" for k, v in row["params"].items()
                   if base.get(k) != v and k not in ignore]
        train = m.get("metrics/train.json") or {}
        test = row["name"] in chosen
        body.append([
            f"**{row['name']}**" if test else row["name"],
            ", ".join(changed) or "(baseline)",
            fmt(score(m, bleu_valid, "sacrebleu")),
            fmt(score(m, bleu_valid, "lowercase_bleu")),
            f"{fmt(train.get('best_valid_bleu'))} ({fmt(train.get('best_valid_bleu_step'))})",
            fmt(train["wall_time_s"] / 60, 1) if train.get("wall_time_s") else "–",
            f"{fmt(train.get('steps'))} ({train.get('stopped_by', '–')})",
            fmt(score(m, "metrics/bleu.json", "sacrebleu")) if test else "not read",
            fmt(score(m, "metrics/bleu.json", "lowercase_bleu")) if test else "not read",
            fmt(score(m, "metrics/bleu.json", "chrf")) if test else "not read",
        ])
    return head, body


def main(argv: list[str] | None = None) -> str:
    ap = harness.parser(__doc__)
    ap.add_argument("--json", type=Path, default=None,
                    help="experiments saved by --save-json (default: read the repository's)")
    ap.add_argument("--save-json", type=Path, default=None,
                    help="also write the experiments read (with their params and metrics) here")
    ap.add_argument("--chosen", default="",
                    help="the experiment(s) whose test scores to show: the chosen recipe's "
                         "trainings (comma-separated, e.g. its seeds)")
    ap.add_argument("--base", default=None,
                    help="the row the changed params are relative to (default: the first "
                         "commit's)")
    ap.add_argument("--names", default=None,
                    help="comma-separated rows to keep, in this order (default: all)")
    ap.add_argument("--all-commits", "-A", action="store_true",
                    help="experiments of every commit (dvc exp show -A)")
    ap.add_argument("--out", type=Path, default=None, help="write the Markdown table here")
    ap.add_argument("--csv", type=Path, default=None, help="also write the rows as CSV")
    args = ap.parse_args(argv)
    if args.json:
        exps = load(args.json)
    else:
        try:
            exps = dvc_exps.read((PARAMS, *METRICS), all_commits=args.all_commits)
        except AiaynError as exc:
            sys.exit(f"error: {exc}; or give --json experiments saved by --save-json")
    if args.save_json:
        write_text(args.save_json, json.dumps([dataclasses.asdict(e) for e in exps], indent=1))
    rows = rows_of(exps)
    if args.names:
        by_name = {r["name"]: r for r in reversed(rows)}
        missing = [n for n in args.names.split(",") if n not in by_name]
        if missing:
            sys.exit(f"error: no experiment named {', '.join(missing)}")
        rows = [by_name[n] for n in args.names.split(",")]
    head, body = table(rows, set(filter(None, args.chosen.split(","))), args.base)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:  # whole or not at all
        write_text(args.out, text)
    if args.csv:
        buf = io.StringIO(newline="")
        w = csv.writer(buf)
        w.writerow(head)
        w.writerows([[c.strip("*") for c in cells] for cells in body])
        write_text(args.csv, buf.getvalue())
    return text


if __name__ == "__main__":
    main()

"""A DVC experiment sweep as one Markdown table: what changed, valid BLEU, minutes.

Usage (in the repository that ran the sweep)::

    python -m bench.sweep_table                          # every experiment of the workspace
    python -m bench.sweep_table --chosen tiny-d128 --out docs/results/multi30k/sweep.md

Reads ``dvc exp show --json`` (all experiments of HEAD, queued ones included), and prints
one row per experiment that has scores: its name, the params that differ from the baseline
row, the valid scores that recipes are chosen by (``metrics/bleu_valid.json``: sacreBLEU and
lowercased tokenized BLEU when present), the best greedy validation BLEU during training and
its step, the training minutes, the steps reached and why training stopped. Test scores
(``metrics/bleu.json``) are printed for the ``--chosen`` rows only (the chosen recipe, one
row per seed): recipes are chosen on valid, and the test set is read for the chosen one.
``--csv`` also writes the rows.
"""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

from aiayn.io import write_text
from bench import harness


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in (d or {}).items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def rows_of(shown: list[dict]) -> list[dict]:
    """(name, params, metrics) of the baseline and of every experiment, in dvc's order."""
    rows = []
    for baseline in shown:
        name = ("workspace" if baseline["rev"] == "workspace"
                else "baseline " + baseline["rev"][:7])
        entries = [(name, baseline)]
        entries += [(e.get("name") or e["revs"][0]["rev"][:7], e["revs"][0])
                    for e in baseline.get("experiments") or []]
        for name, entry in entries:
            data = entry.get("data") or {}
            params = flatten((data.get("params") or {}).get("params.yaml", {}).get("data"))
            metrics = {path: m.get("data") for path, m in (data.get("metrics") or {}).items()}
            rows.append({"name": name, "params": params, "metrics": metrics})
    return rows


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
                    help="a saved `dvc exp show --json` (default: run it here)")
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
        shown = json.loads(args.json.read_text())
    else:
        try:
            done = subprocess.run(["dvc", "exp", "show", "--json",
                                   *(["-A"] if args.all_commits else [])],
                                  capture_output=True, text=True)
        except FileNotFoundError:
            sys.exit("error: no `dvc` on PATH: run this with the project's .venv/bin on PATH, "
                     "or pass a saved `dvc exp show --json` with --json")
        if done.returncode != 0:
            sys.exit(f"error: dvc exp show failed: {done.stderr.strip()}")
        shown = json.loads(done.stdout)
    rows = rows_of(shown)
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

"""Validation BLEU and learning rate of several trainings against training minutes or steps.

Usage::

    python -m bench.valid_bleu_curves --run d256=metrics --run tiny=../other/metrics \
        --out docs/results/multi30k/sweep/valid_bleu_minutes.png

Each ``--run LABEL=FOLDER`` names a folder holding a training's ``train_log.tsv`` (step,
lr and elapsed seconds) and ``valid_bleu.tsv`` (step and greedy validation BLEU), as the
train stage writes them into ``metrics/``; ``git show REV:metrics/train_log.tsv`` (or
``dvc exp show``'s revision of an experiment) gives them for runs that are no longer in
the workspace. Steps are turned into training minutes through the elapsed time logged at
each train-log step, so runs at different speeds line up by the time they cost; ``--x
steps`` lines them up by step instead (runs with a budget in steps, ``train.max_minutes:
0``, whose minutes say more of the machine's load than of the run), and ``--x tokens`` by
the target tokens trained on (runs with other batch sizes, on other machines: how far a
budget is from convergence); ``--x passes`` counts the tokens of R-Drop's steps twice (each
batch goes through the model twice; ``train.json``'s ``rdrop_from_step`` says from which step,
and a run without it trained with R-Drop from its first step if its ``rdrop`` is above 0;
with ``rdrop_fraction`` below 1, that share of them twice),
so that runs that switch R-Drop on late line up by the compute they cost on any machine
whose step cost is its passes'. ``--mark 64=published`` draws a labelled vertical line there
(in millions of tokens with ``--x tokens``), ``--level 41.02=published`` a labelled
horizontal one at that BLEU. Prints each run's last and best validation
BLEU, and writes one picture: BLEU above, lr below.

    python -m bench.valid_bleu_curves --x tokens --mark "64=published 41.02 (8k x 8,000)" \
        --run cpu-hour=docs/results/multi30k/fp32-avx2-target \
        --run gpu-d0.3=docs/results/gpu-h200/2026-11-28-micro-batch-dropout/conv/d0.3-s1 \
        --out curve.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from bench import harness


def load_run(folder: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(train log, validation BLEU with a ``minutes`` column) of one training."""
    missing = [n for n in ("train_log.tsv", "valid_bleu.tsv") if not (folder / n).is_file()]
    if missing:
        raise SystemExit(f"error: {folder} has no {' or '.join(missing)}; give the metrics "
                         "folder of a training with train.valid_bleu_every > 0")
    train = pd.read_csv(folder / "train_log.tsv", sep="\t")
    bleu = pd.read_csv(folder / "valid_bleu.tsv", sep="\t").dropna()
    if bleu.empty:  # the trainer writes the header even with valid_bleu_every 0
        raise SystemExit(f"error: {folder / 'valid_bleu.tsv'} holds no validation BLEU; give "
                         "the metrics folder of a training with train.valid_bleu_every > 0")
    train["minutes"] = train["elapsed_s"] / 60
    train["mtokens"] = train["tokens"] / 1e6
    train["mpasses"] = train["mtokens"] + rdrop_mtokens(folder, train)
    for column in ("minutes", "mtokens", "mpasses"):
        bleu[column] = np.interp(bleu["step"], train["step"], train[column])
    return train, bleu


def first_rdrop_step(run: dict) -> int | None:
    """The first R-Drop step of a ``train.json`` written before it said so: 1 with R-Drop from
    the start; with ``rdrop_start`` and a budget in steps that ended the run, the first step
    the trainer's rule (:func:`aiayn.training.schedule.schedule_at`) gives R-Drop; None
    otherwise (a time budget's switch depends on the clock)."""
    from types import SimpleNamespace

    from aiayn.training.schedule import schedule_at

    if not run.get("rdrop"):
        return None
    start = run.get("rdrop_start") or 0.0
    if not start:
        return 1
    if run.get("max_minutes") or run.get("stopped_by") != "steps":
        return None
    t = SimpleNamespace(steps=run["steps"], max_minutes=0, cooldown=0.0, rdrop=run["rdrop"],
                        rdrop_start=start)
    return next((s for s in range(1, t.steps + 1)
                 if schedule_at(t, s - 1, 0.0)["rdrop_started"]), None)


def rdrop_mtokens(folder: Path, train: pd.DataFrame) -> np.ndarray:
    """At each train-log row, the target tokens (millions) that R-Drop's steps sent through
    the model a second time so far: all of their tokens, or ``rdrop_fraction`` of them, the
    share of sentences it drew (from ``train.json`` beside the logs; none without it)."""
    summary = folder / "train.json"
    run = json.loads(summary.read_text()) if summary.is_file() else {}
    first = run.get("rdrop_from_step", first_rdrop_step(run))
    if not first:
        return np.zeros(len(train))
    before = np.interp(first - 1, np.r_[0, train["step"]], np.r_[0.0, train["mtokens"]])
    share = run.get("rdrop_fraction", 1.0)
    return share * np.clip(train["mtokens"].to_numpy() - before, 0.0, None)


AXES = {"minutes": ("minutes", "training minutes", "time"),
        "steps": ("step", "training steps", "steps"),
        "tokens": ("mtokens", "target tokens trained on (millions)", "target tokens"),
        "passes": ("mpasses",
                   "target tokens through the model (millions; R-Drop's second passes too)",
                   "passes")}


def parse_mark(text: str, option: str = "--mark", axis: str = "X") -> tuple[float, str]:
    where, sep, label = text.partition("=")
    try:
        return float(where), label if sep else ""
    except ValueError:
        place = "on the horizontal axis" if axis == "X" else "of BLEU"
        raise SystemExit(f"error: {option} {text!r}: write it {axis}=LABEL, {axis} a number "
                         f"{place}") from None


def run_style(i: int) -> tuple[str, str, str]:
    """Run ``i``'s colour, line style and marker: the ten tab10 colours, then the same colours
    dashed with squares, dotted with triangles, ..., so that no two of 40 runs look alike."""
    color = f"C{i % 10}"
    style, marker = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D")][i // 10 % 4]
    return color, style, marker


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--run", action="append", required=True, metavar="LABEL=FOLDER",
                    help="a training's metrics folder, with the label it gets (repeatable)")
    ap.add_argument("--out", type=Path, required=True, help="the picture (.png)")
    ap.add_argument("--x", choices=tuple(AXES), default="minutes",
                    help="the horizontal axis: training minutes (default), steps, target "
                         "tokens trained on (millions), or passes: those tokens with the ones "
                         "R-Drop sent through twice counted twice")
    ap.add_argument("--mark", action="append", default=[], metavar="X=LABEL",
                    help="a labelled vertical line at X on the horizontal axis (repeatable)")
    ap.add_argument("--level", action="append", default=[], metavar="Y=LABEL",
                    help="a labelled horizontal line at BLEU Y, e.g. a published figure "
                         "(repeatable)")
    ap.add_argument("--title", default=None,
                    help="default: greedy validation BLEU against training time (or steps, "
                         "or tokens)")
    args = ap.parse_args(argv)
    x, x_label, x_words = AXES[args.x]
    marks = [parse_mark(m) for m in args.mark]
    levels = [parse_mark(m, "--level", "Y") for m in args.level]
    title = args.title or f"greedy validation BLEU against training {x_words}"

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bleu_ax, lr_ax) = plt.subplots(2, 1, figsize=(8, 7), sharex=True,
                                         gridspec_kw={"height_ratios": [2, 1]})
    runs = []
    for spec in args.run:
        label, sep, folder = spec.partition("=")
        if not sep or not label:
            raise SystemExit(f"error: --run {spec!r}: write it LABEL=FOLDER")
        runs.append((label, Path(folder)))
    width = max(len(label) for label, _ in runs) + 2
    print(f"{'run':<{width}}{'steps':>7}{'minutes':>9}{'last BLEU':>11}{'best (step)':>16}")
    for i, (label, folder) in enumerate(runs):
        train, bleu = load_run(folder)
        best = bleu.loc[bleu["valid_bleu"].idxmax()]
        last = bleu.iloc[-1]
        print(f"{label:<{width}}{int(train['step'].iloc[-1]):>7}{train['minutes'].iloc[-1]:>9.1f}"
              f"{last['valid_bleu']:>11.2f}{best['valid_bleu']:>10.2f} ({int(best['step'])})")
        color, style, marker = run_style(i)
        bleu_ax.plot(bleu[x], bleu["valid_bleu"], color=color, linestyle=style, marker=marker,
                     ms=3, label=label)
        lr_ax.plot(train[x], train["lr"], color=color, linestyle=style)
    for where, label in marks:
        for ax in (bleu_ax, lr_ax):
            ax.axvline(where, color="grey", linestyle="--", linewidth=1)
        bleu_ax.annotate(label, (where, 0.02), xycoords=("data", "axes fraction"),
                         rotation=90, ha="right", va="bottom", fontsize=8, color="grey")
    for where, label in levels:
        bleu_ax.axhline(where, color="black", linestyle=":", linewidth=1)
        bleu_ax.annotate(label, (0.01, where), xycoords=("axes fraction", "data"),
                         ha="left", va="bottom", fontsize=8)
    bleu_ax.set(ylabel="valid sacreBLEU (greedy)", title=title)
    bleu_ax.grid(alpha=0.3)
    bleu_ax.legend(loc="lower center", fontsize=8)  # curves rise at the left and stay high
    lr_ax.set(xlabel=x_label, ylabel="learning rate")
    lr_ax.grid(alpha=0.3)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()

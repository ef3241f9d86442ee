"""The table of a recipe screen (part 4 of ``bench/gpu_session.sh``) from its session logs.

Each run of the screen prints one summary line, ``<arm>-s<seed>  steps N (...), valid NLL x,
averaged k of {...}, valid sacreBLEU y``. This script gathers those lines from one or more
logs (screens run in several calls add up: with a budget in steps a run's result does not
depend on the call it ran in) and prints a markdown table: per arm, the valid sacreBLEU of
every seed, the mean, and the mean difference to the baseline arm over the seeds both ran
(paired by seed: one seed is one initialisation, data order and dropout stream) with its
standard error (the standard deviation of the paired differences / sqrt(pairs)).

    python -m bench.screen_table --baseline preset \
        docs/results/gpu-h200/2026-11-27-recipe-screen/call*.log
    python -m bench.screen_table --runs .gpu/screen/*/    # the summary lines (gpu_session.sh)
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

from bench import harness

LINE = re.compile(r"^(?P<arm>\S+)-s(?P<seed>\d+)\s+steps (?P<steps>\d+) \((?P<end>[^)]*)\), "
                  r"valid NLL (?P<nll>[\d.]+), averaged (?P<avg>\d+) of .*valid sacreBLEU "
                  r"(?P<bleu>[\d.e+-]+)\s*$")


def summary_line(run: Path) -> str:
    """The summary line of one run folder of the screen (``<arm>-s<seed>``), from the
    metrics its stages wrote; a stage that did not finish leaves its fields None."""
    def get(name: str) -> dict:
        f = run / "metrics" / name
        return json.loads(f.read_text()) if f.exists() else {}
    t, b, a = get("train.json"), get("bleu_valid.json"), get("average.json")
    return (f"{run.name:22s} steps {t.get('steps')} ({t.get('stopped_by')}), valid NLL "
            f"{t.get('valid_nll')}, averaged {a.get('averaged')} of {a.get('candidates')}, "
            f"valid sacreBLEU {b.get('sacrebleu', {}).get('score')}")


def read_runs(logs: list[Path]) -> dict[str, dict[int, dict]]:
    """{arm: {seed: {steps, end, nll, averaged, bleu}}} from the logs' summary lines."""
    runs: dict[str, dict[int, dict]] = {}
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            m = LINE.match(line)
            if m:
                runs.setdefault(m["arm"], {})[int(m["seed"])] = {
                    "steps": int(m["steps"]), "end": m["end"], "nll": float(m["nll"]),
                    "averaged": int(m["avg"]), "bleu": float(m["bleu"])}
    return runs


def table(runs: dict[str, dict[int, dict]], baseline: str) -> str:
    if baseline not in runs:
        raise SystemExit(f"no runs of the baseline arm {baseline!r}; arms: {', '.join(runs)}")
    base = runs[baseline]
    rows = ["| arm | seeds | valid sacreBLEU per seed | mean | vs baseline (paired seeds, ± s.e.) "
            "| valid NLL (mean) |", "|---|---|---|---:|---:|---:|"]
    for arm in sorted(runs, key=lambda a: (a != baseline, a)):
        seeds = sorted(runs[arm])
        scores = [runs[arm][s]["bleu"] for s in seeds]
        shared = [s for s in seeds if s in base]
        diffs = [runs[arm][s]["bleu"] - base[s]["bleu"] for s in shared]
        se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
        vs = "" if arm == baseline or not diffs else (
            f"{statistics.fmean(diffs):+.2f} ± {se:.2f} over {len(diffs)} "
            f"({sum(d > 0 for d in diffs)} of {len(diffs)} higher)")
        rows.append(f"| {arm} | {','.join(map(str, seeds))} | "
                    f"{' / '.join(f'{x:.2f}' for x in scores)} | {statistics.fmean(scores):.2f} "
                    f"| {vs} | {statistics.fmean(runs[arm][s]['nll'] for s in seeds):.3f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("logs", nargs="+", type=Path,
                    help="session logs of bench/gpu_session.sh (with --runs: run folders)")
    ap.add_argument("--baseline", default="preset", help="the arm the others are compared with")
    ap.add_argument("--runs", action="store_true",
                    help="print the summary line of each run folder given (what the session "
                         "log holds) instead of the table")
    args = ap.parse_args(argv)
    if args.runs:
        for run in args.logs:
            print(summary_line(run))
        return 0
    runs = read_runs(args.logs)
    if not runs:
        raise SystemExit(f"no screen summary lines in {', '.join(map(str, args.logs))}")
    print(table(runs, args.baseline))
    return 0


if __name__ == "__main__":
    sys.exit(main())

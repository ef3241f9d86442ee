"""Resident memory and step time of CPU training on each C heap: glibc with and without the
trainer's ``malloc_trim``, tcmalloc, jemalloc.

Each mode of ``--modes`` trains the real trainer (``bench.train_throughput``'s worker) on the
same batches in a fresh process of its own, ``--repeats`` times; it prints the peak RSS of
the warm-up and of five windows after it, the growth, the median seconds per step, and each
mode against the first. The guide: bench/README.md, ``train_memory.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path

from aiayn.training.memory import ALLOCATORS, allocator_env, allocator_library, install_hint
from bench import harness
from bench.train_throughput import add_preset_options, prepare_data

MODES = ("notrim", "trim", "jemalloc", "tcmalloc")
DEFAULT_MODES = "notrim,trim"


def worker(mode: str, spec: dict, steps: int) -> dict:
    """Train ``steps`` steps of the trainer ``spec`` describes (``bench.train_throughput``'s
    worker spec) in this process; RSS and wall time of every step."""

    from aiayn.training.memory import TRIM_EVERY_STEPS, HeapTrimmer, loaded_allocator
    from bench.train_throughput import TrainerWorker

    runner = TrainerWorker(spec)
    # the trainer's own trims every TRIM_EVERY_STEPS on CPU (glibc's heap; the other
    # allocators, preloaded by run_modes, keep their own)
    runner.heap = HeapTrimmer(every=spec.get("trim_every", TRIM_EVERY_STEPS),
                              enabled=mode == "trim")
    if mode == "trim" and not runner.heap.active:
        raise SystemExit("this C library has no malloc_trim: nothing to compare")
    allocator = loaded_allocator()
    if allocator != (mode if mode in ALLOCATORS else "glibc"):
        raise SystemExit(f"mode {mode} runs on {allocator}: LD_PRELOAD did not take")
    bf16 = runner.trainer.amp_dtype is not None
    rss, secs = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        runner.step()
        secs.append(time.perf_counter() - t0)
        rss.append(harness.rss_mib())
    return {"mode": mode, "precision": "bf16" if bf16 else "fp32", "rss_mib": rss,
            "step_s": secs, "allocator": allocator}


def window_max(rss: list[float], start: int, stop: int) -> float:
    """Peak RSS over steps start+1 .. stop (1-based steps)."""
    return max(rss[start:stop])


def windows(warmup: int, steps: int) -> list[int]:
    """Window edges: the warm-up, then five windows of about equal length."""
    step = max(1, (steps - warmup) // 5)
    return [0, warmup, *list(range(warmup + step, steps, step))[:4], steps]


def summarise(run: dict, edges: list[int]) -> dict:
    rss, secs, warmup = run["rss_mib"], run["step_s"], edges[1]
    first, last = window_max(rss, 0, warmup), window_max(rss, edges[-2], edges[-1])
    return {"mode": run["mode"], "peak_warmup": first, "peak_last": last,
            "peak": max(rss), "growth": last - first,
            "s_per_step": statistics.median(secs[warmup:])}


def report(runs: list[dict], warmup: int, steps: int) -> tuple[list[dict], dict[str, dict]]:
    """Print the tables; return the summaries and, for every mode after the first, its
    ratios to the first ({mode: {"peak_last", "s_per_step"}}, medians over the repeats)."""
    # Peaks per window: a trim step's RSS alone would flatter the trimmed run.
    edges = windows(warmup, steps)
    print(f"\n{runs[0].get('precision', '?')}: peak RSS (MiB) over steps")
    heads = [f"{a + 1}-{b}" for a, b in pairwise(edges)]
    print(f"{'mode':>8} " + " ".join(f"{h:>9}" for h in heads))
    for run in runs:
        print(f"{run['mode']:>8} " + " ".join(
            f"{window_max(run['rss_mib'], a, b):9.0f}" for a, b in pairwise(edges)))
    print(f"{'':>8} (last RSS: " + ", ".join(
        f"{run['mode']} {run['rss_mib'][-1]:.0f}" for run in runs) + ")")

    summary = [summarise(run, edges) for run in runs]
    print(f"\n{'mode':>8} {'warm-up peak':>12} {'last-window peak':>16} {'growth':>7} "
          f"{'s/step':>7}")
    for s in summary:
        print(f"{s['mode']:>8} {s['peak_warmup']:12.0f} {s['peak_last']:16.0f} "
              f"{s['growth']:+7.0f} {s['s_per_step']:7.3f}")
    modes = list(dict.fromkeys(s["mode"] for s in summary))  # the runs cycle through them
    first = summary[0::len(modes)]
    ratios = {}
    print()
    for i, mode in enumerate(modes[1:], 1):
        other = summary[i::len(modes)]
        end = harness.ratio([o["peak_last"] for o in other], [f["peak_last"] for f in first])
        speed = harness.ratio([o["s_per_step"] for o in other], [f["s_per_step"] for f in first])
        ratios[mode] = {"peak_last": end.median, "s_per_step": speed.median}
        print(f"{mode} / {modes[0]}: peak RSS of the last window x{end.median:.2f}, seconds "
              f"per step x{speed.median:.2f} (median over {len(other)} pair(s))")
    return summary, ratios


def prepare(args: argparse.Namespace) -> dict:
    """The workers' trainer spec: the preset's data made once (bench.train_throughput's
    ``prepare_data``), its params with ``--seed`` and ``--precision``, a scratch folder."""
    import yaml

    data_args = argparse.Namespace(set=args.set, workdir=args.workdir, preset=args.preset,
                                   corpus=args.corpus, shards=None, tokenizer=None)
    params, shards, tokenizer = prepare_data(data_args, args.max_tokens)
    scratch = Path(tempfile.mkdtemp(prefix="memory-", dir=args.workdir))
    raw = yaml.safe_load(params.read_text())
    raw["seed"] = args.seed
    (scratch / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return {"name": "fast", "params": str(scratch / "params.yaml"), "shards": str(shards),
            "tokenizer": str(tokenizer), "scratch": str(scratch),
            "train": {"kernels": "fast", "precision": args.precision}}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = harness.parser(__doc__)
    ap.add_argument("--steps", type=int, default=300, help="training steps per mode (300)")
    ap.add_argument("--warmup", type=int, default=20,
                    help="steps before the baseline RSS and the timing start (20)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="how many times to run the modes, one after the other (1)")
    ap.add_argument("--modes", default=DEFAULT_MODES,
                    help="comma-separated, the first the baseline of the ratios: notrim "
                         "(glibc malloc as it is), trim (glibc with the trainer's "
                         "malloc_trim), jemalloc, tcmalloc (LD_PRELOAD, no trim; e.g. "
                         f"{install_hint()}); default {DEFAULT_MODES}")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="positions per batch side (default: the preset's shard.max_tokens)")
    ap.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                    help="as train.precision (default auto)")
    ap.add_argument("--seed", type=int, default=0, help="the batch sampler's seed (0)")
    add_preset_options(ap)
    ap.add_argument("--trim-every", type=int, default=None, metavar="N",
                    help="the trim mode trims every N steps (default: the trainer's, "
                         "aiayn.training.memory.TRIM_EVERY_STEPS)")
    ap.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, default=None, help="write all results here")
    ap.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return args
    if args.warmup < 1 or args.warmup >= args.steps:
        ap.error(f"--warmup ({args.warmup}) must be at least 1 and below --steps "
                 f"({args.steps})")
    harness.require_positive(ap, args, "repeats", "trim_every")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown or len(set(args.modes)) < 2 or len(set(args.modes)) != len(args.modes):
        ap.error(f"--modes {','.join(args.modes)}: give two or more of {', '.join(MODES)}, "
                 f"each once")
    for m in args.modes:
        if m in ALLOCATORS and allocator_library(m) is None:
            ap.error(f"--modes {m}: no {m} library here (e.g. {install_hint(m)})")
    return args


def run_modes(args: argparse.Namespace, spec: dict) -> list[dict]:
    """Each mode in a fresh worker process of its own, in --modes' order, --repeats times;
    an allocator mode's process starts with the allocator preloaded."""
    runs = []
    for r in range(args.repeats):
        for mode in args.modes:
            env = harness.child_env()
            if mode in ALLOCATORS:
                env = allocator_env(mode, env)
            print(f"[{r + 1}/{args.repeats}] {mode}: {args.steps} steps ...", flush=True)
            res = subprocess.run(
                harness.module_command("bench.train_memory", "--worker", mode, "--steps",
                                       str(args.steps), "--spec", json.dumps(spec)),
                capture_output=True, text=True, env=env)
            if res.returncode:
                sys.exit(f"the {mode} worker failed (exit {res.returncode}):\n{res.stderr}")
            runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
    return runs


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.worker:  # the child process: one mode, result as JSON on stdout
        print(json.dumps(worker(args.worker, json.loads(args.spec), args.steps)))
        return {}
    spec = prepare(args)
    if args.trim_every is not None:
        spec["trim_every"] = args.trim_every
    print(harness.machine_line())
    runs = run_modes(args, spec)
    summary, ratios = report(runs, args.warmup, args.steps)
    second = ratios[args.modes[1]]
    out = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                    if k not in ("json", "worker", "spec")},
           "summary": summary, "ratio_peak_last": second["peak_last"],
           "ratio_s_per_step": second["s_per_step"], "ratios": ratios, "runs": runs}
    return harness.save(out, args.json, argv)


if __name__ == "__main__":
    main()

"""Do the fast and the plain training step learn the same? Valid loss side by side.

Usage (from the repository root)::

    .venv/bin/python bench/same_learning.py                  # multi30k, 300 steps each
    .venv/bin/python bench/same_learning.py --steps 100 --preset demo
    .venv/bin/python bench/same_learning.py --help

Runs ``aiayn train`` (the stage command itself) on the preset's shards twice from the same
seed, once with ``train.kernels: plain`` and once with ``fast`` (the only change), one after
the other, validating every ``--valid-every`` steps; then prints both validation curves and
their relative difference. The two runs draw different dropout masks (the fast path's are
cheaper ones of the same distribution), so the curves agree in value, not bit for bit. The
goal is a relative difference of the final valid loss under 0.5%.

Data as ``bench/train_throughput.py`` makes it: ``--shards`` if given, else the preset's data
stages run once into ``--workdir`` and reused.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.machine import cpu_model, describe_caps, instruction_caps  # noqa: E402
from bench.train_throughput import prepare_data  # noqa: E402


def read_tsv(path: Path) -> list[dict]:
    """Rows of a train or valid log, every value a float; an empty field (a validation
    BLEU not taken) is NaN."""
    import pandas as pd

    return pd.read_csv(path, sep="\t", dtype=float).to_dict("records")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="multi30k")
    ap.add_argument("--set", "-S", action="append", default=[], metavar="KEY=VALUE",
                    help="Hydra override of the preset, as `dvc exp run -S` (repeatable)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--valid-every", type=int, default=100)
    ap.add_argument("--corpus", type=Path, default=None)
    ap.add_argument("--shards", type=Path, default=None)
    ap.add_argument("--tokenizer", type=Path, default=None)
    ap.add_argument("--workdir", type=Path,
                    default=Path(tempfile.gettempdir()) / "aiayn-bench-train")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    from aiayn.precision import cpu_has_native_bf16

    params, shards, tokenizer = prepare_data(args)
    out = Path(tempfile.mkdtemp(prefix="same-learning-", dir=args.workdir))
    print(f"CPU {cpu_model()} ({'native bf16' if cpu_has_native_bf16() else 'no native bf16'}"
          f"{describe_caps()})"
          f"; preset {args.preset}{''.join(' -S ' + o for o in args.set)}, {args.steps} steps, "
          f"runs in {out}", flush=True)
    exe = Path(sys.executable).with_name("aiayn")
    runs = {}
    for kernels in ("plain", "fast"):
        raw = yaml.safe_load(params.read_text())
        raw["train"].update(kernels=kernels, steps=args.steps, valid_every=args.valid_every,
                            log_every=min(25, args.steps), checkpoint_every_steps=args.steps,
                            checkpoint_every_minutes=0, max_minutes=0, valid_bleu_every=0)
        run = out / kernels
        run.mkdir()
        (run / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
        t = time.perf_counter()
        subprocess_run([str(exe) if exe.exists() else "aiayn", "train", "--params",
                        str(run / "params.yaml"), "--shards", str(shards), "--tokenizer",
                        str(tokenizer), "--checkpoints", str(run / "checkpoints"),
                        "--metrics", str(run / "train.json"), "--train-log",
                        str(run / "train_log.tsv"), "--valid-log", str(run / "valid_log.tsv"),
                        "--curves", str(run / "curves.png"), "--no-progress", "--no-mlflow"])
        runs[kernels] = {"minutes": (time.perf_counter() - t) / 60,
                         "valid": read_tsv(run / "valid_log.tsv"),
                         "train": read_tsv(run / "train_log.tsv"),
                         "summary": json.loads((run / "train.json").read_text())}
        print(f"{kernels}: {runs[kernels]['minutes']:.1f} min, "
              f"{runs[kernels]['summary']['tokens_per_s']:.0f} target tokens/s", flush=True)
    print(f"\n{'step':>6}{'valid loss plain':>18}{'fast':>10}{'difference':>12}")
    rows = []
    for a, b in zip(runs["plain"]["valid"], runs["fast"]["valid"], strict=True):
        rel = (b["valid_loss"] - a["valid_loss"]) / a["valid_loss"]
        rows.append({"step": int(a["step"]), "plain": a["valid_loss"], "fast": b["valid_loss"],
                     "relative": rel})
        print(f"{int(a['step']):>6}{a['valid_loss']:>18.4f}{b['valid_loss']:>10.4f}{rel:>+12.2%}")
    final = rows[-1]["relative"]
    print(f"\nfinal valid loss: {'within' if abs(final) < 0.005 else 'NOT within'} 0.5% "
          f"({final:+.2%})")
    result = {"cpu": cpu_model(), "instruction_caps": instruction_caps(), "preset": args.preset,
              "overrides": args.set, "steps": args.steps, "rows": rows,
              "runs": runs}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


def subprocess_run(cmd: list[str]) -> None:
    import subprocess

    env = dict(os.environ)
    env.pop("MLFLOW_TRACKING_URI", None)
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd[:2])} failed:\n{result.stderr[-3000:]}")


if __name__ == "__main__":
    main()

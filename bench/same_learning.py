"""Do the fast and the plain training step learn the same? Valid loss side by side.

Usage (from the repository root)::

    .venv/bin/python -m bench.same_learning                  # multi30k, 300 steps each
    .venv/bin/python -m bench.same_learning --steps 100 --preset demo
    .venv/bin/python -m bench.same_learning --vary model.output_vocab=shared,target
    .venv/bin/python -m bench.same_learning --help

Runs ``aiayn train`` (the stage command itself) on the preset's shards twice from the same
seed, once with ``train.kernels: plain`` and once with ``fast`` (the only change), one after
the other, validating every ``--valid-every`` steps; then prints both validation curves and
their relative difference. The two runs draw different dropout masks (the fast path's are
cheaper ones of the same distribution), so the curves agree in value, not bit for bit. The
goal is a relative difference of the final valid loss under 0.5%.

``--vary KEY=A,B`` compares another setting the same way (default
``train.kernels=plain,fast``). Where the two settings smooth labels over different
vocabularies (``model.output_vocab``), the label-smoothed losses differ by construction;
the valid NLL (printed beside them) is the figure to compare.

Data as ``bench.train_throughput`` makes it: ``--shards`` if given, else the preset's data
stages run once into ``--workdir`` and reused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench import harness
from bench.train_throughput import prepare_data


def read_tsv(path: Path) -> list[dict]:
    """Rows of a train or valid log, every value a float; an empty field (a validation
    BLEU not taken) is NaN."""
    import pandas as pd

    return pd.read_csv(path, sep="\t", dtype=float).to_dict("records")


def parse_vary(text: str) -> tuple[str, str, list[str]]:
    """--vary ``section.name=A,B`` as (section, name, [A, B]), or an error naming the form."""
    key, _, values = text.partition("=")
    section, _, name = key.partition(".")
    choices = values.split(",")
    if section not in ("model", "train") or not name or len(choices) != 2:
        raise SystemExit(f"error: --vary {text!r}: expected model.KEY=A,B or train.KEY=A,B")
    if choices[0] == choices[1]:
        raise SystemExit(f"error: --vary {text!r}: the two values are the same; give "
                         "two different ones (A,B)")
    return section, name, choices


def train_run(args, params: Path, shards: Path, tokenizer: Path, run: Path, section: str,
              name: str, value: str) -> dict:
    """One `aiayn train` of the preset with ``section.name`` set to ``value``, in ``run``:
    its minutes, valid and train logs and summary."""
    raw = yaml.safe_load(params.read_text())
    raw["train"].update(steps=args.steps, valid_every=args.valid_every,
                        log_every=min(25, args.steps), checkpoint_every_steps=args.steps,
                        checkpoint_every_minutes=0, max_minutes=0, valid_bleu_every=0)
    raw[section][name] = yaml.safe_load(value)
    run.mkdir()
    (run / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    exe = Path(sys.executable).with_name("aiayn")
    t = time.perf_counter()
    subprocess_run([str(exe) if exe.exists() else "aiayn", "train", "--params",
                    str(run / "params.yaml"), "--shards", str(shards), "--tokenizer",
                    str(tokenizer), "--checkpoints", str(run / "checkpoints"),
                    "--metrics", str(run / "train.json"), "--train-log",
                    str(run / "train_log.tsv"), "--valid-log", str(run / "valid_log.tsv"),
                    "--curves", str(run / "curves.png"), "--no-progress", "--no-mlflow"])
    return {"minutes": (time.perf_counter() - t) / 60,
            "valid": read_tsv(run / "valid_log.tsv"),
            "train": read_tsv(run / "train_log.tsv"),
            "summary": json.loads((run / "train.json").read_text())}


def compare(runs: dict, key: str, a_name: str, b_name: str) -> list[dict]:
    """The two runs' valid loss and NLL side by side, step by step, printed and returned."""
    print(f"\n{key}: {a_name} against {b_name}")
    print(f"{'step':>6}{'valid loss ' + a_name:>22}{b_name:>10}{'difference':>12}"
          f"{'valid NLL ' + a_name:>22}{b_name:>10}{'difference':>12}")
    rows = []
    for a, b in zip(runs[a_name]["valid"], runs[b_name]["valid"], strict=True):
        rel = (b["valid_loss"] - a["valid_loss"]) / a["valid_loss"]
        rel_nll = (b["valid_nll"] - a["valid_nll"]) / a["valid_nll"]
        rows.append({"step": int(a["step"]), a_name: a["valid_loss"], b_name: b["valid_loss"],
                     "relative": rel, f"nll {a_name}": a["valid_nll"],
                     f"nll {b_name}": b["valid_nll"], "relative_nll": rel_nll})
        print(f"{int(a['step']):>6}{a['valid_loss']:>22.4f}{b['valid_loss']:>10.4f}{rel:>+12.2%}"
              f"{a['valid_nll']:>22.4f}{b['valid_nll']:>10.4f}{rel_nll:>+12.2%}")
    final, final_nll = rows[-1]["relative"], rows[-1]["relative_nll"]
    print(f"\nfinal valid loss: {'within' if abs(final) < 0.005 else 'NOT within'} 0.5% "
          f"({final:+.2%}); valid NLL {final_nll:+.2%}")
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(__doc__)
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
    ap.add_argument("--vary", default="train.kernels=plain,fast", metavar="KEY=A,B",
                    help="the one setting the two runs differ in (default "
                    "train.kernels=plain,fast)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    harness.require_positive(ap, args, "steps", "valid_every")
    section, name, choices = parse_vary(args.vary)
    params, shards, tokenizer = prepare_data(args)
    out = Path(tempfile.mkdtemp(prefix="same-learning-", dir=args.workdir))
    facts = harness.machine_facts()
    print(harness.machine_line(facts))
    print(f"preset {args.preset}{''.join(' -S ' + o for o in args.set)}, {args.steps} steps, "
          f"runs in {out}", flush=True)
    runs = {}
    for value in choices:
        runs[value] = train_run(args, params, shards, tokenizer, out / value, section, name,
                                value)
        print(f"{value}: {runs[value]['minutes']:.1f} min, "
              f"{runs[value]['summary']['tokens_per_s']:.0f} target tokens/s", flush=True)
    rows = compare(runs, f"{section}.{name}", *choices)
    result = {"cpu": facts["cpu"], "instruction_caps": facts["instruction_caps"],
              "preset": args.preset, "overrides": args.set, "vary": args.vary,
              "steps": args.steps, "rows": rows, "runs": runs}
    # The JSON is standard: the cells read as NaN (e.g. BLEU not taken) are written as null.
    return harness.save(result, args.json, argv, facts)


def subprocess_run(cmd: list[str]) -> None:
    env = dict(os.environ)
    env.pop("MLFLOW_TRACKING_URI", None)
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd[:2])} failed:\n{result.stderr[-3000:]}")


if __name__ == "__main__":
    main()

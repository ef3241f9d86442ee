"""Translation speed against the decode batch size, and against another commit's decoder.

Each contender (this checkout at each of ``--batch-sizes``, or a ``--baseline REF`` commit's
decoder) translates the whole of ``--inputs`` as ``aiayn translate`` does, in a child process
of its own per turn (the model's loading untimed), turns alternating round by round. Per beam
size it prints sentences/s, the speed against the first contender (median of per-round
ratios, and their range), how many outputs equal the first's and, with ``--references``,
sacreBLEU. The guide: bench/README.md, ``decode_batching.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench import harness


def parse_args(argv: list[str] | None):
    p = harness.parser(__doc__)
    p.add_argument("--model", type=Path, help="a folder written by `aiayn average`")
    p.add_argument("--inputs", type=Path, help="source sentences, one per line")
    p.add_argument("--references", type=Path,
                   help="the target side, line for line (adds sacreBLEU per contender)")
    p.add_argument("--lines", type=int, default=0, help="the first N lines only (0: all)")
    p.add_argument("--baseline", metavar="REF", action="append", default=[],
                   help="git commit whose decoder runs as contender REF@<first batch size> "
                        "(repeatable), or a folder holding that commit's aiayn/ (made where "
                        "git is: git archive REF aiayn | tar -x -C FOLDER; contender "
                        "FOLDER's name@<size>)")
    p.add_argument("--batch-sizes", default="64,256,1024",
                   help="comma-separated sentences per batch for this checkout (default "
                        "64,256,1024; the first is the reference of the ratios when there "
                        "is no --baseline)")
    p.add_argument("--beams", default="1,4", help="comma-separated beam sizes (default 1,4)")
    p.add_argument("--alpha", type=float, default=0.6, help="length penalty (default 0.6)")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="as `aiayn translate --precision` (default auto: bf16 where native; "
                        "fp16 for a GPU without bf16)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where to decode (default cpu)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return args
    for name in ("model", "inputs"):
        if getattr(args, name) is None:
            p.error(f"--{name} is required")
    if not (args.model / "config.json").is_file():
        p.error(f"--model {args.model}: no config.json there; give a folder written by "
                "`aiayn average` (e.g. data/model)")
    for path in (args.inputs, args.references):
        if path is not None and not path.is_file():
            p.error(f"{path}: no such file")
    harness.require_positive(p, args, "rounds")
    args.batch_sizes = harness.int_list(p, "--batch-sizes", args.batch_sizes)
    args.beams = harness.int_list(p, "--beams", args.beams)
    return args


def worker(spec: dict) -> None:
    """One turn: load, translate once, write {seconds, outputs} to spec["out"]."""
    harness.import_from_tree()
    import torch

    import aiayn

    try:
        from aiayn.decoding.beam import BeamConfig
        from aiayn.decoding.translation import load_translator
    except ImportError:  # a baseline tree from before aiayn.decoding: the flat layout
        from aiayn.beam import BeamConfig
        from aiayn.translation import load_translator

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    translator = load_translator(Path(spec["model"]), spec["device"], spec["precision"])
    # Named from the dtype here, not by aiayn.precision.precision_name: older baselines lack it.
    precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(translator.amp_dtype, "fp32")
    lines = spec["lines"]
    cfg = BeamConfig(beam=spec["beam"], alpha=spec["alpha"])
    translator.translate(lines[:8], cfg, batch_size=8, truncate=True)  # warm-up
    sync = torch.cuda.synchronize if spec["device"] == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = translator.translate(lines, cfg, batch_size=spec["batch_size"], truncate=True)
    sync()
    seconds = time.perf_counter() - t0
    Path(spec["out"]).write_text(json.dumps({"seconds": seconds, "outputs": out,
                                             "precision": precision,
                                             "library": str(Path(aiayn.__file__).parent)}))


def run_turn(spec: dict, tree: Path | None, scratch: Path) -> dict:
    out = scratch / "turn.json"
    spec = dict(spec, out=str(out))
    job = scratch / "spec.json"
    job.write_text(json.dumps(spec))
    env = harness.child_env(*([tree] if tree else []))
    # run from the scratch folder: `python -m` puts its folder first on the import path,
    # and from the repository that would be this checkout's aiayn, whatever the baseline
    result = subprocess.run(harness.module_command("bench.decode_batching", "--worker",
                                                   str(job)),
                            capture_output=True, text=True, env=env, cwd=scratch)
    if result.returncode != 0:
        raise SystemExit(f"error: a turn of {spec['name']} failed:\n{result.stderr[-2000:]}")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.worker:
        worker(json.loads(Path(args.worker).read_text()))
        return {}
    lines = args.inputs.read_text(encoding="utf-8").splitlines()
    refs = args.references.read_text(encoding="utf-8").splitlines() if args.references else None
    if refs is not None and len(refs) != len(lines):
        raise SystemExit(f"error: {args.references} has {len(refs)} lines, {args.inputs} "
                         f"{len(lines)}; give the two sides of one split")
    if args.lines:
        lines, refs = lines[:args.lines], (refs[:args.lines] if refs else None)
    facts = harness.machine_facts()
    print(harness.machine_line(facts))
    print(f"{len(lines)} lines of {args.inputs}; model {args.model}; {args.device}, "
          f"precision {args.precision}; beams {args.beams}, alpha {args.alpha}")
    with tempfile.TemporaryDirectory(prefix="aiayn-decode-batching-") as tmp:
        scratch = Path(tmp)
        trees: dict[str, Path | None] = {}
        contenders: list[tuple[str, int]] = []
        for i, ref in enumerate(args.baseline):
            given = Path(ref)
            folder = (given / "aiayn").is_dir()
            who = given.resolve().name if folder else ref
            trees[who] = (given.resolve() if folder
                          else harness.extract_tree(ref, scratch / f"baseline{i}"))
            contenders.append((who, args.batch_sizes[0]))
        trees["this"] = None
        contenders += [("this", b) for b in args.batch_sizes]
        results: dict = {"lines": len(lines), "beams": {}}
        for beam in args.beams:
            names = [f"{who}@{size}" for who, size in contenders]
            runs: dict[str, list[dict]] = {name: [] for name in names}
            for rnd, order in harness.rounds(names, args.rounds):
                for name in order:
                    who, size = name.rsplit("@", 1)
                    spec = {"name": name, "model": str(args.model.resolve()), "lines": lines,
                            "beam": beam, "alpha": args.alpha, "batch_size": int(size),
                            "precision": args.precision, "threads": args.threads,
                            "device": args.device}
                    runs[name].append(run_turn(spec, trees[who], scratch))
                print(f"beam {beam}, round {rnd + 1}/{args.rounds}: " + "  ".join(
                    f"{n} {len(lines) / runs[n][-1]['seconds']:.1f}" for n in names)
                    + " sent/s", flush=True)
            results["beams"][beam] = summarize(names, runs, refs)
            report(beam, results["beams"][beam])
    results["precision"] = next(iter(runs.values()))[0]["precision"]
    harness.save(results, args.json, argv, facts)
    return results


def summarize(names: list[str], runs: dict[str, list[dict]], refs: list[str] | None
              ) -> dict:
    first = names[0]
    reference_out = runs[first][0]["outputs"]
    out = {}
    for name in names:
        secs = [r["seconds"] for r in runs[name]]
        speed = harness.ratio([r["seconds"] for r in runs[first]], secs)  # round by round
        outputs = runs[name][0]["outputs"]
        row = {"seconds": secs, "lines": len(outputs), "library": runs[name][0]["library"],
               "sent_per_s": len(outputs) / statistics.median(secs),
               "speed": list(speed.per_round),
               "same_outputs": sum(a == b for a, b in zip(outputs, reference_out,
                                                         strict=True))}
        if refs is not None:
            import sacrebleu
            row["sacrebleu"] = sacrebleu.corpus_bleu(outputs, [refs]).score
        out[name] = row
    return out


def report(beam: int, rows: dict) -> None:
    first = next(iter(rows))
    print(f"\nbeam {beam}: speed against {first} (median of the per-round ratios, range)")
    print(f"{'contender':<14} {'sent/s':>8} {'speed':>7} {'range':>13} {'same outputs':>13}"
          f" {'sacreBLEU':>10}")
    for name, row in rows.items():
        sp = harness.Ratio(tuple(row["speed"]))
        bleu = f"{row['sacrebleu']:.2f}" if "sacrebleu" in row else ""
        total = row["lines"]
        print(f"{name:<14} {row['sent_per_s']:>8.1f} {sp.median:>6.2f}x "
              f"{sp.low:>6.2f}..{sp.high:<5.2f} {row['same_outputs']:>7}/{total:<5}{bleu:>10}")
    print()


if __name__ == "__main__":
    main()

"""Translation quality against training wall time: BLEU of the checkpoints of one run.

Usage (from the repository root, after `dvc repro` with train.keep_checkpoints large
enough to keep the checkpoints you want on the curve)::

    .venv/bin/python -m bench.quality_curve --every 400 --average 5 --out curve.tsv --png curve.png

For every ``--every``-th checkpoint step (and the last one), the last ``--average``
checkpoints up to that step are averaged (as `aiayn average` does; fewer at the start),
the test split is translated with the params' ``decode.*`` settings (beam 4, alpha 0.6 by
default), and scored against the raw references:

* sacreBLEU (13a, mixed case: the project's headline number) and chrF2;
* ``lc-tok BLEU``: both sides lowercased and Moses-tokenized (sacremoses), then BLEU on
  those tokens (sacreBLEU with ``tokenize="none"``): the procedure of most Multi30k papers
  (multi-bleu.perl / fairseq on lowercased tokenized text), to compare with their numbers.

Wall time for a step is the train stage's ``elapsed_s`` in ``metrics/train_log.tsv`` at
the nearest logged step (training only: data stages and decoding not included).
Decoding runs on CPU in fp32 unless ``--precision bf16``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pandas as pd
import torch

from aiayn.beam import BeamConfig
from aiayn.checkpoint import (
    average_checkpoints,
    checkpoint_step,
    list_checkpoints,
    load_checkpoint,
)
from aiayn.config import load_params
from aiayn.corpus import iter_raw
from aiayn.model import Transformer, TransformerConfig
from aiayn.scoring import lowercase_bleu, sacre_scores
from aiayn.tokenizer import load_tokenizer
from aiayn.translation import Translator
from bench import harness


def lc_tok_bleu(hyps: list[str], refs: list[str], lang: str) -> float:
    """Lowercased Moses-tokenized BLEU, as the score stage computes it (lowercase_bleu)."""
    return lowercase_bleu(hyps, refs, lang)["score"]


def plot(df: pd.DataFrame, png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
    ax.plot(df["train_min"], df["sacrebleu"], "o-", label="sacreBLEU (cased, 13a)")
    ax.plot(df["train_min"], df["lc_tok_bleu"], "s--", label="lowercased Moses-tok BLEU")
    ax.plot(df["train_min"], df["chrf"], "^:", label="chrF2")
    ax.set(xlabel="training wall time (min)", ylabel="score", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = harness.parser(__doc__)
    ap.add_argument("--params", type=Path, default=Path("params.yaml"))
    ap.add_argument("--checkpoints", type=Path, default=Path("data/checkpoints"))
    ap.add_argument("--tokenizer", type=Path, default=Path("data/vocab/tokenizer.json"))
    ap.add_argument("--raw", type=Path, default=Path("data/raw"))
    ap.add_argument("--train-log", type=Path, default=Path("metrics/train_log.tsv"))
    ap.add_argument("--every", type=int, default=400, help="checkpoint steps on the curve")
    ap.add_argument("--average", type=int, default=1,
                    help="average the last N checkpoints up to each point (1: none)")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None, help="TSV of the curve")
    ap.add_argument("--png", type=Path, default=None, help="plot of the curve")
    args = ap.parse_args(argv)
    harness.require_positive(ap, args, "every", "average", "threads")
    if args.threads:
        torch.set_num_threads(args.threads)

    p = load_params(args.params)
    src, tgt = p.data.src_lang, p.data.tgt_lang
    cfg = BeamConfig(beam=p.decode.beam, alpha=p.decode.alpha, max_len_a=p.decode.max_len_a,
                     max_len_b=p.decode.max_len_b)
    rows = [b for b in iter_raw(args.raw, "test", columns=[src, tgt])]
    sources = [s for b in rows for s in b[src]]
    refs = [t for b in rows for t in b[tgt]]
    tok = load_tokenizer(args.tokenizer)
    log = pd.read_csv(args.train_log, sep="\t")
    found = list_checkpoints(args.checkpoints)
    if not found:
        sys.exit(f"error: no checkpoints in {args.checkpoints}")
    steps = [checkpoint_step(c) for c in found]
    chosen = [i for i, s in enumerate(steps) if s % args.every == 0 or i == len(steps) - 1]
    meta = load_checkpoint(found[-1], mmap=True)["meta"]
    model = Transformer(TransformerConfig(**meta["model_config"])).eval()
    amp = torch.bfloat16 if args.precision == "bf16" else None
    translator = Translator(model, tok, torch.device("cpu"), amp)

    results = []
    print(harness.machine_line())  # decode_s is a timing
    print(f"{len(sources)} test sentences, {src}->{tgt}, beam {cfg.beam}, alpha {cfg.alpha}, "
          f"average {args.average}, {args.precision}")
    print("step\ttrain_min\tsacrebleu\tchrf\tlc_tok_bleu\tdecode_s")
    for i in chosen:
        window = found[max(0, i - args.average + 1): i + 1]
        model.load_state_dict(average_checkpoints(window, key="model"))
        t0 = time.perf_counter()
        hyps = translator.translate(sources, cfg, batch_size=p.decode.batch_size, truncate=True)
        decode_s = time.perf_counter() - t0
        scores = sacre_scores(hyps, refs, tgt)
        near = log.iloc[(log["step"] - steps[i]).abs().argmin()]
        row = {"step": steps[i], "averaged": len(window),
               "train_min": round(float(near["elapsed_s"]) / 60, 2),
               "sacrebleu": round(scores["bleu"]["score"], 2),
               "chrf": round(scores["chrf"]["score"], 2),
               "lc_tok_bleu": round(lc_tok_bleu(hyps, refs, tgt), 2),
               "decode_s": round(decode_s, 1)}
        results.append(row)
        print("\t".join(str(row[k]) for k in ("step", "train_min", "sacrebleu", "chrf",
                                               "lc_tok_bleu", "decode_s")), flush=True)
    print(f"sacreBLEU signature: {scores['bleu']['signature']}")
    df = pd.DataFrame(results)
    if args.out:
        df.to_csv(args.out, sep="\t", index=False)
    if args.png:
        plot(df, args.png, f"test {src}->{tgt}, beam {cfg.beam}, last {args.average} averaged")
    return results


if __name__ == "__main__":
    main()

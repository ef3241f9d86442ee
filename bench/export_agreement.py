"""Do the exported models decode as ours does? Agreement on a trained model and real text.

The ``aiayn average`` folder ``--model`` is exported to CTranslate2 and transformers, and the
first ``--lines`` lines of ``--inputs`` are decoded by all three (batches as ``aiayn
translate`` makes them, one maximum length per batch). It prints how many outputs are
identical for greedy search, beam k at alpha 0, and beam k at alpha under |Y|^alpha
(CTranslate2 with patience 1, its default, and 1000, an exact search); how often GNMT's
normalisation picks another output; and the largest difference between our log P of our
beam outputs and each engine's. Nothing is timed. The guide: bench/README.md,
``export_agreement.py``.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from aiayn.data.tokenizer import BOS_ID, EOS, EOS_ID, PAD_ID, encode_ids
from aiayn.decoding.beam import BeamConfig, max_lengths
from aiayn.decoding.translation import Translator, source_batch
from aiayn.export.convert import export, load_model_folder
from aiayn.export.engines import CTranslate2Translator, TransformersTranslator
from bench import harness


@torch.no_grad()
def our_log_p(model, sources, outputs, limits) -> list[float]:
    """log P(output [+ EOS] | source), PAD and BOS banned; an output as long as its limit
    was cut there (no EOS)."""
    totals = []
    for src, out, limit in zip(sources, outputs, limits, strict=True):
        target = out + [EOS_ID] if len(out) < limit else list(out)
        if not target:
            totals.append(0.0)
            continue
        logits = model(source_batch([src]), torch.tensor([[BOS_ID] + target[:-1]])).float()[0]
        logits[:, [PAD_ID, BOS_ID]] = float("-inf")
        lp = F.log_softmax(logits, -1)
        totals.append(float(lp[torch.arange(len(target)), torch.tensor(target)].sum()))
    return totals


def same(a: list, b: list) -> str:
    n = sum(x == y for x, y in zip(a, b, strict=True))
    return f"{n}/{len(a)} identical"


def outputs_agreement(run, k: int, alpha: float) -> tuple[dict, list]:
    """Greedy and beam outputs of the engines against aiayn's: (the report's lines, aiayn's
    beam outputs at ``alpha`` with |Y|^alpha)."""
    engines = ("aiayn", "ctranslate2", "transformers")
    report: dict = {}
    greedy = {e: run(e, 1, 0.0) for e in engines}
    report["greedy ctranslate2"] = same(greedy["aiayn"], greedy["ctranslate2"])
    report["greedy transformers"] = same(greedy["aiayn"], greedy["transformers"])
    zero = {e: run(e, k, 0.0, "gnmt") for e in engines}
    report[f"beam {k} alpha 0 ctranslate2"] = same(zero["aiayn"], zero["ctranslate2"])
    report[f"beam {k} alpha 0 transformers"] = same(zero["aiayn"], zero["transformers"])
    ours = run("aiayn", k, alpha, "length")
    report[f"beam {k} alpha {alpha} (|Y|^a) transformers"] = same(
        ours, run("transformers", k, alpha))
    report[f"beam {k} alpha {alpha} (|Y|^a) ctranslate2, patience 1"] = same(
        ours, run("ctranslate2", k, alpha, patience=1.0))
    report[f"beam {k} alpha {alpha} (|Y|^a) ctranslate2, patience 1000"] = same(
        ours, run("ctranslate2", k, alpha, patience=1000.0))
    report[f"beam {k} alpha {alpha} aiayn GNMT vs |Y|^a"] = same(
        run("aiayn", k, alpha, "gnmt"), ours)
    report[f"beam {k} vs greedy (aiayn)"] = same(zero["aiayn"], greedy["aiayn"])
    return report, ours


def log_p_agreement(model, engines: dict, ids: list, ours: list, limits: list,
                    batches: list, limits_b: list, k: int, alpha: float) -> dict:
    """The log-probabilities of aiayn's beam outputs as each engine scores them, and
    CTranslate2's exhaustive beam scores, against our model's: the largest differences."""
    report: dict = {}
    lp = our_log_p(model, ids, ours, limits)
    ct2 = engines["ctranslate2"]
    ended = [i for i, (o, lim) in enumerate(zip(ours, limits, strict=True)) if len(o) < lim]
    # Only outputs that end before their limit can be scored with the EOS ctranslate2
    # appends; an undertrained model may have none, and then there is nothing to compare.
    d_ct2 = None
    if ended:
        scored = ct2.translator.score_batch(
            [[ct2.vocab[t] for t in ids[i]] + [EOS] for i in ended],
            [[ct2.vocab[t] for t in ours[i]] for i in ended], max_input_length=0)
        d_ct2 = max(abs(sum(r.log_probs) - lp[i]) for r, i in zip(scored, ended, strict=True))
    hf = engines["transformers"].model
    d_hf = 0.0
    with torch.no_grad():
        for src, out, lim, ref in zip(ids, ours, limits, lp, strict=True):
            target = out + [EOS_ID] if len(out) < lim else list(out)
            x = torch.tensor([src + [EOS_ID]])
            logits = hf(input_ids=x, decoder_input_ids=torch.tensor(
                [[BOS_ID] + target[:-1]])).logits[0].float()
            total = float(F.log_softmax(logits, -1)[torch.arange(len(target)),
                                                    torch.tensor(target)].sum())
            d_hf = max(d_hf, abs(total - ref))
    report["max |log P| difference, ctranslate2 score_batch"] = (
        "none compared (no output ended before its limit)" if d_ct2 is None
        else f"{d_ct2:.2e}")
    report["max |log P| difference, transformers forward"] = f"{d_hf:.2e}"
    ct2.patience = 1000.0
    d_search = 0.0
    start = 0
    for b, lim in zip(batches, limits_b, strict=True):
        cfg = BeamConfig(beam=k, alpha=alpha, max_len_a=0.0, max_len_b=lim,
                         length_norm="length")
        for j, r in enumerate(ct2.results(b, cfg, return_scores=True)):
            i = start + j
            n = len(ours[i]) + (len(ours[i]) < lim)
            if [ct2.token_id[t] for t in r.hypotheses[0]] == ours[i]:
                d_search = max(d_search, abs(r.scores[0] * n ** alpha - lp[i]))
        start += len(b)
    report["max |ctranslate2 beam score x |Y|^a - our log P|"] = f"{d_search:.2e}"
    return report


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(__doc__)
    ap.add_argument("--model", type=Path, required=True, help="an `aiayn average` folder")
    ap.add_argument("--inputs", type=Path, required=True, help="source sentences, one a line")
    ap.add_argument("--lines", type=int, default=500, help="first N non-empty lines (500)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--alpha", type=float, default=0.6)
    ap.add_argument("--max-len-b", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    harness.require_positive(ap, args, "lines", "batch_size", "beam", "threads")
    torch.set_num_threads(args.threads)

    folder = load_model_folder(args.model)
    model, tok = folder.model, folder.tokenizer
    texts = [t.strip() for t in args.inputs.read_text(encoding="utf-8").splitlines()]
    ids = [s[:model.cfg.max_positions - 1] for s in encode_ids(tok, texts) if s][:args.lines]
    ids.sort(key=len)
    batches = [ids[i:i + args.batch_size] for i in range(0, len(ids), args.batch_size)]
    limits_b = [max(max_lengths(source_batch(b), 1.0, args.max_len_b, model.cfg.max_positions))
                for b in batches]
    limits = [lim for b, lim in zip(batches, limits_b, strict=True) for _ in b]
    print(f"model {args.model}: d_model {model.cfg.d_model}, {model.cfg.encoder_layers}+"
          f"{model.cfg.decoder_layers} layers, vocabulary {model.cfg.vocab_size}; {len(ids)} "
          f"sentences of {args.inputs}, mean {statistics.fmean(map(len, ids)):.1f} tokens")

    with tempfile.TemporaryDirectory(prefix="aiayn_agree_") as tmp:
        t0 = time.perf_counter()
        ct2_dir = export(folder, Path(tmp) / "ct2", "ctranslate2").directory
        hf_dir = export(folder, Path(tmp) / "hf", "transformers").directory
        print(f"exported both in {time.perf_counter() - t0:.1f} s")
        engines = {"aiayn": Translator(model, tok, torch.device("cpu")),
                   "ctranslate2": CTranslate2Translator.from_folder(ct2_dir,
                                                                    threads=args.threads),
                   "transformers": TransformersTranslator.from_folder(hf_dir)}

        def run(engine: str, beam: int, alpha: float, norm: str = "length",
                patience: float = 1.0) -> list[list[int]]:
            tr = engines[engine]
            if engine == "ctranslate2":
                tr.patience = patience
            out = []
            for b, lim in zip(batches, limits_b, strict=True):
                cfg = BeamConfig(beam=beam, alpha=alpha, max_len_a=0.0, max_len_b=lim,
                                 length_norm=norm)
                out += tr.decode_batch(b, cfg)
            return out

        report, ours = outputs_agreement(run, args.beam, args.alpha)
        report.update(log_p_agreement(model, engines, ids, ours, limits, batches, limits_b,
                                      args.beam, args.alpha))
    width = max(map(len, report))
    for key, value in report.items():
        print(f"  {key:{width}s}  {value}")
    return report


if __name__ == "__main__":
    main()

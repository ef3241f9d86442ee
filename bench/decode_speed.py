"""Decoding speed on CPU: our beam search (cached, recompute, bf16) against the exported
model in CTranslate2 (fp32, int8) and in Hugging Face transformers, same weights, same inputs.

An ``aiayn average`` folder (``--model``) decodes the first lines of ``--inputs``, prepared
and batched as ``aiayn translate`` prepares them, by every method in alternating rounds; it
prints sentences/s and tokens/s per method, the speed ratios (medians of per-round ratios),
how many outputs are identical between methods and, with ``--references``, each engine's
sacreBLEU. The guide: bench/README.md, ``decode_speed.py``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from aiayn.data.tokenizer import decode, encode_ids
from aiayn.decoding.beam import BeamConfig, beam_search, max_lengths
from aiayn.decoding.translation import source_batch
from aiayn.model import Transformer
from aiayn.precision import cpu_has_native_bf16
from bench import harness

METHODS = ("cached", "bf16", "recompute", "ct2", "ct2_int8", "hf")
LABELS = {"cached": "ours, cached, fp32", "bf16": "ours, cached, bf16 autocast",
          "recompute": "ours, recompute (no cache)", "ct2": "CTranslate2 fp32",
          "ct2_int8": "CTranslate2 int8", "hf": "transformers (MarianMT) fp32"}


@dataclass
class Batch:
    words: list[list[int]]  # source token ids, without EOS
    src: torch.Tensor  # (B, S) ids + EOS, PAD-padded
    max_len: list[int]  # our per-sentence maximum output length (EOS included)
    texts: list[str] = field(default_factory=list)  # --inputs: the source lines
    refs: list[str] = field(default_factory=list)  # --references: their reference lines

    @property
    def ct2_max_len(self) -> int:  # one value per translate_batch call
        return max(self.max_len)


def cut_batches(pool: list[list[int]], batch_size: int, cfg: BeamConfig, limit: int,
                texts: list[str] | None = None, refs: list[str] | None = None) -> list[Batch]:
    """``pool`` (sorted by length) in consecutive batches, each source + EOS, PAD-padded
    (``aiayn.decoding.translation.source_batch``)."""
    batches = []
    for start in range(0, len(pool), batch_size):
        words = pool[start:start + batch_size]
        src = source_batch(words)
        batches.append(Batch(words, src, max_lengths(src, cfg.max_len_a, cfg.max_len_b, limit),
                             list(texts[start:start + batch_size]) if texts else [],
                             list(refs[start:start + batch_size]) if refs else []))
    return batches


def read_inputs(path: Path, tokenizer, n: int, limit: int
                ) -> tuple[list[list[int]], list[str], dict, list[int]]:
    """The first ``n`` lines of ``path`` as ``aiayn.decoding.translation`` encodes and orders
    them: stripped, encoded (no special tokens; EOS is appended when batching), those that
    encode to nothing dropped, cut at ``limit - 1`` tokens (``aiayn translate --truncate``),
    sorted by token count (stable); with their texts, statistics and line indices."""
    if not path.is_file():
        raise SystemExit(f"--inputs {path}: no such file")
    lines = path.read_text(encoding="utf-8").splitlines()
    texts = [line.strip() for line in lines]
    ids = encode_ids(tokenizer, texts)
    keep = [i for i, seq in enumerate(ids) if seq]
    truncated = sum(len(ids[i]) > limit - 1 for i in keep)
    for i in keep:
        ids[i] = ids[i][:limit - 1]
    chosen = sorted(keep[:n], key=lambda i: len(ids[i]))
    lens = [len(ids[i]) for i in chosen]
    stats = {"file": str(path), "lines": len(lines), "empty_dropped": len(lines) - len(keep),
             "selected": len(chosen), "truncated_in_file": truncated,
             "mean_src_tokens": statistics.fmean(lens) if lens else 0.0,
             "min_src_tokens": min(lens, default=0), "max_src_tokens": max(lens, default=0)}
    return [ids[i] for i in chosen], [texts[i] for i in chosen], stats, chosen


# -- model -------------------------------------------------------------------------------

def load_real_model(model_dir: Path) -> tuple[Transformer, dict, list[str], object]:
    """An ``aiayn average`` folder through the project's loader; vocabulary by token id."""
    from aiayn.decoding.translation import load_translator
    from aiayn.io import read_json

    tr = load_translator(model_dir, device="cpu", precision="fp32")
    vocab_map = tr.tokenizer.get_vocab(with_added_tokens=True)
    vocab = [""] * tr.model.cfg.vocab_size
    for token, i in vocab_map.items():
        vocab[i] = token
    if len(vocab_map) != len(vocab) or not all(vocab):
        raise SystemExit(f"{model_dir}/tokenizer.json: ids are not exactly 0..{len(vocab) - 1}; "
                         "cannot build a CTranslate2 vocabulary from it")
    meta = read_json(model_dir / "config.json")
    info = {"dir": str(model_dir),
            **{k: meta[k] for k in ("averaged_steps", "tokens_seen", "mlflow_run_id")
               if k in meta}}
    print(f"model: {model_dir} ({tr.model.cfg.d_model} d_model, {tr.model.cfg.encoder_layers}"
          f"+{tr.model.cfg.decoder_layers} layers, {tr.model.cfg.heads} heads, d_ff "
          f"{tr.model.cfg.d_ff}, {tr.model.cfg.norm}-LN, vocabulary {len(vocab)})")
    tr.model.eval()
    return tr.model, info, vocab, tr.tokenizer


# -- CTranslate2 -------------------------------------------------------------------------

def ct2_engine(path: Path, vocab: list[str], limit: int, compute_type: str, threads: int):
    """An export folder written by ``aiayn.export.convert.save_ctranslate2``, as the engine that
    ``aiayn translate --engine ctranslate2`` uses."""
    import ctranslate2

    from aiayn.export.engines import CTranslate2Translator

    return CTranslate2Translator(ctranslate2.Translator(
        str(path), device="cpu", compute_type=compute_type, inter_threads=1,
        intra_threads=threads), vocab, limit)


def engine_cfg(batch: Batch, beam: int, alpha: float) -> BeamConfig:
    """The batch's one maximum length, and the engines' |Y|^alpha normalisation."""
    return BeamConfig(beam=beam, alpha=alpha, max_len_a=0.0, max_len_b=batch.ct2_max_len,
                      length_norm="length")


def ct2_decode(engine, batch: Batch, beam: int, alpha: float):
    return engine.results(batch.words, engine_cfg(batch, beam, alpha), return_scores=True,
                          max_batch_size=0)


def hf_decode(engine, batch: Batch, beam: int, alpha: float) -> list[list[int]]:
    return engine.decode_batch(batch.words, engine_cfg(batch, beam, alpha))


def ct2_ids(results, token_id: dict[str, int]) -> list[list[int]]:
    return [[token_id[t] for t in r.hypotheses[0]] for r in results]


# -- ours --------------------------------------------------------------------------------

def ours_decode(model, batch: Batch, cfg: BeamConfig, use_cache: bool = True,
                bf16: bool = False) -> list[list[int]]:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        return beam_search(model, batch.src, cfg, use_cache=use_cache)


# -- agreement ---------------------------------------------------------------------------

def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for x, y in zip(a, b, strict=True))
    return {"sentences": len(a), "identical": same, "rate": same / len(a) if a else 1.0}


# -- timing ------------------------------------------------------------------------------

def timed(fn):
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w0, time.process_time() - c0


def out_tokens(hyps: list[list[int]]) -> int:
    return sum(len(h) + 1 for h in hyps)


def profile_cached(model, batch: Batch, cfg: BeamConfig) -> dict:
    """cProfile (Python functions) and torch.profiler (operators) of one cached search."""
    ours_decode(model, batch, cfg)
    prof = cProfile.Profile()
    prof.enable()
    _, wall, _ = timed(lambda: ours_decode(model, batch, cfg))
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
    print(f"\n-- cProfile, cached beam search, one batch {tuple(batch.src.shape)} "
          f"({wall:.2f} s with the profiler) --")
    print("\n".join(buf.getvalue().splitlines()[:40]))
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as p:
        ours_decode(model, batch, cfg)
    table = p.key_averages().table(sort_by="self_cpu_time_total", row_limit=22)
    print("\n-- torch.profiler, same batch, by self CPU time --")
    print(table)
    return {"profiler_table": table}


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[int]]:
    """The arguments, checked, and the thread counts of --threads."""
    ap = harness.parser(__doc__)
    ap.add_argument("--model", type=Path, required=True,
                    help="a model folder written by `aiayn average`")
    ap.add_argument("--inputs", type=Path, required=True,
                    help="source sentences, one per line; the first --batches x --batch-size "
                         "non-empty ones are decoded")
    ap.add_argument("--examples", type=int, default=3,
                    help="detokenized outputs shown, spread over the lengths (3)")
    ap.add_argument("--batches", type=int, default=4, help="batches of --batch-size (4)")
    ap.add_argument("--batch-size", type=int, default=64,
                    help="sentences per batch (64, params.yaml's decode.batch_size)")
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds (3)")
    ap.add_argument("--threads", default="2",
                    help="torch threads = CTranslate2 intra_threads; comma list, e.g. 2,1")
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--alpha", type=float, default=0.6)
    ap.add_argument("--max-len-b", type=int, default=50, help="max length = source + b (50)")
    ap.add_argument("--recompute-batches", type=int, default=1,
                    help="batches timed for the recompute path (1; 0 skips it)")
    ap.add_argument("--references", type=Path, default=None,
                    help="reference translations, line for line: each engine's sacreBLEU")
    ap.add_argument("--no-ct2", action="store_true", help="skip CTranslate2 (fp32 and int8)")
    ap.add_argument("--no-int8", action="store_true", help="skip the CTranslate2 int8 row")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    ap.add_argument("--no-bf16", action="store_true",
                    help="skip the bf16 autocast row (skipped anyway on a CPU without native "
                         "bf16, where it would be ~100x slower, unless --bf16)")
    ap.add_argument("--bf16", action="store_true",
                    help="run the bf16 row even on a CPU without native bf16")
    ap.add_argument("--profile", action="store_true",
                    help="profile one cached search (cProfile + torch.profiler) at the end")
    ap.add_argument("--json", type=Path, default=None, help="write all results here")
    args = ap.parse_args(argv)
    if not args.no_bf16 and not args.bf16 and not cpu_has_native_bf16():
        print("this CPU has no native bf16 (see aiayn/precision.py): skipping the bf16 row; "
              "--bf16 runs it anyway", flush=True)
        args.no_bf16 = True
    if not args.model.is_dir():
        ap.error(f"--model {args.model}: not a folder")
    harness.require_positive(ap, args, "rounds", "batches")
    return args, harness.int_list(ap, "--threads", args.threads, "thread count")


def describe(args, threads: list[int], cfg: BeamConfig, argv: list[str] | None) -> dict:
    """The run's header facts (printed) and the engines' versions: the start of the report."""
    facts = harness.machine_facts()
    info: dict = {"command": harness.command_line("bench.decode_speed", argv),
                  **{k: facts[k] for k in ("torch", "cpu", "logical_cpus", "cpu_capability",
                                           "python")},
                  "threads": threads, "beam": vars(cfg), "rounds": args.rounds}
    if not args.no_ct2:
        import ctranslate2

        info["ctranslate2"] = ctranslate2.__version__
        info["ct2_compute_types_cpu"] = sorted(ctranslate2.get_supported_compute_types("cpu"))
    if not args.no_hf:
        from aiayn.export.convert import quiet_transformers

        info["transformers"] = quiet_transformers().__version__
    print(harness.machine_line(facts))
    print(f"ctranslate2 {info.get('ctranslate2', '-')}  "
          f"transformers {info.get('transformers', '-')}  threads {threads}")
    info["load_average_start"] = os.getloadavg()
    print("load average (1, 5, 15 min): " + " ".join(f"{x:.1f}" for x in os.getloadavg()))
    return info


def model_and_batches(args, cfg: BeamConfig, info: dict) -> tuple:
    """(model, vocabulary, tokenizer, batches): --model's on --inputs' lines; what they are
    goes into ``info``."""
    from aiayn.errors import DataError

    try:
        model, info["model"], vocab, tokenizer = load_real_model(args.model)
    except DataError as exc:
        raise SystemExit(f"error: {exc}") from None
    info["model"]["config"] = model.cfg.to_dict()
    pool, texts, info["inputs"], chosen = read_inputs(
        args.inputs, tokenizer, args.batches * args.batch_size, model.cfg.max_positions)
    if not pool:
        raise SystemExit(f"error: --inputs {args.inputs} has no non-empty line")
    refs = None
    if args.references is not None:
        lines = args.references.read_text(encoding="utf-8").splitlines()
        if len(lines) != info["inputs"]["lines"]:
            raise SystemExit(f"error: --references {args.references} has {len(lines)} "
                             f"lines, --inputs {info['inputs']['lines']}")
        refs = [lines[i] for i in chosen]
        info["references"] = str(args.references)
    batches = cut_batches(pool, args.batch_size, cfg, model.cfg.max_positions, texts,
                          refs)
    print("inputs: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                 for k, v in info["inputs"].items()))
    return model, vocab, tokenizer, batches


@dataclass
class Engines:
    """The exported model's engines: CTranslate2 fp32 and int8 by thread count, and
    transformers; a missing one is empty (None); ``folder`` holds the exports."""

    ct2: dict = field(default_factory=dict)
    ct2_int8: dict = field(default_factory=dict)
    hf: object = None
    folder: tempfile.TemporaryDirectory | None = None


def make_engines(args, model, vocab: list[str], cfg: BeamConfig, threads: list[int]) -> Engines:
    from aiayn.export.convert import save_ctranslate2, to_marian

    limit = model.cfg.max_positions
    engines = Engines()
    if not args.no_ct2:
        engines.folder = tempfile.TemporaryDirectory(prefix="aiayn_ct2_")
        path = save_ctranslate2(model, vocab, Path(engines.folder.name) / "fp32")
        engines.ct2 = {t: ct2_engine(path, vocab, limit, "float32", t) for t in threads}
        if not args.no_int8:
            path8 = save_ctranslate2(model, vocab, Path(engines.folder.name) / "int8", "int8")
            engines.ct2_int8 = {t: ct2_engine(path8, vocab, limit, "int8", t) for t in threads}
    if not args.no_hf:
        from aiayn.export.engines import TransformersTranslator

        engines.hf = TransformersTranslator(to_marian(model, cfg.beam, cfg.alpha))
    return engines


def time_methods(args, model, batches: list[Batch], cfg: BeamConfig, engines: Engines,
                 methods: list[str], threads: list[int], rc_idx: list[int],
                 token_id: dict) -> tuple[dict, dict]:
    """For each thread count: every method warmed up on every batch, then --rounds
    alternating rounds, each method decoding all its batches in turn. Returns (results by
    thread count, the first timed round's outputs by method and batch)."""
    results: dict = {}
    first_outputs: dict = {}
    for t in threads:
        torch.set_num_threads(t)

        def run(method: str, bi: int, t=t):
            b = batches[bi]
            if method in ("ct2", "ct2_int8"):
                engine = getattr(engines, method)[t]
                res, wall, cpu = timed(lambda: ct2_decode(engine, b, cfg.beam, cfg.alpha))
                return ct2_ids(res, token_id), wall, cpu
            if method == "hf":
                return timed(lambda: hf_decode(engines.hf, b, cfg.beam, cfg.alpha))
            return timed(lambda: ours_decode(model, b, cfg, use_cache=method != "recompute",
                                             bf16=method == "bf16"))

        def batch_ids(method: str) -> list[int]:
            return rc_idx if method == "recompute" else list(range(len(batches)))

        t0 = time.perf_counter()
        for m in methods:  # warm-up: every batch once (recompute: its batches)
            for bi in batch_ids(m):
                run(m, bi)
        print(f"\nthreads {t}: warm-up {time.perf_counter() - t0:.0f} s", flush=True)
        runs = {m: [] for m in methods}
        for r, order in harness.rounds(methods, args.rounds):
            for m in order:
                time.sleep(0.5)  # lets the other library's OpenMP threads stop spinning
                per = {}
                for bi in batch_ids(m):
                    hyps, wall, cpu = run(m, bi)
                    per[bi] = (wall, cpu, len(hyps), out_tokens(hyps))
                    if r == 0 and t == threads[0]:
                        first_outputs.setdefault(m, {})[bi] = hyps
                runs[m].append(per)
                tot = [sum(x[j] for x in per.values()) for j in range(4)]
                print(f"  round {r + 1} {m:9s} {tot[0]:7.2f} s wall {tot[1]:7.2f} s cpu "
                      f"{tot[2] / tot[0]:7.1f} sent/s {tot[3] / tot[0]:8.1f} tok/s", flush=True)
        results[t] = summarize(runs, rc_idx, args.rounds)
    return results, first_outputs


def timed_agreement(fo: dict, n_batches: int, rc_idx: list[int]) -> dict:
    """How many of the first timed round's outputs (``fo``: method -> batch -> outputs) are
    identical between methods: ours against each engine (CTranslate2 and transformers
    normalise by |Y|^alpha, ours by GNMT's ((5 + |Y|) / 6)^alpha, so beams may part), cached
    against recompute and bf16, int8 against fp32."""
    def joined(m: str, idx) -> list:
        return sum((fo[m][i] for i in idx), [])

    every = range(n_batches)
    pairs = [("cached", m, every) for m in ("bf16", "ct2", "ct2_int8", "hf")]
    pairs += [("cached", "recompute", rc_idx), ("ct2", "ct2_int8", every)]
    return {f"{a} vs {b}": agreement(joined(a, idx), joined(b, idx))
            for a, b, idx in pairs if a in fo and b in fo}


def main(argv: list[str] | None = None) -> dict:
    args, threads = parse_args(argv)
    cfg = BeamConfig(beam=args.beam, alpha=args.alpha, max_len_a=1.0, max_len_b=args.max_len_b)
    info = describe(args, threads, cfg, argv)
    model, vocab, tokenizer, batches = model_and_batches(args, cfg, info)
    token_id = {t: i for i, t in enumerate(vocab)}
    n_sent = sum(len(b.words) for b in batches)
    mid = len(batches) // 2
    rc_idx = sorted({min(len(batches) - 1, max(0, mid - args.recompute_batches // 2 + j))
                     for j in range(args.recompute_batches)}) if args.recompute_batches else []
    info["batches"] = [{"shape": list(b.src.shape), "words": [len(b.words[0]), len(b.words[-1])],
                        "ct2_max_len": b.ct2_max_len} for b in batches]
    info["recompute_batches"] = rc_idx
    print(f"{len(batches)} batches x {args.batch_size}: source shapes "
          + " ".join(f"{tuple(b.src.shape)}" for b in batches)
          + f"; recompute timed on batch(es) {rc_idx}")
    engines = make_engines(args, model, vocab, cfg, threads)
    methods = [m for m in METHODS
               if not (m == "ct2" and not engines.ct2) and not (m == "bf16" and args.no_bf16)
               and not (m == "ct2_int8" and not engines.ct2_int8)
               and not (m == "hf" and engines.hf is None)
               and not (m == "recompute" and not rc_idx)]
    results, fo = time_methods(args, model, batches, cfg, engines, methods, threads, rc_idx,
                               token_id)
    info["results"] = {str(t): v for t, v in results.items()}
    agree = timed_agreement(fo, len(batches), rc_idx)
    if batches[0].refs:
        info["bleu"] = bleu_scores(tokenizer, batches, fo)
    info["agreement"] = agree
    info["timed_outputs"] = {m: {"tokens": out_tokens(sum(v.values(), [])),
                                 "empty": sum(not h for hs in v.values() for h in hs),
                                 "sentences": sum(len(hs) for hs in v.values())}
                             for m, v in fo.items()}
    info["load_average_end"] = os.getloadavg()
    if "cached" in fo and args.examples > 0:
        info["examples"] = examples(tokenizer, batches, fo, args.examples)

    report(info, results, agree, n_sent, len(rc_idx) * args.batch_size)
    if args.profile:
        torch.set_num_threads(threads[0])
        info["profile"] = profile_cached(model, batches[mid], cfg)
    if args.json:
        print()
    info = harness.save(info, args.json, argv)
    if engines.folder is not None:
        engines.folder.cleanup()
    return info


def examples(tokenizer, batches: list[Batch], outputs: dict, n: int) -> list[dict]:
    """``n`` sentences spread over the length range: source, ours and CTranslate2, as text.

    ``outputs``: the first timed round's outputs (beam, alpha of the run), method → batch
    index → hypotheses.
    """
    where = [(bi, i) for bi, b in enumerate(batches) for i in range(len(b.words))]
    picks = sorted({round(j * (len(where) - 1) / max(n - 1, 1)) for j in range(n)})
    out = []
    for k in picks:
        bi, i = where[k]
        ex = {"source": batches[bi].texts[i], "src_tokens": len(batches[bi].words[i]),
              "ours": decode(tokenizer, outputs["cached"][bi][i])}
        for m in ("ct2", "ct2_int8", "hf"):
            if m in outputs:
                ex[m] = decode(tokenizer, outputs[m][bi][i])
                ex[f"{m}_same_tokens"] = outputs["cached"][bi][i] == outputs[m][bi][i]
        out.append(ex)
    return out


def bleu_scores(tokenizer, batches: list[Batch], outputs: dict) -> dict:
    """sacreBLEU of each method's detokenized outputs (all batches) against the references."""
    import sacrebleu

    refs = [r for b in batches for r in b.refs]
    scores, signature = {}, None
    for m, per_batch in outputs.items():
        if m == "recompute" or len(per_batch) != len(batches):
            continue
        hyps = [decode(tokenizer, h) for bi in range(len(batches)) for h in per_batch[bi]]
        bleu = sacrebleu.metrics.BLEU()
        scores[m] = bleu.corpus_score(hyps, [refs]).score
        signature = str(bleu.get_signature())
    return {"sentences": len(refs), "signature": signature, "scores": scores}


def summarize(runs: dict, rc_idx: list[int], rounds: int) -> dict:
    med = statistics.median
    out: dict = {}
    for m, per_round in runs.items():
        walls = [sum(x[0] for x in p.values()) for p in per_round]
        cpus = [sum(x[1] for x in p.values()) for p in per_round]
        sents = sum(x[2] for x in per_round[0].values())
        toks = sum(x[3] for x in per_round[0].values())
        out[m] = {"wall_s": med(walls), "cpu_s": med(cpus), "sentences": sents,
                  "tokens": toks, "sent_per_s": med(sents / w for w in walls),
                  "tok_per_s": med(toks / w for w in walls),
                  "cpu_per_wall": med(c / w for c, w in zip(cpus, walls, strict=True)),
                  "walls": walls}
    ratios: dict = {}

    def ratio(num: str, den: str, idx=None) -> float | None:
        """time(num) / time(den), round by round on the same batches (``idx``: these)."""
        if num not in runs or den not in runs:
            return None
        walls = {m: [sum(runs[m][r][k][0] for k in (idx if idx is not None else runs[num][r]))
                     for r in range(rounds)] for m in (num, den)}
        return harness.ratio(walls[num], walls[den]).median

    # speed ratio X/Y = time(Y) / time(X), per round on the same batches, median
    ratios["cached / recompute"] = ratio("recompute", "cached", rc_idx)
    ratios["ours cached / ct2"] = ratio("ct2", "cached")
    ratios["ours bf16 / ct2"] = ratio("ct2", "bf16")
    ratios["ct2 fp32 / ours cached"] = ratio("cached", "ct2")
    ratios["ct2 int8 / ours cached"] = ratio("cached", "ct2_int8")
    ratios["ct2 int8 / ct2 fp32"] = ratio("ct2", "ct2_int8")
    ratios["transformers / ours cached"] = ratio("cached", "hf")
    ratios["bf16 / fp32 (cached)"] = ratio("cached", "bf16")
    out["ratios"] = {k: v for k, v in ratios.items() if v is not None}
    return out


def report(info: dict, results: dict, agree: dict, n_sent: int, n_rc: int) -> None:
    print("\n== decoding speed (medians over rounds; ratios: median of per-round ratios) ==")
    print(f"beam {info['beam']['beam']}, alpha {info['beam']['alpha']}, max length = source + "
          f"{info['beam']['max_len_b']}; CPU {info['cpu']}; torch {info['torch']}, "
          f"ctranslate2 {info.get('ctranslate2', '-')}")
    mc = info["model"]["config"]
    print(f"model: {info['model']['dir']} on {info['inputs']['selected']} sentences of "
          f"{info['inputs']['file']} (mean {info['inputs']['mean_src_tokens']:.1f} source "
          f"tokens); d_model {mc['d_model']}, {mc['encoder_layers']}+"
          f"{mc['decoder_layers']} layers, {mc['heads']} heads, d_ff {mc['d_ff']}, "
          f"{mc['norm']}-LN, vocabulary {mc['vocab_size']}")
    head = (f"{'threads':>7}  {'method':30s} {'sentences':>9} {'sent/s':>8} {'tok/s':>8} "
            f"{'wall s':>8} {'cpu/wall':>8}")
    print(head)
    print("-" * len(head))
    for t, res in results.items():
        for m in METHODS:
            if m not in res:
                continue
            r = res[m]
            print(f"{t:>7}  {LABELS[m]:30s} {r['sentences']:>9} {r['sent_per_s']:8.1f} "
                  f"{r['tok_per_s']:8.1f} {r['wall_s']:8.2f} {r['cpu_per_wall']:8.2f}")
        for k, v in res["ratios"].items():
            goal = {"cached / recompute": "  (goal >= 5)",
                    "ours cached / ct2": "  (goal >= 0.5)",
                    "ct2 fp32 / ours cached": "  (goal >= 1.5)",
                    "ct2 int8 / ours cached": "  (goal >= 2)"}.get(k, "")
            print(f"{t:>7}  speed ratio {k}: {v:.2f}x{goal}")
    print(f"\n== identical outputs, first timed round (beam {info['beam']['beam']}, alpha "
          f"{info['beam']['alpha']}) ==")
    for k, v in agree.items():
        print(f"{k}: {v['identical']}/{v['sentences']} ({100 * v['rate']:.1f}%)")
    print(f"(recompute timed on {n_rc} of {n_sent} sentences)")
    print("outputs of the first timed round: " + "; ".join(
        f"{m}: {v['tokens']} tokens (with EOS) for {v['sentences']} sentences, {v['empty']} empty"
        for m, v in info["timed_outputs"].items()))
    if info.get("bleu"):
        b = info["bleu"]
        print(f"\n== BLEU on {b['sentences']} sentences of {info['references']} (first timed "
              f"round; sacreBLEU {b['signature']}) ==")
        base = b["scores"].get("ct2")
        for m, score in b["scores"].items():
            delta = "" if base is None or m == "ct2" else f"   {score - base:+.2f} vs ct2 fp32"
            goal = "  (goal: within 0.3)" if m == "ct2_int8" else ""
            print(f"  {LABELS[m]:30s} {score:6.2f}{delta}{goal}")
    if info.get("examples"):
        print(f"\n== examples (first timed round, beam {info['beam']['beam']}, alpha "
              f"{info['beam']['alpha']}; detokenized) ==")
        for j, ex in enumerate(info["examples"], 1):
            print(f"[{j}] source ({ex['src_tokens']} tokens): {ex['source']}")
            print(f"    ours: {ex['ours']}")
            for m in ("ct2", "ct2_int8", "hf"):
                if m in ex:
                    print(f"    {m + ':':9s} {ex[m]}"
                          + ("   (same tokens)" if ex[f"{m}_same_tokens"] else "   (differs)"))


if __name__ == "__main__":
    main()

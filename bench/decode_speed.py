"""Decoding speed on CPU: our beam search (cached, recompute, bf16) against the exported
model in CTranslate2 (fp32, int8) and in Hugging Face transformers, same weights, same inputs.

Usage (from the repository root)::

    .venv/bin/python -m bench.decode_speed                    # 4 batches x 3 rounds, 2 threads
    .venv/bin/python -m bench.decode_speed --threads 2,1 --json out.json
    .venv/bin/python -m bench.decode_speed --profile          # + where the cached search spends
    .venv/bin/python -m bench.decode_speed --model data/model \
        --inputs ../shared/data/multi30k/test2016.en \
        --references ../shared/data/multi30k/test2016.de \
        --batches 16 --recompute-batches 0                    # a trained model, all of test2016,
                                                              # with BLEU of every engine
    .venv/bin/python -m bench.decode_speed --help

The exports come from the library (``aiayn.export.convert``: ``save_ctranslate2``, ``to_marian``)
and decode through its engines (``aiayn.export.engines``), as ``aiayn export`` and ``aiayn
translate --engine`` do. ``ctranslate2`` and ``transformers`` (``pip install
'aiayn[export]'``) are needed for their rows only (``--no-ct2``, ``--no-int8``, ``--no-hf``
skip them).

Model (default: the copy task)
------------------------------
Without ``--model``: d_model 256, 3+3 layers, 4 heads, d_ff 1024, vocabulary 8000, post-LN
(``aiayn``'s default). Random weights decode degenerately: greedy output of a fresh model
repeats a few tokens and never emits EOS, so every sentence runs to its maximum length
(source + 50), a work profile unlike translation, and "the outputs agree" would test little.
So the model is first trained for ``--train-steps`` (default 300) Adam steps on a copy task:
batches of 32 sentences of 4-40 words drawn uniformly from 500 word ids (4-503), target =
source; label smoothing 0.1, lr 1e-3 after 30 warm-up steps. That takes about 0.9
CPU-seconds a step on one thread (about 5 minutes on an idle core); 50 steps are not enough
(still degenerate: no EOS), and with Zipf-distributed words over the whole vocabulary the
copy is not learnt within 400 steps. The result is deliberately half trained (about 40% of
greedy output tokens right): output lengths follow the source lengths with EOS at varied
positions (a translation-like work profile), yet the model is unsure, so beams hold real
alternatives and near-ties. The weights are cached under ``--weights`` (default: the temp
directory, keyed by seed and settings); a rerun loads them. ``--train-steps 0`` uses the
random initialisation.

Inputs: ``--batches`` x ``--batch-size`` (64) source sentences of 10-40 words (same word
distribution) + EOS, sorted by length and cut into batches as ``aiayn.decoding.translation`` does.

Real model (``--model DIR --inputs FILE``)
------------------------------------------
``--model`` takes a folder written by ``aiayn average`` (``model.safetensors``,
``config.json``, ``tokenizer.json``), loaded with ``aiayn.decoding.translation.load_translator``
(device cpu, fp32; it checks the tokenizer's sha256 and vocabulary size against
``config.json``). No copy-task training then: ``--train-steps``, ``--train-threads``,
``--weights``, ``--min-words`` and ``--max-words`` are ignored. The two options go together
(either alone is an argparse error). ``--inputs`` is plain text, one source sentence a line
(e.g. ``../shared/data/multi30k/test2016.en``), prepared as ``aiayn.decoding.translation`` does:
each line stripped and encoded with the model's tokenizer without special tokens, lines
that encode to nothing dropped, a line over ``max_positions - 1`` tokens cut there (what
``aiayn translate --truncate`` does; counted as ``truncated_in_file``), EOS appended,
sorted by token count (stable) and cut into batches of ``--batch-size`` (default 64, the
``decode.batch_size`` of ``params.yaml``). Which ``--batches`` x ``--batch-size``
sentences: ``--select head`` (default) takes the first that many non-empty lines in file
order, then sorts and batches them, i.e. exactly the batches ``aiayn translate --input``
makes for a file of those lines, with the file's length mix; ``--select shortest`` takes
the first batches that ``aiayn translate`` makes for the whole file, which are its
shortest sentences (for 4 x 64 of test2016's 1000, its shortest quarter: not the file's
length mix). Fewer sentences than asked for: all are used, and the last batch may be
smaller. The beam settings are the script's (``--beam``, ``--alpha``,
``--max-len-b``; max length = source tokens + EOS + b, as ``decode.max_len_a`` 1.0), not
read from ``params.yaml``. Besides the tables below, the report shows ``--examples`` (3)
sentences spread over the length range, detokenized with the model's tokenizer
(``aiayn.data.tokenizer.decode``): the source line, our cached fp32 output and each engine's, from
the first timed round, marked "same tokens" or "differs".

Methods (all on the same batches, beam 4, alpha 0.6, max length = source length + 50)
------------------------------------------------------------------------------------
* ``cached``     ``beam_search(use_cache=True)``: encode once, one ``decode_step`` per token;
* ``masked``     ``cached`` as before decoding projected onto the spanned tokens' rows: a
                 model with ``model.output_vocab: target`` computes the logits of the whole
                 vocabulary and sets the others to -inf (only for such a model);
* ``bf16``       the same inside ``torch.autocast("cpu", dtype=torch.bfloat16)``;
* ``recompute``  ``beam_search(use_cache=False)``: a full ``model(src, prefix)`` per step;
                 slow, so timed on ``--recompute-batches`` (1) of the batches, the middle
                 one(s) by length; its ratio to ``cached`` uses cached's times on the same
                 batches of the same round;
* ``ct2``        ``ctranslate2.Translator(device="cpu", compute_type="float32",
                 inter_threads=1, intra_threads=threads).translate_batch(beam_size=4,
                 length_penalty=0.6, max_decoding_length=max over the batch of
                 (source length + 50))`` on the same weights (see "CTranslate2 model"),
                 through ``aiayn.export.engines.CTranslate2Translator`` (patience 1, its default);
* ``ct2_int8``   the same on an export quantized to int8 (``aiayn export --quantization
                 int8``), ``compute_type="int8"``;
* ``hf``         ``MarianMTModel.generate(num_beams=4, length_penalty=0.6,
                 early_stopping="never", max_new_tokens=max over the batch)`` on the same
                 weights (``aiayn.export.convert.to_marian``), through
                 ``aiayn.export.engines.TransformersTranslator``; torch threads as ours.

``torch.set_num_threads(t)`` and CTranslate2's ``intra_threads`` take the same value ``t``,
for each ``t`` of ``--threads`` (default 2). Each method decodes every batch once for warm-up;
then ``--rounds`` rounds, each decoding all batches with every method, in an order rotated by
one method per round, with a 0.5 s pause between methods (lets OpenMP threads of the other
library stop spinning). The machine may be shared: only side-by-side ratios mean something,
so each ratio is the median over rounds of the per-round ratio, and absolute figures are
medians over rounds. CPU seconds (``time.process_time``, all threads of the process) come
next to wall seconds: CPU/wall far below the thread count means time lost to other processes.

CTranslate2 and transformers normalise by |Y|^alpha, ours (timed rows) by GNMT's
((5 + |Y|) / 6)^alpha: the timed rows each decode as their engine does by default.

sentences/s = sentences / wall seconds; tokens/s = generated tokens / wall seconds, where the
generated tokens of a sentence are its output tokens + 1 (its EOS; also counted for an
output cut at the maximum length). Beam search computes ``beam`` hypotheses per sentence;
tokens/s counts the returned one only.

CTranslate2 and transformers models
-----------------------------------
Converted by ``aiayn.export.convert`` (its module docstring has the mapping, weight by weight):
``save_ctranslate2(model, vocab, dir, quantization)`` for CTranslate2 (fp32 and int8) and
``to_marian(model)`` for transformers (``MarianMTModel``, hidden dimensions permuted so that
Marian's [sin | cos] sinusoid equals our interleaved one). One vocabulary for both sides,
token string ``i`` for our id ``i``: for the copy task ``<pad> <s> </s> <unk> w4 ...
w7999``, for ``--model`` the tokenizer's own tokens. Both exports carry an output bias of
-inf at PAD and BOS (our beam search's rule), so no ``suppress_sequences`` is needed; the
engines pass ``min_decoding_length=0`` (CTranslate2's default of 1 forbids an empty output;
ours allows it).

BLEU (``--references FILE``, with ``--model``)
----------------------------------------------
The references of the decoded lines (the same line numbers as ``--inputs``), and for every
method but ``recompute``, the first timed round's outputs detokenized with the model's
tokenizer: sacreBLEU's corpus BLEU (default 13a tokenization, signature printed), and each
engine's BLEU minus ``ct2``'s (the goal: int8 within 0.3 of fp32). With ``--batches 16``
(x 64) all 1000 lines of Multi30k test2016 are decoded.

Agreement (outside the timing)
------------------------------
* greedy: ``greedy_search`` against CTranslate2 ``beam_size=1`` and transformers
  ``num_beams=1``, token for token;
* beam 4, alpha 0: both rank finished hypotheses by log P and stop once the best finished one
  beats every live one, so they should agree;
* beam 4, alpha 0.6: not the same objective. Ours ranks by log P / ((5 + |Y|) / 6)^alpha
  (GNMT; |Y| counts EOS) and stops when no live hypothesis can win any more (exact);
  CTranslate2 ranks by log P / |Y|^alpha and stops a sentence as soon as ``beam x
  patience`` = 4 hypotheses have finished. (|Y| with EOS in 4.8.5: its returned scores equal
  our model's teacher-forced log P / (tokens + 1)^alpha; the script prints the largest
  difference, about 1e-5, which also shows that both run the same weights.) An empty output
  (EOS first) has lp = 1 under both formulas, so an unsure model can prefer it. Both keep
  the same live beams (the top k non-EOS candidates of each step), so they differ only in
  which finished hypothesis wins and in when they stop. Each disagreement is classified by
  rescoring both outputs with our model (teacher forcing, fp32): "formula" (each output wins
  under its own search's formula), "ct2 stopped early" (ours is better under both formulas:
  CTranslate2 stopped before finding it), "ours stopped early" (CTranslate2's output is
  better under both), "tie" (scores within 1e-4), and for the timed outputs "max length"
  (ours was cut at source + 50, CTranslate2 ran on to the batch's one maximum).
  Also: cached vs recompute and fp32 vs bf16 outputs.
* beam 4 against transformers at alpha 0 (ours as is) and at alpha (ours with
  ``length_norm="length"``, transformers' normalisation): both searches are exact
  (``early_stopping="never"``), so they should agree; and CTranslate2 int8 against fp32.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import hashlib
import io
import json
import os
import pstats
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from aiayn.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, decode, encode_ids
from aiayn.decoding.beam import BeamConfig, beam_search, length_penalty, max_lengths
from aiayn.decoding.translation import source_batch
from aiayn.model import Transformer, TransformerConfig
from aiayn.precision import cpu_has_native_bf16
from bench import harness

VOCAB = 8000
WORDS = 500  # sentences draw their words uniformly from ids 4 .. 4 + WORDS - 1
TRAIN_LENGTHS = (4, 40)
VOCAB_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(4, VOCAB)]
METHODS = ("cached", "masked", "bf16", "recompute", "ct2", "ct2_int8", "hf")
LABELS = {"cached": "ours, cached, fp32", "bf16": "ours, cached, bf16 autocast",
          "masked": "ours, cached, masked",
          "recompute": "ours, recompute (no cache)", "ct2": "CTranslate2 fp32",
          "ct2_int8": "CTranslate2 int8", "hf": "transformers (MarianMT) fp32"}


def model_config() -> TransformerConfig:
    return TransformerConfig(vocab_size=VOCAB, d_model=256, heads=4, encoder_layers=3,
                             decoder_layers=3, d_ff=1024, dropout=0.1, norm="post")


# -- data --------------------------------------------------------------------------------

def sentences(rng: np.random.Generator, n: int, lo: int, hi: int) -> list[list[int]]:
    """n sentences of lo..hi words (uniform), words uniform over WORDS ids."""
    lengths = rng.integers(lo, hi + 1, n)
    return [(4 + rng.integers(0, WORDS, int(k))).tolist() for k in lengths]


def pad(seqs: list[list[int]], pre: tuple[int, ...] = (), post: tuple[int, ...] = ()
        ) -> torch.Tensor:
    width = max(len(s) for s in seqs) + len(pre) + len(post)
    out = torch.full((len(seqs), width), PAD_ID, dtype=torch.long)
    for i, s in enumerate(seqs):
        row = [*pre, *s, *post]
        out[i, :len(row)] = torch.tensor(row)
    return out


@dataclass
class Batch:
    words: list[list[int]]  # source token ids (copy task: word ids), without EOS
    src: torch.Tensor  # (B, S) ids + EOS, PAD-padded
    tokens: list[list[str]]  # the same as CTranslate2 token strings, with "</s>"
    max_len: list[int]  # our per-sentence maximum output length (EOS included)
    texts: list[str] = field(default_factory=list)  # --inputs: the source lines
    refs: list[str] = field(default_factory=list)  # --references: their reference lines

    @property
    def ct2_max_len(self) -> int:  # one value per translate_batch call
        return max(self.max_len)


def cut_batches(pool: list[list[int]], batch_size: int, vocab: list[str], cfg: BeamConfig,
                limit: int, texts: list[str] | None = None, refs: list[str] | None = None
                ) -> list[Batch]:
    """``pool`` (sorted by length) in consecutive batches, each source + EOS, PAD-padded
    (``aiayn.decoding.translation.source_batch``)."""
    batches = []
    for start in range(0, len(pool), batch_size):
        words = pool[start:start + batch_size]
        src = source_batch(words)
        batches.append(Batch(words, src, [[vocab[i] for i in w] + [vocab[EOS_ID]] for w in words],
                             max_lengths(src, cfg.max_len_a, cfg.max_len_b, limit),
                             list(texts[start:start + batch_size]) if texts else [],
                             list(refs[start:start + batch_size]) if refs else []))
    return batches


def make_batches(n_batches: int, batch_size: int, lo: int, hi: int, seed: int,
                 cfg: BeamConfig, limit: int) -> list[Batch]:
    rng = np.random.default_rng(seed + 1)
    pool = sorted(sentences(rng, n_batches * batch_size, lo, hi), key=len)
    return cut_batches(pool, batch_size, VOCAB_TOKENS, cfg, limit)


def read_inputs(path: Path, tokenizer, n: int, select: str, limit: int
                ) -> tuple[list[list[int]], list[str], dict, list[int]]:
    """Source lines of ``path`` as ``aiayn.decoding.translation`` encodes and orders them.

    Lines are stripped and encoded with the model's tokenizer (no special tokens; EOS is
    appended when batching); lines that encode to nothing are dropped; a line longer than
    ``limit - 1`` tokens is cut there (what ``aiayn translate --truncate`` does). ``select``
    "head" keeps the first ``n`` remaining lines in file order, "shortest" the ``n`` shortest
    of the whole file; either way the kept ones are returned sorted by token count (stable,
    as ``aiayn.decoding.translation`` sorts), ready to be cut into batches, with their line indices.
    """
    if not path.is_file():
        raise SystemExit(f"--inputs {path}: no such file")
    lines = path.read_text(encoding="utf-8").splitlines()
    texts = [line.strip() for line in lines]
    ids = encode_ids(tokenizer, texts)
    keep = [i for i, seq in enumerate(ids) if seq]
    truncated = sum(len(ids[i]) > limit - 1 for i in keep)
    for i in keep:
        ids[i] = ids[i][:limit - 1]
    if select == "head":
        chosen = sorted(keep[:n], key=lambda i: len(ids[i]))
    else:
        chosen = sorted(keep, key=lambda i: len(ids[i]))[:n]
    lens = [len(ids[i]) for i in chosen]
    stats = {"file": str(path), "lines": len(lines), "empty_dropped": len(lines) - len(keep),
             "select": select, "selected": len(chosen), "truncated_in_file": truncated,
             "mean_src_tokens": statistics.fmean(lens) if lens else 0.0,
             "min_src_tokens": min(lens, default=0), "max_src_tokens": max(lens, default=0)}
    return [ids[i] for i in chosen], [texts[i] for i in chosen], stats, chosen


# -- model -------------------------------------------------------------------------------

def train_copy(model: Transformer, steps: int, seed: int, batch_size: int = 32) -> list[float]:
    """Adam (paper betas), lr 1e-3 after 30 warm-up steps, label smoothing 0.1, copy task."""
    rng = np.random.default_rng(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=1e-9)
    model.train()
    losses = []
    for step in range(1, steps + 1):
        for group in opt.param_groups:
            group["lr"] = 1e-3 * min(1.0, step / 30)
        words = sentences(rng, batch_size, *TRAIN_LENGTHS)
        labels = source_batch(words)  # the source is the target
        logits = model(labels, pad(words, pre=(BOS_ID,)))
        loss = F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), ignore_index=PAD_ID,
                               label_smoothing=0.1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 25 == 0 or step == steps:
            print(f"  train step {step}/{steps}: loss {statistics.fmean(losses[-25:]):.3f}",
                  flush=True)
    model.eval()
    return losses


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
    info = {"task": "real", "dir": str(model_dir),
            **{k: meta[k] for k in ("averaged_steps", "tokens_seen", "mlflow_run_id")
               if k in meta}}
    print(f"model: {model_dir} ({tr.model.cfg.d_model} d_model, {tr.model.cfg.encoder_layers}"
          f"+{tr.model.cfg.decoder_layers} layers, {tr.model.cfg.heads} heads, d_ff "
          f"{tr.model.cfg.d_ff}, {tr.model.cfg.norm}-LN, vocabulary {len(vocab)})")
    tr.model.eval()
    return tr.model, info, vocab, tr.tokenizer


def build_model(args) -> tuple[Transformer, dict]:
    """The copy-task model of the module docstring: trained now, or loaded from its cache."""
    torch.manual_seed(args.seed)
    model = Transformer(model_config())
    info: dict = {"train_steps": args.train_steps, "task": "copy"}
    if args.train_steps <= 0:
        model.eval()
        return model, info
    key = hashlib.sha256(json.dumps([model.cfg.to_dict(), args.seed, args.train_steps,
                                     TRAIN_LENGTHS, WORDS, "copy-v2"]).encode()).hexdigest()[:12]
    path = args.weights or Path(tempfile.gettempdir()) / f"aiayn_decode_speed_{key}.pt"
    info["weights"] = str(path)
    if path.exists():
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        info["trained"] = "loaded"
        print(f"model: loaded {path}")
    else:
        print(f"model: training {args.train_steps} steps on the copy task "
              f"({args.train_threads} thread(s)); cached at {path}", flush=True)
        threads = torch.get_num_threads()
        torch.set_num_threads(args.train_threads)
        t0 = time.perf_counter()
        losses = train_copy(model, args.train_steps, args.seed)
        torch.set_num_threads(threads)
        info.update(trained="now", train_seconds=time.perf_counter() - t0,
                    final_loss=statistics.fmean(losses[-25:]))
        tmp = path.with_suffix(".tmp")
        torch.save(model.state_dict(), tmp)
        os.replace(tmp, path)
    model.eval()
    return model, info


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


def ct2_decode(engine, batch: Batch, beam: int, alpha: float, num_hypotheses: int = 1):
    return engine.results(batch.words, engine_cfg(batch, beam, alpha),
                          num_hypotheses=num_hypotheses, return_scores=True, max_batch_size=0)


def hf_decode(engine, batch: Batch, beam: int, alpha: float) -> list[list[int]]:
    return engine.decode_batch(batch.words, engine_cfg(batch, beam, alpha))


def ct2_ids(results, token_id: dict[str, int]) -> list[list[int]]:
    return [[token_id[t] for t in r.hypotheses[0]] for r in results]


# -- ours --------------------------------------------------------------------------------

def ours_decode(model, batch: Batch, cfg: BeamConfig, use_cache: bool = True,
                bf16: bool = False, masked: bool = False) -> list[list[int]]:
    """``masked``: a model with an output vocabulary decodes as before the projection onto
    its rows: logits over the whole vocabulary, the others at -inf (the baseline)."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        return beam_search(model, batch.src, cfg, use_cache=use_cache, spanned_only=not masked)


def log_probs_of(model, batch: Batch, hyps: list[list[int]], max_len: list[int]
                 ) -> tuple[list[float], list[bool]]:
    """log P(hyp [+ EOS] | src) under ``model`` in fp32, PAD and BOS banned as in beam.py
    (``bench.export_agreement.our_log_p``), and whether each hypothesis ended: one as long
    as its sentence's maximum length was cut there, with no EOS."""
    from bench.export_agreement import our_log_p

    ended = [len(h) < m for h, m in zip(hyps, max_len, strict=True)]
    return our_log_p(model, batch.words, hyps, max_len), ended


def gnmt(logp: float, n_out: int, alpha: float) -> float:
    """Ours: log P / ((5 + |Y|) / 6)^alpha (``aiayn.decoding.beam.length_penalty``)."""
    return logp / length_penalty(n_out, alpha)


def ct2_norm(logp: float, n_out: int, alpha: float) -> float:
    """CTranslate2 4.x: log P / |Y|^alpha, |Y| with EOS (its scores match this, see below)."""
    return logp / length_penalty(n_out, alpha, "length") if alpha and n_out else logp


# -- agreement ---------------------------------------------------------------------------

def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for x, y in zip(a, b, strict=True))
    return {"sentences": len(a), "identical": same, "rate": same / len(a) if a else 1.0}


def classify_beam(model, batches: list[Batch], ours: list[list[list[int]]],
                  ct2: list[list[list[int]]], alpha: float, uniform: bool) -> dict:
    """Count identical outputs; classify the others (see the module docstring).

    ``uniform``: both searches ran with the batch's one maximum length (else ours per row).
    """
    counts = {"agree": 0, "formula": 0, "ct2 stopped early": 0, "ours stopped early": 0,
              "tie": 0, "max length": 0}
    examples = []
    for batch, o_b, c_b in zip(batches, ours, ct2, strict=True):
        diff = [i for i, (x, y) in enumerate(zip(o_b, c_b, strict=True)) if x != y]
        counts["agree"] += len(o_b) - len(diff)
        if not diff:
            continue
        mx = [batch.ct2_max_len] * len(o_b) if uniform else batch.max_len
        lo, eo = log_probs_of(model, batch, o_b, mx)
        lc, ec = log_probs_of(model, batch, c_b, [batch.ct2_max_len] * len(o_b))
        for i in diff:
            no, nc = len(o_b[i]) + eo[i], len(c_b[i]) + ec[i]
            g_o, g_c = gnmt(lo[i], no, alpha), gnmt(lc[i], nc, alpha)
            c_o, c_c = ct2_norm(lo[i], no, alpha), ct2_norm(lc[i], nc, alpha)
            if not uniform and max(len(o_b[i]), len(c_b[i])) >= batch.max_len[i]:
                kind = "max length"  # ours was cut at source + b, ct2 at the batch's max
            elif abs(g_o - g_c) < 1e-4 or abs(c_o - c_c) < 1e-4:
                kind = "tie"
            elif g_o > g_c and c_c > c_o:
                kind = "formula"
            elif g_o > g_c:
                kind = "ct2 stopped early"
            else:
                kind = "ours stopped early"
            counts[kind] += 1
            if len(examples) < 6:
                examples.append({"kind": kind, "src_len": len(batch.words[i]),
                                 "ours_len": len(o_b[i]), "ct2_len": len(c_b[i]),
                                 "logp_ours": round(lo[i], 4), "logp_ct2": round(lc[i], 4),
                                 "gnmt_ours": round(g_o, 4), "gnmt_ct2": round(g_c, 4),
                                 "ct2norm_ours": round(c_o, 4), "ct2norm_ct2": round(c_c, 4)})
    total = sum(counts.values())
    return {"counts": counts, "rate": counts["agree"] / total if total else 1.0,
            "examples": examples}


# -- timing ------------------------------------------------------------------------------

def timed(fn):
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w0, time.process_time() - c0


def out_tokens(hyps: list[list[int]]) -> int:
    return sum(len(h) + 1 for h in hyps)


@contextlib.contextmanager
def counting_decode_steps(model):
    """Count the decoder steps and rows (batch x beam) of the searches run inside the block:
    the work a search asked of the cached decoder. Yields ``{"steps": n, "rows": n}``."""
    work = {"steps": 0, "rows": 0}
    step_fn = model.decode_step

    def counting(tokens, state, projection=None):
        work["steps"] += 1
        work["rows"] += tokens.shape[0]
        return step_fn(tokens, state, projection)

    model.decode_step = counting
    try:
        yield work
    finally:
        del model.decode_step


def profile_cached(model, batch: Batch, cfg: BeamConfig) -> dict:
    """cProfile (Python functions) and torch.profiler (operators) of one cached search."""
    with counting_decode_steps(model) as work:
        ours_decode(model, batch, cfg)
    steps = {"decode_steps": work["steps"], "rows": work["rows"]}
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
    return {**steps, "profiler_table": table}


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[int]]:
    """The arguments, checked, and the thread counts of --threads."""
    ap = harness.parser(__doc__)
    ap.add_argument("--model", type=Path, default=None,
                    help="a model folder written by `aiayn average` (model.safetensors, "
                         "config.json, tokenizer.json): benchmark it instead of training the "
                         "copy-task model; needs --inputs")
    ap.add_argument("--inputs", type=Path, default=None,
                    help="source sentences, one per line (plain text); needs --model")
    ap.add_argument("--select", choices=("head", "shortest"), default="head",
                    help="with --inputs: decode the first --batches x --batch-size non-empty "
                         "lines in file order (head, default) or the shortest that many of the "
                         "file (shortest); sorted by length and batched as "
                         "aiayn.decoding.translation")
    ap.add_argument("--examples", type=int, default=3,
                    help="with --model: detokenized outputs of ours and CTranslate2 shown (3)")
    ap.add_argument("--batches", type=int, default=4, help="batches of --batch-size (4)")
    ap.add_argument("--batch-size", type=int, default=64,
                    help="sentences per batch (64, params.yaml's decode.batch_size)")
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds (3)")
    ap.add_argument("--threads", default="2",
                    help="torch threads = CTranslate2 intra_threads; comma list, e.g. 2,1")
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--alpha", type=float, default=0.6)
    ap.add_argument("--max-len-b", type=int, default=50, help="max length = source + b (50)")
    ap.add_argument("--min-words", type=int, default=10, help="copy task only")
    ap.add_argument("--max-words", type=int, default=40, help="copy task only")
    ap.add_argument("--recompute-batches", type=int, default=1,
                    help="batches timed for the recompute path (1; 0 skips it)")
    ap.add_argument("--train-steps", type=int, default=300,
                    help="copy-task training steps before decoding (300; 0 = random weights; "
                         "ignored with --model)")
    ap.add_argument("--train-threads", type=int, default=1)
    ap.add_argument("--weights", type=Path, default=None,
                    help="cache file for the copy-task weights (default: temp dir)")
    ap.add_argument("--references", type=Path, default=None,
                    help="with --inputs: reference translations, line for line; prints the "
                         "sacreBLEU of every engine's output")
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
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write all results here")
    args = ap.parse_args(argv)
    if not args.no_bf16 and not args.bf16 and not cpu_has_native_bf16():
        print("this CPU has no native bf16 (see aiayn/precision.py): skipping the bf16 row; "
              "--bf16 runs it anyway", flush=True)
        args.no_bf16 = True
    if args.inputs is not None and args.model is None:
        ap.error("--inputs requires --model (the copy-task model decodes synthetic word ids)")
    if args.model is not None and args.inputs is None:
        ap.error("--model requires --inputs FILE (source sentences, one per line)")
    if args.model is not None and not args.model.is_dir():
        ap.error(f"--model {args.model}: not a folder")
    if args.references is not None and args.inputs is None:
        ap.error("--references requires --model and --inputs")
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
    """(model, vocabulary, tokenizer or None, batches): --model's on --inputs' lines, or the
    copy-task model on its synthetic sentences; what they are goes into ``info``."""
    if args.model is None:
        model, info["model"] = build_model(args)
        info["model"]["config"] = model.cfg.to_dict()
        batches = make_batches(args.batches, args.batch_size, args.min_words, args.max_words,
                               args.seed, cfg, model.cfg.max_positions)
        return model, VOCAB_TOKENS, None, batches
    from aiayn.errors import DataError

    try:
        model, info["model"], vocab, tokenizer = load_real_model(args.model)
    except DataError as exc:
        raise SystemExit(f"error: {exc}") from None
    info["model"]["config"] = model.cfg.to_dict()
    pool, texts, info["inputs"], chosen = read_inputs(
        args.inputs, tokenizer, args.batches * args.batch_size, args.select,
        model.cfg.max_positions)
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
    batches = cut_batches(pool, args.batch_size, vocab, cfg, model.cfg.max_positions, texts,
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


def untimed_agreement(model, batches: list[Batch], cfg: BeamConfig, engines: Engines,
                      threads: int, token_id: dict, tokenizer, info: dict) -> dict:
    """Greedy and beam outputs of ours against each engine's, with one maximum length per
    batch for both (CTranslate2 takes one per call): the agreements, and in ``info`` the
    greedy outputs' lengths and the single (not alternated) passes' times."""
    torch.set_num_threads(threads)
    agree: dict = {}

    def uniform(b: Batch, beam: int, alpha: float) -> BeamConfig:
        return BeamConfig(beam=beam, alpha=alpha, max_len_a=0.0, max_len_b=b.ct2_max_len)

    # The same passes give one (not alternated) timing each, with the same maximum lengths
    # for both and, at alpha 0, the same stopping rule: a rough like-for-like ratio. Our
    # decode_step is wrapped to count decoder rows x steps (the work the search asked for).
    def ours_pass(beam: int, alpha: float) -> tuple[list[list[list[int]]], dict]:
        with counting_decode_steps(model) as work:
            outs, wall, _ = timed(lambda: [ours_decode(model, b, uniform(b, beam, alpha))
                                           for b in batches])
        return outs, {"ours_s": wall, "ours_decoder_steps": work["steps"],
                      "ours_decoder_rows": work["rows"]}

    single: dict = {}
    greedy_ours, single["greedy"] = ours_pass(1, 0.0)
    info["greedy_outputs"] = greedy_lengths(greedy_ours, batches, tokenizer)
    print("greedy outputs (ours): " + ", ".join(
        f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
        for k, v in info["greedy_outputs"].items()), flush=True)
    if engines.ct2:
        tr = engines.ct2[threads]
        greedy_ct2, single["greedy"]["ct2_s"], _ = timed(
            lambda: [ct2_ids(ct2_decode(tr, b, 1, 0.0), token_id) for b in batches])
        agree["greedy ours vs ct2"] = agreement(sum(greedy_ours, []), sum(greedy_ct2, []))
        for alpha in dict.fromkeys([0.0, cfg.alpha]):
            name = f"beam {cfg.beam} alpha={alpha}"
            ours_b, single[name] = ours_pass(cfg.beam, alpha)
            raw, single[name]["ct2_s"], _ = timed(
                lambda alpha=alpha: [ct2_decode(tr, b, cfg.beam, alpha) for b in batches])
            ct2_b = [ct2_ids(r, token_id) for r in raw]
            # Same weights? CTranslate2's returned scores against our model's log P of
            # CTranslate2's outputs, normalised by CTranslate2's formula.
            diffs = []
            for b, r, hyps in zip(batches, raw, ct2_b, strict=True):
                lp, ended = log_probs_of(model, b, hyps, [b.ct2_max_len] * len(hyps))
                diffs += [abs(x.scores[0] - ct2_norm(q, len(h) + e, alpha))
                          for x, q, h, e in zip(r, lp, hyps, ended, strict=True)]
            single[name]["max |ct2 score - our log P normalised|"] = max(diffs)
            agree[f"{name} ours vs ct2"] = classify_beam(model, batches, ours_b, ct2_b, alpha,
                                                         uniform=True)
        if engines.ct2_int8:
            tr8 = engines.ct2_int8[threads]
            greedy_int8 = [ct2_ids(ct2_decode(tr8, b, 1, 0.0), token_id) for b in batches]
            agree["greedy ct2 fp32 vs int8"] = agreement(sum(greedy_ct2, []),
                                                         sum(greedy_int8, []))
        for v in single.values():
            v["ours / ct2 speed"] = v["ct2_s"] / v["ours_s"]
    if engines.hf is not None:
        greedy_hf = [hf_decode(engines.hf, b, 1, 0.0) for b in batches]
        agree["greedy ours vs transformers"] = agreement(sum(greedy_ours, []), sum(greedy_hf, []))
        for alpha in dict.fromkeys([0.0, cfg.alpha]):
            norm = "gnmt" if alpha == 0 else "length"
            ours_b = [ours_decode(model, b, BeamConfig(beam=cfg.beam, alpha=alpha, max_len_a=0.0,
                                                       max_len_b=b.ct2_max_len,
                                                       length_norm=norm)) for b in batches]
            hf_b = [hf_decode(engines.hf, b, cfg.beam, alpha) for b in batches]
            agree[f"beam {cfg.beam} alpha={alpha} ours ({norm}) vs transformers"] = agreement(
                sum(ours_b, []), sum(hf_b, []))
    info["single_pass"] = single
    print(f"single passes (indicative, not alternated), {threads} thread(s), one max length per "
          "batch for both:")
    for k, v in single.items():
        print(f"  {k}: ours {v['ours_s']:.2f} s ({v['ours_decoder_steps']} decoder steps, "
              f"{v['ours_decoder_rows']} rows)" + (f", ct2 {v['ct2_s']:.2f} s, ours/ct2 "
                                                 f"{v['ours / ct2 speed']:.2f}x"
                                                 if "ct2_s" in v else "")
              + "".join(f", {m} {x:.1e}" for m, x in v.items() if m.startswith("max |")))
    for k, v in agree.items():
        print(f"agreement {k}: {v['counts']['agree'] if 'counts' in v else v['identical']}/"
              f"{sum(v['counts'].values()) if 'counts' in v else v['sentences']} "
              f"({100 * v['rate']:.1f}%)" + (f" {v['counts']}" if "counts" in v else ""),
              flush=True)
    return agree


def greedy_lengths(greedy: list, batches: list[Batch], tokenizer) -> dict:
    """Lengths of our greedy outputs against the sources (and, for the copy task, how many
    are the source itself)."""
    lens = [len(h) for g in greedy for h in g]
    cut = sum(len(h) >= m for g, b in zip(greedy, batches, strict=True)
              for h, m in zip(g, b.max_len, strict=True))
    src_lens = [len(w) for b in batches for w in b.words]
    out = {"mean_src_words" if tokenizer is None else "mean_src_tokens": statistics.fmean(src_lens),
           "mean_len": statistics.fmean(lens),
           "min_len": min(lens), "max_len": max(lens), "distinct_lengths": len(set(lens)),
           "longer_than_source_plus_b": cut}
    if tokenizer is None:  # the copy task: how many outputs are the source
        out["exact_copies"] = sum(h == w for g, b in zip(greedy, batches, strict=True)
                                  for h, w in zip(g, b.words, strict=True))
    return out


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
                                             bf16=method == "bf16", masked=method == "masked"))

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


def timed_agreement(model, batches: list[Batch], cfg: BeamConfig, fo: dict,
                    rc_idx: list[int]) -> dict:
    """Agreement of the first timed round's outputs (``fo``: method -> batch -> outputs)."""
    agree: dict = {}
    all_b = list(range(len(batches)))
    if "ct2" in fo:
        agree[f"timed beam {cfg.beam} alpha={cfg.alpha} ours (max len per sentence) vs ct2"] = (
            classify_beam(model, batches, [fo["cached"][i] for i in all_b],
                          [fo["ct2"][i] for i in all_b], cfg.alpha, uniform=False))
    if "recompute" in fo:
        agree["beam cached vs recompute"] = agreement(
            sum((fo["cached"][i] for i in rc_idx), []),
            sum((fo["recompute"][i] for i in rc_idx), []))
    if "masked" in fo:
        agree["beam spanned rows vs masked logits"] = agreement(
            sum((fo["cached"][i] for i in all_b), []), sum((fo["masked"][i] for i in all_b), []))
    if "bf16" in fo:
        agree["beam fp32 vs bf16"] = agreement(sum((fo["cached"][i] for i in all_b), []),
                                               sum((fo["bf16"][i] for i in all_b), []))
    for m in ("ct2_int8", "hf"):
        if m in fo and "ct2" in fo:
            agree[f"timed beam {cfg.beam} alpha={cfg.alpha} ct2 vs {m}"] = agreement(
                sum((fo["ct2"][i] for i in all_b), []), sum((fo[m][i] for i in all_b), []))
    return agree


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
    agree = untimed_agreement(model, batches, cfg, engines, threads[0], token_id, tokenizer,
                              info)
    methods = [m for m in METHODS
               if not (m == "ct2" and not engines.ct2) and not (m == "bf16" and args.no_bf16)
               and not (m == "ct2_int8" and not engines.ct2_int8)
               and not (m == "hf" and engines.hf is None)
               and not (m == "recompute" and not rc_idx)
               and not (m == "masked" and model.output_vocab() is None)]
    results, fo = time_methods(args, model, batches, cfg, engines, methods, threads, rc_idx,
                               token_id)
    info["results"] = {str(t): v for t, v in results.items()}
    agree.update(timed_agreement(model, batches, cfg, fo, rc_idx))
    if tokenizer is not None and batches[0].refs:
        info["bleu"] = bleu_scores(tokenizer, batches, fo)
    info["agreement"] = agree
    info["timed_outputs"] = {m: {"tokens": out_tokens(sum(v.values(), [])),
                                 "empty": sum(not h for hs in v.values() for h in hs),
                                 "sentences": sum(len(hs) for hs in v.values())}
                             for m, v in fo.items()}
    info["load_average_end"] = os.getloadavg()
    if tokenizer is not None and "cached" in fo and args.examples > 0:
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
    ratios["spanned rows / masked logits (cached)"] = ratio("masked", "cached")
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
    what = (f"{info['model']['dir']} on {info['inputs']['selected']} sentences of "
            f"{info['inputs']['file']} ({info['inputs']['select']}, mean "
            f"{info['inputs']['mean_src_tokens']:.1f} source tokens)"
            if info["model"].get("task") == "real" else
            f"copy task, {info['model']['train_steps']} training steps")
    print(f"model: {what}; d_model {mc['d_model']}, {mc['encoder_layers']}+"
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
    print("\n== agreement ==")
    for k, v in agree.items():
        if "counts" in v:
            tot = sum(v["counts"].values())
            print(f"{k}: {v['counts']['agree']}/{tot} identical ({100 * v['rate']:.1f}%); "
                  "disagreements: " + (", ".join(f"{c} {n}" for c, n in v["counts"].items()
                                                  if c != "agree" and n) or "none"))
            for ex in v["examples"]:
                print(f"    {ex}")
        else:
            print(f"{k}: {v['identical']}/{v['sentences']} identical ({100 * v['rate']:.1f}%)")
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

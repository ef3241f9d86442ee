"""BLEU and chrF of detokenized translations against the raw references, two ways.

* :func:`sacre_scores` — sacreBLEU's corpus BLEU and chrF with their default settings and
  signatures: the honest, reproducible numbers (Post, 2018, "A Call for Clarity in Reporting
  BLEU Scores").
* :func:`tokenized_bleu` — the procedure behind the paper's 27.3 (base) and 28.4 (big) on
  newstest2014 EN-DE: tensor2tensor's ``get_ende_bleu.sh`` (Moses tokenization, hyphenated
  compounds split into ``##AT##-##AT##`` tokens, ``multi-bleu.perl``). Comparable with the
  paper, not with sacreBLEU.

Both score the hypotheses against the references exactly as the corpus gives them; nothing
here uses the model's own tokenizer.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from aiayn.errors import DataError

TOKENIZED_BLEU_PROCEDURE = (
    "moses-tok + compound-split, multi-bleu (tensor2tensor get_ende_bleu.sh); "
    "not comparable with sacreBLEU"
)

LOWERCASE_BLEU_PROCEDURE = (
    "moses-tok, lowercased, multi-bleu -lc (the Multi30k literature's BLEU); "
    "not comparable with sacreBLEU"
)

# get_ende_bleu.sh: perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g'. Perl reads bytes there, so
# its \s is ASCII whitespace only: re.ASCII does the same (Moses tokenization has already
# turned every Unicode space into " ", so this only matters for exotic input).
_COMPOUND = re.compile(r"(\S)-(\S)", re.ASCII)
_AT_AT = r"\1 ##AT##-##AT## \2"


def _check_lengths(hypotheses: Sequence[str], references: Sequence[str]) -> None:
    if len(hypotheses) != len(references):
        raise ValueError(
            f"{len(hypotheses)} hypotheses but {len(references)} references; "
            "they must be aligned line by line")


# --------------------------------------------------------------------------- sacreBLEU


def sacre_scores(hypotheses: list[str], references: list[str], target_lang: str) -> dict:
    """sacreBLEU corpus BLEU and chrF, default settings (13a, exp smoothing, mixed case; chrF2).

    Returns ``{"bleu": {...}, "chrf": {...}}``; BLEU with its score, signature, the four
    n-gram precisions (percent), brevity penalty, length ratio and system/reference lengths,
    chrF with its score, signature and beta. ``target_lang`` is passed as sacreBLEU's
    ``trg_lang`` (it only changes the default tokenizer for zh, ja and ko), as the command
    line's ``-l src-tgt`` would.
    """
    from sacrebleu.metrics import BLEU, CHRF

    _check_lengths(hypotheses, references)
    bleu = BLEU(trg_lang=target_lang)
    b = bleu.corpus_score(list(hypotheses), [list(references)])
    chrf = CHRF()
    c = chrf.corpus_score(list(hypotheses), [list(references)])
    return {
        "bleu": {
            "score": float(b.score),
            "signature": str(bleu.get_signature()),
            "precisions": [float(x) for x in b.precisions],
            "bp": float(b.bp),
            "ratio": float(b.ratio),
            "sys_len": int(b.sys_len),
            "ref_len": int(b.ref_len),
        },
        "chrf": {
            "score": float(c.score),
            "signature": str(chrf.get_signature()),
            "beta": int(chrf.beta),
        },
    }


# --------------------------------------------------------------------------- tokenized BLEU


@lru_cache(maxsize=8)
def _moses(lang: str) -> Any:
    from sacremoses import MosesTokenizer

    return MosesTokenizer(lang=lang)


def moses_tokenize(text: str, lang: str) -> str:
    """``tokenizer.perl -l LANG`` with its defaults, as get_ende_bleu.sh calls it.

    The script passes neither ``-a`` (so no aggressive splitting of hyphens: compounds stay
    whole until :func:`split_compounds`) nor ``-no-escape`` (so ``& | < > ' " [ ]`` become
    XML entities such as ``&quot;``). Escaping maps each of those characters to a fixed
    space-free string on both sides, so it changes no BLEU value; it is kept to reproduce the
    script's token streams exactly. sacremoses is the Python port of tokenizer.perl.
    """
    return _moses(lang).tokenize(text, aggressive_dash_splits=False, escape=True,
                                 return_str=True)


def split_compounds(text: str) -> str:
    """``X-Y`` → ``X ##AT##-##AT## Y``, as ``perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g'``.

    Like perl's ``/g``, the search resumes after the end of each match, so a hyphen whose
    left neighbour was consumed by the previous match is not split: ``a-b-c`` becomes
    ``a ##AT##-##AT## b-c`` (longer parts, as in ``state-of-the-art``, are all split). This
    is what produced the published numbers, so it is reproduced, not corrected.
    """
    return _COMPOUND.sub(_AT_AT, text)


def tokenized_bleu(hypotheses: list[str], references: list[str], target_lang: str) -> dict:
    """The paper-comparable tokenized BLEU of tensor2tensor's ``get_ende_bleu.sh``.

    That script (tensor2tensor/utils/get_ende_bleu.sh, used for the Transformer's published
    27.3/28.4 on newstest2014) runs, on both the hypotheses and the reference:

    1. ``tokenizer.perl -l de`` with default flags (escaping on, no ``-a``):
       :func:`moses_tokenize` with ``target_lang``;
    2. ``perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g'``: :func:`split_compounds`;
    3. ``multi-bleu.perl``: corpus BLEU over whitespace-separated tokens, case-sensitive,
       no smoothing (any zero n-gram precision gives 0), brevity penalty
       ``exp(1 - ref_len/sys_len)`` when shorter. Here: sacreBLEU with ``tokenize="none"``,
       ``smooth_method="none"``, which computes exactly that.

    (tensor2tensor's reference was Moses-tokenized by its data generator; we tokenize the raw
    reference with the same tokenizer as the hypotheses.) Returns the score, the n-gram
    precisions, brevity penalty, lengths and ``procedure``, a description string.
    """
    def prepare(line: str) -> str:
        return split_compounds(moses_tokenize(line, target_lang))

    return _multi_bleu(hypotheses, references, prepare, TOKENIZED_BLEU_PROCEDURE)


def lowercase_bleu(hypotheses: list[str], references: list[str], target_lang: str) -> dict:
    """Lowercased tokenized BLEU, the score of the Multi30k literature (WMT16-18 multimodal
    tasks; Wu et al. 2021's 41.02 for Transformer-tiny): ``tokenizer.perl -l LANG`` on
    both sides (:func:`moses_tokenize`), then ``multi-bleu.perl -lc`` (corpus BLEU over
    whitespace tokens after lowercasing, no smoothing). No compound splitting, unlike
    :func:`tokenized_bleu`. Returns the score, precisions, brevity penalty and lengths.
    """
    def prepare(line: str) -> str:
        return moses_tokenize(line, target_lang).lower()

    return _multi_bleu(hypotheses, references, prepare, LOWERCASE_BLEU_PROCEDURE)


def _multi_bleu(hypotheses: list[str], references: list[str], prepare: Any,
                procedure: str) -> dict:
    """multi-bleu.perl on ``prepare``-d lines: corpus BLEU over whitespace tokens, no
    smoothing (sacreBLEU with ``tokenize="none"``, ``smooth_method="none"``)."""
    from sacrebleu.metrics import BLEU

    _check_lengths(hypotheses, references)
    bleu = BLEU(tokenize="none", smooth_method="none", force=True)
    b = bleu.corpus_score([prepare(x) for x in hypotheses], [[prepare(x) for x in references]])
    return {
        "score": float(b.score),
        "precisions": [float(x) for x in b.precisions],
        "bp": float(b.bp),
        "sys_len": int(b.sys_len),
        "ref_len": int(b.ref_len),
        "procedure": procedure,
    }


# --------------------------------------------------------------------------- files


def read_lines(path: Path) -> list[str]:
    """The lines of a UTF-8 text file, split at ``\\n`` only (as sacreBLEU's command line
    reads them); a final newline ends the last line rather than starting an empty one."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise DataError(
            f"{path}: no translations to score; run `aiayn translate` first (with "
            "--split, it writes one line per sentence of the split)") from None
    return utf8_lines(data, str(path), "the translations must be UTF-8 text: re-run "
                                       "`aiayn translate`")


def utf8_lines(data: bytes, name: str, fix: str) -> list[str]:
    """:func:`text_lines` of UTF-8 ``data``; invalid UTF-8 is a one-line DataError naming
    NAME, the line and the byte, then ``fix``."""
    try:
        return text_lines(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise DataError(f"{name}, line {line}: invalid UTF-8 (byte {exc.start}: "
                        f"{data[exc.start:exc.start + 4]!r}); {fix}") from None


def text_lines(text: str) -> list[str]:
    """``text`` split at ``\\n`` only, as sacreBLEU's command line and `wc -l` count lines
    (not at the other breaks of ``str.splitlines``: U+2028, form feed, U+0085, a lone CR);
    a final newline ends the last line, and a CR before a newline goes with it."""
    if not text:
        return []
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def score_files(hyp_path: Path, references: list[str], target_lang: str,
                *, reference_source: str = "references") -> dict:
    """Score the hypotheses in ``hyp_path`` (one per line) against ``references``.

    Returns ``{"sacrebleu": {...}, "chrf": {...}, "tokenized_bleu": {...},
    "lowercase_bleu": {...}, "sentences": n}``.
    Raises :class:`DataError` when the file is missing or its line count differs from the
    number of references (``reference_source`` names them in the message).
    """
    hyp_path = Path(hyp_path)
    hypotheses = read_lines(hyp_path)
    if not references:
        raise DataError(f"{reference_source}: no reference sentences to score against")
    if len(hypotheses) != len(references):
        raise DataError(
            f"{hyp_path} has {len(hypotheses)} lines but {reference_source} has "
            f"{len(references)} sentences: line i must translate sentence i; the translations "
            "are stale or cut short, re-run `aiayn translate`")
    sacre = sacre_scores(hypotheses, references, target_lang)
    return {
        "sacrebleu": sacre["bleu"],
        "chrf": sacre["chrf"],
        "tokenized_bleu": tokenized_bleu(hypotheses, references, target_lang),
        "lowercase_bleu": lowercase_bleu(hypotheses, references, target_lang),
        "sentences": len(references),
    }

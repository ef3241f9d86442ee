"""Data-pipeline benchmark: vocab -> survey -> shard on a WMT14-sized synthetic corpus.

It writes a synthetic English-German corpus of ``--pairs`` pairs (deterministic from
``--seed``, reused while it matches) into ``WORKDIR/raw``, runs ``aiayn vocab``, ``survey``
and ``shard`` as ``dvc repro`` would with the paper's WMT14 data settings, each measured by
its own ``wait4`` rusage, and judges them against the goals (under 15 minutes together, no
stage over 4 GiB); results in ``WORKDIR/bench_data_pipeline.json``. The guide:
bench/README.md, ``data_pipeline.py``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from bench import harness

REPO = harness.REPO

GENERATOR_VERSION = 1
CHUNK = 50_000  # pairs per generated chunk = per parquet row group
VALID_PAIRS, TEST_PAIRS = 3000, 3003  # newstest2013, newstest2014
WMT14_TRAIN_PAIRS = 4_500_000
GOAL_WALL_S = 15 * 60
GOAL_RSS_GIB = 4.0
GIB = 1024**3
STAGES = ("vocab", "survey", "shard")

# The benchmark's data settings: the paper's WMT14 En-De base setup (Section 5.1).
PARAM_OVERRIDES = {
    ("data", "src_lang"): "en",
    ("data", "tgt_lang"): "de",
    ("vocab", "vocab_size"): 37000,
    ("vocab", "min_frequency"): 2,
    ("survey", "max_len_candidates"): [64, 128, 256, 512],
    ("shard", "max_tokens"): 6250,
    ("shard", "max_len"): 256,
}


# =========================================================================== corpus model


@dataclass(frozen=True)
class LangSpec:
    """How one synthetic language builds its words and sentences."""

    name: str
    word_types: int  # size of the Zipf vocabulary of ordinary words
    zipf: float  # exponent over word ranks
    function_words: tuple[str, ...]  # the most frequent ranks, in order
    onsets: tuple[str, ...]
    vowels: tuple[str, ...]
    codas: tuple[str, ...]
    prefixes: tuple[str, ...]
    suffixes: tuple[str, ...]
    extra_syllables: float  # syllables per stem = 1 + Poisson(extra_syllables)
    p_prefix: float
    p_suffix: float
    p_compound: float  # second stem appended (German compounds)
    compound_link: str  # linking element used in some compounds ("s" in German)
    p_hyphen: float  # two stems joined by '-'
    p_capital: float  # word types written capitalised (German nouns)
    decimal: str  # decimal mark and thousands separator for numbers
    thousands: str


EN = LangSpec(
    name="en",
    word_types=500_000,
    zipf=1.1,
    function_words=tuple(
        "the of to and a in is that for it on with as was be by this are at from have not "
        "has an which will we but or they he i his more their also been would its said you "
        "can had one all about were there who new our so than what if up when she them only "
        "other out year people time like into after over some no these must should may "
        "most could how very do any two now just first such those many because between "
        "even well where made last us under both being while then make against through "
        "world government last however european president".split()),
    onsets=("", "s", "t", "p", "c", "b", "d", "m", "f", "r", "l", "h", "w", "n", "g", "st",
            "pr", "tr", "th", "sh", "ch", "br", "cr", "gr", "pl", "cl", "fl", "fr", "dr", "sp",
            "str", "wh", "qu", "v", "k", "j", "y", "sc", "sl", "sm", "sn", "sw", "gl", "ph",
            "z", "bl"),
    vowels=("e", "a", "i", "o", "u", "ea", "y", "ou", "ai", "ee", "oo", "ie", "oa", "au",
            "ow", "oi"),
    codas=("", "n", "r", "s", "t", "l", "d", "m", "nd", "nt", "st", "ng", "ck", "ll", "rt",
           "ss", "th", "sh", "ght", "x", "p", "k", "ct", "mp", "rd", "nk", "lt", "ft", "b",
           "g", "ch"),
    prefixes=("re", "un", "in", "con", "dis", "pre", "de", "pro", "com", "ex", "over",
              "inter", "under", "sub", "trans"),
    suffixes=("s", "ed", "ing", "er", "es", "ly", "tion", "al", "ers", "ment", "ity",
              "tions", "ness", "able", "ive", "ous", "ist", "ful", "ments", "ism", "less",
              "'s"),
    extra_syllables=0.9,
    p_prefix=0.12,
    p_suffix=0.45,
    p_compound=0.0,
    compound_link="",
    p_hyphen=0.02,
    p_capital=0.0,
    decimal=".",
    thousands=",",
)

DE = LangSpec(
    name="de",
    word_types=750_000,
    zipf=1.05,
    function_words=tuple(
        "die der und in den von zu das mit sich des auf für ist im dem nicht ein eine als "
        "auch es an werden aus er hat dass sie nach wird bei einer um am sind noch wie "
        "einem über einen so zum war haben nur oder aber vor zur bis mehr durch man sehr "
        "wir ich kann diese ihre sein schon wenn jahr wurde können gegen unter dies uns "
        "damit keine immer seine europäischen müssen hier heute alle zwei dieser ihr "
        "unsere denn was zwischen während".split()),
    onsets=("", "t", "s", "b", "d", "g", "h", "k", "l", "m", "n", "r", "w", "f", "z", "st",
            "sch", "sp", "schw", "schl", "schr", "br", "gr", "kr", "tr", "fr", "pf", "kl",
            "bl", "fl", "gl", "pl", "zw", "v", "j"),
    vowels=("e", "a", "i", "o", "u", "ei", "ie", "au", "ä", "ö", "ü", "eu", "äu", "ee",
            "aa", "oo"),
    codas=("", "n", "r", "s", "t", "ch", "cht", "ng", "nd", "nk", "tz", "ß", "ft", "lt",
           "rt", "st", "ck", "ll", "mm", "ss", "rn", "rz", "hl", "hr", "hn", "m", "l", "f",
           "g", "k"),
    prefixes=("ver", "be", "ge", "ent", "er", "un", "vor", "aus", "ein", "über", "an", "auf",
              "zer", "mit", "nach", "ab", "zu", "durch", "unter"),
    suffixes=("en", "er", "ung", "e", "es", "te", "ten", "lich", "ungen", "heit", "keit",
              "isch", "schaft", "chen", "em", "ern", "ig", "bar", "los", "nis", "ige",
              "igen"),
    extra_syllables=1.0,
    p_prefix=0.25,
    p_suffix=0.55,
    p_compound=0.35,
    compound_link="s",
    p_hyphen=0.01,
    p_capital=0.4,
    decimal=",",
    thousands=".",
)

NAME_TYPES = 100_000  # shared proper names (same strings in both languages)
NAME_ZIPF = 1.0
NUMBER_ZIPF = 1.0
P_NUMBER = 0.02  # per word slot
P_NAME = 0.03
P_COMMA = 0.045  # per non-final word
P_COLON = 0.004
# Sentence-final punctuation: ".", "?", "!", ":", none.
FINAL_MARKS = (".", "?", "!", ":", "")
FINAL_P = (0.88, 0.04, 0.015, 0.015, 0.05)
# Separators after a word.
SEPARATORS = (" ", ", ", ": ", "; ", ".", "?", "!", ":", "")
SEP_SPACE, SEP_COMMA, SEP_COLON = 0, 1, 2
SEP_FINAL = 4  # separators 4.. are the sentence-final marks, in FINAL_MARKS order

# Words per English sentence: lognormal, median 20, mean 23; German/English word ratio.
LEN_MEDIAN, LEN_MEAN, LEN_MAX = 20.0, 23.0, 250
RATIO_MEAN, RATIO_SD, RATIO_MIN, RATIO_MAX = 0.95, 0.08, 0.6, 1.5


def _weights(n: int, decay: float = 0.6) -> np.ndarray:
    """Earlier entries of an inventory are more frequent."""
    w = 1.0 / np.arange(1, n + 1) ** decay
    return w / w.sum()


def _pick(rng: np.random.Generator, items: tuple[str, ...], size: int,
          decay: float = 0.6) -> np.ndarray:
    arr = np.array(items)
    return arr[rng.choice(len(items), size=size, p=_weights(len(items), decay))]


def _stems(rng: np.random.Generator, spec: LangSpec, n: int) -> np.ndarray:
    """n stems of 1 + Poisson syllables (onset + vowel + coda each)."""
    syllables = 1 + np.minimum(rng.poisson(spec.extra_syllables, n), 5)
    out = np.full(n, "", dtype="U1")
    for k in range(int(syllables.max())):
        syl = np.strings.add(np.strings.add(_pick(rng, spec.onsets, n),
                                            _pick(rng, spec.vowels, n)),
                             _pick(rng, spec.codas, n))
        out = np.where(syllables > k, np.strings.add(out, syl), out)
    return out


def _candidates(rng: np.random.Generator, spec: LangSpec, n: int) -> np.ndarray:
    words = _stems(rng, spec, n)
    pre = np.where(rng.random(n) < spec.p_prefix, _pick(rng, spec.prefixes, n), "")
    words = np.strings.add(pre, words)
    if spec.p_compound:
        link = np.where(rng.random(n) < 0.3, spec.compound_link, "")
        second = np.strings.add(link, _stems(rng, spec, n))
        words = np.where(rng.random(n) < spec.p_compound, np.strings.add(words, second), words)
    if spec.p_hyphen:
        second = np.strings.add("-", _stems(rng, spec, n))
        words = np.where(rng.random(n) < spec.p_hyphen, np.strings.add(words, second), words)
    suf = np.where(rng.random(n) < spec.p_suffix, _pick(rng, spec.suffixes, n, 0.4), "")
    return np.strings.add(words, suf)


def _unique_new(candidates: np.ndarray, taken: set[str], want: int) -> list[str]:
    """Up to ``want`` candidates, in order, whose lowercase form is not in ``taken``."""
    out = []
    for word in candidates.tolist():
        low = word.lower()
        if low and low not in taken:
            taken.add(low)
            out.append(word)
            if len(out) == want:
                break
    return out


def build_word_table(rng: np.random.Generator, spec: LangSpec, taken: set[str]) -> list[str]:
    """Word types in rank order: function words, then syllable words, shorter ones first."""
    words = [w for w in dict.fromkeys(spec.function_words) if w not in taken]
    taken.update(words)
    generated: list[str] = []
    need = spec.word_types - len(words)
    while len(generated) < need:  # in slices: fixed-width string arrays are big
        batch = _candidates(rng, spec, min(int((need - len(generated)) * 1.4) + 1000, 200_000))
        generated += _unique_new(batch, taken, need - len(generated))
    # Zipf's law of abbreviation, loosely: frequent words tend to be short.
    key = np.fromiter(map(len, generated), dtype=np.float64, count=len(generated))
    key += rng.normal(0.0, 2.5, key.size)
    generated = [generated[i] for i in np.argsort(key, kind="stable").tolist()]
    if spec.p_capital:  # German nouns: a random share of types is written capitalised
        for i in np.flatnonzero(rng.random(len(generated)) < spec.p_capital).tolist():
            generated[i] = generated[i].capitalize()
    return words + generated


def build_names(rng: np.random.Generator, taken: set[str]) -> list[str]:
    spec = LangSpec(**{**EN.__dict__, "extra_syllables": 1.2, "p_prefix": 0.0,
                       "p_suffix": 0.35, "p_hyphen": 0.0,
                       "suffixes": ("son", "er", "ez", "ski", "ov", "berg", "mann", "ini",
                                    "ia", "o", "a", "ton", "ing", "ard")})
    names: list[str] = []
    while len(names) < NAME_TYPES:
        batch = np.strings.capitalize(_candidates(rng, spec, NAME_TYPES))
        names += _unique_new(batch, taken, NAME_TYPES - len(names))
    return names


def build_numbers(rng: np.random.Generator, spec: LangSpec) -> list[str]:
    """Number tokens in rank order: small integers and years first, then the rest."""
    small = [str(i) for i in range(0, 101)]
    years = [str(y) for y in range(2014, 1899, -1)]
    ints = rng.integers(101, 1_000_000, 40_000)
    big = [f"{i:,}".replace(",", spec.thousands) if i >= 10_000 else str(i) for i in ints]
    dec = rng.integers(1, 10_000, 15_000)
    decimals = [f"{d // 10}{spec.decimal}{d % 10}" for d in dec]
    pct = rng.integers(1, 100, 3_000)
    percents = [f"{p}%" for p in pct]
    tail = big + decimals + percents
    tail = [tail[i] for i in rng.permutation(len(tail))]
    return list(dict.fromkeys(small + years + tail))


def _zipf_cdf(n: int, exponent: float) -> np.ndarray:
    p = np.arange(1, n + 1, dtype=np.float64) ** -exponent
    cdf = np.cumsum(p)
    return cdf / cdf[-1]


class PieceTable:
    """Strings as one UTF-8 byte blob with offsets, for vectorised assembly."""

    def __init__(self, strings: list[str]):
        encoded = [s.encode("utf-8") for s in strings]
        self.lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        self.starts = np.zeros(len(encoded), dtype=np.int64)
        np.cumsum(self.lengths[:-1], out=self.starts[1:])
        self.blob = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        first = np.array([b[0] if b else 0 for b in encoded], dtype=np.uint8)
        self.lower_first = (first >= ord("a")) & (first <= ord("z"))


class Language:
    """Samples sentences of one language as an Arrow string array."""

    def __init__(self, spec: LangSpec, words: list[str], names: list[str],
                 numbers: list[str]):
        self.spec = spec
        self.n_words, self.n_names, self.n_numbers = len(words), len(names), len(numbers)
        self.name_base = self.n_words
        self.number_base = self.n_words + self.n_names
        self.sep_base = self.number_base + self.n_numbers
        self.pieces = PieceTable(words + names + numbers + list(SEPARATORS))
        self.word_cdf = _zipf_cdf(self.n_words, spec.zipf)
        self.name_cdf = _zipf_cdf(self.n_names, NAME_ZIPF)
        self.number_cdf = _zipf_cdf(self.n_numbers, NUMBER_ZIPF)
        self.words = 0
        self.bytes = 0
        self.sentences = 0

    def sample(self, rng: np.random.Generator, lengths: np.ndarray) -> pa.StringArray:
        n = lengths.size
        total = int(lengths.sum())
        sent_start = np.zeros(n, dtype=np.int64)
        np.cumsum(lengths[:-1], out=sent_start[1:])
        last = sent_start + lengths - 1

        # Which table each word slot draws from, then Zipf ranks by inverse CDF.
        piece = np.empty(total, dtype=np.int64)
        kind = rng.random(total)
        for lo, hi, cdf, base in ((0.0, P_NUMBER, self.number_cdf, self.number_base),
                                  (P_NUMBER, P_NUMBER + P_NAME, self.name_cdf, self.name_base),
                                  (P_NUMBER + P_NAME, 1.0, self.word_cdf, 0)):
            where = np.flatnonzero((kind >= lo) & (kind < hi))
            ranks = np.searchsorted(cdf, rng.random(where.size), side="right")
            piece[where] = base + np.minimum(ranks, cdf.size - 1)

        # Separators: space, sometimes ", " or ": "/"; "; sentence-final punctuation.
        u = rng.random(total)
        sep = np.full(total, SEP_SPACE, dtype=np.int64)
        sep[u < P_COMMA] = SEP_COMMA
        sep[(u >= P_COMMA) & (u < P_COMMA + P_COLON / 2)] = SEP_COLON  # ": "
        sep[(u >= P_COMMA + P_COLON / 2) & (u < P_COMMA + P_COLON)] = SEP_COLON + 1  # "; "
        sep[last] = SEP_FINAL + rng.choice(len(FINAL_MARKS), size=n, p=FINAL_P)

        cap = self.pieces.lower_first[piece[sent_start]]  # sentence starts to capitalise

        # Assemble bytes: word piece, separator piece, word piece, ... gathered from the blob.
        order = np.empty(2 * total, dtype=np.int64)
        order[0::2] = piece
        order[1::2] = self.sep_base + sep
        lens = self.pieces.lengths[order]
        out_start = np.zeros(order.size + 1, dtype=np.int64)
        np.cumsum(lens, out=out_start[1:])
        size = int(out_start[-1])
        src = np.repeat(self.pieces.starts[order] - out_start[:-1], lens)
        src += np.arange(size, dtype=np.int64)
        data = self.pieces.blob[src]
        del src
        # Capitalise the first letter of each sentence (ASCII a-z; others stay as they are).
        first = out_start[2 * sent_start]
        data[first[cap]] -= 32
        offsets = np.empty(n + 1, dtype=np.int32)
        offsets[:-1] = out_start[2 * sent_start]
        offsets[-1] = size
        self.words += total
        self.bytes += size
        self.sentences += n
        return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(data))

    def stats(self) -> dict:
        return {
            "sentences": self.sentences,
            "words": self.words,
            "mean_words_per_sentence": self.words / max(self.sentences, 1),
            "mean_bytes_per_sentence": self.bytes / max(self.sentences, 1),
            "vocabulary": {"word_types": self.n_words, "zipf": self.spec.zipf,
                           "names": self.n_names, "numbers": self.n_numbers},
        }


def sentence_lengths(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """English and German word counts of n pairs."""
    mu = np.log(LEN_MEDIAN)
    sigma = np.sqrt(2.0 * np.log(LEN_MEAN / LEN_MEDIAN))
    en = np.clip(np.rint(rng.lognormal(mu, sigma, n)), 1, LEN_MAX).astype(np.int64)
    ratio = np.clip(rng.normal(RATIO_MEAN, RATIO_SD, n), RATIO_MIN, RATIO_MAX)
    de = np.clip(np.rint(en * ratio), 1, LEN_MAX).astype(np.int64)
    return en, de


def build_languages(seed: int) -> dict[str, Language]:
    """The two languages; tables depend on the seed only, not on the corpus size."""
    rng = np.random.default_rng([seed, 0x7AB1E5])
    # Names are shared, and no name may equal a word of either language (case-insensitively):
    # every whitespace token comes from exactly one table.
    names = build_names(rng, set(EN.function_words) | set(DE.function_words))
    name_keys = {n.lower() for n in names}
    out = {}
    for spec in (EN, DE):
        # Each language has its own word space; names are excluded from both.
        lang_taken = set(name_keys)
        words = build_word_table(rng, spec, lang_taken)
        out[spec.name] = Language(spec, words, names, build_numbers(rng, spec))
    return out


def generate_corpus(raw: Path, pairs: int, seed: int) -> dict:
    """Write raw/{train,valid,test}.parquet (replacing raw whole); return statistics."""
    t0 = time.perf_counter()
    langs = build_languages(seed)
    t_tables = time.perf_counter() - t0
    print(f"  word tables built in {t_tables:.1f} s "
          f"(en {langs['en'].n_words:,} words, de {langs['de'].n_words:,} words, "
          f"{langs['en'].n_names:,} shared names)", flush=True)
    schema = pa.schema([("de", pa.string()), ("en", pa.string())])  # sorted, as download
    tmp = raw.with_name(f".{raw.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    sizes = {"train": pairs, "valid": VALID_PAIRS, "test": TEST_PAIRS}
    per_split = {}
    for split_index, (split, n_split) in enumerate(sizes.items()):
        before = {k: (v.sentences, v.words) for k, v in langs.items()}
        last_print = time.perf_counter()
        with pq.ParquetWriter(tmp / f"{split}.parquet", schema, compression="zstd") as writer:
            for chunk_index, start in enumerate(range(0, n_split, CHUNK)):
                n = min(CHUNK, n_split - start)
                rng = np.random.default_rng([seed, split_index, chunk_index])
                en_len, de_len = sentence_lengths(rng, n)
                table = pa.Table.from_arrays(
                    [langs["de"].sample(rng, de_len), langs["en"].sample(rng, en_len)],
                    schema=schema)
                writer.write_table(table, row_group_size=CHUNK)
                if time.perf_counter() - last_print > 15:
                    last_print = time.perf_counter()
                    print(f"  {split}: {start + n:,}/{n_split:,} pairs "
                          f"({time.perf_counter() - t0:.0f} s)", flush=True)
        per_split[split] = {
            "pairs": n_split,
            "words": {k: v.words - before[k][1] for k, v in langs.items()},
        }
    if raw.exists():
        shutil.rmtree(raw)
    tmp.rename(raw)
    seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "tables_seconds": t_tables,
        "self_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB,
        "splits": per_split,
        "languages": {k: v.stats() for k, v in langs.items()},
        "bytes_on_disk": sum(f.stat().st_size for f in raw.glob("*.parquet")),
    }


def row_counts(raw: Path) -> dict[str, int]:
    """Rows of each split's parquet file (its footer only: ``aiayn.data.corpus.raw_rows``)."""
    from aiayn.data.corpus import raw_rows

    return {s: raw_rows(raw, s) for s in ("train", "valid", "test")}


def check_corpus(raw: Path, stats: dict) -> None:
    """Cheap sanity check of the written files: row counts, schema, a few sentences."""
    for split, entry in stats["splits"].items():
        pf = pq.ParquetFile(raw / f"{split}.parquet")
        if pf.metadata.num_rows != entry["pairs"]:
            raise SystemExit(f"error: {raw / f'{split}.parquet'} holds {pf.metadata.num_rows:,} "
                             f"pairs, not the {entry['pairs']:,} expected; run again with "
                             "--regenerate")
        if pf.schema_arrow.names != ["de", "en"]:
            raise SystemExit(f"error: {raw / f'{split}.parquet'} has columns "
                             f"{pf.schema_arrow.names}, not ['de', 'en']; run again with "
                             "--regenerate")
    first = pq.ParquetFile(raw / "train.parquet").read_row_group(0).slice(0, 3).to_pylist()
    for row in first:
        print(f"    en: {row['en'][:150]}")
        print(f"    de: {row['de'][:150]}")


# =========================================================================== stages


@dataclass
class StageResult:
    name: str
    argv: list[str]
    returncode: int
    wall_s: float
    user_s: float
    sys_s: float
    peak_rss_gib: float  # ru_maxrss of the stage process (wait4): its own peak
    events: list  # (seconds since start, log line) of the stage's own log lines
    log: str
    mean_loadavg: float  # the machine's 1-minute load average, mean of start and end
    interrupted: bool = False

    def as_dict(self) -> dict:
        return dict(self.__dict__)


# Runs one stage as its own child and reports that child's rusage. A child's ru_maxrss starts
# at its parent's high-water RSS (Linux records the pre-exec memory map's peak), so stages
# started straight from this script, which has held the corpus tables, would all seem to
# need as much; this wrapper is a small fresh interpreter, so its child's peak is the
# stage's own.
RUSAGE_WRAPPER = r"""
import json, os, signal, sys
out, argv = sys.argv[1], sys.argv[2:]
pid = os.fork()
if pid == 0:
    try:
        os.execv(argv[0], argv)
    finally:
        os._exit(127)
# Pass a kill on to the stage and still report its usage; Ctrl-C reaches the stage directly.
signal.signal(signal.SIGTERM, lambda signum, frame: os.kill(pid, signal.SIGTERM))
signal.signal(signal.SIGINT, signal.SIG_IGN)
_, status, ru = os.wait4(pid, 0)
with open(out, "w") as f:
    json.dump({"ru_maxrss_kib": ru.ru_maxrss, "ru_utime": ru.ru_utime,
               "ru_stime": ru.ru_stime, "status": status}, f)
code = os.waitstatus_to_exitcode(status)
sys.exit(code if code >= 0 else 128 - code)
"""


def _loadavg() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")


def _pump(stream, log, name: str, start: float, events: list, echo_every: float) -> None:
    """Copy a stage's output to its log with arrival times; echo log lines (and progress
    every ``echo_every`` seconds); collect the log lines and 100% progress lines."""
    last_echo = 0.0
    buf = b""
    while True:
        data = stream.read1(65536)
        if not data:
            break
        buf += data
        parts = re.split(rb"[\r\n]", buf)
        buf = parts.pop()
        now = time.perf_counter() - start
        for raw_line in parts:
            line = raw_line.decode("utf-8", "replace").rstrip()
            if not line:
                continue
            log.write(f"{now:9.2f}  {line}\n")
            is_progress = re.search(r"\d+%\|", line) is not None or "/s]" in line
            if not is_progress or "100%" in line:
                events.append((round(now, 2), line))
            if not is_progress or now - last_echo >= echo_every or "100%" in line:
                if is_progress:
                    last_echo = now
                print(f"  [{name} {now:7.1f}s] {line}", flush=True)
    if buf.strip():
        log.write(f"{time.perf_counter() - start:9.2f}  {buf.decode('utf-8', 'replace')}\n")


def run_stage(name: str, argv: list[str], log_path: Path, echo_every: float = 20.0) -> StageResult:
    """Run one stage, stream its output to a log (with arrival times), measure it."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"\n$ {' '.join(argv)}", flush=True)
    start = time.perf_counter()
    usage_file = log_path.with_suffix(".rusage.json")
    usage_file.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", RUSAGE_WRAPPER, str(usage_file), *argv],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    load = _loadavg()
    events: list[tuple[float, str]] = []
    interrupted = False
    with open(log_path, "w", encoding="utf-8", buffering=1) as log:
        try:
            _pump(proc.stdout, log, name, start, events, echo_every)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: stop the stage, report what we have
            interrupted = True
            log.write(f"{time.perf_counter() - start:9.2f}  [bench] interrupted\n")
            proc.terminate()  # the wrapper passes it on to the stage
    proc.wait()
    wall = time.perf_counter() - start
    usage = _read_json(usage_file) or {"ru_maxrss_kib": 0, "ru_utime": 0.0, "ru_stime": 0.0}
    return StageResult(
        name=name, argv=argv, returncode=proc.returncode, wall_s=wall,
        user_s=usage["ru_utime"], sys_s=usage["ru_stime"],
        peak_rss_gib=usage["ru_maxrss_kib"] * 1024 / GIB,  # KiB on Linux
        events=events, log=str(log_path), mean_loadavg=(load + _loadavg()) / 2,
        interrupted=interrupted)


# Prints, for each stage of the `aiayn` CLI, its options and their defaults (as JSON).
OPTIONS_PROBE = r"""
import json, typer
from stages.cli import app
group = typer.main.get_command(app)
print(json.dumps({name: [[list(p.opts), None if p.default is None else str(p.default)]
                         for p in cmd.params] for name, cmd in group.commands.items()}))
"""


def stage_options() -> dict[str, list]:
    """The CLI's stages with their options and defaults, read from the code as it is now."""
    res = subprocess.run([sys.executable, "-c", OPTIONS_PROBE], cwd=REPO, capture_output=True,
                         text=True)
    if res.returncode != 0:
        raise SystemExit(f"error: cannot list the aiayn commands:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def relocate(path: str, work: Path) -> Path | None:
    """A repository data or metrics path, moved under the work folder (None: not one)."""
    parts = Path(path).parts
    if parts and parts[0] == "data":
        return work.joinpath(*parts[1:])
    if parts and parts[0] == "metrics":
        return work.joinpath(*parts)
    return None


def stage_commands(work: Path, params: Path, profile: bool) -> tuple[dict, dict]:
    """Each stage's command line as dvc.yaml runs it, with every data/ and metrics/ path
    (the defaults of the stage's options) moved under ``work``; and the stage's outs there.

    The raw corpus is ``work/raw``, which is where ``data/raw`` lands.
    """
    dvc = yaml.safe_load((REPO / "dvc.yaml").read_text(encoding="utf-8"))["stages"]
    options = stage_options()
    aiayn = Path(sys.executable).parent / "aiayn"
    exe = str(aiayn) if aiayn.exists() else (shutil.which("aiayn") or "aiayn")
    commands, outs = {}, {}
    for name in STAGES:
        if name not in dvc or name not in options:
            continue
        cmd = shlex.split(dvc[name]["cmd"])
        if cmd[:2] != ["aiayn", name]:
            raise SystemExit(f"error: dvc.yaml runs stage {name} as {dvc[name]['cmd']!r}; this "
                             "benchmark only knows `aiayn <stage> [options]`")
        given = set(cmd[2:])
        argv = [str(a) for a in cmd[2:]]
        for opts, default in options[name]:
            if given & set(opts) or default is None:
                continue
            if "--params" in opts:
                argv += ["--params", str(params)]
            elif (moved := relocate(default, work)) is not None:
                argv += [opts[0], str(moved)]
        if profile:
            prefix = [sys.executable, "-m", "cProfile", "-o", str(work / f"profile/{name}.prof"),
                      "-m", "stages.cli"]
        else:
            prefix = [exe]
        commands[name] = prefix + [name] + argv
        # the data outputs (DVC-cached); the small uncached logs beside the metrics are not
        outs[name] = [relocate(next(iter(o)) if isinstance(o, dict) else o, work)
                      for o in dvc[name].get("outs", [])
                      if not (isinstance(o, dict) and next(iter(o.values())).get("cache") is False)]
    return commands, outs


def print_profile(path: Path) -> None:
    import io
    import pstats

    if not path.is_file():
        return
    for key, top, what in (("cumulative", 25, "cumulative time"), ("tottime", 15, "own time")):
        out = io.StringIO()
        pstats.Stats(str(path), stream=out).sort_stats(key).print_stats(top)
        print(f"\n--- cProfile {path.name}: top {top} by {what}")
        print("\n".join(line for line in out.getvalue().splitlines()[6:] if line.strip()))


# =========================================================================== reporting


def machine() -> dict:
    """The harness's machine facts, and what a data-pipeline figure also depends on: usable
    CPUs, memory, kernel, the data libraries' versions, the load, thread settings."""
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = round(int(line.split()[1]) / 1024**2, 1)
    except OSError:
        pass
    versions = {"python": platform.python_version()}
    for mod in ("tokenizers", "pyarrow", "numpy", "pandas"):
        try:
            versions[mod] = __import__(mod).__version__
        except ImportError:
            versions[mod] = None
    return {**harness.machine_facts(), "nproc": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)), "mem_gib": mem,
            "kernel": platform.release(), "versions": versions,
            "loadavg_start": _loadavg(),
            "env": {k: os.environ[k] for k in ("RAYON_NUM_THREADS", "TOKENIZERS_PARALLELISM",
                                               "OMP_NUM_THREADS") if k in os.environ}}


def write_params(work: Path) -> Path:
    from aiayn.config import load_params

    params = yaml.safe_load((REPO / "params.yaml").read_text(encoding="utf-8"))
    for (section, key), value in PARAM_OVERRIDES.items():
        params.setdefault(section, {})[key] = value
    # The model must have positions for the longest sharded pair (bos/eos included); the
    # paper's base model has plenty, the small demo preset may not.
    model = params.setdefault("model", {})
    need = PARAM_OVERRIDES[("shard", "max_len")] + 2
    if int(model.get("max_positions", need)) < need:
        model["max_positions"] = 1024
    path = work / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")
    load_params(path)  # validates; raises ParamsError with a clear message otherwise
    return path


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def stage_metrics(work: Path) -> dict:
    return {s: _read_json(work / f"metrics/{s}.json") for s in STAGES}


def print_metrics(m: dict) -> None:
    v, s, sh = m.get("vocab"), m.get("survey"), m.get("shard")
    if v:
        per = ", ".join(f"{k} {v[k]['mean_tokens_per_sentence']:.1f} tokens/sentence "
                        f"(unk {v[k]['unknown_rate']:.2g})" for k in ("en", "de") if k in v)
        print(f"vocab:  {v['size']} tokens (requested {v['requested_size']}); valid: {per}")
    if s:
        for split in ("train",):
            entry = s["splits"][split]
            for lang in ("en", "de"):
                e = entry[lang]
                print(f"survey: {split} {lang}: mean {e['mean']:.1f}, p50 {e['p50']:g}, "
                      f"p90 {e['p90']:g}, p95 {e['p95']:g}, p99 {e['p99']:g}, "
                      f"p99.9 {e['p99.9']:g}, max {e['max']} tokens; {e['tokens']:,} tokens")
        drops = ", ".join(f"{k}: {d['pairs']:,} ({100 * d['fraction']:.3f}%)"
                          for k, d in sorted(s["max_len_drops"].items(),
                                             key=lambda kv: int(kv[0])))
        print(f"survey: train pairs dropped per max_len: {drops}")
    if sh:
        for split in ("train", "valid", "test"):
            e = sh["splits"].get(split)
            if e is None:
                continue
            print(f"shard:  {split}: {e['pairs']:,} pairs ({e['dropped_over_max_len']:,} over "
                  f"max_len), {e['batches']:,} batches in {e['shards']} shard(s), "
                  f"{e['mean_pairs_per_batch']:.1f} pairs/batch, padding "
                  f"{100 * e['padding_ratio']:.2f}%")


def print_table(results: list[StageResult], total_wall: float,
                pairs: int = WMT14_TRAIN_PAIRS) -> dict:
    """The stages' table with totals, and the goals' verdicts: those are for WMT14's
    training set, so a run on fewer ``pairs`` reports them as not judged (None)."""
    print("\n" + "=" * 78)
    print(f"{'stage':<8} {'wall s':>9} {'peak RSS GiB':>13} {'CPU s':>9} {'CPU/wall':>9} "
          f"{'load':>6}  status")
    print("-" * 78)
    for r in results:
        cpu = r.user_s + r.sys_s
        print(f"{r.name:<8} {r.wall_s:9.1f} {r.peak_rss_gib:13.2f} {cpu:9.1f} "
              f"{cpu / max(r.wall_s, 1e-9):9.2f} {r.mean_loadavg:6.1f}  "
              f"{'ok' if r.returncode == 0 else f'FAILED ({r.returncode})'}")
    peak = max((r.peak_rss_gib for r in results), default=0.0)
    cpu = sum(r.user_s + r.sys_s for r in results)
    print("-" * 78)
    print(f"{'total':<8} {total_wall:9.1f} {peak:13.2f} {cpu:9.1f} "
          f"{cpu / max(total_wall, 1e-9):9.2f}  (peak = max over stages)")
    complete = len(results) == len(STAGES) and all(r.returncode == 0 for r in results)
    wall_ok = complete and total_wall <= GOAL_WALL_S
    rss_ok = bool(results) and peak <= GOAL_RSS_GIB
    if pairs < WMT14_TRAIN_PAIRS:
        print(f"{'goal':<8} {GOAL_WALL_S:9.0f} {GOAL_RSS_GIB:13.2f}  not judged: the goals are "
              f"for {WMT14_TRAIN_PAIRS:,} training pairs, this run had {pairs:,}")
        wall_ok = rss_ok = None
    else:
        print(f"{'goal':<8} {GOAL_WALL_S:9.0f} {GOAL_RSS_GIB:13.2f}  "
              f"wall: {'MET' if wall_ok else 'MISSED'}"
              f"{'' if complete else ' (not all stages ran/succeeded)'}, "
              f"peak RSS: {'MET' if rss_ok else 'MISSED'}")
    print("=" * 78)
    return {"total_wall_s": total_wall, "total_cpu_s": cpu, "peak_rss_gib": peak,
            "goal_wall_s": GOAL_WALL_S, "goal_rss_gib": GOAL_RSS_GIB,
            "wall_goal_met": wall_ok, "rss_goal_met": rss_ok, "all_stages_ok": complete}


# =========================================================================== main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = harness.parser(__doc__)
    ap.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    ap.add_argument("--pairs", type=int, default=WMT14_TRAIN_PAIRS,
                    help="training pairs to generate (valid/test: 3000/3003)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/aiayn-bench"),
                    help="work folder (corpus, params, stage outputs, logs, results)")
    ap.add_argument("--seed", type=int, default=1, help="corpus seed")
    ap.add_argument("--keep", action="store_true",
                    help="keep the stage outputs (by default only the corpus, metrics, logs "
                         "and results stay)")
    ap.add_argument("--regenerate", action="store_true",
                    help="generate the corpus even if a matching one exists")
    ap.add_argument("--skip-generate", action="store_true",
                    help="use WORKDIR/raw as it is, whatever made it")
    ap.add_argument("--stages", default=",".join(STAGES),
                    help="comma-separated subset of vocab,survey,shard to run (a later stage "
                         "needs the outputs of an earlier run kept with --keep)")
    ap.add_argument("--profile", action="store_true",
                    help="run each stage under cProfile (slower; for finding hot spots)")
    ap.add_argument("--generate-only", action="store_true", help="stop after the corpus")
    args = ap.parse_args(argv)
    harness.require_positive(ap, args, "pairs")
    args.workdir = args.workdir.resolve()
    if args.workdir == REPO or REPO in args.workdir.parents:
        ap.error(f"--workdir {args.workdir} is inside the repository; use a folder outside it")
    args.stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in args.stages if s not in STAGES]
    if unknown:
        ap.error(f"--stages: unknown stage(s) {unknown}; choose from {list(STAGES)}")
    if not args.stages:
        ap.error(f"--stages names no stage; choose from {list(STAGES)} (or --generate-only)")
    return args


def _remove(path: Path | None) -> None:
    if path is None or not path.exists():
        return
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def prepare_corpus(args, work: Path) -> dict | None:
    """WORKDIR/raw as --skip-generate, --regenerate and a matching earlier corpus say: its
    record (None: --skip-generate without one), checked and with a few sentences shown."""
    raw = work / "raw"
    marker = work / "corpus.json"
    want = {"generator_version": GENERATOR_VERSION, "pairs": args.pairs, "seed": args.seed,
            "valid_pairs": VALID_PAIRS, "test_pairs": TEST_PAIRS}
    want_rows = {"train": args.pairs, "valid": VALID_PAIRS, "test": TEST_PAIRS}
    present = all((raw / f"{s}.parquet").is_file() for s in ("train", "valid", "test"))
    previous = _read_json(marker)
    if args.skip_generate:
        if not present:
            print(f"error: --skip-generate but {raw} has no train/valid/test.parquet",
                  file=sys.stderr)
            return None
        corpus = previous if previous else {"origin": "external"}
        print(f"\ncorpus: using {raw} as it is (--skip-generate)")
    else:
        reuse = not args.regenerate and previous and previous.get("spec") == want and present
        rows = row_counts(raw) if reuse else None
        if reuse and rows != want_rows:  # a file changed since it was generated
            print(f"\ncorpus: {raw} no longer holds the pairs {marker.name} records "
                  f"({rows}); generating it again")
            reuse = False
        if reuse:
            corpus = previous
            corpus["reused"] = True
            print(f"\ncorpus: reusing {raw} ({args.pairs:,} pairs, seed {args.seed}; generated "
                  f"in {previous['generation']['seconds']:.1f} s)")
        else:
            print(f"\ncorpus: generating {args.pairs:,} train pairs (+{VALID_PAIRS}/{TEST_PAIRS}"
                  f" valid/test), seed {args.seed} -> {raw}", flush=True)
            marker.unlink(missing_ok=True)
            gen = generate_corpus(raw, args.pairs, args.seed)
            corpus = {"spec": want, "generation": gen, "reused": False}
            marker.write_text(json.dumps(corpus, indent=2), encoding="utf-8")
    print_corpus(corpus)
    # An external corpus (--skip-generate) is checked for its schema; ours for its rows too.
    expected = row_counts(raw) if args.skip_generate else want_rows
    check_corpus(raw, {"splits": {s: {"pairs": n} for s, n in expected.items()}})
    return corpus


def print_corpus(corpus: dict) -> None:
    gen = corpus.get("generation")
    if not gen:
        return
    print(f"corpus: generated in {gen['seconds']:.1f} s (tables {gen['tables_seconds']:.1f}"
          f" s), generator peak RSS {gen['self_peak_rss_gib']:.2f} GiB, "
          f"{gen['bytes_on_disk'] / 2**20:,.0f} MiB on disk")
    for lang, st in gen["languages"].items():
        voc = st["vocabulary"]
        print(f"  {lang}: {st['sentences']:,} sentences, {st['words']:,} words, "
              f"{st['mean_words_per_sentence']:.2f} words/sentence, "
              f"{st['mean_bytes_per_sentence']:.0f} bytes/sentence; tables of "
              f"{voc['word_types']:,} words, {voc['names']:,} names, {voc['numbers']:,} numbers")


def run_stages(args, work: Path, commands: dict) -> list[StageResult]:
    """The stages of --stages one after another, until one fails or is interrupted."""
    results: list[StageResult] = []
    for name in STAGES:
        if name not in args.stages:
            continue
        res = run_stage(name, commands[name], work / f"logs/{name}.log")
        results.append(res)
        print(f"  -> {name}: {res.wall_s:.1f} s wall, peak RSS {res.peak_rss_gib:.2f} GiB, "
              f"exit {res.returncode}", flush=True)
        if args.profile:
            print_profile(work / f"profile/{name}.prof")
        if res.interrupted:
            print(f"interrupted during stage {name}; reporting what was measured",
                  file=sys.stderr)
            break
        if res.returncode != 0:
            print(f"error: stage {name} failed; see {res.log}", file=sys.stderr)
            break
    return results


def output_sizes(work: Path, outs: dict) -> dict[str, int]:
    """Bytes of each stage output on disk (a folder: its files'), by path under ``work``."""
    disk = {}
    for path in [p for name in STAGES for p in outs.get(name, []) if p is not None]:
        if path.is_file():
            disk[str(path.relative_to(work))] = path.stat().st_size
        elif path.is_dir():
            disk[str(path.relative_to(work))] = sum(
                f.stat().st_size for f in path.rglob("*") if f.is_file())
    return disk


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # a kill reports the stages measured so far
    work: Path = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now().astimezone()
    info = machine()
    print(f"aiayn data-pipeline benchmark, {started:%Y-%m-%d %H:%M %Z}")
    print(harness.machine_line(info))
    print(f"machine: {info['nproc']} CPUs ({info['affinity']} usable), "
          f"{info['mem_gib']} GiB RAM, Linux {info['kernel']}; load average at start "
          f"{info['loadavg_start']:.1f}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()))
    print(f"workdir: {work}")

    corpus = prepare_corpus(args, work)
    if corpus is None:
        return 2
    if args.generate_only:
        return 0

    params = write_params(work)
    print(f"\nparams: {params} (repository params.yaml with "
          + ", ".join(f"{a}.{b}={v}" for (a, b), v in PARAM_OVERRIDES.items()) + ")")
    commands, outs = stage_commands(work, params, args.profile)
    missing = [s for s in args.stages if s not in commands]
    if missing:
        print(f"error: stage(s) {missing} not in dvc.yaml or not an `aiayn` command in this "
              "checkout; run the others with --stages, or try again later", file=sys.stderr)
        return 2
    if args.stages == list(STAGES):  # a full run starts clean
        for path in [p for name in STAGES for p in outs[name]]:
            _remove(path)
        for sub in ("metrics", "profile"):
            shutil.rmtree(work / sub, ignore_errors=True)
    (work / "profile").mkdir(exist_ok=True)

    results = run_stages(args, work, commands)
    summary = print_table(results, sum(r.wall_s for r in results), args.pairs)
    metrics = stage_metrics(work)
    print()
    print_metrics(metrics)
    disk = output_sizes(work, outs)
    if disk:
        print("outputs on disk: " + ", ".join(f"{k} {v / 2**20:,.0f} MiB" for k, v in disk.items()))

    report = {
        "date": started.isoformat(timespec="seconds"),
        "command": harness.command_line("bench.data_pipeline", argv),
        "workdir": str(work),
        "params_overrides": {f"{a}.{b}": v for (a, b), v in PARAM_OVERRIDES.items()},
        "corpus": corpus,
        "stages": [r.as_dict() for r in results],
        "summary": summary,
        "stage_metrics": metrics,
        "outputs_bytes": disk,
        "profiled": args.profile,
    }
    out = work / "bench_data_pipeline.json"
    harness.write_json(out, harness.record(report, argv, machine=info))
    print(f"\nresults: {out}")
    if not args.keep and summary["all_stages_ok"]:
        for path in [p for name in STAGES for p in outs[name]]:
            _remove(path)
        print("stage outputs deleted (--keep keeps them); corpus kept for the next run")
    if any(r.interrupted for r in results):
        return 130
    return 0 if all(r.returncode == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Token-length survey: how long are the pairs, and what would each max length cost?

The survey is the one pass that runs the tokenizer over the whole corpus. It keeps the token
ids it computes, so the shard stage plans its token-bucket batches from the lengths and
packs the ids without encoding anything again; a user picks ``shard.max_len`` from the drop
counts reported here.

Layout of the survey folder (``data/survey/``, format version :data:`FORMAT_VERSION`)::

    lengths.parquet          split (category), row (index within the raw split), one int32
                             token count (BPE, no special tokens) per language
    meta.json                vocab_size, languages, dtype, rows and tokens per split, and
                             the sha256 of the tokenizer file the ids came from
    ids/{split}.{lang}.npy   flat BPE ids (no special tokens) of all sentences of the split,
                             concatenated in row order; dtype :func:`token_dtype`

Sentence ``i`` of a split is ``flat[offsets[i]:offsets[i + 1]]``, where ``flat`` is
``np.load(ids/{split}.{lang}.npy, mmap_mode="r")`` and ``offsets = [0, *cumsum(lengths)]``
over that split's rows of column ``lang`` of ``lengths.parquet`` (:func:`sentence_offsets`).

The folder is written whole into a temporary sibling and renamed into place at the end, so
a crash leaves the previous survey intact. While encoding, the ids of each split and
language are appended batch by batch to their ``.npy`` file behind a placeholder header
that is rewritten with the final length afterwards: memory stays at one batch of ids.
"""

from __future__ import annotations

import io
import itertools
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from numpy.lib import format as npy_format
from tokenizers import Tokenizer

from aiayn.config import SPLITS
from aiayn.data.corpus import iter_raw, open_raw
from aiayn.data.tokenizer import load_tokenizer
from aiayn.errors import DataError
from aiayn.io import atomic_path, file_sha256, write_json

if TYPE_CHECKING:
    import pandas as pd

# pandas is imported where it is used: aiayn.data.shards, and through it the training data
# reader, use this module's folder layout helpers and should not pay for it.

PERCENTILES = (50, 90, 95, 99, 99.9)
FORMAT = "aiayn-survey"
FORMAT_VERSION = 1
LENGTHS_FILE = "lengths.parquet"
META_FILE = "meta.json"


def ids_path(survey_dir: str | Path, split: str, lang: str) -> Path:
    """The flat token file of one split and language inside a survey folder."""
    return Path(survey_dir) / "ids" / f"{split}.{lang}.npy"


def sentence_offsets(lengths: np.ndarray) -> np.ndarray:
    """int64 [n + 1]: sentence i of a flat ids file is ``flat[off[i]:off[i + 1]]``."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type that holds every id (uint16 halves disk and page cache)."""
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.uint32)


# --------------------------------------------------------------------------- flat id files


def _npy_header(dtype: np.dtype, size: int) -> bytes:
    buf = io.BytesIO()
    npy_format.write_array_header_1_0(buf, {"descr": npy_format.dtype_to_descr(dtype),
                                            "fortran_order": False, "shape": (size,)})
    return buf.getvalue()


class FlatIdsWriter:
    """Append token ids to a 1-D ``.npy`` file whose length is only known at the end.

    The file starts with the header of an empty array; :meth:`close` rewrites it with the
    final length (numpy pads 1-D headers so that any length fits in the same bytes; if it
    ever does not, the body is copied behind a longer header).
    """

    def __init__(self, path: Path, dtype: np.dtype):
        self.path = path
        self.dtype = np.dtype(dtype)
        self.size = 0
        path.parent.mkdir(parents=True, exist_ok=True)
        self._header = _npy_header(self.dtype, 0)
        self._file = open(path, "wb")  # noqa: SIM115 (closed in close())
        self._file.write(self._header)

    def append(self, lengths: np.ndarray, ids: Iterable[int]) -> None:
        """Append the concatenated ids of a batch of sequences of the given lengths."""
        total = int(lengths.sum())
        flat = np.fromiter(ids, dtype=self.dtype, count=total)
        self._file.write(flat.tobytes())
        self.size += total

    def close(self) -> None:
        header = _npy_header(self.dtype, self.size)
        if len(header) == len(self._header):
            self._file.seek(0)
            self._file.write(header)
            self._file.close()
            return
        self._file.close()
        moved = self.path.with_suffix(".body")
        os.replace(self.path, moved)
        with open(moved, "rb") as src, open(self.path, "wb") as dst:
            dst.write(header)
            src.seek(len(self._header))
            while chunk := src.read(1 << 24):
                dst.write(chunk)
        moved.unlink()

    def abort(self) -> None:
        self._file.close()


# --------------------------------------------------------------------------- the survey


def encode(tok: Tokenizer, texts: list[str]) -> list:
    """Encodings (no special tokens) of a batch of sentences, encoded in parallel."""
    return tok.encode_batch_fast(texts, add_special_tokens=False)


def check_raw(raw_dir: str | Path, languages: Iterable[str]) -> None:
    """Fail before any work if a raw split is missing or unreadable, or one of the language
    columns is missing or not text."""
    for split in SPLITS:
        open_raw(raw_dir, split, list(languages))


def survey_lengths(tok: Tokenizer, raw_dir: str | Path, languages: Iterable[str],
                   progress: Callable[[int], None] | None = None,
                   ids_dir: str | Path | None = None) -> pd.DataFrame:
    """Token counts (no special tokens) of every sentence of every split.

    Columns: ``split`` (category), ``row`` (index within the raw split), one int32 column
    per language. Built split by split, batch by batch: memory is a few bytes per pair.
    With ``ids_dir``, the ids themselves go to ``ids_dir/{split}.{lang}.npy`` as they are
    encoded (see the module docstring; dtype :func:`token_dtype`).
    """
    import pandas as pd


    langs = list(languages)
    dtype = token_dtype(tok.get_vocab_size())
    frames = []
    for split in SPLITS:
        writers = {lang: FlatIdsWriter(Path(ids_dir) / f"{split}.{lang}.npy", dtype)
                   for lang in langs} if ids_dir is not None else {}
        try:
            start = 0
            for batch in iter_raw(raw_dir, split, columns=langs):
                n = len(batch[langs[0]])
                cols = {}
                for lang in langs:
                    encodings = encode(tok, batch[lang])
                    # len(encoding) is its token count; each .ids list is built once, streamed
                    # into numpy and dropped (keeping them all costs garbage-collector time).
                    cols[lang] = np.fromiter(map(len, encodings), dtype=np.int32, count=n)
                    if writers:
                        writers[lang].append(cols[lang], itertools.chain.from_iterable(
                            e.ids for e in encodings))
                frames.append(pd.DataFrame({"split": split,
                                            "row": np.arange(start, start + n, dtype=np.int64),
                                            **cols}))
                start += n
                if progress:
                    progress(n)
        except BaseException:
            for writer in writers.values():
                writer.abort()
            raise
        for writer in writers.values():
            writer.close()
    df = pd.concat(frames, ignore_index=True)
    df["split"] = pd.Categorical(df["split"], categories=list(SPLITS))
    return df


def build_survey(tokenizer: str | Path, raw_dir: str | Path, languages: Iterable[str],
                 out: str | Path, progress: Callable[[int], None] | None = None
                 ) -> pd.DataFrame:
    """Encode every split once and write the survey folder ``out`` (replaced whole, only on
    success): ``lengths.parquet``, ``ids/{split}.{lang}.npy`` and ``meta.json``.

    Returns the lengths table. ``progress`` is called with the number of pairs just encoded.
    """

    langs = list(languages)
    check_raw(raw_dir, langs)
    tok = load_tokenizer(tokenizer)
    sha = file_sha256(tokenizer)
    vocab_size = tok.get_vocab_size()
    with atomic_path(out, directory=True) as tmp:
        df = survey_lengths(tok, raw_dir, langs, progress, ids_dir=tmp / "ids")
        df.to_parquet(tmp / LENGTHS_FILE, index=False, compression="zstd")
        splits = {}
        for split in SPLITS:
            part = df[df["split"] == split]
            splits[split] = {"rows": int(len(part)),
                             "tokens": {lang: int(part[lang].sum()) for lang in langs}}
        write_json(tmp / META_FILE, {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "languages": langs,
            "vocab_size": vocab_size,
            "dtype": token_dtype(vocab_size).name,
            "tokenizer_sha256": sha,
            "lengths_file": LENGTHS_FILE,
            "ids_files": "ids/{split}.{lang}.npy",
            "splits": splits,
        })
    return df


def read_lengths(survey_dir: str | Path) -> pd.DataFrame:
    """The lengths table of a survey folder."""
    import pandas as pd

    path = Path(survey_dir) / LENGTHS_FILE
    if not path.is_file():
        raise DataError(f"{path}: missing; run the survey stage first (`aiayn survey`)")
    return pd.read_parquet(path)


def summarize(df: pd.DataFrame, languages: Iterable[str], candidates: Iterable[int]) -> dict:
    """Percentiles per split and language, and the pairs each candidate max length drops.

    A pair is dropped by ``max_len`` L when either side has more than L tokens.
    """
    langs = list(languages)
    out: dict = {"splits": {}, "max_len_drops": {}}
    for split in SPLITS:
        part = df[df["split"] == split]
        entry: dict = {"pairs": int(len(part))}
        for lang in langs:
            values = part[lang].to_numpy()
            stats = {f"p{p:g}": round(float(np.percentile(values, p)), 2) for p in PERCENTILES}
            stats.update(mean=round(float(values.mean()), 3), max=int(values.max()),
                         tokens=int(values.sum()))
            entry[lang] = stats
        out["splits"][split] = entry
    train = df[df["split"] == "train"]
    longest = train[langs].max(axis=1).to_numpy()
    for length in sorted(candidates):
        dropped = int((longest > length).sum())
        out["max_len_drops"][str(length)] = {
            "pairs": dropped, "fraction": dropped / max(len(train), 1)}
    return out


def histogram(df: pd.DataFrame, languages: Iterable[str], bins: int,
              split: str = "train") -> pd.DataFrame:
    """Pair counts per token-length bin of one split, one column per language (for plots)."""
    import pandas as pd

    langs = list(languages)
    part = df[df["split"] == split]
    top = int(part[langs].to_numpy().max()) if len(part) else 1
    edges = np.unique(np.linspace(0, top + 1, bins + 1).round().astype(int))
    table = {"length": edges[:-1]}
    for lang in langs:
        counts, _ = np.histogram(part[lang].to_numpy(), bins=edges)
        table[lang] = counts
    return pd.DataFrame(table)


def plot_histogram(hist: pd.DataFrame, columns: Iterable[str], path: str | Path,
                   title: str, labels: Iterable[str] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=110)
    widths = np.diff(np.append(hist["length"].to_numpy(), hist["length"].iloc[-1] + 1))
    columns = list(columns)
    for column, label in zip(columns, labels or columns, strict=True):
        ax.step(hist["length"], hist[column], where="post", label=label)
    ax.set_xlabel("tokens per sentence (BPE, no specials)")
    ax.set_ylabel("sentences per bin")
    ax.set_title(title)
    ax.legend()
    ax.set_xlim(0, hist["length"].iloc[-1] + widths[-1])
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)

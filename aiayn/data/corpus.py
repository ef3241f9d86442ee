"""Parallel corpora: three sources behind one interface, cleaning, and the raw split files.

A source streams a split as batches of aligned sentences, ``{lang: [text, ...]}``, so a
4.5M-pair corpus never sits in memory as one list. :func:`write_raw_splits` cleans the
stream and writes ``{out}/{split}.parquet`` (one string column per language) into a
temporary folder that replaces ``out`` only when every split is complete.
"""

from __future__ import annotations

import gzip
import io
import os
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from aiayn.config import SPLITS, Cleaning, DataConfig, HubSource, LocalSource, ToySource
from aiayn.errors import DataError
from aiayn.io import atomic_path

Batch = dict[str, list[str]]
BATCH_SIZE = 50_000


class PairSource(Protocol):
    """Where raw sentence pairs come from."""

    def describe(self) -> str: ...

    def check(self) -> None:
        """Cheap preflight (files exist, ...) so that bad input fails before any work."""

    def batches(self, split: str) -> Iterator[Batch]:
        """Aligned sentences of one of our splits ("train", "valid", "test")."""


# --------------------------------------------------------------------------- toy


@dataclass
class ToyPairs:
    cfg: ToySource
    languages: tuple[str, str] = ("en", "de")

    def describe(self) -> str:
        c = self.cfg
        return (
            f"toy generator (seed {c.seed}; {c.train_pairs}/{c.valid_pairs}/{c.test_pairs} pairs; "
            f"{c.min_words}-{c.max_words} words)"
        )

    def check(self) -> None:
        return None

    def batches(self, split: str) -> Iterator[Batch]:
        from aiayn.data.toy import generate_pairs

        n = {"train": self.cfg.train_pairs, "valid": self.cfg.valid_pairs,
             "test": self.cfg.test_pairs}[split]
        # Each split has its own stream, so resizing one split leaves the others unchanged.
        seed = self.cfg.seed * 1000 + SPLITS.index(split)
        batch: Batch = {"en": [], "de": []}
        for en, de in generate_pairs(n, seed, self.cfg.min_words, self.cfg.max_words):
            batch["en"].append(en)
            batch["de"].append(de)
            if len(batch["en"]) == BATCH_SIZE:
                yield batch
                batch = {"en": [], "de": []}
        if batch["en"]:
            yield batch


# --------------------------------------------------------------------------- local


def _open_text(path: Path) -> io.BufferedIOBase:
    try:
        return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")
    except OSError as exc:
        raise _unreadable(path, exc) from None


# What reading a damaged file raises: a truncated .gz ends in EOFError, plain text named .gz
# in BadGzipFile (an OSError), a corrupt deflate stream in zlib.error.
READ_ERRORS = (EOFError, gzip.BadGzipFile, zlib.error, OSError)


def _unreadable(path: Path, exc: BaseException) -> DataError:
    detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if path.suffix == ".gz":
        fix = ("a truncated or corrupt gzip file (check it with `gzip -t`); re-create it, or, "
               "if it is plain text, name it without .gz in data.local.pattern")
    else:
        fix = "check that the file is readable and re-create it if it is damaged"
    return DataError(f"{path}: cannot be read ({detail}); {fix}")


def _readline(f: io.BufferedIOBase, path: Path) -> bytes:
    try:
        return f.readline()
    except READ_ERRORS as exc:
        raise _unreadable(path, exc) from None


@dataclass
class LocalPairs:
    cfg: LocalSource
    languages: tuple[str, str]
    root: Path = Path(".")

    def _candidates(self) -> list[Path]:
        """Where data.local.dir may be: as given when absolute; else relative to the params
        file's folder, then to ``$DVC_ROOT`` (the user's repository, which DVC names when a
        queued experiment runs in a temporary copy under ``.dvc/tmp/exps/``, where a path
        such as ``../corpora`` would point inside the repository)."""
        given = Path(self.cfg.dir)
        if given.is_absolute():
            return [given]
        found = [self.root / given]
        dvc_root = os.environ.get("DVC_ROOT")
        if dvc_root and Path(dvc_root).resolve() != self.root.resolve():
            found.append(Path(dvc_root) / given)
        return found

    @property
    def folder(self) -> Path:
        candidates = self._candidates()
        return next((c for c in candidates if c.is_dir()), candidates[0])

    def path(self, split: str, lang: str) -> Path:
        name = self.cfg.pattern.format(split=getattr(self.cfg.splits, split), lang=lang)
        return self.folder / name

    def describe(self) -> str:
        return f"local folder {self.cfg.dir} ({self.cfg.pattern})"

    def check(self) -> None:
        folder = self.folder
        if not folder.is_dir():
            tried = [str(c) for c in self._candidates()]
            where = (f"folder {tried[0]} does not exist" if len(tried) == 1
                     else f"neither folder {' nor '.join(tried)} exists")
            raise DataError(
                f"data.local.dir: {where}; set data.local.dir in "
                "params.yaml to the folder holding the parallel text files"
            )
        missing = [str(self.path(s, lang)) for s in SPLITS for lang in self.languages
                   if not self.path(s, lang).is_file()]
        if missing:
            raise DataError(
                "missing parallel text file(s): " + ", ".join(missing) + "; the names come from "
                "data.local.pattern and data.local.splits in params.yaml"
            )

    def batches(self, split: str) -> Iterator[Batch]:
        a, b = self.languages
        pa_, pb_ = self.path(split, a), self.path(split, b)
        batch: Batch = {a: [], b: []}
        with _open_text(pa_) as fa, _open_text(pb_) as fb:
            line = 0
            while True:
                ra, rb = _readline(fa, pa_), _readline(fb, pb_)
                if not ra and not rb:
                    break
                line += 1
                if not ra or not rb:
                    short, long_ = (pa_, pb_) if not ra else (pb_, pa_)
                    raise DataError(
                        f"{short} has {line - 1} lines but {long_} has more: parallel files must "
                        "have the same number of lines (line i of one translates line i of the "
                        "other); fix or re-export the shorter file"
                    )
                batch[a].append(_decode(ra, pa_, line))
                batch[b].append(_decode(rb, pb_, line))
                if len(batch[a]) == BATCH_SIZE:
                    yield batch
                    batch = {a: [], b: []}
        if batch[a]:
            yield batch


def _decode(raw: bytes, path: Path, line: int) -> str:
    try:
        text = raw.decode("utf-8").rstrip("\r\n")
        # A byte-order mark (some Windows editors write one) is not part of the first sentence,
        # and str.strip() in cleaning does not remove it.
        return text.removeprefix("\ufeff") if line == 1 else text
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{path}, line {line}: invalid UTF-8 (byte {exc.start}: "
            f"{raw[exc.start:exc.start + 4]!r}); convert the file to UTF-8, "
            "e.g. `iconv -f latin1 -t utf-8`"
        ) from None


# --------------------------------------------------------------------------- hub


@dataclass
class HubPairs:
    """A hub dataset through ``datasets.load_dataset`` in streaming mode.

    ``path`` may also be a local folder laid out like the hub repository (parquet files and
    a README whose metadata names the configs); the same code path loads both.
    """

    cfg: HubSource
    languages: tuple[str, str]
    # The local source of the same params: the download stage's error names it as the way
    # to go on without the hub.
    offline: LocalSource | None = None

    def describe(self) -> str:
        return f"hub {self.cfg.path} (config {self.cfg.name})"

    def _without_hub(self) -> str:
        if self.offline is None:
            return "or use data.source: local with a folder of text files"
        local = self.offline
        names = ", ".join(local.pattern.format(split=getattr(local.splits, split), lang=lang)
                          for split in SPLITS for lang in self.languages)
        return (f"without the hub, read the same corpus from text files: set data.source: "
                f"local (`dvc exp run -S data.source=local`, or `aiayn params <preset> "
                f"data.source=local`) with the files {names} in the folder {local.dir} "
                "(data.local.dir; their names: data.local.pattern and data.local.splits)")

    def check(self) -> None:
        return None  # reachability is only known by trying; batches() reports it clearly

    def _load(self, split_name: str):
        import datasets

        try:
            return datasets.load_dataset(
                self.cfg.path, self.cfg.name, split=split_name, streaming=True,
                revision=self.cfg.revision,
            )
        except Exception as exc:  # the hub raises many types: network, auth, not found
            raise DataError(
                f"could not load {self.cfg.path!r} (config {self.cfg.name!r}, split "
                f"{split_name!r}) through datasets: {type(exc).__name__}: {exc}. Check the "
                "network and HF_HUB_OFFLINE, and data.hub.path/name/splits in params.yaml; "
                f"{self._without_hub()}"
            ) from None

    def batches(self, split: str) -> Iterator[Batch]:
        split_name = getattr(self.cfg.splits, split)
        ds = self._load(split_name)
        where = f"{self.cfg.path} ({self.cfg.name}, {split_name})"
        try:
            start = 0
            for chunk in ds.iter(batch_size=BATCH_SIZE):
                batch = self._pairs(chunk, where, start)
                start += len(batch[self.languages[0]])
                yield batch
        except DataError:
            raise
        except Exception as exc:
            raise DataError(f"{where}: reading failed: {type(exc).__name__}: {exc}") from None

    def _pairs(self, chunk: dict, where: str, start: int = 0) -> Batch:
        """One chunk of rows in either hub layout → ``{lang: [text, ...]}``.

        WMT-style datasets (``wmt/wmt14``) hold one column ``translation: {lang: text}``;
        others (``bentrevett/multi30k``) one plain column per language. A row without the
        text of a language is an error in both; ``start`` is the chunk's first row, for it.
        """
        if "translation" not in chunk:
            missing = [lang for lang in self.languages if lang not in chunk]
            if missing:
                raise DataError(
                    f"{where}: no 'translation' column and no column {missing[0]!r} (found "
                    f"{sorted(chunk)}); the hub source reads rows {{'translation': {{lang: "
                    "text}}}} or one column per language: set data.src_lang/data.tgt_lang "
                    "to languages of this dataset")
            for lang in self.languages:
                for i, text in enumerate(chunk[lang]):
                    if text is None:
                        raise DataError(
                            f"{where}: row {start + i + 1} has no {lang} text (column {lang!r} "
                            "is null); every row needs a sentence in both languages: fix the "
                            "dataset, or set data.hub.path to another one")
            return {lang: list(chunk[lang]) for lang in self.languages}
        batch: Batch = {lang: [] for lang in self.languages}
        for row in chunk["translation"]:
            for lang in self.languages:
                text = row.get(lang) if isinstance(row, dict) else None
                if text is None:
                    raise DataError(
                        f"{where}: a row has no translation.{lang} (keys: "
                        f"{sorted(row) if isinstance(row, dict) else row!r}); set "
                        "data.src_lang/data.tgt_lang to languages of this dataset"
                    )
                batch[lang].append(text)
        return batch


def make_source(cfg: DataConfig, root: Path = Path(".")) -> PairSource:
    if cfg.source == "toy":
        return ToyPairs(cfg.toy)
    if cfg.source == "local":
        return LocalPairs(cfg.local, cfg.languages, root)
    return HubPairs(cfg.hub, cfg.languages, offline=cfg.local)


# --------------------------------------------------------------------------- cleaning


@dataclass
class SplitStats:
    read: int = 0
    kept: int = 0
    dropped: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict:
        return {"read": self.read, "kept": self.kept, "dropped": dict(sorted(self.dropped.items()))}


def clean_batch(batch: Batch, languages: tuple[str, str], rules: Cleaning | None,
                stats: SplitStats) -> Batch:
    """Strip whitespace and drop empty, over-long and badly length-ratioed pairs.

    With ``rules`` None only empty pairs are dropped (used for valid/test, which are kept as
    published). Every dropped pair is counted in ``stats.dropped`` under its reason.
    """
    a, b = languages
    out: Batch = {a: [], b: []}
    for ta, tb in zip(batch[a], batch[b], strict=True):
        stats.read += 1
        ta, tb = ta.strip(), tb.strip()
        if not ta or not tb:
            stats.dropped["empty"] += 1
            continue
        if rules is not None:
            na, nb = len(ta.split()), len(tb.split())
            if max(na, nb) > rules.max_words:
                stats.dropped["too_long"] += 1
                continue
            if max(na, nb) > rules.max_ratio * min(na, nb):
                stats.dropped["length_ratio"] += 1
                continue
        out[a].append(ta)
        out[b].append(tb)
        stats.kept += 1
    return out


# --------------------------------------------------------------------------- raw files


def raw_path(raw_dir: str | Path, split: str) -> Path:
    return Path(raw_dir) / f"{split}.parquet"


def write_raw_splits(source: PairSource, languages: tuple[str, str], cleaning: Cleaning,
                     out_dir: str | Path, progress=None) -> dict[str, SplitStats]:
    """Stream every split of ``source`` through cleaning into ``out_dir/{split}.parquet``.

    All splits are written into a temporary folder that replaces ``out_dir`` only at the
    end: on any error ``out_dir`` keeps its previous content and no partial file remains.
    ``progress`` is called with (split, pairs read so far).
    """
    source.check()
    langs = tuple(sorted(languages))
    schema = pa.schema([(lang, pa.string()) for lang in langs])
    stats: dict[str, SplitStats] = {}
    with atomic_path(out_dir, directory=True) as tmp:
        for split in SPLITS:
            st = stats[split] = SplitStats()
            rules = cleaning if (split == "train" or cleaning.clean_test) else None
            with pq.ParquetWriter(raw_path(tmp, split), schema, compression="zstd") as writer:
                for batch in source.batches(split):
                    kept = clean_batch(batch, languages, rules, st)
                    if kept[langs[0]]:
                        writer.write_table(pa.table({lang: kept[lang] for lang in langs},
                                                    schema=schema))
                    if progress:
                        progress(split, st.read)
            if st.kept == 0:
                raise DataError(
                    f"{source.describe()}: split {split!r} has no pairs left after cleaning "
                    f"(read {st.read}, dropped {dict(st.dropped)}); check the source or loosen "
                    "data.clean in params.yaml"
                )
    return stats


def iter_raw(raw_dir: str | Path, split: str, columns: list[str] | None = None,
             batch_size: int = BATCH_SIZE) -> Iterator[Batch]:
    """Stream a raw split back as batches ``{lang: [text, ...]}`` (bounded memory).

    Every value is a string: a file that cannot be read, a column that is missing or not
    text, and a null value are DataErrors naming the file (and the row).
    """
    pf = open_raw(raw_dir, split, columns)
    path = raw_path(raw_dir, split)
    batches = pf.iter_batches(batch_size=batch_size, columns=columns)
    start = 0
    while True:
        try:
            rb = next(batches)
        except StopIteration:
            return
        except (pa.ArrowException, OSError) as exc:
            raise _not_parquet(path, exc) from None
        for name in rb.schema.names:
            column = rb.column(name)
            if column.null_count:
                row = start + column.is_null().to_pylist().index(True) + 1
                raise DataError(f"{path}, row {row}: column {name!r} is null; the download "
                                "stage writes text on both sides of every pair: re-run "
                                "`aiayn download`")
        yield {name: rb.column(name).to_pylist() for name in rb.schema.names}
        start += rb.num_rows


def _existing_raw(raw_dir: str | Path, split: str) -> Path:
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}: the raw splits are {', '.join(SPLITS)}")
    path = raw_path(raw_dir, split)
    if not path.is_file():
        raise DataError(f"{path}: missing; run the download stage first (`aiayn download`)")
    return path


def _not_parquet(path: Path, exc: BaseException) -> DataError:
    detail = " ".join(str(exc).split()) or type(exc).__name__
    return DataError(f"{path}: not a readable parquet file ({detail}); it is damaged or was "
                     "not written by the download stage: re-run `aiayn download`")


def open_raw(raw_dir: str | Path, split: str,
             columns: list[str] | None = None) -> pq.ParquetFile:
    """The raw split's parquet file, checked: it exists and can be read, and ``columns``
    (default: all) are there and hold strings. Each problem is a DataError naming the file."""
    path = _existing_raw(raw_dir, split)
    try:
        pf = pq.ParquetFile(path)
        schema = pf.schema_arrow
    except (pa.ArrowException, OSError) as exc:
        raise _not_parquet(path, exc) from None
    names = list(schema.names)
    for name in names if columns is None else columns:
        if name not in names:
            raise DataError(
                f"{path}: no column {name!r} (columns: {', '.join(names)}); "
                "data.src_lang/data.tgt_lang in params.yaml must name languages of the "
                "downloaded corpus, or re-run `aiayn download` after changing them"
            )
        kind = schema.field(name).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise DataError(f"{path}: column {name!r} is {kind}, expected string (one sentence "
                            "per row); re-run `aiayn download`")
    return pf


def raw_languages(raw_dir: str | Path) -> list[str]:
    return list(open_raw(raw_dir, "train").schema_arrow.names)


def raw_rows(raw_dir: str | Path, split: str) -> int:
    return open_raw(raw_dir, split).metadata.num_rows

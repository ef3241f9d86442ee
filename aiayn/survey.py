"""Token-length survey: how long are the pairs, and what would each max length cost?

The shard stage plans its token-bucket batches from these lengths before it encodes, and a
user picks ``shard.max_len`` from the drop counts reported here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import pandas as pd
from tokenizers import Tokenizer

from aiayn.config import SPLITS
from aiayn.corpus import iter_raw
from aiayn.io import atomic_path
from aiayn.tokenizer import encode_lengths

PERCENTILES = (50, 90, 95, 99, 99.9)


def survey_lengths(tok: Tokenizer, raw_dir: str | Path, languages: Iterable[str],
                   progress: Callable[[int], None] | None = None) -> pd.DataFrame:
    """Token counts (no special tokens) of every sentence of every split.

    Columns: ``split`` (category), ``row`` (index within the raw split), one int32 column
    per language. Built split by split, batch by batch: memory is a few bytes per pair.
    """
    langs = list(languages)
    frames = []
    for split in SPLITS:
        start = 0
        for batch in iter_raw(raw_dir, split, columns=langs):
            n = len(batch[langs[0]])
            cols = {lang: np.asarray(encode_lengths(tok, batch[lang]), dtype=np.int32)
                    for lang in langs}
            frames.append(pd.DataFrame({"split": split,
                                        "row": np.arange(start, start + n, dtype=np.int64),
                                        **cols}))
            start += n
            if progress:
                progress(n)
    df = pd.concat(frames, ignore_index=True)
    df["split"] = pd.Categorical(df["split"], categories=list(SPLITS))
    return df


def write_lengths(df: pd.DataFrame, path: str | Path) -> None:
    with atomic_path(path) as tmp:
        df.to_parquet(tmp, index=False, compression="zstd")


def read_lengths(path: str | Path) -> pd.DataFrame:
    from aiayn.errors import DataError

    path = Path(path)
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

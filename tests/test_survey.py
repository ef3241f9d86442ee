"""Length survey against brute-force recomputation."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from aiayn.config import Cleaning, LocalSource, SplitNames
from aiayn.corpus import LocalPairs, write_raw_splits
from aiayn.survey import histogram, plot_histogram, summarize, survey_lengths
from aiayn.tokenizer import train_bpe
from tests.conftest import SENTENCES_DE, SENTENCES_EN


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tests.conftest import write_parallel

    root = tmp_path_factory.mktemp("survey")
    rng = np.random.default_rng(0)
    words = "the a house small big dog cat runs sees because of in on over".split()
    en = [" ".join(rng.choice(words, size=rng.integers(1, 30))) for _ in range(300)]
    de = [" ".join(rng.choice(words, size=rng.integers(1, 30))) + " ß" for _ in range(300)]
    write_parallel(root / "c", "train", en, de)
    write_parallel(root / "c", "valid", SENTENCES_EN, SENTENCES_DE)
    write_parallel(root / "c", "test", SENTENCES_EN[:2], SENTENCES_DE[:2])
    src = LocalPairs(LocalSource(dir=str(root / "c"), splits=SplitNames(valid="valid")),
                     ("en", "de"))
    write_raw_splits(src, ("en", "de"), Cleaning(max_ratio=100), root / "raw")
    tok = train_bpe(iter(en + de), 300, 1)
    return root, tok, en, de


def test_lengths_match_direct_encoding(setup):
    root, tok, en, de = setup
    df = survey_lengths(tok, root / "raw", ["en", "de"])
    train = df[df["split"] == "train"]
    assert list(train["row"]) == list(range(300))
    assert list(train["en"]) == [len(tok.encode(s, add_special_tokens=False).ids) for s in en]
    assert list(train["de"]) == [len(tok.encode(s, add_special_tokens=False).ids) for s in de]
    assert (df["split"] == "valid").sum() == len(SENTENCES_EN)
    assert list(df["split"].cat.categories) == ["train", "valid", "test"]


def test_summary_against_numpy_and_brute_force(setup):
    root, tok, en, de = setup
    df = survey_lengths(tok, root / "raw", ["en", "de"])
    s = summarize(df, ["en", "de"], [5, 10, 1000])
    train = df[df["split"] == "train"]
    assert s["splits"]["train"]["pairs"] == 300
    expected_p95 = np.percentile(train["de"], 95)
    assert s["splits"]["train"]["de"]["p95"] == pytest.approx(expected_p95, abs=0.005)
    assert s["splits"]["train"]["en"]["max"] == train["en"].max()
    for limit in (5, 10, 1000):
        pairs = zip(train["en"], train["de"], strict=True)
        expected = sum(1 for a, b in pairs if a > limit or b > limit)
        assert s["max_len_drops"][str(limit)]["pairs"] == expected
    assert s["max_len_drops"]["1000"]["pairs"] == 0


def test_histogram_counts_every_pair(setup, tmp_path):
    root, tok, _, _ = setup
    df = survey_lengths(tok, root / "raw", ["en", "de"])
    hist = histogram(df, ["en", "de"], bins=12)
    assert hist["en"].sum() == hist["de"].sum() == 300
    assert hist["length"].is_monotonic_increasing
    plot_histogram(hist, ["en", "de"], tmp_path / "h.png", "t")
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_histogram_bins_cover_the_longest_sentence():
    df = pd.DataFrame({"split": ["train"] * 3, "row": [0, 1, 2], "en": [1, 2, 97],
                       "de": [3, 3, 3]})
    hist = histogram(df, ["en", "de"], bins=10)
    assert hist["en"].sum() == 3 and hist["en"].iloc[-1] == 1

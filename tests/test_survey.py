"""Length survey and its token ids against brute-force recomputation."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import yaml
from typer.testing import CliRunner

import aiayn.data.survey as survey
from aiayn.config import SPLITS, Cleaning, LocalSource, SplitNames
from aiayn.data.corpus import LocalPairs, write_raw_splits
from aiayn.data.survey import histogram, plot_histogram, summarize, survey_lengths
from aiayn.data.tokenizer import save_tokenizer, train_bpe
from aiayn.errors import DataError
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
    save_tokenizer(tok, root / "tokenizer.json")
    return root, tok, en, de


def tree_digest(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


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


# --------------------------------------------------------------------------- the survey folder


def test_survey_folder_ids_match_direct_encoding(setup, tmp_path):
    """Every sentence of every split: its slice of ids/{split}.{lang}.npy is tok.encode()."""
    from aiayn.io import file_sha256

    root, tok, _, _ = setup
    out = tmp_path / "survey"
    df = survey.build_survey(root / "tokenizer.json", root / "raw", ["en", "de"], out)
    assert sorted(p.name for p in out.iterdir()) == ["ids", "lengths.parquet", "meta.json"]
    on_disk = survey.read_lengths(out)
    pd.testing.assert_frame_equal(on_disk, df)
    pd.testing.assert_frame_equal(df, survey_lengths(tok, root / "raw", ["en", "de"]))
    meta = json.loads((out / "meta.json").read_text())
    assert meta["vocab_size"] == tok.get_vocab_size() and meta["dtype"] == "uint16"
    assert meta["languages"] == ["en", "de"]
    assert meta["tokenizer_sha256"] == file_sha256(root / "tokenizer.json")
    for split in SPLITS:
        part = df[df["split"] == split]
        assert meta["splits"][split]["rows"] == len(part)
        for lang in ("en", "de"):
            texts = pq.read_table(root / "raw" / f"{split}.parquet")[lang].to_pylist()
            flat = np.load(survey.ids_path(out, split, lang), mmap_mode="r")
            assert flat.dtype == np.uint16 and flat.ndim == 1
            lengths = part[lang].to_numpy()
            offsets = survey.sentence_offsets(lengths)
            assert offsets[-1] == flat.size == meta["splits"][split]["tokens"][lang]
            assert len(texts) == len(lengths)
            for i, text in enumerate(texts):
                want = tok.encode(text, add_special_tokens=False).ids
                assert flat[offsets[i]:offsets[i + 1]].tolist() == want, (split, lang, i)


def test_crash_mid_survey_keeps_previous_output(setup, tmp_path, monkeypatch):
    root, _, _, _ = setup
    out = tmp_path / "survey"
    survey.build_survey(root / "tokenizer.json", root / "raw", ["en", "de"], out)
    before = tree_digest(out)
    calls = {"n": 0}
    real = survey.encode

    def flaky(tok, texts):
        calls["n"] += 1
        if calls["n"] == 3:  # train is written, valid half way
            raise RuntimeError("disk on fire")
        return real(tok, texts)

    monkeypatch.setattr(survey, "encode", flaky)
    with pytest.raises(RuntimeError, match="disk on fire"):
        survey.build_survey(root / "tokenizer.json", root / "raw", ["de", "en"], out)
    assert tree_digest(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["survey"], "no temporary folder left"


def test_missing_language_is_refused_before_any_work(setup, tmp_path):
    root, _, _, _ = setup
    with pytest.raises(DataError, match=r"train\.parquet: no column 'fr'.*data\.src_lang"):
        survey.build_survey(root / "tokenizer.json", root / "raw", ["en", "fr"],
                            tmp_path / "survey")
    assert not (tmp_path / "survey").exists()


def test_flat_ids_writer_with_a_header_that_grows(tmp_path, monkeypatch):
    """If the final .npy header ever needed more bytes, the body moves behind it intact."""
    real = survey._npy_header
    monkeypatch.setattr(survey, "_npy_header",
                        lambda dtype, size: b"x" * 64 if size == 0 else real(dtype, size))
    writer = survey.FlatIdsWriter(tmp_path / "a.npy", np.dtype(np.uint16))
    writer.append(np.array([3, 0, 1]), [5, 6, 7, 65535])
    writer.append(np.array([2]), iter([1, 2]))
    writer.close()
    assert np.load(tmp_path / "a.npy").tolist() == [5, 6, 7, 65535, 1, 2]
    assert [p.name for p in tmp_path.iterdir()] == ["a.npy"]


def test_stage_command_writes_the_folder_and_metrics(setup, tmp_path):
    from stages.survey import app

    root, _, _, _ = setup
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"data": {"source": "toy", "src_lang": "de",
                                               "tgt_lang": "en"},
                                      "survey": {"max_len_candidates": [8, 16], "bins": 10}}))
    result = CliRunner().invoke(app, [
        "--params", str(params), "--raw", str(root / "raw"),
        "--tokenizer", str(root / "tokenizer.json"), "--out", str(tmp_path / "survey"),
        "--metrics", str(tmp_path / "survey.json"), "--plot-data", str(tmp_path / "h.csv"),
        "--plot-image", str(tmp_path / "h.png")])
    assert result.exit_code == 0, result.output
    metrics = json.loads((tmp_path / "survey.json").read_text())
    assert metrics["splits"]["train"]["pairs"] == 300 and set(metrics["max_len_drops"]) == {
        "8", "16"}
    assert (tmp_path / "survey" / "ids" / "test.de.npy").is_file()
    meta = json.loads((tmp_path / "survey" / "meta.json").read_text())
    assert meta["languages"] == ["de", "en"]

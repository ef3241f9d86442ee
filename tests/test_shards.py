"""The shard stage: planning from lengths, packing survey ids to memory-mapped shards, crash
safety, and refusing a survey that does not fit (other tokenizer, stale lengths or ids)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from typer.testing import CliRunner

import aiayn.data.shards as shards
import aiayn.data.survey as survey
from aiayn.config import SPLITS, ShardConfig
from aiayn.data.sampler import ShardDataset
from aiayn.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, decode, save_tokenizer, train_bpe
from aiayn.errors import DataError

CFG = ShardConfig(max_tokens=120, max_len=40, shard_tokens=1500)
SPLIT_PAIRS = {"train": 700, "valid": 90, "test": 90}
WORDS_EN = ["the", "house", "is", "small", "green", "dog", "runs", "quickly", "over", "a",
            "bridge", "and", "river", "cat", "sleeps", "\"quoted\"", "well-known", "why?"]
WORDS_DE = ["das", "Haus", "ist", "klein", "grün", "Hund", "läuft", "schnell", "über", "eine",
            "Brücke", "und", "Fluss", "Katze", "schläft", "„zitiert“", "wohlbekannt", "warum?"]


# --------------------------------------------------------------------------- fixtures


def make_pairs(n: int, seed: int) -> tuple[list[str], list[str]]:
    """Word salad with German about 1.2x the English length; 1 in 12 pairs is very long."""
    rng = np.random.default_rng(seed)
    en, de = [], []
    for i in range(n):
        words = int(rng.integers(1, 60 if i % 12 == 0 else 18))
        en.append(" ".join(rng.choice(WORDS_EN, words)))
        extra = int(rng.integers(0, max(2, words // 3)))
        sep = "  " if i % 7 == 0 else " "  # odd whitespace must survive the round trip
        de.append(sep.join(rng.choice(WORDS_DE, words + extra)))
    return en, de


def write_raw(raw: Path) -> None:
    raw.mkdir(parents=True, exist_ok=True)
    for k, split in enumerate(SPLITS):
        en, de = make_pairs(SPLIT_PAIRS[split], seed=k)
        # row groups of 64 rows: the stage must stream across many batches
        pq.write_table(pa.table({"de": de, "en": en}), raw / f"{split}.parquet", row_group_size=64)


def raw_texts(raw: Path, split: str, lang: str) -> list[str]:
    return pq.read_table(raw / f"{split}.parquet", columns=[lang])[lang].to_pylist()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    raw = root / "raw"
    write_raw(raw)
    texts = [t for lang in ("en", "de") for t in raw_texts(raw, "train", lang)]
    tok = train_bpe(texts, vocab_size=400, min_frequency=2)
    save_tokenizer(tok, root / "tokenizer.json")
    survey.build_survey(root / "tokenizer.json", raw, ("en", "de"), root / "survey")
    return {"root": root, "raw": raw, "tok": tok, "tokenizer": root / "tokenizer.json",
            "survey": root / "survey"}


def build(corpus, out: Path, cfg: ShardConfig = CFG, splits=SPLITS, survey_dir=None,
          tokenizer=None, langs=("en", "de"), fill_chunk: int = shards.FILL_CHUNK) -> dict:
    return shards.build_shards(survey_dir or corpus["survey"], tokenizer or corpus["tokenizer"],
                               out, cfg, *langs, splits=splits, fill_chunk=fill_chunk)


def copy_survey(corpus, tmp_path: Path) -> Path:
    """A private copy of the survey folder, to damage."""
    return Path(shutil.copytree(corpus["survey"], tmp_path / "survey"))


@pytest.fixture(scope="module")
def built(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("built") / "shards"
    return {"out": out, "metrics": build(corpus, out)}


def load_split(folder: Path) -> dict:
    """Everything of a split folder as plain arrays, read without aiayn.data.sampler."""
    meta = json.loads((folder / "meta.json").read_text())
    parts = {}
    for s in meta["shards"]:
        parts[s["name"]] = {p: np.load(folder / f"{s['name']}.{p}.npy")
                            for p in ("src", "tgt", "src_offsets", "tgt_offsets")}
    return {"meta": meta, "shards": parts, "rows": np.load(folder / "rows.npy"),
            "batches": np.load(folder / "batches.npy")}


def stored_pairs(split: dict):
    """(raw row, src ids, tgt ids) of every stored pair, in stored order."""
    for entry in split["meta"]["shards"]:
        part = split["shards"][entry["name"]]
        so, to = part["src_offsets"], part["tgt_offsets"]
        for r in range(entry["pairs"]):
            row = int(split["rows"][entry["first_pair"] + r])
            yield row, part["src"][so[r]:so[r + 1]], part["tgt"][to[r]:to[r + 1]]


def batch_lengths(split: dict):
    """(source costs, target costs) of each batch: len(src)+1 and len(tgt)+1 per pair."""
    for shard_id, start, end in split["batches"].tolist():
        part = split["shards"][split["meta"]["shards"][shard_id]["name"]]
        src = np.diff(part["src_offsets"][start:end + 1])
        tgt = np.diff(part["tgt_offsets"][start:end + 1]) - 1
        yield src, tgt


def tree_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------- the build


@pytest.mark.parametrize("split", SPLITS)
def test_every_kept_pair_round_trips_once(corpus, built, split):
    tok = corpus["tok"]
    en, de = raw_texts(corpus["raw"], split, "en"), raw_texts(corpus["raw"], split, "de")
    n_en = [len(tok.encode(t, add_special_tokens=False).ids) for t in en]
    n_de = [len(tok.encode(t, add_special_tokens=False).ids) for t in de]
    expected_kept = {i for i in range(len(en)) if max(n_en[i], n_de[i]) <= CFG.max_len}
    data = load_split(built["out"] / split)
    seen = []
    for row, src, tgt in stored_pairs(data):
        seen.append(row)
        assert src[-1] == EOS_ID and tgt[0] == BOS_ID and tgt[-1] == EOS_ID
        assert decode(tok, src) == en[row]
        assert decode(tok, tgt) == de[row]
        assert len(src) == n_en[row] + 1 and len(tgt) == n_de[row] + 2
    assert len(seen) == len(set(seen)) == len(expected_kept)
    assert set(seen) == expected_kept
    assert data["meta"]["dropped_over_max_len"] == len(en) - len(expected_kept)
    assert built["metrics"][split]["dropped_over_max_len"] == len(en) - len(expected_kept) > 0


def test_batches_respect_budget_and_tile_the_shards(built):
    data = load_split(built["out"] / "train")
    for src, tgt in batch_lengths(data):
        assert len(src) * src.max() <= CFG.max_tokens
        assert len(src) * tgt.max() <= CFG.max_tokens
    # batches cover each shard's rows 0..pairs-1 contiguously, in order
    for k, entry in enumerate(data["meta"]["shards"]):
        mine = data["batches"][data["batches"][:, 0] == k]
        assert mine[0, 1] == 0 and mine[-1, 2] == entry["pairs"]
        assert np.array_equal(mine[1:, 1], mine[:-1, 2])
        assert (mine[:, 2] > mine[:, 1]).all()
    assert len(data["meta"]["shards"]) >= 3, "small shard_tokens must give several shards"


def test_pairs_are_sorted_and_shards_bounded(built):
    data = load_split(built["out"] / "train")
    keys = [(len(s), len(t), row) for row, s, t in stored_pairs(data)]
    assert keys == sorted(keys)  # by source, then target length; ties in raw order
    for entry in data["meta"]["shards"]:
        if entry["batches"] > 1:
            assert entry["src_tokens"] + entry["tgt_tokens"] <= CFG.shard_tokens


def test_dtype_and_meta(built, corpus):
    meta = json.loads((built["out"] / "valid" / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == corpus["tok"].get_vocab_size()
    assert (meta["pad_id"], meta["bos_id"], meta["eos_id"]) == (PAD_ID, BOS_ID, EOS_ID)
    assert (meta["src_lang"], meta["tgt_lang"], meta["split"]) == ("en", "de", "valid")
    assert meta["max_tokens"] == CFG.max_tokens and meta["max_len"] == CFG.max_len
    assert np.load(built["out"] / "valid" / "shard-00000.src.npy").dtype == np.uint16
    assert survey.token_dtype(65535) == np.uint16 and survey.token_dtype(65536) == np.uint32


@pytest.mark.parametrize("split", SPLITS)
def test_metrics_match_brute_force(built, split):
    data = load_split(built["out"] / split)
    real = pad = n_pairs = 0
    src_tokens = tgt_tokens = 0
    for src, tgt in batch_lengths(data):
        for side in (src, tgt):
            padded = np.zeros((len(side), side.max()), dtype=bool)
            for i, n in enumerate(side):
                padded[i, :n] = True
            real += padded.sum()
            pad += (~padded).sum()
        src_tokens += src.sum()
        tgt_tokens += tgt.sum()
        n_pairs += len(src)
    m = built["metrics"][split]
    assert m["padding_tokens"] == pad
    assert m["padding_ratio"] == pytest.approx(pad / (pad + real))
    assert (m["source_tokens"], m["target_tokens"]) == (src_tokens, tgt_tokens)
    assert m["pairs"] == n_pairs == len(data["rows"])
    assert m["batches"] == len(data["batches"])
    assert m["mean_pairs_per_batch"] == pytest.approx(n_pairs / len(data["batches"]))
    assert m["shards"] == len(data["meta"]["shards"])


def test_reader_gives_back_the_stored_pairs(built, corpus):
    """ShardDataset over a real build: every raw row once per pass, text intact."""
    tok = corpus["tok"]
    en, de = raw_texts(corpus["raw"], "train", "en"), raw_texts(corpus["raw"], "train", "de")
    ds = ShardDataset(built["out"] / "train")
    rows = []
    for i in range(ds.num_batches):
        b = ds.batch(i)
        for j, row in enumerate(b.rows.tolist()):
            rows.append(row)
            assert decode(tok, b.src[j].tolist()) == en[row]
            assert decode(tok, b.tgt_out[j].tolist()) == de[row]
    assert sorted(rows) == sorted(np.load(built["out"] / "train" / "rows.npy").tolist())


def test_build_is_deterministic(corpus, built, tmp_path):
    build(corpus, tmp_path / "again")
    assert tree_digest(tmp_path / "again") == tree_digest(built["out"])


def test_small_gather_chunks_give_the_same_bytes(corpus, built, tmp_path):
    """Chunks that end mid-shard, mid-batch and on single pairs change nothing on disk."""
    for chunk in (1, 7):
        build(corpus, tmp_path / f"chunk-{chunk}", fill_chunk=chunk)
        assert tree_digest(tmp_path / f"chunk-{chunk}") == tree_digest(built["out"])


# --------------------------------------------------------------------------- bad input, crashes


def test_stale_lengths_are_refused(corpus, tmp_path):
    """A length that disagrees with the ids: the ids file no longer sums up."""
    stale = copy_survey(corpus, tmp_path)
    df = pd.read_parquet(stale / "lengths.parquet")
    df.loc[(df["split"] == "valid") & (df["row"] == 3), "de"] += 1
    df.to_parquet(stale / "lengths.parquet", index=False)
    with pytest.raises(DataError, match=r"valid\.de\.npy: holds \d+ token ids but column 'de' "
                                        r"of split 'valid'.*sums to.*stale.*aiayn survey"):
        build(corpus, tmp_path / "out", survey_dir=stale)
    assert not (tmp_path / "out").exists()


def test_truncated_ids_are_refused(corpus, tmp_path):
    damaged = copy_survey(corpus, tmp_path)
    path = survey.ids_path(damaged, "train", "en")
    ids = np.load(path)
    np.save(path, ids[:-1])
    with pytest.raises(DataError, match=r"train\.en\.npy: holds \d+ token ids.*aiayn survey"):
        build(corpus, tmp_path / "out", survey_dir=damaged)
    np.save(path, ids.astype(np.uint32))
    with pytest.raises(DataError, match=r"train\.en\.npy: holds uint32.*expected 1-D uint16"):
        build(corpus, tmp_path / "out", survey_dir=damaged)
    np.save(path, np.full_like(ids, 9999))
    with pytest.raises(DataError, match=r"train\.en\.npy: holds token id 9999, over the "
                                        r"vocabulary of 400.*aiayn survey"):
        build(corpus, tmp_path / "out", survey_dir=damaged)
    path.unlink()
    with pytest.raises(DataError, match=r"train\.en\.npy: missing.*aiayn survey"):
        build(corpus, tmp_path / "out", survey_dir=damaged)
    assert not (tmp_path / "out").exists()


def test_lengths_with_wrong_row_count_are_refused(corpus, tmp_path):
    short = copy_survey(corpus, tmp_path)
    df = pd.read_parquet(short / "lengths.parquet")
    df[~((df["split"] == "test") & (df["row"] == 0))].to_parquet(short / "lengths.parquet",
                                                                 index=False)
    with pytest.raises(DataError, match=r"'row' of split 'test' covers 89 rows but meta\.json "
                                        r"says 90.*aiayn survey"):
        build(corpus, tmp_path / "out", survey_dir=short)


def test_another_tokenizer_is_refused(corpus, tmp_path):
    """Same vocabulary size or not: ids from another tokenizer must not be packed."""
    texts = [t for lang in ("de", "en") for t in raw_texts(corpus["raw"], "valid", lang)]
    for size in (300, 400):
        other = tmp_path / f"other-{size}.json"
        save_tokenizer(train_bpe(texts, vocab_size=size, min_frequency=1), other)
        with pytest.raises(DataError, match=r"survey/meta\.json: the survey's token ids were "
                                            r"made with a tokenizer of 400 tokens .* but "
                                            rf".*other-{size}\.json has \d+ tokens .*another "
                                            r"tokenizer, re-run `aiayn survey`"):
            build(corpus, tmp_path / "out", tokenizer=other)
    assert not (tmp_path / "out").exists()


def test_unknown_language_is_refused(corpus, tmp_path):
    with pytest.raises(DataError, match=r"meta\.json: no language 'fr' surveyed.*"
                                        r"data\.src_lang"):
        build(corpus, tmp_path / "out", langs=("en", "fr"))


def test_missing_survey_is_refused(corpus, tmp_path):
    with pytest.raises(DataError, match=r"missing/meta\.json: missing.*aiayn survey"):
        build(corpus, tmp_path / "out", survey_dir=tmp_path / "missing")
    partial = copy_survey(corpus, tmp_path)
    (partial / "lengths.parquet").unlink()
    with pytest.raises(DataError, match=r"lengths\.parquet: missing.*aiayn survey"):
        build(corpus, tmp_path / "out", survey_dir=partial)


def test_crash_mid_build_keeps_previous_output(corpus, tmp_path, monkeypatch):
    out = tmp_path / "shards"
    build(corpus, out, splits=("valid",))
    before = tree_digest(out)
    calls = {"n": 0}
    real = shards.gather

    def flaky(*args):
        calls["n"] += 1
        if calls["n"] == 3:  # train's first chunks are already written to the memmaps
            raise RuntimeError("disk on fire")
        return real(*args)

    monkeypatch.setattr(shards, "gather", flaky)
    with pytest.raises(RuntimeError, match="disk on fire"):
        build(corpus, out, fill_chunk=32)
    assert tree_digest(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["shards"], "no temporary folder left"


def test_stage_command_writes_metrics_and_reports_bad_input(corpus, tmp_path):
    from stages.shard import app

    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({
        "data": {"source": "toy", "src_lang": "de", "tgt_lang": "en"},
        "shard": {"max_tokens": 200, "max_len": 50, "shard_tokens": 100_000},
    }))
    args = ["--params", str(params), "--vocab", str(corpus["tokenizer"]),
            "--survey", str(corpus["survey"]), "--out", str(tmp_path / "shards"),
            "--metrics", str(tmp_path / "shard.json")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    metrics = json.loads((tmp_path / "shard.json").read_text())
    assert set(metrics["splits"]) == set(SPLITS)
    meta = json.loads((tmp_path / "shards" / "test" / "meta.json").read_text())
    assert (meta["src_lang"], meta["tgt_lang"]) == ("de", "en")
    assert metrics["splits"]["test"]["pairs"] == meta["num_pairs"]

    bad = CliRunner().invoke(app, [*args[:4], "--survey", str(tmp_path / "nope"), *args[6:]])
    assert bad.exit_code == 2
    assert "meta.json: missing" in bad.output and "nope" in bad.output


# --------------------------------------------------------------------------- planning alone


def brute_force_batches(src_cost, tgt_cost, max_tokens):
    """Reference greedy cut, written the slow obvious way."""
    batches, current = [], []
    for i in range(len(src_cost)):
        trial = current + [i]
        fits = all(len(trial) * max(c[j] for j in trial) <= max_tokens
                   for c in (src_cost, tgt_cost))
        if current and not fits:
            batches.append(current)
            trial = [i]
        current = trial
    if current:
        batches.append(current)
    return [b[0] for b in batches] + [len(src_cost)]


def test_cut_batches_matches_reference():
    rng = np.random.default_rng(5)
    s = np.sort(rng.integers(1, 30, 300))
    t = rng.integers(1, 30, 300)
    got = shards.cut_batches(s, t, 64)
    assert got.tolist() == brute_force_batches(s.tolist(), t.tolist(), 64)


def test_cut_shards_never_splits_batches():
    assert shards.cut_shards(np.array([4, 4, 4, 9, 1, 1]), 8).tolist() == [0, 2, 3, 4, 6]
    assert shards.cut_shards(np.array([], dtype=np.int64), 8).tolist() == [0]


def test_plan_drops_sorts_and_is_stable():
    src = np.array([5, 50, 3, 5, 3, 7])
    tgt = np.array([2, 1, 9, 2, 1, 70])
    plan = shards.plan_split(src, tgt, max_tokens=100, max_len=40, shard_tokens=1000)
    assert plan.dropped == 2
    assert plan.order.tolist() == [4, 2, 0, 3]  # (3,1) (3,9) (5,2) (5,2): ties keep row order


def wmt_like_lengths(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """WMT14 En-De-like BPE lengths: lognormal source (median 25), target ~1.1x +- noise."""
    rng = np.random.default_rng(seed)
    src = np.maximum(1, np.round(rng.lognormal(np.log(25), 0.6, n))).astype(np.int64)
    tgt = np.maximum(1, np.round(1.1 * src + rng.normal(0, 3, n))).astype(np.int64)
    return src, tgt


def test_padding_under_ten_percent_on_wmt_like_lengths():
    src, tgt = wmt_like_lengths(200_000)
    plan = shards.plan_split(src, tgt, max_tokens=25_000, max_len=256, shard_tokens=10**9)
    stats = shards.padding_stats(plan)
    print(f"WMT-like 200k pairs, max_tokens 25000: padding ratio {stats['padding_ratio']:.4f}, "
          f"{plan.num_batches} batches of {stats['mean_pairs_per_batch']:.0f} pairs")
    assert stats["padding_ratio"] < 0.10
    sizes = np.diff(plan.batch_bounds)
    starts = plan.batch_bounds[:-1]
    for lengths in (plan.src_len + 1, plan.tgt_len + 1):
        assert (sizes * np.maximum.reduceat(lengths, starts) <= 25_000).all()
    assert plan.num_pairs + plan.dropped == src.size
    assert plan.dropped == int(((src > 256) | (tgt > 256)).sum())

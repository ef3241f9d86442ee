"""Corpus sources, cleaning and the raw split files, including every kind of bad input."""

from __future__ import annotations

import gzip
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from aiayn.config import Cleaning, HubSource, LocalSource, SplitNames
from aiayn.data.corpus import (
    HubPairs,
    LocalPairs,
    SplitStats,
    clean_batch,
    iter_raw,
    write_raw_splits,
)
from aiayn.errors import DataError
from tests.conftest import REPO, SENTENCES_DE, SENTENCES_EN, make_fake_hub, write_parallel

LANGS = ("en", "de")
SPLITS_PLAIN = SplitNames(train="train", valid="valid", test="test")


def local(folder: Path, pattern: str = "{split}.{lang}") -> LocalPairs:
    return LocalPairs(LocalSource(dir=str(folder), pattern=pattern, splits=SPLITS_PLAIN), LANGS)


def read_split(out: Path, split: str) -> dict[str, list[str]]:
    table = pq.read_table(out / f"{split}.parquet")
    return {name: table.column(name).to_pylist() for name in table.column_names}


def test_local_source_round_trip(local_corpus, tmp_path):
    out = tmp_path / "raw"
    stats = write_raw_splits(local(local_corpus), LANGS, Cleaning(), out)
    train = read_split(out, "train")
    assert train["en"] == SENTENCES_EN * 5 and train["de"] == SENTENCES_DE * 5
    assert read_split(out, "test")["de"] == SENTENCES_DE[3:]
    assert stats["train"].kept == stats["train"].read == 30
    assert sorted(p.name for p in out.iterdir()) == ["test.parquet", "train.parquet",
                                                     "valid.parquet"]


def test_gzipped_files(tmp_path):
    folder = tmp_path / "gz"
    for split in ("train", "valid", "test"):
        for lang, lines in (("en", SENTENCES_EN), ("de", SENTENCES_DE)):
            folder.mkdir(exist_ok=True)
            with gzip.open(folder / f"{split}.{lang}.gz", "wt", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")
    out = tmp_path / "raw"
    write_raw_splits(local(folder, "{split}.{lang}.gz"), LANGS, Cleaning(), out)
    assert read_split(out, "valid")["en"] == SENTENCES_EN


def test_cleaning_counts_every_drop_by_reason():
    batch = {
        "en": ["  ok pair  ", "", "a b c d e f", "one two", "fine", "x " * 11, "y"],
        "de": ["gutes Paar", "leer", "a", "eins zwei", "   ", "x", "y " * 12],
    }
    stats = SplitStats()
    out = clean_batch(batch, LANGS, Cleaning(max_words=10, max_ratio=3.0), stats)
    # Expected by hand: two empties, "a b c d e f"/"a" is 6:1 > 3, "x "*11 has 11 > 10 words,
    # "y"/"y "*12 has 12 > 10 words.
    assert out == {"en": ["ok pair", "one two"], "de": ["gutes Paar", "eins zwei"]}
    assert stats.read == 7 and stats.kept == 2
    assert stats.dropped == {"empty": 2, "length_ratio": 1, "too_long": 2}


def test_valid_and_test_keep_all_but_empty_pairs(tmp_path):
    folder = tmp_path / "c"
    long_en = " ".join(["word"] * 300)
    write_parallel(folder, "train", ["short", long_en, "a b c d e f g h"], ["kurz", "lang", "a"])
    write_parallel(folder, "valid", ["short", long_en, ""], ["kurz", "lang", "leer"])
    write_parallel(folder, "test", ["a b c d e f g h"], ["a"])
    stats = write_raw_splits(local(folder), LANGS, Cleaning(), tmp_path / "raw")
    assert stats["train"].as_dict() == {"read": 3, "kept": 1,
                                        "dropped": {"length_ratio": 1, "too_long": 1}}
    assert stats["valid"].as_dict() == {"read": 3, "kept": 2, "dropped": {"empty": 1}}
    assert read_split(tmp_path / "raw", "test")["de"] == ["a"]


def previous_output(tmp_path: Path) -> Path:
    out = tmp_path / "raw"
    out.mkdir()
    (out / "train.parquet").write_text("previous run")
    return out


def assert_untouched(out: Path) -> None:
    assert [p.name for p in out.iterdir()] == ["train.parquet"]
    assert (out / "train.parquet").read_text() == "previous run"
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".raw")]


def test_different_line_counts_name_the_files(tmp_path):
    folder = tmp_path / "c"
    write_parallel(folder, "train", SENTENCES_EN, SENTENCES_DE)
    write_parallel(folder, "valid", SENTENCES_EN, SENTENCES_DE[:4])
    write_parallel(folder, "test", SENTENCES_EN, SENTENCES_DE)
    out = previous_output(tmp_path)
    with pytest.raises(DataError) as err:
        write_raw_splits(local(folder), LANGS, Cleaning(), out)
    assert f"{folder / 'valid.de'} has 4 lines" in str(err.value)
    assert "same number of lines" in str(err.value)
    assert_untouched(out)


def test_invalid_utf8_names_file_and_line(tmp_path):
    folder = tmp_path / "c"
    write_parallel(folder, "train", SENTENCES_EN, SENTENCES_DE)
    write_parallel(folder, "valid", SENTENCES_EN, SENTENCES_DE)
    write_parallel(folder, "test", SENTENCES_EN, SENTENCES_DE)
    (folder / "test.de").write_bytes(b"gut\nauch gut\nGr\xf6\xdfe in Latin-1\n" + b"x\n" * 3)
    out = previous_output(tmp_path)
    with pytest.raises(DataError) as err:
        write_raw_splits(local(folder), LANGS, Cleaning(), out)
    assert f"{folder / 'test.de'}, line 3: invalid UTF-8" in str(err.value)
    assert "iconv" in str(err.value)
    assert_untouched(out)


def test_missing_file_and_folder(tmp_path, local_corpus):
    (local_corpus / "test.en").unlink()
    out = previous_output(tmp_path)
    with pytest.raises(DataError, match=r"missing parallel text file\(s\): .*test\.en"):
        write_raw_splits(local(local_corpus), LANGS, Cleaning(), out)
    assert_untouched(out)
    with pytest.raises(DataError, match="data.local.dir: folder .*nowhere does not exist"):
        local(tmp_path / "nowhere").check()


def test_relative_local_dir_in_a_queued_experiments_copy(tmp_path, monkeypatch):
    """A queued `dvc exp run` works in a copy under .dvc/tmp/exps/ and names the user's
    repository in $DVC_ROOT: a relative data.local.dir that is not in the copy is found
    beside the repository, as `dvc repro` there would find it."""
    repo, data = tmp_path / "work" / "repo", tmp_path / "work" / "shared" / "corpus"
    copy = repo / ".dvc" / "tmp" / "exps" / "tmpabc"
    copy.mkdir(parents=True)
    write_parallel(data, "train", SENTENCES_EN, SENTENCES_DE)
    write_parallel(data, "valid", SENTENCES_EN[:2], SENTENCES_DE[:2])
    write_parallel(data, "test", SENTENCES_EN[2:], SENTENCES_DE[2:])

    def source(root: Path) -> LocalPairs:
        return LocalPairs(LocalSource(dir="../shared/corpus", splits=SPLITS_PLAIN), LANGS, root)

    monkeypatch.delenv("DVC_ROOT", raising=False)
    with pytest.raises(DataError, match=r"folder .*tmpabc/\.\./shared/corpus does not exist"):
        source(copy).check()
    monkeypatch.setenv("DVC_ROOT", str(repo))
    source(copy).check()
    assert source(copy).folder.resolve() == data.resolve()
    out = tmp_path / "raw"
    write_raw_splits(source(copy), LANGS, Cleaning(), out)
    assert read_split(out, "train")["de"] == SENTENCES_DE
    # The copy's own folder wins where it has one (a corpus committed in the repository).
    inside = copy / ".." / "shared" / "corpus"
    write_parallel(inside, "train", SENTENCES_EN[:1], SENTENCES_DE[:1])
    assert source(copy).folder == copy / "../shared/corpus"
    # Neither: the error names both places it looked.
    monkeypatch.setenv("DVC_ROOT", str(tmp_path / "elsewhere"))
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(DataError, match=r"other/\.\./shared/corpus nor .*elsewhere/\.\./shared"):
        source(other).check()


def test_hub_schema_loads_through_the_hub_code_path(fake_hub, tmp_path):
    """A local copy of the hub's wmt/wmt14 layout goes through datasets.load_dataset."""
    source = HubPairs(HubSource(path=str(fake_hub), name="de-en"), LANGS)
    out = tmp_path / "raw"
    stats = write_raw_splits(source, LANGS, Cleaning(), out)
    assert read_split(out, "train")["de"] == SENTENCES_DE * 3
    assert read_split(out, "valid")["en"] == SENTENCES_EN[:2]   # hub split "validation"
    assert read_split(out, "test")["en"] == SENTENCES_EN[2:]
    assert stats["train"].kept == 18
    batches = list(iter_raw(out, "train", batch_size=7))
    assert [len(b["en"]) for b in batches] == [7, 7, 4]


def test_hub_dataset_with_one_column_per_language(tmp_path):
    """The layout of bentrevett/multi30k: {train,val,test}.jsonl with rows {"en", "de"}."""
    import json

    folder = tmp_path / "multi30k"
    folder.mkdir()
    pairs = list(zip(SENTENCES_EN, SENTENCES_DE, strict=True))
    for name, rows in (("train", pairs * 2), ("val", pairs[:2]), ("test", pairs[2:])):
        (folder / f"{name}.jsonl").write_text(
            "".join(json.dumps({"en": en, "de": de}) + "\n" for en, de in rows), "utf-8")
    source = HubPairs(HubSource(path=str(folder), name=None), LANGS)
    out = tmp_path / "raw"
    write_raw_splits(source, LANGS, Cleaning(), out)
    assert read_split(out, "train")["de"] == SENTENCES_DE * 2
    assert read_split(out, "valid")["en"] == SENTENCES_EN[:2]   # file val.jsonl
    assert read_split(out, "test")["de"] == SENTENCES_DE[2:]
    with pytest.raises(DataError, match="no 'translation' column and no column 'fr'"):
        next(HubPairs(HubSource(path=str(folder), name=None), ("fr", "en")).batches("train"))


def test_hub_rows_without_the_language(tmp_path):
    hub = make_fake_hub(tmp_path / "h", {s: [("a", "b")] for s in ("train", "validation", "test")})
    source = HubPairs(HubSource(path=str(hub), name="de-en"), ("fr", "de"))
    with pytest.raises(DataError, match="no translation.fr"):
        next(source.batches("train"))


def run_download(params: dict, tmp_path: Path, env: dict) -> subprocess.CompletedProcess:
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    return subprocess.run([sys.executable, "-m", "stages.download", "--params", "params.yaml",
                           "--out", "data/raw", "--metrics", "metrics/download.json"],
                          cwd=tmp_path, env={**env, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120)


def test_unreachable_hub_fails_fast_and_clearly(tmp_path, cli_env):
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["data"]["source"] = "hub"
    result = run_download(params, tmp_path, cli_env)
    assert result.returncode == 2
    assert "could not load 'wmt/wmt14'" in result.stderr and "HF_HUB_OFFLINE" in result.stderr
    assert "set data.source: local" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "data" / "raw").exists()
    assert not (tmp_path / "metrics" / "download.json").exists()


# --------------------------------------------------------------------------- Multi30k presets

MULTI30K_PRESETS = ("multi30k", "multi30k_rdrop", "multi30k_rdrop_half")


def multi30k_params(preset: str, *overrides: str) -> dict:
    from stages.params import compose

    return yaml.safe_load(compose(REPO / "conf", preset, list(overrides)))


def write_multi30k_hub_copy(folder: Path) -> Path:
    """A local folder laid out as the hub's bentrevett/multi30k: {train,val,test}.jsonl of
    rows {"en", "de"} and a README without configs (datasets names the splits by file)."""
    import json

    folder.mkdir(parents=True)
    pairs = list(zip(SENTENCES_EN, SENTENCES_DE, strict=True))
    for name, rows in (("train", pairs * 2), ("val", pairs[:2]), ("test", pairs[2:])):
        (folder / f"{name}.jsonl").write_text(
            "".join(json.dumps({"en": en, "de": de}) + "\n" for en, de in rows), "utf-8")
    (folder / "README.md").write_text("---\nlanguage:\n- en\n- de\n---\n# Multi30k\n")
    return folder


@pytest.mark.parametrize("preset", MULTI30K_PRESETS)
def test_the_multi30k_presets_read_the_hub_as_shipped(preset):
    data = multi30k_params(preset)["data"]
    assert data["source"] == "hub" and data["hub"]["path"] == "bentrevett/multi30k"
    assert data["hub"]["splits"] == {"train": "train", "valid": "validation", "test": "test"}
    # no preset names a folder that only this project's own machines have
    for path in (REPO / "conf").rglob("*.yaml"):
        assert "shared/data" not in path.read_text(), path


@pytest.mark.parametrize("preset", MULTI30K_PRESETS)
def test_the_multi30k_presets_download_from_a_copy_of_the_hubs_layout(preset, tmp_path,
                                                                      cli_env):
    hub = write_multi30k_hub_copy(tmp_path / "bentrevett-multi30k")
    result = run_download(multi30k_params(preset, f"data.hub.path={hub}"), tmp_path, cli_env)
    assert result.returncode == 0, result.stderr
    raw = tmp_path / "data" / "raw"
    assert read_split(raw, "train")["de"] == SENTENCES_DE * 2
    assert read_split(raw, "valid")["en"] == SENTENCES_EN[:2]  # val.jsonl
    assert read_split(raw, "test")["en"] == SENTENCES_EN[2:]


def test_without_the_hub_the_multi30k_preset_says_the_one_setting_and_it_works(tmp_path,
                                                                               cli_env):
    """Offline (HF_HUB_OFFLINE=1 in cli_env), the hub stage fails at once and its error names
    data.source: local, the folder and the file names; that one setting then reads the
    corpus's own text files from that folder, next to params.yaml."""
    result = run_download(multi30k_params("multi30k"), tmp_path, cli_env)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    said = " ".join(result.stderr.split())
    assert "could not load 'bentrevett/multi30k'" in said
    assert "set data.source: local (`dvc exp run -S data.source=local`" in said
    assert ("the files train.en, train.de, val.en, val.de, test2016.en, test2016.de in the "
            "folder data/multi30k") in said
    assert not (tmp_path / "data" / "raw").exists()
    folder = tmp_path / "data" / "multi30k"
    write_parallel(folder, "train", SENTENCES_EN, SENTENCES_DE)
    write_parallel(folder, "val", SENTENCES_EN[:2], SENTENCES_DE[:2])
    write_parallel(folder, "test2016", SENTENCES_EN[2:], SENTENCES_DE[2:])
    result = run_download(multi30k_params("multi30k", "data.source=local"), tmp_path, cli_env)
    assert result.returncode == 0, result.stderr
    assert read_split(tmp_path / "data" / "raw", "test")["de"] == SENTENCES_DE[2:]


def test_download_stage_on_a_local_folder(tmp_path, local_corpus, cli_env):
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["data"]["source"] = "local"
    params["data"]["local"] = {"dir": str(local_corpus), "pattern": "{split}.{lang}",
                               "splits": {"train": "train", "valid": "valid", "test": "test"}}
    result = run_download(params, tmp_path, cli_env)
    assert result.returncode == 0, result.stderr
    metrics = yaml.safe_load((tmp_path / "metrics" / "download.json").read_text())
    assert metrics["splits"]["train"] == {"read": 30, "kept": 30, "dropped": {}}
    assert read_split(tmp_path / "data" / "raw", "valid")["de"] == SENTENCES_DE[:3]


def test_a_byte_order_mark_is_not_part_of_the_first_sentence(tmp_path):
    folder = tmp_path / "c"
    write_parallel(folder, "train", SENTENCES_EN, SENTENCES_DE)
    write_parallel(folder, "valid", SENTENCES_EN, SENTENCES_DE)
    write_parallel(folder, "test", SENTENCES_EN, SENTENCES_DE)
    for name in ("train.en", "valid.de"):
        (folder / name).write_bytes(b"\xef\xbb\xbf" + (folder / name).read_bytes())
    gz = tmp_path / "gz"
    gz.mkdir()
    for path in folder.iterdir():
        (gz / f"{path.name}.gz").write_bytes(gzip.compress(path.read_bytes()))
    for source, out in ((local(folder), tmp_path / "raw"),
                        (local(gz, "{split}.{lang}.gz"), tmp_path / "raw_gz")):
        write_raw_splits(source, LANGS, Cleaning(), out)
        assert read_split(out, "train")["en"] == SENTENCES_EN
        assert read_split(out, "valid")["de"] == SENTENCES_DE


@pytest.mark.parametrize("damage", ["truncated", "plain text", "corrupt"])
def test_an_unreadable_gz_names_the_file(tmp_path, damage):
    folder = tmp_path / "gz"
    folder.mkdir()
    for split in ("train", "valid", "test"):
        for lang, lines in (("en", SENTENCES_EN * 40), ("de", SENTENCES_DE * 40)):
            (folder / f"{split}.{lang}.gz").write_bytes(
                gzip.compress(("\n".join(lines) + "\n").encode()))
    bad = folder / "valid.de.gz"
    data = bad.read_bytes()
    bad.write_bytes({"truncated": data[:len(data) // 2], "plain text": b"plain\n" * 6,
                     "corrupt": data[:20] + b"\xff" * 40 + data[60:]}[damage])
    out = previous_output(tmp_path)
    with pytest.raises(DataError) as err:
        write_raw_splits(local(folder, "{split}.{lang}.gz"), LANGS, Cleaning(), out)
    assert str(err.value).startswith(f"{bad}: cannot be read (")
    assert "gzip -t" in str(err.value)
    assert_untouched(out)


def test_a_null_cell_in_a_hub_dataset_with_one_column_per_language(tmp_path):
    import json

    folder = tmp_path / "multi30k"
    folder.mkdir()
    rows = [{"en": en, "de": de} for en, de in zip(SENTENCES_EN, SENTENCES_DE, strict=True)]
    rows[4]["de"] = None
    for name in ("train", "val", "test"):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows),
                                              "utf-8")
    out = previous_output(tmp_path)
    with pytest.raises(DataError, match=r"row 5 has no de text \(column 'de' is null\)"):
        write_raw_splits(HubPairs(HubSource(path=str(folder), name=None), LANGS), LANGS,
                         Cleaning(), out)
    assert_untouched(out)


def write_raw(folder: Path, split: str, table) -> None:
    folder.mkdir(exist_ok=True)
    pq.write_table(table, folder / f"{split}.parquet")


def test_a_raw_split_is_checked_as_it_is_read(tmp_path):
    import pyarrow as pa

    raw = tmp_path / "raw"
    en = [f"s{i}" for i in range(10)]
    de = [f"t{i}" for i in range(10)]
    de[7] = None
    write_raw(raw, "valid", pa.table({"de": pa.array(de, pa.string()), "en": en}))
    # The row is counted over the whole file (1-based), not within its batch of 3.
    with pytest.raises(DataError, match=r"valid\.parquet, row 8: column 'de' is null"):
        list(iter_raw(raw, "valid", columns=["en", "de"], batch_size=3))
    assert [b["en"] for b in iter_raw(raw, "valid", columns=["en"], batch_size=4)] == \
        [en[:4], en[4:8], en[8:]]
    with pytest.raises(DataError, match=r"valid\.parquet: no column 'fr' \(columns: de, en\)"):
        list(iter_raw(raw, "valid", columns=["fr"]))
    write_raw(raw, "test", pa.table({"de": pa.array([1, 2], pa.int64()), "en": ["a", "b"]}))
    with pytest.raises(DataError, match=r"test\.parquet: column 'de' is int64, expected string"):
        list(iter_raw(raw, "test"))
    (raw / "train.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=r"train\.parquet: not a readable parquet file"):
        list(iter_raw(raw, "train"))
    with pytest.raises(DataError, match=r"unknown split 'tst': the raw splits are train, valid"):
        list(iter_raw(raw, "tst"))

"""bench/data_pipeline.py: the synthetic corpus checked against its own files (word counts,
bytes), its determinism and reuse, the params and stage command lines it
builds from dvc.yaml, the wrapper that measures a stage, and one full run on tiny tables
whose JSON report is checked field by field (the benchmark's sizes are never used here)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import string
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from bench import data_pipeline as dp
from tests.conftest import REPO, usage_error

PUNCT = ",:;.?!"  # what a separator can leave at the end of a whitespace token


@pytest.fixture
def tiny(monkeypatch):
    """Word tables of thousands of types instead of 500k/750k, small valid/test splits and
    chunks, so that a corpus takes well under a second; the module is put back afterwards."""
    monkeypatch.setattr(dp, "EN", dataclasses.replace(dp.EN, word_types=3000))
    monkeypatch.setattr(dp, "DE", dataclasses.replace(dp.DE, word_types=4000))
    monkeypatch.setattr(dp, "NAME_TYPES", 400)
    monkeypatch.setattr(dp, "VALID_PAIRS", 50)
    monkeypatch.setattr(dp, "TEST_PAIRS", 40)
    monkeypatch.setattr(dp, "CHUNK", 300)
    return dp


@pytest.fixture
def keep_sigterm():
    """main() installs its own SIGTERM handler; the test process gets its own back."""
    saved = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, saved)


def read_split(path: Path) -> dict[str, list[str]]:
    table = pq.read_table(path)
    return {name: table.column(name).to_pylist() for name in table.column_names}


def tokens_of(sentences: list[str]) -> list[str]:
    return [tok for s in sentences for tok in s.split(" ")]


# --------------------------------------------------------------------------- corpus model


def test_sentence_lengths_are_the_documented_lognormal_and_ratio():
    """Lengths against the constants: median 20, mean 23, 1..250, German/English ratio 0.6-1.5."""
    # English lengths: median 20, mean 23, a tail past 100, within 1..250; German = English x ratio
    # in [0.6, 1.5] with mean 0.95 (LEN_* and RATIO_*).
    en, de = dp.sentence_lengths(np.random.default_rng(0), 200_000)
    assert en.dtype.kind == "i" and de.dtype.kind == "i"
    assert int(en.min()) >= 1 and int(en.max()) <= 250
    assert int(de.min()) >= 1 and int(de.max()) <= 250
    assert np.median(en) == 20
    assert abs(en.mean() - 23.0) < 0.15  # sd ~13: the mean of 200k is within ~0.03
    assert (en > 100).mean() > 0
    # per pair, German is English x a ratio in [0.6, 1.5], rounded
    assert np.all(de >= np.maximum(1, np.rint(0.6 * en)))
    assert np.all(de <= np.minimum(250, np.rint(1.5 * en)))
    assert abs((de / en).mean() - 0.95) < 0.01
    again, _ = dp.sentence_lengths(np.random.default_rng(0), 200_000)
    assert np.array_equal(en, again)


def test_piece_table_round_trips_every_string_through_its_byte_blob():
    """Each string's blob slice decodes back to it; lower_first is exactly 'starts with a-z'."""
    # Each string is its bytes at starts[i]:starts[i] + lengths[i] of the blob (UTF-8), and
    # lower_first marks exactly the strings that start with an ASCII a-z letter.
    strings = ["the", "", "Haus", "über", "ß", "3,5", "x", "Straßenbahn-Haltestelle", "'s", "a"]
    table = dp.PieceTable(strings)
    blob = table.blob.tobytes()
    for i, s in enumerate(strings):
        start, length = int(table.starts[i]), int(table.lengths[i])
        assert blob[start:start + length].decode("utf-8") == s
        assert bool(table.lower_first[i]) == (s != "" and s[0] in string.ascii_lowercase)
    assert len(blob) == sum(len(s.encode("utf-8")) for s in strings)


def test_word_table_is_unique_case_insensitively_with_function_words_first():
    """Word table: function words first, unique case-insensitively, 40% capitalised, short first."""
    # A German table: the function words in order, then generated words; no two equal
    # case-insensitively, none taken before; ~40% of generated types capitalised (p_capital)
    # and frequent ranks shorter than rare ones (Zipf's law of abbreviation).
    spec = dataclasses.replace(dp.DE, word_types=3000)
    taken = {"haus", "die"}  # "die" is a function word: it must be skipped
    words = dp.build_word_table(np.random.default_rng(1), spec, taken)
    function = [w for w in dict.fromkeys(spec.function_words) if w != "die"]
    assert len(words) == 3000
    assert words[:len(function)] == function
    lower = [w.lower() for w in words]
    assert len(set(lower)) == 3000
    assert "haus" not in lower and "die" not in lower
    assert set(lower) <= taken  # the table's words are now taken for the next table
    generated = words[len(function):]
    assert all(w and " " not in w for w in generated)
    capital = np.mean([w[0].isupper() for w in generated])
    assert abs(capital - 0.4) < 0.06
    lengths = [len(w) for w in generated]
    assert np.mean(lengths[:500]) < np.mean(lengths[-500:])
    en = dp.build_word_table(np.random.default_rng(1), dataclasses.replace(dp.EN, word_types=800),
                             set())
    assert all(w == w.lower() for w in en)  # p_capital 0: no capitalised English type


def _piece(lang, i: int) -> str:
    p = lang.pieces
    return p.blob[p.starts[i]:p.starts[i] + p.lengths[i]].tobytes().decode("utf-8")


def test_languages_share_names_and_keep_words_names_numbers_apart(tiny):
    """Tables: shared names, words/names/numbers disjoint, numbers in each locale, seeded only."""
    # Both languages get the same names; within a language no word equals a name and no number a
    # word (case-insensitively), so each whitespace token has one source; numbers use each
    # language's format; the tables depend on the seed only.
    dp = tiny
    langs = dp.build_languages(7)
    en, de = langs["en"], langs["de"]
    names_en = [_piece(en, i) for i in range(en.name_base, en.number_base)]
    names_de = [_piece(de, i) for i in range(de.name_base, de.number_base)]
    assert names_en == names_de and len(names_en) == 400
    assert all(n[0].isupper() for n in names_en)
    number_format = {
        "en": re.compile(r"\d{1,3}(,\d{3})+|\d{1,4}|\d{1,3}\.\d|\d{1,2}%"),
        "de": re.compile(r"\d{1,3}(\.\d{3})+|\d{1,4}|\d{1,3},\d|\d{1,2}%"),
    }
    for code, lang in langs.items():
        words = [_piece(lang, i) for i in range(lang.n_words)]
        numbers = [_piece(lang, i) for i in range(lang.number_base, lang.sep_base)]
        assert lang.n_words == (3000 if code == "en" else 4000)
        low_words = {w.lower() for w in words}
        assert len(low_words) == len(words)
        assert not low_words & {n.lower() for n in names_en}
        assert len(set(numbers)) == len(numbers) and not set(numbers) & set(words)
        assert numbers[:101 + 115] == [str(i) for i in range(101)] + [
            str(y) for y in range(2014, 1899, -1)]
        assert all(number_format[code].fullmatch(n) for n in numbers), code
    again = dp.build_languages(7)
    other = dp.build_languages(8)
    for code, lang in langs.items():
        assert np.array_equal(again[code].pieces.blob, lang.pieces.blob)
        assert not np.array_equal(other[code].pieces.blob[:lang.pieces.blob.size],
                                  lang.pieces.blob[:other[code].pieces.blob.size])


def test_sampled_sentences_have_the_asked_words_from_the_tables_only(tiny):
    """Sampled sentences against counts made on the strings and the documented rates."""
    # Every sentence has exactly the asked number of space-separated tokens, each a table entry plus
    # at most one punctuation mark, capitalised when it starts the sentence; the statistics (words,
    # sentences, bytes over two calls) equal counts made on the strings; final
    # marks, commas and the rank-1 word follow the stated rates.
    dp = tiny
    lang = dp.build_languages(3)["en"]
    table = {_piece(lang, i) for i in range(lang.sep_base)}
    rng = np.random.default_rng(11)
    lengths = [dp.sentence_lengths(rng, 1500)[0], dp.sentence_lengths(rng, 700)[0]]
    sentences = []
    for n_words in lengths:
        arr = lang.sample(rng, n_words)
        got = arr.to_pylist()
        assert len(got) == n_words.size
        for s, k in zip(got, n_words.tolist(), strict=True):
            toks = s.split(" ")
            assert len(toks) == k and all(toks), s
            assert s[0] not in string.ascii_lowercase, s  # sentence starts capitalised
            for j, tok in enumerate(toks):
                assert _known(tok, table, first=j == 0), (tok, s)
        sentences += got
    all_tokens = tokens_of(sentences)
    st = lang.stats()
    assert st["sentences"] == len(sentences)
    assert st["words"] == len(all_tokens)
    assert len(all_tokens) == int(sum(x.sum() for x in lengths))
    assert st["mean_bytes_per_sentence"] == pytest.approx(
        sum(len(s.encode("utf-8")) for s in sentences) / len(sentences))
    assert st["vocabulary"]["word_types"] == 3000 and st["vocabulary"]["names"] == 400
    # sentence-final marks ".", "?", "!", ":" at 0.88, 0.04, 0.015, 0.015 (none: 0.05)
    finals = [s[-1] for s in sentences]
    for mark, p in zip(".?!:", (0.88, 0.04, 0.015, 0.015), strict=True):
        assert abs(finals.count(mark) / len(sentences) - p) < 0.025, mark
    # ", " after 4.5% of the non-final words
    inner = [tok for s in sentences for tok in s.split(" ")[:-1]]
    assert abs(sum(t.endswith(",") for t in inner) / len(inner) - 0.045) < 0.006
    # Zipf: rank 1 ("the") takes 1 / H(3000, 1.1) of the ordinary-word slots (95% of slots)
    harmonic = sum(k ** -1.1 for k in range(1, 3001))
    the = sum(tok.rstrip(PUNCT).lower() == "the" for tok in all_tokens) / len(all_tokens)
    assert abs(the - (1 - 0.02 - 0.03) / harmonic) < 0.01


def _known(tok: str, table: set[str], first: bool) -> bool:
    cands = [tok] + ([tok[:-1]] if tok[-1] in PUNCT else [])
    if first:  # the sentence's first letter may have been capitalised (ASCII only)
        cands += [c[0].lower() + c[1:] for c in cands if c and c[0] in string.ascii_uppercase]
    return any(c in table for c in cands)


def test_generated_files_and_statistics_match_what_is_on_disk(tiny, tmp_path):
    """generate_corpus's files and returned statistics against counts made on the parquet files."""
    # raw/{train,valid,test}.parquet: the asked rows in row groups of CHUNK, columns de and en as
    # zstd strings; the returned word counts, bytes per sentence and bytes on disk
    # equal counts made on the files; raw is replaced whole.
    dp = tiny
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "stale.txt").write_text("from an older corpus")
    gen = dp.generate_corpus(raw, 700, seed=5)
    assert sorted(p.name for p in raw.iterdir()) == ["test.parquet", "train.parquet",
                                                     "valid.parquet"]
    assert not (tmp_path / ".raw.tmp").exists()
    sizes = {"train": 700, "valid": 50, "test": 40}
    columns = {"en": [], "de": []}
    for split, n in sizes.items():
        pf = pq.ParquetFile(raw / f"{split}.parquet")
        assert pf.metadata.num_rows == n
        assert [pf.metadata.row_group(i).num_rows for i in range(pf.num_row_groups)] == [
            min(300, n - start) for start in range(0, n, 300)]
        assert pf.schema_arrow.names == ["de", "en"]
        assert all(str(t) == "string" for t in pf.schema_arrow.types)
        assert pf.metadata.row_group(0).column(0).compression == "ZSTD"
        data = read_split(raw / f"{split}.parquet")
        assert gen["splits"][split]["pairs"] == n
        for lang in ("en", "de"):
            assert gen["splits"][split]["words"][lang] == len(tokens_of(data[lang]))
            columns[lang] += data[lang]
    for lang, sentences in columns.items():
        st = gen["languages"][lang]
        assert st["sentences"] == sum(sizes.values())
        assert st["words"] == len(tokens_of(sentences))
        assert st["mean_bytes_per_sentence"] == pytest.approx(
            sum(len(s.encode("utf-8")) for s in sentences) / len(sentences))
    assert gen["bytes_on_disk"] == sum(p.stat().st_size for p in raw.glob("*.parquet"))


def test_corpus_depends_on_the_seed_and_valid_test_not_on_the_train_size(tiny, tmp_path):
    """Valid/test and the first train chunk do not depend on --pairs; another seed changes them."""
    # Same seed: valid and test are identical whatever --pairs is, and so is the first train chunk
    # (each chunk draws from its own seed); another seed gives other sentences.
    dp = tiny
    small, big, other = tmp_path / "a/raw", tmp_path / "b/raw", tmp_path / "c/raw"
    dp.generate_corpus(small, 300, seed=5)
    dp.generate_corpus(big, 700, seed=5)
    dp.generate_corpus(other, 300, seed=6)
    for split in ("valid", "test"):
        assert read_split(small / f"{split}.parquet") == read_split(big / f"{split}.parquet")
        assert read_split(small / f"{split}.parquet") != read_split(other / f"{split}.parquet")
    first = read_split(small / "train.parquet")
    longer = read_split(big / "train.parquet")
    assert {k: v[:300] for k, v in longer.items()} == first


# --------------------------------------------------------------------------- main: corpus


def test_a_matching_corpus_is_reused_and_any_change_regenerates_it(tiny, tmp_path, capsys,
                                                                   monkeypatch, keep_sigterm):
    """Corpus reuse against a spy on generate_corpus: same spec reused, any change regenerates."""
    # --generate-only: the first run generates and records its spec in corpus.json; the same
    # --pairs/--seed reuses it (no generation); --regenerate, another --seed or another --pairs
    # generate again; the files always hold the asked rows.
    dp = tiny
    calls = []
    real = dp.generate_corpus

    def counting(raw, pairs, seed):
        calls.append((pairs, seed))
        return real(raw, pairs, seed)

    monkeypatch.setattr(dp, "generate_corpus", counting)
    work = tmp_path / "work"
    base = ["--workdir", str(work), "--generate-only"]
    runs = [(["--pairs", "200"], [(200, 1)], False),
            (["--pairs", "200"], [], True),
            (["--pairs", "200", "--regenerate"], [(200, 1)], False),
            (["--pairs", "200", "--seed", "2"], [(200, 2)], False),
            (["--pairs", "250", "--seed", "2"], [(250, 2)], False),
            (["--pairs", "250", "--seed", "2"], [], True)]
    for args, generated, reused in runs:
        calls.clear()
        assert dp.main(args + base) == 0
        out = capsys.readouterr().out
        assert calls == generated, args
        assert ("corpus: reusing" in out) == reused, args
        marker = json.loads((work / "corpus.json").read_text())
        pairs, seed = int(args[1]), int(args[3]) if "--seed" in args else 1
        assert marker["spec"] == {"generator_version": 1, "pairs": pairs, "seed": seed,
                                  "valid_pairs": 50, "test_pairs": 40}
        assert pq.ParquetFile(work / "raw/train.parquet").metadata.num_rows == pairs
    assert not (work / "params.yaml").exists()  # --generate-only stops before the stages


def test_a_corpus_whose_files_lost_rows_is_generated_again(tiny, tmp_path, capsys,
                                                          keep_sigterm):
    """corpus.json matches the arguments but train.parquet was cut short after it was
    written: the corpus is generated again (not reused), and the files hold the asked rows."""
    dp = tiny
    work = tmp_path / "work"
    argv = ["--pairs", "200", "--workdir", str(work), "--generate-only"]
    assert dp.main(argv) == 0
    train = work / "raw" / "train.parquet"
    pq.write_table(pq.read_table(train).slice(0, 50), train)
    capsys.readouterr()
    assert dp.main(argv) == 0
    out = capsys.readouterr().out
    assert "no longer holds the pairs corpus.json records" in out and "corpus: reusing" not in out
    assert pq.ParquetFile(train).metadata.num_rows == 200


def test_check_corpus_names_the_file_whose_rows_or_columns_are_wrong(tmp_path):
    """check_corpus stops (not an assert that -O would drop) naming the file and the fix."""
    raw = tmp_path / "raw"
    raw.mkdir()
    pq.write_table(pa.table({"de": ["a", "b"], "en": ["c", "d"]}), raw / "valid.parquet")
    with pytest.raises(SystemExit, match=r"valid.parquet holds 2 pairs, not the 3 expected; "
                                         r"run again with --regenerate"):
        dp.check_corpus(raw, {"splits": {"valid": {"pairs": 3}}})
    pq.write_table(pa.table({"en": ["c", "d"]}), raw / "valid.parquet")
    with pytest.raises(SystemExit, match=r"has columns \['en'\], not \['de', 'en'\]"):
        dp.check_corpus(raw, {"splits": {"valid": {"pairs": 2}}})


def test_skip_generate_without_a_corpus_stops_with_exit_2(tmp_path, capsys, keep_sigterm):
    """--skip-generate on an empty work folder: exit 2 and a message naming the files."""
    assert dp.main(["--workdir", str(tmp_path / "empty"), "--skip-generate"]) == 2
    err = capsys.readouterr().err
    assert "--skip-generate" in err and "train/valid/test.parquet" in err


@pytest.mark.parametrize("argv, message", [
    (["--pairs", "0"], "--pairs (0) must be at least 1"),
    (["--workdir", str(REPO / "bench-out")], "inside the repository; use a folder outside it"),
    (["--stages", "vocab,bpe"], "unknown stage(s) ['bpe']; choose from ['vocab', 'survey', "
                                "'shard']"),
    (["--stages", ","], "--stages names no stage; choose from ['vocab', 'survey', 'shard']"),
])
def test_bad_arguments_stop_with_the_fix(argv, message, capsys):
    """Argument errors: argparse's exit 2 and a message saying what to pass instead."""
    assert message in usage_error(lambda: dp.parse_args(argv), capsys)


# --------------------------------------------------------------------------- params, stages


def test_params_are_the_repositorys_with_the_papers_wmt14_data_settings(tmp_path):
    """WORKDIR/params.yaml against the repository's params.yaml plus the paper's WMT14 settings."""
    # WORKDIR/params.yaml: the repository's params.yaml with en->de, a 37000-token BPE (min
    # frequency 2), survey candidates 64..512, shard max_tokens 6250 and max_len 256 (Section 5.1 /
    # the README), everything else as committed; it validates.
    from aiayn.config import load_params

    path = dp.write_params(tmp_path)
    assert path == tmp_path / "params.yaml"
    written = yaml.safe_load(path.read_text())
    expected = yaml.safe_load((REPO / "params.yaml").read_text())
    expected["data"].update(src_lang="en", tgt_lang="de")
    expected["vocab"].update(vocab_size=37000, min_frequency=2)
    expected["survey"]["max_len_candidates"] = [64, 128, 256, 512]
    expected["shard"].update(max_tokens=6250, max_len=256)
    if expected["model"]["max_positions"] < 258:  # room for max_len + BOS/EOS
        expected["model"]["max_positions"] = 1024
    assert written == expected
    p = load_params(path)
    assert (p.vocab.vocab_size, p.shard.max_tokens, p.shard.max_len) == (37000, 6250, 256)
    assert p.model.max_positions >= 258


def test_relocate_moves_data_and_metrics_paths_under_the_work_folder(tmp_path):
    """relocate: data/X -> WORK/X, metrics/X -> WORK/metrics/X, anything else None."""
    # data/X lands at WORK/X (data/raw is WORK/raw), metrics/X at WORK/metrics/X; other paths are
    # not relocated.
    assert dp.relocate("data/raw", tmp_path) == tmp_path / "raw"
    assert dp.relocate("data/vocab/tokenizer.json", tmp_path) == tmp_path / "vocab/tokenizer.json"
    assert dp.relocate("metrics/survey.json", tmp_path) == tmp_path / "metrics/survey.json"
    assert dp.relocate("params.yaml", tmp_path) is None
    assert dp.relocate("conf/experiment/demo.yaml", tmp_path) is None


def test_stage_commands_wire_every_dvc_yaml_path_to_the_work_folder(tmp_path, monkeypatch):
    """Stage command lines against dvc.yaml: every declared data/metrics path, under WORK."""
    # Each stage's command line reads and writes, under the work folder, every data/ dep, out,
    # metric and plot that dvc.yaml declares for it, with the work folder's params; no argument
    # points into the repository; --profile runs the same under cProfile.
    params = tmp_path / "params.yaml"
    options = dp.stage_options()
    monkeypatch.setattr(dp, "stage_options", lambda: options)
    commands, outs = dp.stage_commands(tmp_path, params, profile=False)
    dvc = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    assert sorted(commands) == ["shard", "survey", "vocab"]
    assert sorted(outs) == ["shard", "survey", "vocab"]

    def declared(stage: str, key: str) -> list[str]:
        return [next(iter(e)) if isinstance(e, dict) else e for e in dvc[stage].get(key, [])]

    for name, argv in commands.items():
        assert Path(argv[0]).is_absolute() and Path(argv[0]).name == "aiayn"
        assert argv[1] == name
        values = argv[2:]
        assert values[values.index("--params") + 1] == str(params)
        paths = {Path(v) for v in values if "/" in v}
        assert all(tmp_path in p.parents for p in paths), values
        for key in ("deps", "outs", "metrics", "plots"):
            for entry in declared(name, key):
                if entry.startswith(("data/", "metrics/")):
                    moved = tmp_path / entry.removeprefix("data/")
                    assert moved in paths, (name, key, entry, values)
        cached = [o for o in dvc[name].get("outs", [])
                  if not (isinstance(o, dict) and next(iter(o.values())).get("cache") is False)]
        assert outs[name] == [tmp_path / (next(iter(o)) if isinstance(o, dict) else o
                                          ).removeprefix("data/") for o in cached]
    profiled, _ = dp.stage_commands(tmp_path, params, profile=True)
    for name, argv in profiled.items():
        assert argv[:7] == [sys.executable, "-m", "cProfile", "-o",
                            str(tmp_path / f"profile/{name}.prof"), "-m", "stages.cli"]
        assert argv[7:] == commands[name][1:]


def test_print_profile_shows_cumulative_then_own_time(tmp_path, capsys):
    """--profile's tables: a stage's cProfile file by cumulative time, then by own time; a
    stage that left no file prints nothing."""
    import cProfile

    path = tmp_path / "vocab.prof"
    cProfile.run("sorted(range(1000), key=str)", str(path))
    dp.print_profile(path)
    out = capsys.readouterr().out
    assert out.index("vocab.prof: top 25 by cumulative time") < out.index(
        "vocab.prof: top 15 by own time")
    assert "sorted" in out
    dp.print_profile(tmp_path / "none.prof")
    assert capsys.readouterr().out == ""


CHILD = """
import sys, time
print("starting", flush=True)
sys.stdout.write("step  10%|#         | 1/10 [00:00<00:01, 9.0it/s]\\r")
sys.stdout.write("step 100%|##########| 10/10 [00:01<00:00, 9.0it/s]\\n")
sys.stdout.flush()
data = b"\\x01" * (200 * 2**20)
time.sleep(1.0)
print("done", len(data), flush=True)
sys.exit(3)
"""


def test_run_stage_measures_the_stage_itself_and_logs_its_lines(tmp_path):
    """run_stage on a known child: exit code, its own peak RSS (not ours), its log lines."""
    # A child that holds 200 MiB for a second and exits 3: its exit code, a peak RSS of at least 200
    # MiB but not the benchmark's own (this process holds 600 MiB more), and its log lines
    # (progress lines kept at 100% only).
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    log = tmp_path / "logs/child.log"
    ballast = b"\x02" * (600 * 2**20)  # a high-water mark a forked child would inherit
    res = dp.run_stage("child", [sys.executable, str(script)], log)
    assert len(ballast) == 600 * 2**20
    held = 200 * 2**20 / dp.GIB
    assert res.returncode == 3 and not res.interrupted
    assert res.peak_rss_gib >= held
    assert res.peak_rss_gib < held + 0.25  # a fresh interpreter's own memory, not 600 MiB more
    assert res.wall_s >= 1.0  # it slept a second
    assert res.user_s + res.sys_s > 0
    assert [line for _, line in res.events] == [
        "starting", "step 100%|##########| 10/10 [00:01<00:00, 9.0it/s]",
        f"done {200 * 2**20}"]
    assert [t for t, _ in res.events] == sorted(t for t, _ in res.events)
    logged = log.read_text().splitlines()
    assert [line.split(None, 1)[1] for line in logged] == [
        "starting", "step  10%|#         | 1/10 [00:00<00:01, 9.0it/s]",
        "step 100%|##########| 10/10 [00:01<00:00, 9.0it/s]", f"done {200 * 2**20}"]
    usage = json.loads(log.with_suffix(".rusage.json").read_text())
    assert usage["ru_maxrss_kib"] * 1024 / dp.GIB == pytest.approx(res.peak_rss_gib)


@pytest.mark.parametrize("argv, code", [
    (["/nonexistent/aiayn"], 127),  # exec fails: the shell's "command not found"
    ([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
     128 + 9),  # killed by a signal: 128 + its number, as a shell reports it
])
def test_run_stage_reports_a_failed_start_or_a_kill_as_a_shell_would(tmp_path, argv, code):
    """The wrapper's exit code: 127 when the stage cannot start, 128 + N for signal N."""
    res = dp.run_stage("x", argv, tmp_path / "x.log")
    assert res.returncode == code


def _result(name, wall, cpu, peak, code=0):
    return dp.StageResult(name=name, argv=[name], returncode=code, wall_s=wall,
                          user_s=cpu * 0.75, sys_s=cpu * 0.25, peak_rss_gib=peak, events=[],
                          log="x.log", mean_loadavg=1.0)


@pytest.mark.parametrize("stages, wall_ok, rss_ok, all_ok", [
    ([("vocab", 300, 280, 3.9), ("survey", 200, 190, 1.0), ("shard", 400, 390, 2.0)],
     True, True, True),
    ([("vocab", 500, 480, 1.0), ("survey", 200, 190, 1.0), ("shard", 201, 200, 1.0)],
     False, True, True),  # 901 s: over 15 minutes
    ([("vocab", 100, 90, 4.5), ("survey", 200, 190, 1.0), ("shard", 200, 190, 1.0)],
     True, False, True),  # one stage over 4 GiB
    ([("vocab", 100, 90, 1.0), ("survey", 200, 190, 1.0)], False, True, False),
    ([("vocab", 100, 90, 1.0), ("survey", 20, 19, 1.0, 1), ("shard", 10, 9, 1.0)],
     False, True, False),  # a stage failed: the wall goal is not met, however fast
])
def test_table_totals_and_goals(stages, wall_ok, rss_ok, all_ok, capsys):
    """print_table's totals (sums, max) and goals (15 min for all three, 4 GiB each) by hand."""
    # Totals are sums (wall, CPU) and the maximum (peak RSS) over the stages; the wall goal needs
    # all three stages to succeed within 15 minutes, the RSS goal every stage at most 4 GiB.
    results = [_result(*s) for s in stages]
    total = sum(s[1] for s in stages)
    summary = dp.print_table(results, total)
    assert summary["total_wall_s"] == total
    assert summary["total_cpu_s"] == pytest.approx(sum(s[2] for s in stages))
    assert summary["peak_rss_gib"] == max(s[3] for s in stages)
    assert (summary["goal_wall_s"], summary["goal_rss_gib"]) == (900, 4.0)
    assert (summary["wall_goal_met"], summary["rss_goal_met"],
            summary["all_stages_ok"]) == (wall_ok, rss_ok, all_ok)
    out = capsys.readouterr().out
    assert f"wall: {'MET' if wall_ok else 'MISSED'}" in out
    assert f"peak RSS: {'MET' if rss_ok else 'MISSED'}" in out


def test_goals_are_not_judged_on_a_smaller_corpus(capsys):
    """The goals are for WMT14's 4.5M training pairs: a quick run on fewer pairs, however
    fast and small, reports them as not judged rather than met."""
    results = [_result("vocab", 10, 9, 0.5), _result("survey", 5, 4, 0.5),
               _result("shard", 5, 4, 0.5)]
    summary = dp.print_table(results, 20, pairs=5000)
    assert summary["wall_goal_met"] is None and summary["rss_goal_met"] is None
    assert summary["all_stages_ok"] is True
    out = capsys.readouterr().out
    assert "MET" not in out and "not judged" in out and "5,000" in out


# --------------------------------------------------------------------------- a full run


def test_full_run_reports_every_stage_and_cleans_up_field_by_field(tiny, tmp_path, capsys,
                                                                   keep_sigterm):
    """A full tiny run: the JSON report field by field against the corpus, overrides and files."""
    # vocab -> survey -> shard on a 600-pair corpus: exit 0; the JSON report holds the command, the
    # overrides, the corpus spec, each stage's run (its own log, its argv), totals that add up, the
    # stages' metrics files, which saw the corpus's pairs and the overrides; the outputs are deleted
    # (no --keep), corpus and metrics stay. A rerun of survey alone then fails (its input is gone):
    # exit 1, a message, the report says so.
    dp = tiny
    work = tmp_path / "work"
    argv = ["--pairs", "600", "--workdir", str(work)]
    assert dp.main(argv) == 0
    capsys.readouterr()
    report = json.loads((work / "bench_data_pipeline.json").read_text())
    assert report["command"] == " ".join([sys.executable, "-m", "bench.data_pipeline", *argv])
    assert report["argv"] == argv and report["machine"]["nproc"] == os.cpu_count()
    assert report["workdir"] == str(work) and report["profiled"] is False
    assert report["params_overrides"] == {
        "data.src_lang": "en", "data.tgt_lang": "de", "vocab.vocab_size": 37000,
        "vocab.min_frequency": 2, "survey.max_len_candidates": [64, 128, 256, 512],
        "shard.max_tokens": 6250, "shard.max_len": 256}
    assert report["corpus"]["spec"] == {"generator_version": 1, "pairs": 600, "seed": 1,
                                        "valid_pairs": 50, "test_pairs": 40}
    assert report["corpus"]["reused"] is False
    stages = report["stages"]
    assert [s["name"] for s in stages] == ["vocab", "survey", "shard"]
    for s in stages:
        assert s["returncode"] == 0 and s["argv"][1] == s["name"]
        assert s["argv"][s["argv"].index("--params") + 1] == str(work / "params.yaml")
        assert s["log"] == str(work / f"logs/{s['name']}.log")
        assert s["events"] and Path(s["log"]).read_text().strip()
        assert s["peak_rss_gib"] > 0 and s["wall_s"] > 0
    summary = report["summary"]
    assert summary["total_wall_s"] == pytest.approx(sum(s["wall_s"] for s in stages))
    assert summary["total_cpu_s"] == pytest.approx(sum(s["user_s"] + s["sys_s"] for s in stages))
    assert summary["peak_rss_gib"] == max(s["peak_rss_gib"] for s in stages)
    assert summary["all_stages_ok"] is True
    metrics = report["stage_metrics"]
    for name in ("vocab", "survey", "shard"):
        assert metrics[name] == json.loads((work / f"metrics/{name}.json").read_text())
    assert metrics["vocab"]["trained_on_pairs"] == 600
    assert metrics["vocab"]["requested_size"] == 37000
    assert metrics["vocab"]["min_frequency"] == 2
    pairs = {"train": 600, "valid": 50, "test": 40}
    assert {k: v["pairs"] for k, v in metrics["survey"]["splits"].items()} == pairs
    assert sorted(metrics["survey"]["max_len_drops"], key=int) == ["64", "128", "256", "512"]
    shard = metrics["shard"]
    assert (shard["max_len"], shard["max_tokens"], shard["languages"]) == (256, 6250,
                                                                          ["en", "de"])
    assert {k: v["pairs"] + v["dropped_over_max_len"]
            for k, v in shard["splits"].items()} == pairs
    assert set(report["outputs_bytes"]) == {"vocab/tokenizer.json", "survey", "shards"}
    assert all(size > 0 for size in report["outputs_bytes"].values())
    for out in ("vocab/tokenizer.json", "survey", "shards"):
        assert not (work / out).exists()  # deleted: no --keep
    assert (work / "raw/train.parquet").is_file() and (work / "corpus.json").is_file()

    assert dp.main(argv + ["--stages", "survey"]) == 1
    captured = capsys.readouterr()
    assert "corpus: reusing" in captured.out
    assert f"error: stage survey failed; see {work / 'logs/survey.log'}" in captured.err
    again = json.loads((work / "bench_data_pipeline.json").read_text())
    assert [s["name"] for s in again["stages"]] == ["survey"]
    assert again["stages"][0]["returncode"] != 0
    assert again["summary"]["all_stages_ok"] is False
    assert again["corpus"]["reused"] is True
    assert again["summary"]["total_wall_s"] == pytest.approx(again["stages"][0]["wall_s"])

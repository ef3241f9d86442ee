"""Scoring: sacreBLEU as its command line computes it, and tensor2tensor's tokenized BLEU."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from aiayn.decoding.scoring import (
    TOKENIZED_BLEU_PROCEDURE,
    lowercase_bleu,
    moses_tokenize,
    sacre_scores,
    score_files,
    split_compounds,
    tokenized_bleu,
)
from aiayn.errors import DataError
from tests.conftest import REPO

# A small en→de test set: real German with umlauts, ß, quotes, numbers and compounds.
SOURCES = [
    "The tram stop is right in front of the town hall.",
    "In 2014, the European Union spent 1,200.50 euros per head.",
    "\"We are not afraid,\" said Mr. O'Neill.",
    "The e-mail address is on the website.",
    "Prices rose by 3.5 percent over the year.",
    "The state-of-the-art system translates news articles.",
    "Is the bridge closed? Yes, since Monday.",
    "Children under 12 years travel free of charge.",
    "The football world cup takes place in Brazil.",
    "The meeting was postponed until further notice.",
]
REFERENCES = [
    "Die Straßenbahn-Haltestelle liegt direkt vor dem Rathaus.",
    "Im Jahr 2014 gab die Europäische Union 1.200,50 Euro pro Kopf aus.",
    "„Wir haben keine Angst“, sagte Herr O'Neill.",
    "Die E-Mail-Adresse steht auf der Website.",
    "Die Preise stiegen im Laufe des Jahres um 3,5 Prozent.",
    "Das hochmoderne System übersetzt Nachrichten-Artikel.",
    "Ist die Brücke gesperrt? Ja, seit Montag.",
    "Kinder unter 12 Jahren fahren kostenlos.",
    "Die Fußball-Weltmeisterschaft findet in Brasilien statt.",
    "Das Treffen wurde bis auf Weiteres verschoben.",
]
HYPOTHESES = [
    "Die Straßenbahn-Haltestelle ist direkt vor dem Rathaus.",
    "2014 gab die Europäische Union 1.200,50 Euro pro Kopf aus.",
    "\"Wir haben keine Angst\", sagte Herr O'Neill.",
    "Die E-Mail-Adresse ist auf der Webseite.",
    "Die Preise stiegen über das Jahr um 3,5 Prozent.",
    "Das modernste System übersetzt Nachrichtenartikel.",
    "Ist die Brücke geschlossen? Ja, seit Montag.",
    "Kinder unter 12 Jahren reisen kostenlos.",
    "Die Fußball-WM findet in Brasilien statt.",
    "Die Sitzung wurde bis auf weiteres verschoben.",
]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def cli_scores(tmp_path_factory) -> dict:
    """What the `sacrebleu` command line prints for HYPOTHESES against REFERENCES."""
    folder = tmp_path_factory.mktemp("cli")
    ref = write_lines(folder / "ref.de", REFERENCES)
    hyp = write_lines(folder / "hyp.de", HYPOTHESES)
    exe = Path(sys.executable).parent / "sacrebleu"
    out = subprocess.run(
        [str(exe), str(ref), "-i", str(hyp), "-m", "bleu", "chrf", "-l", "en-de", "-w", "4",
         "--format", "json"],
        capture_output=True, text=True, check=True, timeout=120)
    bleu, chrf = json.loads(out.stdout)
    assert bleu["name"] == "BLEU" and chrf["name"] == "chrF2"
    lengths = re.search(r"hyp_len = (\d+) ref_len = (\d+)", bleu["verbose_score"])
    bleu["hyp_len"], bleu["ref_len"] = int(lengths[1]), int(lengths[2])
    return {"bleu": bleu, "chrf": chrf}


def assert_same_as_cli(bleu: dict, chrf: dict, cli: dict) -> None:
    assert round(bleu["score"], 4) == pytest.approx(cli["bleu"]["score"], abs=1e-9)
    assert bleu["signature"] == cli["bleu"]["signature"]
    assert (bleu["sys_len"], bleu["ref_len"]) == (cli["bleu"]["hyp_len"], cli["bleu"]["ref_len"])
    assert round(chrf["score"], 4) == pytest.approx(cli["chrf"]["score"], abs=1e-9)
    assert chrf["signature"] == cli["chrf"]["signature"]


# --------------------------------------------------------------------------- sacreBLEU


def test_sacre_scores_equal_the_sacrebleu_command_line(cli_scores: dict) -> None:
    s = sacre_scores(HYPOTHESES, REFERENCES, "de")
    assert_same_as_cli(s["bleu"], s["chrf"], cli_scores)
    assert s["bleu"]["signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|")
    assert len(s["bleu"]["precisions"]) == 4
    assert 0 < s["bleu"]["score"] < 100 and 0 < s["chrf"]["score"] < 100
    # Not a constant: identical text scores 100 on both.
    same = sacre_scores(REFERENCES, REFERENCES, "de")
    assert same["bleu"]["score"] == pytest.approx(100)
    assert same["chrf"]["score"] == pytest.approx(100)


# --------------------------------------------------------------------------- tokenized BLEU

COMPOUNDS = [
    ("Straßenbahn-Haltestelle", "Straßenbahn ##AT##-##AT## Haltestelle"),
    ("Die Größe-Änderung", "Die Größe ##AT##-##AT## Änderung"),
    # perl's /g resumes after the previous match: the "b" it consumed cannot start another.
    ("a-b-c", "a ##AT##-##AT## b-c"),
    ("a-b-c-d-e", "a ##AT##-##AT## b-c ##AT##-##AT## d-e"),
    ("state-of-the-art", "state ##AT##-##AT## of ##AT##-##AT## the ##AT##-##AT## art"),
    ("e-Mail-Adresse", "e ##AT##-##AT## Mail ##AT##-##AT## Adresse"),
    ("Vor- und Nachteile", "Vor- und Nachteile"),
    ("am Satzende-", "am Satzende-"),
    ("-Anfang", "-Anfang"),
    ("x - y", "x - y"),
    ("a--b", "a ##AT##-##AT## -b"),
    ("a -- b", "a -- b"),
    ("--", "--"),
    ("10-15", "10 ##AT##-##AT## 15"),
]


@pytest.mark.parametrize(("text", "expected"), COMPOUNDS)
def test_split_compounds(text: str, expected: str) -> None:
    assert split_compounds(text) == expected


@pytest.mark.skipif(shutil.which("perl") is None, reason="perl not installed")
def test_split_compounds_equals_the_perl_one_liner() -> None:
    texts = [t for t, _ in COMPOUNDS] + ["Die E-Mail-Adresse &quot;-x ##AT##-##AT## y"]
    out = subprocess.run(["perl", "-ple", r"s{(\S)-(\S)}{$1 ##AT##-##AT## $2}g"],
                         input="".join(t + "\n" for t in texts).encode(),
                         capture_output=True, check=True, timeout=60)
    assert out.stdout.decode().split("\n")[:-1] == [split_compounds(t) for t in texts]


def test_moses_tokenization_of_a_german_sentence() -> None:
    # tokenizer.perl -l de, defaults: punctuation split off, the number kept whole, the
    # hyphenated compound left whole (no -a), XML escaping on (no -no-escape).
    text = "Herr O'Neill sagte: \"Die Straßenbahn-Haltestelle kostet 1.200,50 €!\""
    assert moses_tokenize(text, "de") == (
        "Herr O &apos; Neill sagte : &quot; Die Straßenbahn-Haltestelle kostet 1.200,50 € ! "
        "&quot;")


def test_tokenized_bleu_by_hand() -> None:
    # After Moses + compound splitting:
    #   hyp 1 "Die Bus ##AT##-##AT## Haltestelle ist nah ."          7 tokens
    #   ref 1 "Die Straßenbahn ##AT##-##AT## Haltestelle ist nah ."  7 tokens
    #   hyp 2 "Er kommt ."                                           3 tokens
    #   ref 2 "Er kommt morgen wieder ."                             5 tokens
    # matches / n-grams, sentence 1 + 2:
    #   1-grams 6/7 + 3/3 = 9/10   (only "Bus" misses)
    #   2-grams 4/6 + 1/2 = 5/8    ("##AT## Haltestelle", "Haltestelle ist", "ist nah",
    #                               "nah ."; "Er kommt")
    #   3-grams 3/5 + 0/1 = 3/6;   4-grams 2/4 + 0/0 = 2/4
    # brevity penalty exp(1 - 12/10).
    hyps = ["Die Bus-Haltestelle ist nah.", "Er kommt."]
    refs = ["Die Straßenbahn-Haltestelle ist nah.", "Er kommt morgen wieder."]
    result = tokenized_bleu(hyps, refs, "de")
    expected = 100 * math.exp(1 - 12 / 10) * (9 / 10 * 5 / 8 * 3 / 6 * 2 / 4) ** 0.25
    assert result["score"] == pytest.approx(expected, rel=1e-12)
    assert result["precisions"] == pytest.approx([90.0, 62.5, 50.0, 50.0])
    assert result["bp"] == pytest.approx(math.exp(-0.2))
    assert (result["sys_len"], result["ref_len"]) == (10, 12)
    assert result["procedure"] == TOKENIZED_BLEU_PROCEDURE
    assert "get_ende_bleu.sh" in result["procedure"] and "not comparable" in result["procedure"]


def test_tokenized_bleu_has_no_smoothing() -> None:
    # multi-bleu.perl: a zero 4-gram precision makes the score 0 (sacreBLEU's default would
    # smooth it to a positive number).
    assert tokenized_bleu(["Das ist gut."], ["Das ist nicht gut."], "de")["score"] == 0.0
    assert sacre_scores(["Das ist gut."], ["Das ist nicht gut."], "de")["bleu"]["score"] > 0


def multi_bleu(hyps: list[str], refs: list[str]) -> float:
    """multi-bleu.perl's arithmetic for one reference, written out independently."""
    correct, total = [0] * 4, [0] * 4
    hyp_len = ref_len = 0
    for hyp, ref in zip(hyps, refs, strict=True):
        h, r = hyp.split(), ref.split()
        hyp_len, ref_len = hyp_len + len(h), ref_len + len(r)
        for n in range(1, 5):
            hc = Counter(tuple(h[i:i + n]) for i in range(len(h) - n + 1))
            rc = Counter(tuple(r[i:i + n]) for i in range(len(r) - n + 1))
            correct[n - 1] += sum(min(c, rc[g]) for g, c in hc.items())
            total[n - 1] += max(len(h) - n + 1, 0)
    if min(correct) == 0:
        return 0.0
    bp = 1.0 if hyp_len >= ref_len else math.exp(1 - ref_len / hyp_len)
    logs = [math.log(c / t) for c, t in zip(correct, total, strict=True)]
    return 100 * bp * math.exp(sum(logs) / 4)


def test_tokenized_bleu_equals_multi_bleu_on_the_split_token_streams() -> None:
    def prepare(lines):
        return [split_compounds(moses_tokenize(line, "de")) for line in lines]

    streams = prepare(HYPOTHESES), prepare(REFERENCES)
    assert "Straßenbahn ##AT##-##AT## Haltestelle" in streams[1][0]
    assert "E ##AT##-##AT## Mail ##AT##-##AT## Adresse" in streams[1][3]
    expected = multi_bleu(*streams)
    assert tokenized_bleu(HYPOTHESES, REFERENCES, "de")["score"] == pytest.approx(expected,
                                                                                  rel=1e-12)
    # The compound splitting matters on this set (else the test would not test it).
    plain = [moses_tokenize(line, "de") for line in HYPOTHESES]
    plain_refs = [moses_tokenize(line, "de") for line in REFERENCES]
    assert multi_bleu(plain, plain_refs) != pytest.approx(expected)


def test_lowercase_bleu_equals_multi_bleu_lc_on_the_moses_token_streams() -> None:
    hyps = [*HYPOTHESES, "DAS IST EIN TEST."]
    refs = [*REFERENCES, "Das ist ein Test."]
    streams = ([moses_tokenize(line, "de").lower() for line in hyps],
               [moses_tokenize(line, "de").lower() for line in refs])
    assert streams[0][-1] == streams[1][-1] == "das ist ein test ."
    expected = multi_bleu(*streams)  # multi-bleu.perl -lc, by hand
    result = lowercase_bleu(hyps, refs, "de")
    assert result["score"] == pytest.approx(expected, rel=1e-12)
    assert "lowercased" in result["procedure"]
    # Case matters on this set, and no compound is split.
    cased = multi_bleu([moses_tokenize(x, "de") for x in hyps],
                       [moses_tokenize(x, "de") for x in refs])
    assert cased < expected
    assert not any("##AT##" in line for line in streams[1])


# --------------------------------------------------------------------------- files


def test_score_files_combines_both(tmp_path: Path, cli_scores: dict) -> None:
    hyp = write_lines(tmp_path / "test.de", HYPOTHESES)
    result = score_files(hyp, REFERENCES, "de")
    assert set(result) == {"sacrebleu", "chrf", "tokenized_bleu", "lowercase_bleu", "sentences"}
    assert result["sentences"] == len(REFERENCES)
    assert_same_as_cli(result["sacrebleu"], result["chrf"], cli_scores)
    assert result["tokenized_bleu"] == tokenized_bleu(HYPOTHESES, REFERENCES, "de")
    assert result["lowercase_bleu"] == lowercase_bleu(HYPOTHESES, REFERENCES, "de")


def test_score_files_keeps_empty_lines_and_splits_at_newline_only(tmp_path: Path) -> None:
    # An empty translation is a line; U+2028 inside a sentence does not end it.
    hyp = tmp_path / "test.de"
    hyp.write_text("Das Haus.\n\nEin\u2028Satz.\n", encoding="utf-8")
    result = score_files(hyp, ["Das Haus.", "Der Baum.", "Ein Satz."], "de")
    assert result["sentences"] == 3


def test_line_count_mismatch_names_the_file_and_both_counts(tmp_path: Path) -> None:
    hyp = write_lines(tmp_path / "test.de", HYPOTHESES[:7])
    with pytest.raises(DataError) as err:
        score_files(hyp, REFERENCES, "de", reference_source="data/raw/test.parquet")
    message = str(err.value)
    assert str(hyp) in message and "7 lines" in message and "10 sentences" in message
    assert "data/raw/test.parquet" in message and "aiayn translate" in message


def test_missing_hypotheses_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=re.escape(str(tmp_path / "nope.de"))) as err:
        score_files(tmp_path / "nope.de", REFERENCES, "de")
    assert "aiayn translate" in str(err.value)



def test_invalid_utf8_names_the_file_line_and_byte(tmp_path: Path) -> None:
    hyp = tmp_path / "test.de"
    good = "\n".join(HYPOTHESES[:2]).encode("utf-8")
    hyp.write_bytes(good + b"\nein Gr\xfc\xdfe\n")  # latin-1 on the third line
    with pytest.raises(DataError) as err:
        score_files(hyp, REFERENCES, "de")
    start = len(good) + len(b"\nein Gr")
    assert str(err.value) == (f"{hyp}, line 3: invalid UTF-8 (byte {start}: "
                              "b'\\xfc\\xdfe\\n'); the translations must be UTF-8 text: "
                              "re-run `aiayn translate`")


# --------------------------------------------------------------------------- the stage


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    shutil.copyfile(REPO / "params.yaml", tmp_path / "params.yaml")
    raw = tmp_path / "data/raw"
    raw.mkdir(parents=True)
    pq.write_table(pa.table({"de": REFERENCES, "en": SOURCES}), raw / "test.parquet")
    write_lines(tmp_path / "data/translations/test.de", HYPOTHESES)
    return tmp_path


def run_stage(root: Path, *extra: str):
    from stages.score import app

    return CliRunner().invoke(app, [
        "--params", str(root / "params.yaml"), "--raw", str(root / "data/raw"),
        "--hypotheses", str(root / "data/translations/test.{tgt}"),
        "--metrics", str(root / "metrics/bleu.json"),
        "--run-file", str(root / "data/checkpoints/mlflow_run.json"), *extra])


def test_score_stage_writes_metrics(workspace: Path, cli_scores: dict) -> None:
    result = run_stage(workspace, "--no-mlflow")
    assert result.exit_code == 0, result.output
    m = json.loads((workspace / "metrics/bleu.json").read_text(encoding="utf-8"))
    assert m["direction"] == "en-de" and m["split"] == "test" and m["sentences"] == 10
    assert m["hypotheses"] == str(workspace / "data/translations/test.de")
    assert_same_as_cli(m["sacrebleu"], m["chrf"], cli_scores)
    assert m["tokenized_bleu"]["score"] == pytest.approx(
        tokenized_bleu(HYPOTHESES, REFERENCES, "de")["score"])
    assert m["tokenized_bleu"]["procedure"] == TOKENIZED_BLEU_PROCEDURE
    assert "27.3" in m["note"] and "28.4" in m["note"] and "sacreBLEU" in m["note"]
    # The table shows the three scores as printed by the command line (2 decimals).
    assert f"{m['sacrebleu']['score']:.2f}" in result.output
    assert f"{m['tokenized_bleu']['score']:.2f}" in result.output
    assert not list(workspace.glob("**/mlflow.db")) and not (workspace / "mlruns").exists()


def test_score_stage_scores_against_the_raw_references(workspace: Path) -> None:
    write_lines(workspace / "data/translations/test.de", REFERENCES)
    assert run_stage(workspace, "--no-mlflow").exit_code == 0
    m = json.loads((workspace / "metrics/bleu.json").read_text(encoding="utf-8"))
    for key in ("sacrebleu", "chrf", "tokenized_bleu"):
        assert m[key]["score"] == pytest.approx(100.0)


def test_score_stage_without_a_run_id_skips_mlflow(workspace: Path, monkeypatch,
                                                   caplog) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(workspace)
    with caplog.at_level("INFO", logger="aiayn"):
        result = run_stage(workspace)
    assert result.exit_code == 0, result.output
    assert "not logging to MLflow" in caplog.text
    assert not (workspace / "mlflow.db").exists()


def test_score_stage_line_mismatch_fails_clearly(workspace: Path) -> None:
    write_lines(workspace / "data/translations/test.de", HYPOTHESES[:-1])
    result = run_stage(workspace, "--no-mlflow")
    assert result.exit_code == 2
    assert "test.de has 9 lines" in result.output and "10 sentences" in result.output
    assert not (workspace / "metrics/bleu.json").exists()


@pytest.mark.slow
def test_score_stage_logs_into_the_training_run(workspace: Path, monkeypatch) -> None:
    from mlflow import MlflowClient

    from aiayn.tracking import Tracker, save_run_id

    uri = f"sqlite:///{workspace}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(workspace)  # the sqlite store keeps artifacts in ./mlruns
    training = Tracker()
    run_id = training.start("train", {"model": {"d_model": 128}})
    training.log_metrics({"valid/loss": 2.5}, step=1)
    training.end()
    save_run_id(workspace / "data/checkpoints/mlflow_run.json", run_id, uri)

    result = run_stage(workspace)
    assert result.exit_code == 0, result.output
    m = json.loads((workspace / "metrics/bleu.json").read_text(encoding="utf-8"))
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    assert run.data.metrics["test/sacrebleu"] == pytest.approx(m["sacrebleu"]["score"])
    assert run.data.metrics["test/chrf"] == pytest.approx(m["chrf"]["score"])
    assert run.data.metrics["test/tokenized_bleu"] == pytest.approx(m["tokenized_bleu"]["score"])
    assert run.data.metrics["valid/loss"] == 2.5 and run.data.params["model.d_model"] == "128"
    assert run.info.status == "FINISHED"
    artifacts = {a.path for folder in ("metrics", "translations")
                 for a in client.list_artifacts(run_id, folder)}
    assert artifacts == {"metrics/bleu.json", "translations/test.de"}
    assert len(client.search_runs([run.info.experiment_id])) == 1

"""Bad input wherever a user types: every case ends in one line that names the file and the
fix, a non-zero exit and no half-written output; or it recovers as documented.

The cases are the table of docs/troubleshooting.md, run through the `aiayn`
command itself in a workspace laid out as `dvc repro` leaves it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from aiayn.training.checkpoint import list_checkpoints
from tests.conftest import REPO


@pytest.fixture(scope="module")
def workspace(toy_workspace, tmp_path_factory) -> Path:
    """The toy workspace after train, average and translate (no MLflow)."""
    from stages.cli import app

    ws = tmp_path_factory.mktemp("pipeline") / "ws"
    shutil.copytree(toy_workspace, ws)
    (ws / "metrics").mkdir()
    runner = CliRunner()
    cwd = Path.cwd()
    try:
        os.chdir(ws)
        for args in (["train", "--no-progress", "--no-mlflow"], ["average", "--no-mlflow"],
                     ["translate", "--split", "test", "--no-progress"]):
            res = runner.invoke(app, args)
            assert res.exit_code == 0, res.output
    finally:
        os.chdir(cwd)
    return ws


def edit_params(ws: Path, changes: dict) -> None:
    from tests.conftest import merge

    path = ws / "params.yaml"
    path.write_text(yaml.safe_dump(merge(yaml.safe_load(path.read_text()), changes),
                                   sort_keys=False))


def local_corpus(ws: Path, files: dict[str, bytes]) -> None:
    """A local corpus folder in ws/corpus (train/valid/test.{en,de}) with ``files``
    replacing some of them, and params that read it."""
    good = {f"{split}.{lang}": "".join(f"{split} sentence {i} {lang}\n" for i in range(6))
            .encode() for split in ("train", "valid", "test") for lang in ("en", "de")}
    (ws / "corpus").mkdir()
    for name, data in {**good, **files}.items():
        if data is not None:
            (ws / "corpus" / name).write_bytes(data)
    edit_params(ws, {"data": {"source": "local", "local": {
        "dir": "corpus", "pattern": "{split}.{lang}",
        "splits": {"train": "train", "valid": "valid", "test": "test"}}}})


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


@dataclass
class Case:
    """``args`` of `aiayn` in a copy of the workspace after ``setup``; the one error line must
    hold every string of ``says``; ``untouched`` outputs must be as they were (or absent)."""

    name: str
    args: list[str]
    says: list[str]
    setup: Callable[[Path], None] = lambda ws: None
    untouched: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


def _rm(rel: str) -> Callable[[Path], None]:
    def setup(ws: Path) -> None:
        path = ws / rel
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return setup


def _write(rel: str, data: bytes) -> Callable[[Path], None]:
    def setup(ws: Path) -> None:
        (ws / rel).parent.mkdir(parents=True, exist_ok=True)
        (ws / rel).write_bytes(data)
    return setup


def _all(*steps: Callable[[Path], None]) -> Callable[[Path], None]:
    def setup(ws: Path) -> None:
        for step in steps:
            step(ws)
    return setup


def _truncate_all_checkpoints(ws: Path) -> None:
    for path in list_checkpoints(ws / "data/checkpoints"):
        truncate(path)


def gz_corpus(ws: Path, files: dict[str, bytes]) -> None:
    """The local corpus of :func:`local_corpus` gzipped (pattern '{split}.{lang}.gz'), with
    ``files`` (raw bytes, not compressed) replacing some of the .gz files."""
    import gzip

    local_corpus(ws, {})
    for path in sorted((ws / "corpus").iterdir()):
        gz = path.with_name(path.name + ".gz")
        gz.write_bytes(files.get(gz.name) or gzip.compress(path.read_bytes()))
        path.unlink()
    edit_params(ws, {"data": {"local": {"pattern": "{split}.{lang}.gz"}}})


def _truncated_gz(ws: Path) -> bytes:
    import gzip

    data = gzip.compress("".join(f"train sentence {i} de\n" for i in range(6)).encode())
    return data[:len(data) // 2]


def _raw_table(rel: str, change: Callable) -> Callable[[Path], None]:
    """Rewrite the raw split ``rel`` as ``change(table)`` gives it (a valid parquet file)."""
    def setup(ws: Path) -> None:
        import pyarrow.parquet as pq

        pq.write_table(change(pq.read_table(ws / rel)), ws / rel)
    return setup


def _null_at(row: int, column: str) -> Callable:
    def change(table):
        import pyarrow as pa

        values = table.column(column).to_pylist()
        values[row] = None
        return table.set_column(table.schema.get_field_index(column), column,
                                pa.array(values, pa.string()))
    return change


def _ints(column: str) -> Callable:
    def change(table):
        import pyarrow as pa

        return table.set_column(table.schema.get_field_index(column), column,
                                pa.array(range(table.num_rows), pa.int64()))
    return change


def _truncate(rel: str) -> Callable[[Path], None]:
    return lambda ws: truncate(ws / rel)


LATIN1 = "Le café est ouvert.\n".encode("latin-1")

CASES = [
    # params.yaml
    Case("params: unknown key", ["vocab"], ["params.yaml", "vocab.vocab_sise"],
         lambda ws: edit_params(ws, {"vocab": {"vocab_sise": 100}}), ["data/vocab"]),
    Case("params: wrong type", ["vocab"], ["params.yaml", "vocab.vocab_size", "lots"],
         lambda ws: edit_params(ws, {"vocab": {"vocab_size": "lots"}}), ["data/vocab"]),
    Case("params: impossible value", ["train", "--no-mlflow"],
         ["params.yaml", "divisible by heads (5)", "d_model"],
         lambda ws: edit_params(ws, {"model": {"heads": 5}}), ["data/checkpoints"]),
    Case("params: empty file", ["shard"], ["params.yaml: empty", "aiayn params"],
         _write("params.yaml", b""), ["data/shards"]),
    Case("params: not UTF-8", ["shard"], ["params.yaml: not UTF-8"],
         _write("params.yaml", "vocab: {vocab_size: 8000}  # café\n".encode("latin-1")),
         ["data/shards"]),
    Case("params: missing file", ["survey"], ["params.yaml"], _rm("params.yaml"),
         ["data/survey"]),
    Case("params: unknown preset", ["params", "multi31k", "--conf", str(REPO / "conf")],
         ["experiment/multi31k.yaml: no such preset", "known experiments", "multi30k"],
         untouched=["params.yaml"]),
    # the corpus
    Case("corpus: line counts differ", ["download"],
         ["train.de has 5 lines", "train.en has more"],
         lambda ws: local_corpus(ws, {"train.de": b"".join(
             f"train sentence {i} de\n".encode() for i in range(5))}), ["data/raw"]),
    Case("corpus: not UTF-8", ["download"], ["valid.de", "line 1", "UTF-8"],
         lambda ws: local_corpus(ws, {"valid.de": LATIN1 * 6}), ["data/raw"]),
    Case("corpus: a file missing", ["download"], ["test.en"],
         lambda ws: local_corpus(ws, {"test.en": None}), ["data/raw"]),
    Case("corpus: a truncated .gz", ["download"], ["train.de.gz", "gzip -t"],
         lambda ws: gz_corpus(ws, {"train.de.gz": _truncated_gz(ws)}), ["data/raw"]),
    Case("corpus: plain text named .gz", ["download"], ["valid.en.gz", "without .gz"],
         lambda ws: gz_corpus(ws, {"valid.en.gz": b"plain text\n" * 6}), ["data/raw"]),
    Case("params: an unknown field in data.local.pattern", ["download"],
         ["params.yaml", "data.local.pattern", "{x}"],
         lambda ws: local_corpus(ws, {}) or edit_params(
             ws, {"data": {"local": {"pattern": "{split}.{lang}.{x}"}}}), ["data/raw"]),
    Case("params: an unmatched brace in data.local.pattern", ["download"],
         ["params.yaml", "data.local.pattern", "Single '}'"],
         lambda ws: local_corpus(ws, {}) or edit_params(
             ws, {"data": {"local": {"pattern": "{split}.{lang}}"}}}), ["data/raw"]),
    Case("corpus: the hub offline", ["download"], ["wmt/wmt14"],
         lambda ws: edit_params(ws, {"data": {"source": "hub"}}), ["data/raw"],
         env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}),
    # stage inputs
    Case("vocab: no raw splits", ["vocab"], ["data/raw/train.parquet: missing", "aiayn download"],
         _rm("data/raw"),
         ["data/vocab"]),
    Case("vocab: a truncated raw split", ["vocab"],
         ["data/raw/train.parquet: not a readable parquet file", "aiayn download"],
         _truncate("data/raw/train.parquet"), ["data/vocab", "metrics/vocab.json"]),
    Case("vocab: a raw column not text", ["vocab"],
         ["data/raw/train.parquet", "column 'de' is int64, expected string", "aiayn download"],
         _raw_table("data/raw/train.parquet", _ints("de")), ["data/vocab", "metrics/vocab.json"]),
    # The tokenizer differs from the workspace's (another size): the failure, found after
    # training, must leave the old one in place, not a new tokenizer beside old metrics.
    Case("vocab: a null in the valid split", ["vocab"],
         ["data/raw/valid.parquet, row 3", "column 'de' is null", "aiayn download"],
         _all(lambda ws: edit_params(ws, {"vocab": {"vocab_size": 300}}),
              _raw_table("data/raw/valid.parquet", _null_at(2, "de"))),
         ["data/vocab", "metrics/vocab.json"]),
    Case("vocab: --out a folder", ["vocab", "--out", "data/vocab"],
         ["data/vocab", "is a folder"], untouched=["data/vocab", "metrics/vocab.json"]),
    Case("survey: a truncated raw split", ["survey"],
         ["data/raw/valid.parquet: not a readable parquet file", "aiayn download"],
         _truncate("data/raw/valid.parquet"), ["data/survey", "metrics/survey.json"]),
    Case("survey: no tokenizer", ["survey"], ["tokenizer.json", "aiayn vocab"],
         _rm("data/vocab/tokenizer.json"), ["data/survey"]),
    Case("shard: no survey", ["shard"], ["data/survey", "aiayn survey"], _rm("data/survey"),
         ["data/shards"]),
    Case("shard: truncated survey", ["shard"], ["data/survey"],
         lambda ws: [truncate(p) for p in sorted((ws / "data/survey").rglob("*"))
                     if p.is_file()], ["data/shards"]),
    Case("train: no shards", ["train", "--no-mlflow", "--no-progress"],
         ["data/shards", "aiayn shard"], _rm("data/shards"), ["data/checkpoints"]),
    Case("train: every checkpoint torn", ["train", "--no-mlflow", "--no-progress"],
         ["data/checkpoints", "none of the", "could be read"], _truncate_all_checkpoints),
    Case("train: --metrics a folder", ["train", "--no-mlflow", "--no-progress", "--metrics",
                                       "data/checkpoints"],
         ["data/checkpoints", "is a folder"], untouched=["data/checkpoints", "metrics/train.json"]),
    Case("average: --metrics a folder", ["average", "--no-mlflow", "--metrics", "data/model"],
         ["data/model", "is a folder"], untouched=["data/model", "metrics/average.json"]),
    Case("average: no checkpoints", ["average", "--no-mlflow"],
         ["data/checkpoints", "aiayn train"], _rm("data/checkpoints"), ["data/model"]),
    Case("average: a torn checkpoint", ["average", "--no-mlflow"],
         ["step-00000012.pt", "corrupt"],
         lambda ws: truncate(ws / "data/checkpoints/step-00000012.pt"), ["data/model"]),
    # translating and scoring
    Case("translate: no model", ["translate", "--split", "test", "--no-progress"],
         ["data/model", "aiayn average"], _rm("data/model"), ["data/translations"]),
    Case("translate: input missing", ["translate", "--input", "nope.txt", "--out", "o.txt"],
         ["nope.txt"], untouched=["o.txt"]),
    Case("translate: input not UTF-8", ["translate", "--input", "in.txt", "--out", "o.txt",
                                        "--no-progress"],
         ["in.txt", "line 1", "UTF-8"], _write("in.txt", LATIN1), ["o.txt"]),
    Case("translate: input too long", ["translate", "--input", "in.txt", "--out", "o.txt",
                                       "--no-progress"],
         ["in.txt", "line 2", "--truncate"],
         _write("in.txt", b"short\n" + b"word " * 400 + b"\n"), ["o.txt"]),
    Case("translate: a truncated raw split", ["translate", "--split", "test", "--no-progress"],
         ["data/raw/test.parquet: not a readable parquet file", "aiayn download"],
         _truncate("data/raw/test.parquet"), ["data/translations"]),
    Case("translate: data.src_lang not in the raw split",
         ["translate", "--split", "test", "--no-progress"],
         ["data/raw/test.parquet", "no column 'fr'", "columns: de, en"],
         lambda ws: edit_params(ws, {"data": {"source": "local", "src_lang": "fr"}}),
         ["data/translations"]),
    Case("translate: an unknown split", ["translate", "--split", "tst", "--no-progress"],
         ["--split 'tst'", "train, valid, test"], untouched=["data/translations"]),
    Case("translate: --out a folder", ["translate", "--input", "in.txt", "--out", "data/model",
                                       "--no-progress"],
         ["data/model", "is a folder"], _write("in.txt", b"a b c\n"), ["data/model"]),
    Case("score: a truncated raw split", ["score", "--no-mlflow"],
         ["data/raw/test.parquet: not a readable parquet file", "aiayn download"],
         _truncate("data/raw/test.parquet"), ["metrics/bleu.json"]),
    Case("score: a null reference", ["score", "--no-mlflow"],
         ["data/raw/test.parquet, row 5", "column 'de' is null", "aiayn download"],
         _raw_table("data/raw/test.parquet", _null_at(4, "de")), ["metrics/bleu.json"]),
    Case("score: wrong number of lines", ["score", "--no-mlflow"],
         ["test.de", "has 1 lines", "40 sentences", "aiayn translate"],
         _write("data/translations/test.de", b"one line\n"),
         ["metrics/bleu.json"]),
    Case("score: no translations", ["score", "--no-mlflow"],
         ["test.de", "aiayn translate"], _rm("data/translations"), ["metrics/bleu.json"]),
    Case("score: translations not UTF-8", ["score", "--no-mlflow"], ["test.de", "UTF-8"],
         _write("data/translations/test.de", LATIN1 * 40), ["metrics/bleu.json"]),
    Case("export: no model", ["export", "--format", "transformers"],
         ["data/model", "aiayn average"], _rm("data/model"), ["data/export"]),
]


def snapshot(ws: Path, rel: str) -> dict[str, bytes] | None:
    path = ws / rel
    if not path.exists():
        return None
    if path.is_file():
        return {"": path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file()}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_ends_in_one_line_that_names_the_file_and_the_fix(case, workspace,
                                                                     tmp_path, monkeypatch):
    from stages.cli import app

    ws = tmp_path / "ws"
    shutil.copytree(workspace, ws)
    case.setup(ws)
    before = {rel: snapshot(ws, rel) for rel in case.untouched}
    monkeypatch.chdir(ws)
    for key, value in case.env.items():
        monkeypatch.setenv(key, value)
    res = CliRunner().invoke(app, case.args)
    assert res.exit_code not in (0, None), res.output
    assert "Traceback" not in res.output, res.output
    assert not isinstance(res.exception, Exception) or isinstance(res.exception, SystemExit), \
        repr(res.exception)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, res.stderr
    for fragment in case.says:
        assert fragment in errors[0], errors[0]
    for rel in case.untouched:
        assert snapshot(ws, rel) == before[rel], f"{rel} changed"
    leftovers = [p for p in ws.rglob(".*.tmp")]
    assert not leftovers, leftovers


def test_a_torn_latest_checkpoint_is_skipped_with_a_warning_naming_it(workspace, tmp_path,
                                                                      monkeypatch):
    from stages.cli import app

    ws = tmp_path / "ws"
    shutil.copytree(workspace, ws)
    truncate(ws / "data/checkpoints/step-00000012.pt")
    edit_params(ws, {"train": {"steps": 15}})
    monkeypatch.chdir(ws)
    res = CliRunner().invoke(app, ["train", "--no-mlflow", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "skipping checkpoint" in res.stderr and "step-00000012.pt" in res.stderr
    assert "step-00000009.pt (step 9" in res.stderr  # the newest good one
    assert (ws / "data/checkpoints/step-00000015.pt").is_file()


def test_an_unreachable_tracking_server_warns_and_training_goes_on(workspace, tmp_path,
                                                                   monkeypatch):
    from stages.cli import app

    ws = tmp_path / "ws"
    shutil.copytree(workspace, ws)
    shutil.rmtree(ws / "data/checkpoints")
    monkeypatch.chdir(ws)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    res = CliRunner().invoke(app, ["train", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "MLflow at http://127.0.0.1:9 is unreachable" in res.stderr
    assert (ws / "data/checkpoints/step-00000012.pt").is_file()


def test_an_empty_input_translates_to_an_empty_output(workspace, tmp_path, monkeypatch):
    from stages.cli import app

    ws = tmp_path / "ws"
    shutil.copytree(workspace, ws)
    (ws / "in.txt").write_bytes(b"")
    monkeypatch.chdir(ws)
    res = CliRunner().invoke(app, ["translate", "--input", "in.txt", "--out", "o.txt",
                                   "--no-progress"])
    assert res.exit_code == 0, res.output
    assert (ws / "o.txt").read_bytes() == b""


def test_an_output_path_that_is_a_folder_stops_the_stage_before_its_work(workspace, tmp_path,
                                                                         monkeypatch):
    from stages.cli import app

    ws = tmp_path / "ws"
    shutil.copytree(workspace, ws)
    monkeypatch.chdir(ws)
    res = CliRunner().invoke(app, ["vocab", "--metrics", "data"])
    assert res.exit_code == 2, res.output
    assert "error: data: is a folder" in res.stderr
    assert "training BPE" not in res.stderr  # refused before, not after, the training

"""Shared fixtures: small corpora in the layouts the sources read (no network, no ../shared)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from aiayn.precision import instruction_caps_text

REPO = Path(__file__).resolve().parents[1]

# torch's compiler keeps the kernels it builds in one folder per user and hands them to later
# runs; a run under instruction caps (to test as an AVX2-only CPU would, bench/README.md)
# was handed kernels built without them and failed. Under caps, the tests' compiled
# trainings (and the processes they start, which inherit the variable) get a folder of their
# own per set of caps.
_CAPS = instruction_caps_text()
if _CAPS and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import getpass
    import hashlib
    import tempfile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(
        Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"
        / f"caps-{hashlib.sha256(_CAPS.encode()).hexdigest()[:12]}")

# Real sentences with the things lossless tokenization must survive.
SENTENCES_EN = [
    "The house is small.",
    "\"Quotes\", 'apostrophes' and (brackets) — plus 3.14 km/h at 10:30 on 2014-06-01.",
    "A well-known, state-of-the-art translation system costs $1,200.50!",
    "Two  spaces,   three spaces and a tab\there.",
    "Mr. O'Neill said: \"It's the 21st century; isn't it?\"",
    "He works for the European Union's High Representative.",
]
SENTENCES_DE = [
    "Das Haus ist klein.",
    "„Anführungszeichen“, ‚einfache‘ und (Klammern) — dazu 3,14 km/h um 10:30 Uhr am 1.6.2014.",
    "Ein bekanntes, hochmodernes Übersetzungssystem kostet 1.200,50 $!",
    "Zwei  Leerzeichen,   drei Leerzeichen und ein Tab\thier.",
    "Herr O'Neill sagte: »Es ist das 21. Jahrhundert; nicht wahr?«",
    "Er arbeitet für den Hohen Vertreter der Europäischen Union; Straßenbahn-Haltestelle, Größe.",
]


PIPELINES = ("dvc.yaml", "export/dvc.yaml")  # the pipeline and the optional export one


def dvc_stages() -> dict[str, tuple[str, dict]]:
    """Every stage of the pipeline files by name: the file it is in, and its entry."""
    import yaml

    return {name: (file, stage) for file in PIPELINES
            for name, stage in yaml.safe_load((REPO / file).read_text())["stages"].items()}


def write_parallel(folder: Path, split: str, en: list[str], de: list[str],
                   pattern: str = "{split}.{lang}") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for lang, lines in (("en", en), ("de", de)):
        path = folder / pattern.format(split=split, lang=lang)
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


@pytest.fixture
def local_corpus(tmp_path: Path) -> Path:
    """A folder train/valid/test.{en,de} of real sentences."""
    folder = tmp_path / "corpus"
    write_parallel(folder, "train", SENTENCES_EN * 5, SENTENCES_DE * 5)
    write_parallel(folder, "valid", SENTENCES_EN[:3], SENTENCES_DE[:3])
    write_parallel(folder, "test", SENTENCES_EN[3:], SENTENCES_DE[3:])
    return folder


def make_fake_hub(folder: Path, splits: dict[str, list[tuple[str, str]]],
                  config: str = "de-en") -> Path:
    """A local folder laid out like the hub's wmt/wmt14 repository: parquet files with one
    column ``translation: {de, en}`` and a README whose metadata names the config."""
    (folder / config).mkdir(parents=True, exist_ok=True)
    meta = ["---", "configs:", f"- config_name: {config}", "  data_files:"]
    for split, pairs in splits.items():
        rows = [{"de": de, "en": en} for en, de in pairs]
        table = pa.table({"translation": pa.array(rows, type=pa.struct(
            [("de", pa.string()), ("en", pa.string())]))})
        pq.write_table(table, folder / config / f"{split}-00000-of-00001.parquet")
        meta += [f"  - split: {split}", f"    path: {config}/{split}-*"]
    (folder / "README.md").write_text("\n".join(meta + ["---", "# a test copy"]) + "\n")
    return folder


@pytest.fixture
def fake_hub(tmp_path: Path) -> Path:
    pairs = list(zip(SENTENCES_EN, SENTENCES_DE, strict=True))
    return make_fake_hub(tmp_path / "wmt14", {"train": pairs * 3, "validation": pairs[:2],
                                              "test": pairs[2:]})


def usage_error(call, capsys) -> str:
    """Run ``call``, which must stop as argparse does on a bad argument (exit status 2), and
    return what it wrote to stderr."""
    with pytest.raises(SystemExit) as stop:
        call()
    assert stop.value.code == 2
    return capsys.readouterr().err


def save_model_folder(model, tokenizer: Path, out: Path, **config) -> Path:
    """``model`` as `aiayn average` writes its folder: weights, config.json (plus ``config``)
    and the tokenizer beside them."""
    from aiayn.io import file_sha256
    from aiayn.training.checkpoint import export_model

    export_model(out, model.state_dict(),
                 {"model": model.cfg.to_dict(), "vocab_size": model.cfg.vocab_size,
                  "tokenizer_sha256": file_sha256(tokenizer), **config},
                 extra_files={"tokenizer.json": tokenizer})
    return out


def command_env() -> dict[str, str]:
    """Environment for running the project's commands in a subprocess, offline."""
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["HF_HUB_OFFLINE"] = "1"
    env["HF_DATASETS_OFFLINE"] = "1"
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


@pytest.fixture
def cli_env() -> dict[str, str]:
    """Environment for running the project's commands in a subprocess, offline."""
    return command_env()


TINY_PARAMS = {
    "data": {"toy": {"train_pairs": 400, "valid_pairs": 40, "test_pairs": 40, "max_words": 12}},
    "vocab": {"vocab_size": 400, "min_frequency": 2},
    "shard": {"max_tokens": 160, "max_len": 48},
    "model": {"d_model": 32, "heads": 4, "encoder_layers": 1, "decoder_layers": 1, "d_ff": 64,
              "dropout": 0.1, "max_positions": 64},
    "train": {"tokens_per_step": 320, "max_tokens": 160, "steps": 12, "warmup_steps": 4,
              "lr_scale": 1.0, "log_every": 2, "valid_every": 6, "checkpoint_every_steps": 3,
              "checkpoint_every_minutes": 0, "keep_checkpoints": 5, "average_last": 2},
}


def merge(base: dict, changes: dict) -> dict:
    out = dict(base)
    for key, value in changes.items():
        out[key] = merge(base.get(key, {}), value) if isinstance(value, dict) else value
    return out


def write_params(path: Path, changes: dict | None = None) -> Path:
    """The committed params.yaml with TINY_PARAMS and ``changes`` applied."""
    import yaml

    base = yaml.safe_load((REPO / "params.yaml").read_text())
    path.write_text(yaml.safe_dump(merge(merge(base, TINY_PARAMS), changes or {}),
                                   sort_keys=False))
    return path


def build_toy_workspace(root: Path, changes: dict | None = None) -> Path:
    """``root`` with params.yaml (TINY_PARAMS and ``changes``) and data/{raw,vocab,survey,
    shards} for its toy corpus, built through the library functions the stages call."""
    from aiayn.config import load_params
    from aiayn.data.corpus import iter_raw, make_source, write_raw_splits
    from aiayn.data.shards import build_shards
    from aiayn.data.survey import build_survey
    from aiayn.data.tokenizer import save_tokenizer, train_bpe

    root.mkdir(parents=True, exist_ok=True)
    p = load_params(write_params(root / "params.yaml", changes))
    raw = root / "data/raw"
    write_raw_splits(make_source(p.data), p.data.languages, p.data.clean, raw)
    texts = (b[lang] for b in iter_raw(raw, "train") for lang in p.data.languages)
    tok = train_bpe(texts, p.vocab.vocab_size, p.vocab.min_frequency)
    tokenizer = root / "data/vocab/tokenizer.json"
    save_tokenizer(tok, tokenizer)
    survey = root / "data/survey"
    build_survey(tokenizer, raw, p.data.languages, survey)
    build_shards(survey, tokenizer, root / "data/shards", p.shard, *p.data.languages)
    return root


@pytest.fixture(scope="session")
def toy_workspace(tmp_path_factory) -> Path:
    """A folder with params.yaml and data/{raw,vocab,survey,shards} for a tiny toy corpus."""
    return build_toy_workspace(tmp_path_factory.mktemp("toy"))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- MLflow server


@pytest.fixture
def mlflow_server(tmp_path: Path):
    from bench.mlflow_compare import ServerError, local_server

    try:
        with local_server(f"sqlite:///{tmp_path}/db.sqlite", artifact_root=tmp_path / "artifacts",
                          cwd=tmp_path, timeout=120) as address:
            yield address
    except ServerError as e:
        pytest.fail(str(e))


# --------------------------------------------------------------------------- project copies

GIT_IDENTITY = {"GIT_AUTHOR_NAME": "aiayn tests", "GIT_AUTHOR_EMAIL": "tests@aiayn.invalid",
                "GIT_COMMITTER_NAME": "aiayn tests", "GIT_COMMITTER_EMAIL": "tests@aiayn.invalid"}


def run(cmd: list[str], cwd: Path, env: dict, check: bool = True,
        timeout: float = 600) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({result.returncode}):\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def project_files() -> list[str]:
    """The project's own files (what a clone of the repository holds, minus results)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [f for f in out.splitlines() if (REPO / f).is_file()
            and not f.startswith(("data/", "metrics/", "tests/", "bench/"))
            and f != "dvc.lock"]


def copy_project(root: Path, env: dict, preset_changes: dict | None = None) -> Path:
    """A copy of the project as a fresh git + DVC repository with one commit.

    ``preset_changes`` (nested dict) are merged into the copy's conf/experiment/demo.yaml
    and params.yaml is composed again, so that `dvc repro` and `dvc exp run` (which
    re-composes from conf/) both see them.
    """
    import yaml

    for name in project_files():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, root / name)
    (root / "metrics").mkdir(exist_ok=True)
    if preset_changes:
        preset = root / "conf/experiment/demo.yaml"
        merged = merge(yaml.safe_load(preset.read_text()), preset_changes)
        preset.write_text("# @package _global_\n" + yaml.safe_dump(merged, sort_keys=False))
        run(["aiayn", "params", "demo"], root, env)
    run(["git", "init", "-q"], root, env)
    run(["git", "add", "-A"], root, env)
    run(["git", "commit", "-q", "-m", "test repository"], root, env)
    return root


# --------------------------------------------------------------------------- one pipeline run

# The pipeline the end-to-end tests run: the copy's demo preset shrunk so that a whole
# `dvc repro` takes seconds. Written into the copy's conf/experiment/demo.yaml, so that
# `dvc exp run` (which composes params.yaml again from conf/) sees it too.
E2E_PRESET = {"data": {"toy": {"train_pairs": 1000, "valid_pairs": 60, "test_pairs": 60}},
              "vocab": {"vocab_size": 500}, "shard": {"max_tokens": 512, "max_len": 64},
              "model": {"d_model": 32, "d_ff": 64, "encoder_layers": 1, "decoder_layers": 1},
              "train": {"steps": 8, "tokens_per_step": 1024, "warmup_steps": 4, "log_every": 2,
                        "valid_every": 4, "checkpoint_every_steps": 2, "keep_checkpoints": 3,
                        "average_last": 2, "valid_bleu_every": 4}}


@dataclass(frozen=True)
class PipelineRun:
    """A repository after its first `dvc repro`, results committed; ``log`` is that run's."""

    root: Path
    log: str


@pytest.fixture(scope="session")
def e2e_baseline(tmp_path_factory) -> PipelineRun:
    """A copy of the project shrunk by E2E_PRESET, run once by `dvc repro` and committed:
    where a user stands after their first run. MLflow logs to the default store, mlflow.db
    in the repository. Shared by the whole session: a test that changes anything takes
    ``e2e_repo``, a copy of it, instead."""
    env = {**command_env(), **GIT_IDENTITY}
    root = copy_project(tmp_path_factory.mktemp("e2e") / "repo", env, E2E_PRESET)
    result = run(["dvc", "repro"], root, env)
    run(["git", "add", "-A"], root, env)
    run(["git", "commit", "-q", "-m", "baseline run"], root, env)
    return PipelineRun(root, result.stdout + result.stderr)


@pytest.fixture
def e2e_repo(e2e_baseline, tmp_path, cli_env) -> tuple[Path, dict]:
    """A copy of ``e2e_baseline`` of the test's own (git, DVC cache, outputs, mlflow.db),
    and the environment to run commands in it."""
    root, env = tmp_path / "repo", {**cli_env, **GIT_IDENTITY}
    shutil.copytree(e2e_baseline.root, root, symlinks=True)
    relocate_mlflow_store(root, e2e_baseline.root, env)
    return root, env


def relocate_mlflow_store(root: Path, old: Path, env: dict) -> None:
    """Make a copy of a repository at ``old`` log where its first run would have, had it
    run at ``root``: MLflow writes artifact locations as absolute paths (a copy must not log
    into the folder it was copied from), and the train stage saved its run id for the store
    at ``old`` (later stages log into that run only for the same store)."""
    import json
    import sqlite3

    from aiayn.tracking import RUN_FILE

    run_file = root / "data/checkpoints" / RUN_FILE
    saved = json.loads(run_file.read_text())
    saved["tracking_uri"] = f"sqlite:///{root / 'mlflow.db'}"
    run_file.write_text(json.dumps(saved, indent=2) + "\n")
    # the outputs as they are now, and the deps of the stages after them
    run(["dvc", "commit", "--force", "dvc.yaml"], root, env)
    run(["git", "commit", "-q", "-am", "the baseline's MLflow run, here"], root, env)
    con = sqlite3.connect(root / "mlflow.db")
    with con:  # one transaction
        for table, column in (("experiments", "artifact_location"), ("runs", "artifact_uri")):
            con.execute(f"UPDATE {table} SET {column} = replace({column}, ?, ?)",
                        (str(old), str(root)))
    con.close()

"""aiayn.tracking against real MLflow stores: SQLite in tmp_path, a dead port, a real server."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
from mlflow import MlflowClient

from aiayn import tracking
from aiayn.tracking import Tracker, default_run_name, load_run_id, save_run_id
from tests.conftest import free_port

HTTP_VARS = (
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
    "MLFLOW_HTTP_REQUEST_TIMEOUT",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
)

PARAMS = {
    "model": {"d_model": 512, "heads": 8, "dropout": 0.1, "share_embeddings": True},
    "data": {"hub": {"splits": {"train": "train[:90%]", "valid": None}}, "langs": ["en", "de"]},
    "seed": 1234,
    "empty": {},  # no key (aiayn.config.flatten)
    "long": "x" * 7000,  # over MLflow's limit: MLflow truncates it
    # More than one log_batch worth (MLflow's client splits the batch into calls of 100).
    "many": {f"k{i:03d}": i for i in range(150)},
}


def expected_flat() -> dict[str, str]:
    flat = {
        "model.d_model": "512",
        "model.heads": "8",
        "model.dropout": "0.1",
        "model.share_embeddings": "True",
        "data.hub.splits.train": "train[:90%]",
        "data.hub.splits.valid": "None",
        "data.langs": "['en', 'de']",
        "seed": "1234",
        "long": "x" * 6000,
    }
    flat.update({f"many.k{i:03d}": str(i) for i in range(150)})
    return flat


def git(cwd: Path, *args: str) -> str:
    out = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
        cwd=cwd, check=True, capture_output=True, text=True,
    )
    return out.stdout.strip()


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No tracking URI, DVC experiment or HTTP settings leak in from the caller's shell, nor
    out of a test (``tracking.configure`` sets process-wide ones)."""
    for name in ("MLFLOW_TRACKING_URI", "DVC_EXP_NAME", "MLFLOW_LOGGING_LEVEL", *HTTP_VARS):
        monkeypatch.setenv(name, "")  # recorded: restored (or removed) after the test
        monkeypatch.delenv(name)
    # git must not find a repository above tmp_path (the tests make their own).
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    monkeypatch.chdir(tmp_path)  # the sqlite store puts artifacts in ./mlruns


@pytest.fixture(scope="session")
def migrated_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty, migrated MLflow SQLite store (creating one takes MLflow ~10 s here)."""
    path = tmp_path_factory.mktemp("template") / "mlflow.db"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SQLAlchemy deprecations inside MLflow
        MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments(max_results=1)
    return path


@pytest.fixture
def uri(tmp_path: Path, migrated_db: Path) -> str:
    shutil.copyfile(migrated_db, tmp_path / "mlflow.db")
    return f"sqlite:///{tmp_path}/mlflow.db"


@pytest.fixture
def commit(tmp_path: Path) -> str:
    git(tmp_path, "init", "-q")
    git(tmp_path, "commit", "-q", "--allow-empty", "-m", "baseline")
    return git(tmp_path, "rev-parse", "HEAD")


def test_run_params_metrics_tags_artifacts(
    tmp_path: Path, uri: str, commit: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DVC_EXP_NAME", "exp-lucid-owl")
    assert default_run_name() == "exp-lucid-owl"
    tracker = Tracker(tracking_uri=uri, experiment="wmt14")
    run_id = tracker.start(default_run_name(), PARAMS, tags={"stage": "train"})
    assert run_id is not None and tracker.run_id == run_id and tracker.active

    for step, loss in [(0, 9.5), (100, 5.25), (200, 4.125)]:
        tracker.log_metrics({"train/loss": loss, "lr": step * 1e-6}, step=step)
    ckpt = tmp_path / "ckpt.safetensors"
    ckpt.write_bytes(b"\x00" * 64)
    folder = tmp_path / "plots"
    (folder / "sub").mkdir(parents=True)
    (folder / "curve.png").write_bytes(b"png")
    (folder / "sub" / "attn.png").write_bytes(b"png")
    tracker.log_artifact(ckpt, artifact_path="checkpoints")
    tracker.log_artifact(folder)
    tracker.set_tags({"bleu": "27.3"})
    tracker.end()
    assert not tracker.active and tracker.run_id == run_id

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    assert run.info.run_name == "exp-lucid-owl"
    assert client.get_experiment(run.info.experiment_id).name == "wmt14"
    assert run.data.params == expected_flat()
    history = client.get_metric_history(run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(0, 9.5), (100, 5.25), (200, 4.125)]
    assert [m.step for m in client.get_metric_history(run_id, "lr")] == [0, 100, 200]
    tags = run.data.tags
    assert tags["git_commit"] == commit
    assert tags["mlflow.source.git.commit"] == commit
    assert tags["dvc_experiment"] == "exp-lucid-owl"
    assert tags["stage"] == "train" and tags["bleu"] == "27.3"
    assert run.info.status == "FINISHED" and run.info.end_time is not None

    assert [a.path for a in client.list_artifacts(run_id, "checkpoints")] == [
        "checkpoints/ckpt.safetensors"
    ]
    top = {a.path for a in client.list_artifacts(run_id)}
    assert top == {"checkpoints", "curve.png", "sub"}
    assert [a.path for a in client.list_artifacts(run_id, "sub")] == ["sub/attn.png"]
    # Default artifact root of the sqlite store: ./mlruns in the cwd.
    stored = Path(run.info.artifact_uri.removeprefix("file://")) / "checkpoints/ckpt.safetensors"
    assert stored.is_relative_to(tmp_path / "mlruns") and stored.read_bytes() == ckpt.read_bytes()


def test_resume_appends_metrics_and_keeps_params(
    uri: str, caplog: pytest.LogCaptureFixture
) -> None:
    first = Tracker(tracking_uri=uri)
    run_id = first.start("run", {"model": {"d_model": 512}, "seed": 1})
    first.log_metrics({"loss": 3.0}, step=1)
    first.log_metrics({"loss": 2.0}, step=2)
    first.end("KILLED")  # a stage that was interrupted
    client = MlflowClient(tracking_uri=uri)
    assert client.get_run(run_id).info.status == "KILLED"

    second = Tracker(tracking_uri=uri)
    with caplog.at_level(logging.WARNING, logger="aiayn"):
        resumed = second.start(
            "ignored-on-resume", {"model": {"d_model": 1024}, "seed": 1, "extra": {"a": 2}},
            run_id=run_id,
        )
    assert resumed == run_id
    run = client.get_run(run_id)
    assert run.info.status == "RUNNING" and run.info.run_name == "run"
    # Present params are not re-logged (MLflow would refuse a new value); new ones are added.
    assert run.data.params == {"model.d_model": "512", "seed": "1", "extra.a": "2"}
    assert [r.getMessage() for r in caplog.records if "model.d_model" in r.getMessage()]
    second.log_metrics({"loss": 1.5}, step=3)
    second.end()
    history = client.get_metric_history(run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(1, 3.0), (2, 2.0), (3, 1.5)]
    assert client.get_run(run_id).info.status == "FINISHED"
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_unknown_run_id_starts_a_new_run(uri: str) -> None:
    tracker = Tracker(tracking_uri=uri)
    run_id = tracker.start(None, {"a": 1}, run_id="0123456789abcdef0123456789abcdef")
    assert run_id is not None and run_id != "0123456789abcdef0123456789abcdef"
    run = MlflowClient(tracking_uri=uri).get_run(run_id)
    assert run.info.run_name  # MLflow picked one
    assert run.data.params == {"a": "1"}
    # Outside a git repository and outside `dvc exp run`: neither tag.
    assert "git_commit" not in run.data.tags and "dvc_experiment" not in run.data.tags
    tracker.end()


def test_default_uri_is_sqlite_in_cwd(
    tmp_path: Path, migrated_db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert Tracker().tracking_uri == "sqlite:///mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://example.invalid:5000")
    assert Tracker().tracking_uri == "http://example.invalid:5000"
    assert Tracker("sqlite:///x.db").tracking_uri == "sqlite:///x.db"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    shutil.copyfile(migrated_db, tmp_path / "mlflow.db")
    tracker = Tracker()
    run_id = tracker.start(None, {})
    tracker.end()
    # The run is in ./mlflow.db of the cwd.
    assert MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(run_id).info.run_id == run_id


def test_run_id_file_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "out" / "mlflow_run.json"
    assert load_run_id(path) is None
    save_run_id(path, "abc123", tracking_uri="sqlite:///mlflow.db")
    assert load_run_id(path) == "abc123"
    assert load_run_id(path, tracking_uri="sqlite:///mlflow.db") == "abc123"
    assert load_run_id(path, tracking_uri="http://elsewhere:5000") is None
    assert not [p for p in path.parent.iterdir() if p.name != path.name]  # no temp leftovers
    save_run_id(path, None)
    assert load_run_id(path) is None
    path.write_text("{not json", encoding="utf-8")
    assert load_run_id(path) is None


def test_a_run_id_saved_for_the_absolute_sqlite_uri_is_found_by_the_relative_one(
        tmp_path: Path, monkeypatch) -> None:
    # A DVC stage saves the absolute URI of the repository's mlflow.db; a stage run by hand
    # in the repository uses sqlite:///mlflow.db, the same file.
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "mlflow_run.json"
    save_run_id(path, "abc123", tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    assert load_run_id(path, tracking_uri="sqlite:///mlflow.db") == "abc123"
    assert load_run_id(path, tracking_uri="sqlite:///other.db") is None


def test_a_store_with_no_relative_path_saves_the_absolute_one(tmp_path, monkeypatch) -> None:
    # On Windows a store on another drive than the run file has no relative path
    # (os.path.relpath raises ValueError): the run id is saved with the absolute URI alone.
    import aiayn.tracking

    def no_relpath(*args):
        raise ValueError("path is on mount 'D:', start on mount 'C:'")

    monkeypatch.setattr(aiayn.tracking.os.path, "relpath", no_relpath)
    path = tmp_path / "run" / "mlflow_run.json"
    uri = f"sqlite:///{tmp_path}/store/mlflow.db"
    save_run_id(path, "abc123", tracking_uri=uri)
    assert "sqlite_from_run_file" not in json.loads(path.read_text(encoding="utf-8"))
    assert load_run_id(path, tracking_uri=uri) == "abc123"
    assert load_run_id(path, tracking_uri=f"sqlite:///{tmp_path}/other.db") is None


def test_a_moved_repository_keeps_its_link_to_the_training_run(tmp_path, monkeypatch) -> None:
    # Under `dvc repro` the run file records the absolute path of the repository's mlflow.db
    # (DVC_ROOT). Once the repository is moved (or copied with its store), the later stages
    # must still log into the training run there, not start an unlinked one.
    import shutil

    from aiayn.tracking import log_into_run

    old = tmp_path / "old-home"
    run_file = old / "data" / "checkpoints" / "mlflow_run.json"
    run_file.parent.mkdir(parents=True)
    monkeypatch.setenv("DVC_ROOT", str(old))
    train = Tracker()
    run_id = train.start("train", {})
    train.end()
    save_run_id(run_file, run_id)
    assert f"sqlite:///{old}" in run_file.read_text(encoding="utf-8")

    new = tmp_path / "moved"
    shutil.move(old, new)
    monkeypatch.setenv("DVC_ROOT", str(new))
    moved_file = new / "data" / "checkpoints" / "mlflow_run.json"
    assert log_into_run(moved_file, "score", {"test/sacrebleu": 30.0}) == run_id
    assert MlflowClient(f"sqlite:///{new}/mlflow.db").get_run(run_id).data.metrics == {
        "test/sacrebleu": 30.0}
    # Another store is still another store: no run id for it.
    assert load_run_id(moved_file, f"sqlite:///{tmp_path}/elsewhere.db") is None
    assert load_run_id(moved_file, "http://elsewhere:5000") is None


def test_disabled_tracker_is_a_no_op(tmp_path: Path) -> None:
    tracker = Tracker(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", enabled=False)
    assert tracker.start("run", PARAMS, tags={"a": "b"}) is None
    tracker.log_metrics({"loss": 1.0}, step=1)
    tracker.log_artifact(tmp_path / "missing")
    tracker.set_tags({"a": "b"})
    tracker.end()
    assert tracker.run_id is None and not tracker.active
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "mlruns").exists()


def test_unreachable_server_gives_up_quickly(caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()  # nothing listens there
    tracker = Tracker(tracking_uri=f"http://127.0.0.1:{port}")
    with caplog.at_level(logging.DEBUG, logger="aiayn"):
        t0 = time.monotonic()
        assert tracker.start("run", PARAMS) is None
        elapsed = time.monotonic() - t0
        tracker.log_metrics({"loss": 1.0}, step=1)
        tracker.log_artifact(__file__)
        tracker.set_tags({"a": "b"})
        tracker.end("FAILED")
    assert elapsed < 20, f"took {elapsed:.1f} s to give up"
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1
    message = warned[0].getMessage()
    assert message.startswith(f"MLflow at http://127.0.0.1:{port} is unreachable (")
    assert "Connection refused" in message
    assert message.endswith("; training continues, the same numbers are in metrics/")
    assert tracker.run_id is None and not tracker.active


def test_hanging_server_gives_up_quickly(caplog: pytest.LogCaptureFixture) -> None:
    """A server that accepts connections but never answers (a stuck or overloaded one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        port = sock.getsockname()[1]
        tracker = Tracker(tracking_uri=f"http://127.0.0.1:{port}")
        with caplog.at_level(logging.DEBUG, logger="aiayn"):
            t0 = time.monotonic()
            assert tracker.start("run", {"a": 1}) is None
            elapsed = time.monotonic() - t0
            tracker.log_metrics({"loss": 1.0}, step=1)
    assert elapsed < 20, f"took {elapsed:.1f} s to give up"
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1
    assert "is unreachable (Read timed out." in warned[0].getMessage()


def test_process_wide_settings_are_set_once_and_the_users_win(
    uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    assert "MLFLOW_HTTP_REQUEST_TIMEOUT" not in os.environ
    tracker = Tracker(tracking_uri=uri)
    assert tracker.start("run", {}) is not None  # the stage's first MLflow call configures
    tracker.end()
    assert {name: os.environ[name] for name in HTTP_VARS} == {
        **tracking.HTTP_LIMITS, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}  # the user's stays
    assert os.environ["MLFLOW_LOGGING_LEVEL"] == "WARNING"
    assert logging.getLogger("urllib3.connectionpool").getEffectiveLevel() == logging.ERROR
    tracking.configure()  # again: the same
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "0"


def test_failing_call_disables_with_one_warning(
    uri: str, caplog: pytest.LogCaptureFixture
) -> None:
    tracker = Tracker(tracking_uri=uri)
    run_id = tracker.start("run", {"a": 1})
    with caplog.at_level(logging.WARNING, logger="aiayn"):
        tracker.log_metrics({"a/../b": 1.0}, step=1)  # MLflow rejects this name
        tracker.log_metrics({"loss": 1.0}, step=2)
        tracker.end()
    assert len(caplog.records) == 1
    assert "failed in log_metrics" in caplog.records[0].getMessage()
    assert not tracker.active and tracker.run_id is None
    run = MlflowClient(tracking_uri=uri).get_run(run_id)
    assert run.info.status == "FAILED"  # not left RUNNING
    assert "loss" not in run.data.metrics


def test_console_stays_quiet(tmp_path: Path) -> None:
    """A fresh SQLite store (MLflow migrates it, loudly by default) prints nothing."""
    script = textwrap.dedent(f"""
        from aiayn.tracking import Tracker
        t = Tracker(tracking_uri="sqlite:///{tmp_path}/fresh.db")
        assert t.start("run", {{"a": {{"b": 1}}}}) is not None
        t.log_metrics({{"loss": 1.0}}, step=1)
        t.end()
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "" and out.stderr == ""


@pytest.mark.slow
def test_real_tracking_server(mlflow_server: str, tmp_path: Path) -> None:
    tracker = Tracker(tracking_uri=mlflow_server)
    run_id = tracker.start("served", PARAMS, tags={"stage": "train"})
    assert run_id is not None
    tracker.log_metrics({"loss": 2.5}, step=10)
    tracker.log_metrics({"loss": 2.0}, step=20)
    report = tmp_path / "report.json"
    report.write_text('{"bleu": 27.3}', encoding="utf-8")
    tracker.log_artifact(report, artifact_path="eval")
    tracker.end()

    client = MlflowClient(tracking_uri=mlflow_server)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "served"
    assert run.data.params == expected_flat()
    assert run.data.tags["stage"] == "train"
    history = client.get_metric_history(run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(10, 2.5), (20, 2.0)]
    assert [a.path for a in client.list_artifacts(run_id, "eval")] == ["eval/report.json"]
    stored = list((tmp_path / "artifacts").rglob("report.json"))
    assert len(stored) == 1 and stored[0].read_text(encoding="utf-8") == '{"bleu": 27.3}'

    # Resume over HTTP as well.
    again = Tracker(tracking_uri=mlflow_server)
    assert again.start("served", PARAMS, run_id=run_id) == run_id
    again.log_metrics({"loss": 1.75}, step=30)
    again.end()
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [10, 20, 30]


def test_the_default_store_is_the_dvc_repository_root_under_dvc(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    assert tracking.resolve_tracking_uri() == "sqlite:///mlflow.db"  # by hand: the cwd
    # Under DVC (a queued experiment runs in a copy, DVC_ROOT is the user's repository).
    monkeypatch.setenv("DVC_ROOT", str(tmp_path / "repo"))
    assert tracking.resolve_tracking_uri() == f"sqlite:///{tmp_path.resolve()}/repo/mlflow.db"
    # The user's choice wins over the default, and an explicit URI over both.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracker:5000")
    assert tracking.resolve_tracking_uri() == "http://tracker:5000"
    assert tracking.resolve_tracking_uri("sqlite:///x.db") == "sqlite:///x.db"


WRITER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from aiayn.tracking import Tracker

    uri, go, name = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    while not go.exists():  # all writers start together, on a store nobody has created yet
        time.sleep(0.005)
    t = Tracker(uri)
    assert t.start(name, {"train": {"lr_scale": name}, "model": {"d_model": 32}}), "no run"
    for step in range(1, 61):
        t.log_metrics({"train/loss": 1.0 / step, "train/lr": step * 1e-4}, step=step)
    t.set_tags({"stopped_by": "steps"})
    t.end()
    assert t.run_id, "the tracker turned itself off"
    print(t.run_id)
""")


def test_parallel_writers_share_one_sqlite_store(tmp_path: Path) -> None:
    # As `dvc queue start -j 3` does: three processes create, then fill, one fresh mlflow.db.
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, uri, str(go), f"w{i}"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(3)]
    time.sleep(3)  # all of them imported and waiting
    go.touch()
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
        assert "MLflow at" not in err, err[-3000:]  # no warning: nothing was dropped
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("aiayn").experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["w0", "w1", "w2"]
    for r in runs:
        assert r.info.status == "FINISHED" and r.data.tags["stopped_by"] == "steps"
        assert r.data.params["train.lr_scale"] == r.info.run_name  # its own, not another's
        history = client.get_metric_history(r.info.run_id, "train/loss")
        assert sorted(m.step for m in history) == list(range(1, 61))


def test_a_locked_database_is_tried_again(tmp_path: Path, monkeypatch) -> None:
    import sqlalchemy.exc

    t = Tracker(f"sqlite:///{tmp_path}/mlflow.db")
    assert t.start("r", {"a": 1})
    real, calls = t._client.log_batch, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) <= 2:  # what SQLite says while another process writes
            raise sqlalchemy.exc.OperationalError("INSERT", {}, Exception("database is locked"))
        return real(*args, **kwargs)

    monkeypatch.setattr(t._client, "log_batch", flaky)
    monkeypatch.setattr(tracking, "_LOCKED_DELAYS", (0.01, 0.01, 0.01))
    t.log_metrics({"x": 1.0}, step=1)
    assert t.active and len(calls) == 3
    t.end()
    history = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_metric_history(t.run_id, "x")
    assert [(m.step, m.value) for m in history] == [(1, 1.0)]


def test_an_experiment_that_reuses_a_training_logs_into_a_child_run(tmp_path, monkeypatch):
    # `dvc exp run -S decode.alpha=1.0` re-runs only translate and score: their numbers are
    # that experiment's, not the training run's, which keeps its own.
    from aiayn.tracking import log_into_run

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    run_file = tmp_path / "mlflow_run.json"
    monkeypatch.setenv("DVC_EXP_NAME", "base")
    train = Tracker()
    base = train.start("base", {"decode": {"alpha": 0.6}, "model": {"d_model": 32}})
    train.end()
    save_run_id(run_file, base, uri)
    assert log_into_run(run_file, "score", {"test/sacrebleu": 30.0}) == base

    monkeypatch.setenv("DVC_EXP_NAME", "alpha-1")
    params = {"decode": {"alpha": 1.0}, "model": {"d_model": 32}}
    child = log_into_run(run_file, "average", {"averaged_checkpoints": 2}, params=params)
    assert child not in (None, base)
    assert log_into_run(run_file, "score", {"test/sacrebleu": 31.5}, params=params) == child

    client = MlflowClient(uri)
    parent, kid = client.get_run(base), client.get_run(child)
    # Named for what it is (DVC's own names, such as zippy-fore, say nothing), found again
    # by the experiment's tag.
    assert kid.info.run_name == "decode.alpha=1.0" and kid.data.tags["dvc_experiment"] == "alpha-1"
    assert kid.data.tags["mlflow.parentRunId"] == base
    assert kid.data.params["decode.alpha"] == "1.0"
    assert kid.data.metrics == {"averaged_checkpoints": 2.0, "test/sacrebleu": 31.5}
    assert parent.data.metrics["test/sacrebleu"] == 30.0  # untouched by the child's score
    assert parent.data.tags["dvc_experiment"] == "base"
    assert parent.data.params["decode.alpha"] == "0.6"
    assert parent.info.status == "FINISHED" and kid.info.status == "FINISHED"
    # An experiment that changed none of the settings its parent logged: its experiment's name.
    monkeypatch.setenv("DVC_EXP_NAME", "rescore")
    again = log_into_run(run_file, "score", {"test/sacrebleu": 30.0},
                         params={"decode": {"alpha": 0.6}, "model": {"d_model": 32}})
    assert again not in (None, base, child)
    assert client.get_run(again).info.run_name == "rescore"
    monkeypatch.delenv("DVC_EXP_NAME")  # `dvc repro`, no experiment: the training run
    assert log_into_run(run_file, "score", {"test/sacrebleu": 30.5}) == base


def test_an_experiment_whose_train_stage_resumes_a_finished_run_does_not_take_it_over(
        tmp_path, monkeypatch):
    # `dvc exp run -n best -S train.average=best` after a change to the trainer's code: DVC
    # re-runs the train stage, which resumes the finished run (nothing to train) and then
    # average, translate and score. Their scores belong in a child run named `best`; the
    # training run keeps its name and its own scores.
    from aiayn.tracking import log_into_run

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    run_file = tmp_path / "mlflow_run.json"
    monkeypatch.setenv("DVC_EXP_NAME", "base")
    train = Tracker()
    base = train.start("base", {"train": {"average": "last"}})
    train.end()
    save_run_id(run_file, base, uri)
    assert log_into_run(run_file, "score", {"test/sacrebleu": 30.0}) == base

    monkeypatch.setenv("DVC_EXP_NAME", "best")
    params = {"train": {"average": "best"}}
    ended = MlflowClient(uri).get_run(base).info.end_time
    time.sleep(0.05)
    again = Tracker()
    assert again.start("best", params, tags={"stage": "train"}, run_id=base) == base
    assert MlflowClient(uri).get_run(base).info.status == "RUNNING"
    again.log_metrics({"final/steps": 12.0})
    again.end(unchanged=True)  # it trained nothing: the run keeps its duration
    assert MlflowClient(uri).get_run(base).info.end_time == ended
    child = log_into_run(run_file, "score", {"test/sacrebleu": 29.0}, params=params)
    assert child not in (None, base)

    client = MlflowClient(uri)
    parent, kid = client.get_run(base), client.get_run(child)
    assert parent.data.tags["dvc_experiment"] == "base"
    assert parent.data.metrics["test/sacrebleu"] == 30.0
    assert kid.info.run_name == "train.average=best" and kid.data.tags["dvc_experiment"] == "best"
    assert kid.data.tags["mlflow.parentRunId"] == base
    assert kid.data.metrics == {"test/sacrebleu": 29.0}
    assert parent.info.status == "FINISHED" and parent.info.end_time == ended


def test_an_experiment_does_not_take_over_a_run_that_dvc_repro_made(tmp_path, monkeypatch):
    # `dvc repro` made the training run (no experiment); `dvc exp run -n b2 -S
    # decode.beam=2` then re-runs train (a code change), which resumes that finished run.
    # b2's scores go to a child run; the workspace's run keeps its own.
    from aiayn.tracking import log_into_run

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    run_file = tmp_path / "mlflow_run.json"
    train = Tracker()
    base = train.start("aiayn", {"decode": {"beam": 4}})
    train.end()
    save_run_id(run_file, base, uri)
    assert log_into_run(run_file, "score", {"test/sacrebleu": 30.0}) == base

    monkeypatch.setenv("DVC_EXP_NAME", "b2")
    again = Tracker()
    assert again.start("b2", {"decode": {"beam": 2}}, run_id=base) == base
    again.end(unchanged=True)
    child = log_into_run(run_file, "score", {"test/sacrebleu": 29.0},
                         params={"decode": {"beam": 2}})
    assert child not in (None, base)
    client = MlflowClient(uri)
    parent, kid = client.get_run(base), client.get_run(child)
    assert "dvc_experiment" not in parent.data.tags
    assert parent.data.metrics["test/sacrebleu"] == 30.0
    assert kid.data.tags["dvc_experiment"] == "b2" and kid.info.run_name == "decode.beam=2"
    assert kid.data.tags["mlflow.parentRunId"] == base
    assert kid.data.metrics == {"test/sacrebleu": 29.0}


def test_dvc_repro_with_other_decoding_settings_scores_into_a_child_run(tmp_path,
                                                                         monkeypatch):
    # `dvc repro` trained with beam 4; decode.beam: 1 then re-runs translate and score on
    # the same training. That score is not the training run's (whose params say beam 4):
    # it goes to a child run named after the change, found again by the same change.
    from aiayn.tracking import VARIANT_TAG, log_into_run

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    run_file = tmp_path / "mlflow_run.json"
    beam4 = {"decode": {"beam": 4, "alpha": 0.6}, "train": {"steps": 600},
             "data": {"local": {"dir": "corpus"}}}
    train = Tracker()
    base = train.start("aiayn", beam4)
    train.end()
    save_run_id(run_file, base, uri)
    assert log_into_run(run_file, "score", {"test/sacrebleu": 30.0}, params=beam4) == base
    # a longer training is the same run (train.steps shapes training: not a variant)
    # nor is a data setting (it comes before training; the same run's data here)
    longer = {**beam4, "train": {"steps": 1200}, "data": {"local": {"dir": "../corpus"}}}
    assert log_into_run(run_file, "score", {"test/sacrebleu": 31.0}, params=longer) == base

    beam1 = {**longer, "decode": {"beam": 1, "alpha": 0.6}}
    child = log_into_run(run_file, "score", {"test/sacrebleu": 27.0}, params=beam1)
    assert child not in (None, base)
    assert log_into_run(run_file, "score", {"test/chrf": 50.0}, params=beam1) == child
    assert log_into_run(run_file, "score", {"test/sacrebleu": 31.5}, params=longer) == base
    client = MlflowClient(uri)
    parent, kid = client.get_run(base), client.get_run(child)
    assert kid.info.run_name == "decode.beam=1" and kid.data.tags[VARIANT_TAG] == "decode.beam=1"
    assert kid.data.tags["mlflow.parentRunId"] == base and "dvc_experiment" not in kid.data.tags
    assert kid.data.params["decode.beam"] == "1"
    assert kid.data.metrics == {"test/sacrebleu": 27.0, "test/chrf": 50.0}
    assert parent.data.metrics["test/sacrebleu"] == 31.5
    assert parent.info.status == kid.info.status == "FINISHED"


def test_a_resumed_run_that_goes_on_ends_at_its_new_end(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    first = Tracker(uri)
    run_id = first.start("run", {"train": {"steps": 10}})
    first.end()
    ended = MlflowClient(uri).get_run(run_id).info.end_time
    time.sleep(0.05)
    again = Tracker(uri)  # more steps: the training goes on in the same run
    assert again.start("run", {"train": {"steps": 20}}, run_id=run_id) == run_id
    again.end()
    assert MlflowClient(uri).get_run(run_id).info.end_time > ended
    fresh = Tracker(uri)  # unchanged on a run this session created: nothing to keep
    new_id = fresh.start("other", {})
    fresh.end(unchanged=True)
    assert MlflowClient(uri).get_run(new_id).info.end_time is not None


def test_a_stage_run_a_day_later_adds_its_own_time_to_the_duration_not_the_day(
        tmp_path, monkeypatch):
    # `dvc repro` re-runs only `score` a day after the pipeline ran (a new sacreBLEU
    # setting): the MLflow UI's Duration must count the minutes the stages worked, not the
    # day between them; a child run (an experiment that reused this training) likewise.
    from aiayn.tracking import log_into_run

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("DVC_EXP_NAME", "base")
    run_file = tmp_path / "mlflow_run.json"
    train = Tracker()
    run_id = train.start("base", {"train": {"steps": 10}})
    train.end()
    save_run_id(run_file, run_id, uri)
    first = MlflowClient(uri).get_run(run_id).info
    day = 86_400_000

    def clock(*times):  # the session's start, then its end, as the stage sees them
        ticks = iter(times)
        monkeypatch.setattr(tracking, "_now_ms", lambda: next(ticks))

    clock(first.end_time + day, first.end_time + day + 5_000)
    assert log_into_run(run_file, "score", {"test/sacrebleu": 30.0}) == run_id
    info = MlflowClient(uri).get_run(run_id).info
    assert info.status == "FINISHED" and info.start_time == first.start_time
    assert info.end_time == first.end_time + 5_000

    monkeypatch.setenv("DVC_EXP_NAME", "beam8")  # reuses base's training: a child run
    monkeypatch.setattr(tracking, "_now_ms", lambda: int(time.time() * 1000))
    child = log_into_run(run_file, "translate", {"valid/sacrebleu": 31.0},
                         params={"decode": {"beam": 8}})
    assert child not in (None, run_id)
    kid = MlflowClient(uri).get_run(child).info  # created by this session: ends now
    assert kid.end_time >= kid.start_time
    clock(kid.end_time + day, kid.end_time + day + 7_000)
    assert log_into_run(run_file, "score", {"test/sacrebleu": 31.5},
                        params={"decode": {"beam": 8}}) == child
    assert MlflowClient(uri).get_run(child).info.end_time == kid.end_time + 7_000
    assert MlflowClient(uri).get_run(run_id).info.end_time == first.end_time + 5_000


def test_a_resumed_run_that_fails_counts_its_own_time_not_the_gap(tmp_path, monkeypatch):
    # A training resumed a day after its run ended, whose MLflow call then fails: the run is
    # marked FAILED (not left RUNNING), ending as a finished session would, at its old end
    # plus this session's length, not "now" with the day in between.
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    first_run = Tracker(tracking_uri=uri)
    run_id = first_run.start("base", {"train": {"steps": 10}})
    first_run.end()
    first = MlflowClient(uri).get_run(run_id).info
    day = 86_400_000
    ticks = iter([first.end_time + day, first.end_time + day + 9_000])
    monkeypatch.setattr(tracking, "_now_ms", lambda: next(ticks))

    resumed = Tracker(tracking_uri=uri)
    assert resumed.start("base", {"train": {"steps": 10}}, run_id=run_id) == run_id

    def refuse(*args, **kwargs):
        raise RuntimeError("the store refused the batch")

    monkeypatch.setattr(MlflowClient, "log_batch", refuse)
    resumed.log_metrics({"train/loss": 1.0}, step=11)
    assert not resumed.active  # disabled after the failure
    info = MlflowClient(uri).get_run(run_id).info
    assert info.status == "FAILED"
    assert info.end_time == first.end_time + 9_000

"""bench/mlflow_compare.py: which runs it compares, the address it opens (no browser here), and
the local MLflow server it (and the tests' mlflow_server fixture) runs."""

from __future__ import annotations

import json
import os
from pathlib import Path
from urllib.parse import parse_qs, unquote

import pytest

from bench import mlflow_compare as compare


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory):
    """A sqlite store laid out as the trainer and a decoding experiment leave it."""
    from mlflow import MlflowClient

    root = tmp_path_factory.mktemp("store")
    uri = f"sqlite:///{root}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("aiayn", artifact_location=(root / "artifacts").as_uri())
    ids = {}
    for name in ("ls0.2", "ls0.3"):
        ids[name] = client.create_run(exp, run_name=name, tags={"dvc_experiment": name}).info.run_id
    # A decoding experiment: a child run of the training it reused, under its own name.
    ids["ls0.2-a1.6"] = client.create_run(
        exp, run_name="ls0.2-a1.6",
        tags={"dvc_experiment": "ls0.2-a1.6", "mlflow.parentRunId": ids["ls0.2"]}).info.run_id
    # A name reused: the later run is the one meant.
    ids["old ls0.3"] = ids["ls0.3"]
    ids["ls0.3"] = client.create_run(exp, run_name="ls0.3",
                                     tags={"dvc_experiment": "ls0.3"}).info.run_id
    # A run of no DVC experiment (stage run by hand): found by its run name.
    ids["by-hand"] = client.create_run(exp, run_name="by-hand").info.run_id
    return uri, exp, ids


def test_finds_each_name_in_the_order_given(store):
    uri, exp, ids = store
    runs = compare.find_runs(uri, "aiayn", ["ls0.3", "ls0.2-a1.6", "by-hand", "ls0.2"])
    expected = [ids["ls0.3"], ids["ls0.2-a1.6"], ids["by-hand"], ids["ls0.2"]]
    assert [r.info.run_id for r in runs] == expected
    assert ids["old ls0.3"] != ids["ls0.3"]


def test_unknown_name_is_a_clear_error(store):
    uri, _, _ = store
    with pytest.raises(compare.CompareError) as e:
        compare.find_runs(uri, "aiayn", ["ls0.2", "ls0.5", "ls0.6"])
    message = str(e.value)
    assert "ls0.5, ls0.6" in message and "Runs there: by-hand, ls0.2, ls0.2-a1.6, ls0.3" in message
    with pytest.raises(compare.CompareError, match="no MLflow experiment 'nope'.*aiayn"):
        compare.find_runs(uri, "nope", ["ls0.2"])


def test_compare_url_round_trips():
    url = compare.compare_url("http://127.0.0.1:5000/", ["b", "a"], ["7", "3", "7"])
    base, fragment = url.split("/#/compare-runs?")
    assert base == "http://127.0.0.1:5000"
    query = parse_qs(fragment)
    assert json.loads(unquote(query["runs"][0])) == ["b", "a"]
    assert json.loads(unquote(query["experiments"][0])) == ["3", "7"]


def test_missing_store_exits_2_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "shot.png"
    uri = f"sqlite:///{tmp_path}/none.db"
    code = compare.main(["ls0.2", "--tracking-uri", uri, "--out", str(out)])
    assert code == 2 and not out.exists()
    assert "none.db: no MLflow store there" in capsys.readouterr().err


def _children() -> list[str]:
    """Command lines of this process's live children (Linux /proc; [] elsewhere)."""
    found = []
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else []:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
                found.append(Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " "))
        except (OSError, ValueError, IndexError):
            continue
    return found


@pytest.mark.slow
def test_local_server_that_cannot_start_says_why_and_leaves_no_process() -> None:
    with pytest.raises(compare.ServerError) as e:
        with compare.local_server("nosuchscheme://store", timeout=60):
            pytest.fail("a server on an unsupported store must not come up")
    # The message carries the server's own log: the store it could not use.
    assert "mlflow server exited" in str(e.value) and "nosuchscheme://store" in str(e.value)
    assert [c for c in _children() if "mlflow" in c] == []

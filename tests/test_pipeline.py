"""End to end: the data stages through `dvc repro` / `dvc exp run` in a temporary repository.

Checks that the pipeline runs on the toy source, writes what dvc.yaml declares, and that
DVC re-runs exactly the stages whose params or deps changed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import REPO

pytestmark = pytest.mark.slow

GIT_IDENTITY = {"GIT_AUTHOR_NAME": "aiayn tests", "GIT_AUTHOR_EMAIL": "tests@aiayn.invalid",
                "GIT_COMMITTER_NAME": "aiayn tests", "GIT_COMMITTER_EMAIL": "tests@aiayn.invalid"}


def run(cmd: list[str], cwd: Path, env: dict, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({result.returncode}):\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [f for f in out.splitlines() if (REPO / f).is_file()
            and not f.startswith(("data/", "metrics/", "tests/", "bench/"))
            and f != "dvc.lock"]


def set_params(repo: Path, **changes) -> None:
    params = yaml.safe_load((repo / "params.yaml").read_text())
    for dotted, value in changes.items():
        node = params
        *path, last = dotted.split("__")
        for key in path:
            node = node[key]
        node[last] = value
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


@pytest.fixture
def repo(tmp_path, cli_env) -> tuple[Path, dict]:
    """A copy of the project as a fresh git + DVC repository with a first commit."""
    root = tmp_path / "repo"
    for name in tracked_files():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, root / name)
    (root / "metrics").mkdir(exist_ok=True)
    env = {**cli_env, **GIT_IDENTITY}
    # A small toy corpus keeps the test quick; everything else is the committed demo preset.
    set_params(root, data__toy__train_pairs=1500, data__toy__valid_pairs=100,
               data__toy__test_pairs=100, vocab__vocab_size=600, shard__max_tokens=512,
               shard__max_len=64)
    run(["git", "init", "-q"], root, env)
    run(["git", "add", "-A"], root, env)
    run(["git", "commit", "-q", "-m", "test repository"], root, env)
    return root, env


def repro(root: Path, env: dict) -> str:
    result = run(["dvc", "repro"], root, env)
    return result.stdout + result.stderr


def ran(log: str, stage: str) -> bool:
    return f"Running stage '{stage}'" in log


def test_dvc_repro_runs_the_data_stages_and_reruns_only_what_changed(repo):
    root, env = repo
    log = repro(root, env)
    assert all(ran(log, s) for s in ("download", "vocab", "survey", "shard")), log

    # Outputs declared in dvc.yaml exist and agree with each other.
    for split in ("train", "valid", "test"):
        assert pq.read_schema(root / "data/raw" / f"{split}.parquet").names == ["de", "en"]
    download = json.loads((root / "metrics/download.json").read_text())
    assert download["splits"]["valid"]["kept"] == 100
    vocab = json.loads((root / "metrics/vocab.json").read_text())
    assert vocab["size"] <= 600 and vocab["en"]["unknown_rate"] == 0.0
    survey = json.loads((root / "metrics/survey.json").read_text())
    assert survey["splits"]["train"]["pairs"] == download["splits"]["train"]["kept"]
    shard = json.loads((root / "metrics/shard.json").read_text())
    train = shard["splits"]["train"]
    assert train["pairs"] + train["dropped_over_max_len"] == survey["splits"]["train"]["pairs"]
    assert 0 <= train["padding_ratio"] < 0.5
    assert (root / "data/shards/train/meta.json").is_file()
    assert (root / "metrics/survey_hist.png").read_bytes()[:4] == b"\x89PNG"

    # Everything is cached: nothing to run.
    assert json.loads(run(["dvc", "status", "--json"], root, env).stdout) == {}

    # A training parameter touches no data stage.
    set_params(root, train__steps=7, train__lr_scale=3.0, decode__beam=8)
    assert json.loads(run(["dvc", "status", "--json"], root, env).stdout) == {}

    # A vocabulary change re-runs vocab and what depends on it, never download.
    set_params(root, vocab__vocab_size=500)
    log = repro(root, env)
    assert not ran(log, "download") and ran(log, "vocab") and ran(log, "shard"), log
    assert json.loads((root / "metrics/vocab.json").read_text())["size"] <= 500

    # A batch-size change re-runs shard only.
    set_params(root, shard__max_tokens=256)
    log = repro(root, env)
    assert [s for s in ("download", "vocab", "survey", "shard") if ran(log, s)] == ["shard"]
    batches = np.load(root / "data/shards/train/batches.npy")
    shard = json.loads((root / "metrics/shard.json").read_text())
    assert len(batches) == shard["splits"]["train"]["batches"] and shard["max_tokens"] == 256


def test_dvc_exp_run_composes_presets_and_overrides(repo):
    root, env = repo
    run(["dvc", "exp", "run", "-n", "small-vocab", "-S", "experiment=demo",
         "-S", "data.toy.train_pairs=1200", "-S", "vocab.vocab_size=450",
         "-S", "shard.max_tokens=512", "-S", "shard.max_len=64"], root, env)
    shown = json.loads(run(["dvc", "exp", "show", "--json"], root, env).stdout)
    text = json.dumps(shown)
    assert "small-vocab" in text
    # The experiment's params are the Hydra composition: preset values plus the overrides.
    exp_params = run(["dvc", "exp", "show", "--json", "--only-changed"], root, env).stdout
    assert "450" in exp_params
    params = yaml.safe_load((root / "params.yaml").read_text())
    assert params["vocab"]["vocab_size"] == 450 and params["data"]["toy"]["train_pairs"] == 1200
    assert params["model"]["d_model"] == 128  # from conf/experiment/demo.yaml
    vocab = json.loads((root / "metrics/vocab.json").read_text())
    assert vocab["requested_size"] == 450


def test_a_bad_param_stops_dvc_repro_before_any_work(repo):
    root, env = repo
    set_params(root, model__heads=5)
    result = run(["dvc", "repro"], root, env, check=False)
    assert result.returncode != 0
    assert "d_model (128) must be divisible by heads (5)" in result.stderr + result.stdout
    assert not (root / "data/raw").exists()

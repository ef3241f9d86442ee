"""End to end: the stages through `dvc repro` / `dvc exp run` in a temporary repository.

Checks that the pipeline runs on the toy source, writes what dvc.yaml declares, and that
DVC re-runs exactly the stages whose params or deps changed. The first run is the session's
``e2e_baseline`` (tests/conftest.py), shared with tests/test_experiments.py; each test that
changes something works in a copy of it.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import E2E_PRESET, GIT_IDENTITY, copy_project, run

pytestmark = pytest.mark.slow
STAGES = ("download", "vocab", "survey", "shard", "train", "average", "translate", "score")
DATA_STAGES = STAGES[:4]


def set_params(repo: Path, **changes) -> None:
    params = yaml.safe_load((repo / "params.yaml").read_text())
    for dotted, value in changes.items():
        node = params
        *path, last = dotted.split("__")
        for key in path:
            node = node[key]
        node[last] = value
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def repro(root: Path, env: dict) -> str:
    result = run(["dvc", "repro"], root, env)
    return result.stdout + result.stderr


def ran(log: str, stage: str) -> bool:
    return f"Running stage '{stage}'" in log


def status(root: Path, env: dict) -> set[str]:
    """The stages of dvc.yaml whose own params or deps changed (not those downstream)."""
    return set(json.loads(run(["dvc", "status", "dvc.yaml", "--json"], root, env).stdout))


def test_dvc_repro_runs_every_stage_and_reruns_only_what_changed(e2e_baseline, e2e_repo):
    log, first = e2e_baseline.log, e2e_baseline.root
    assert all(ran(log, s) for s in STAGES), log

    # Outputs declared in dvc.yaml exist and agree with each other.
    for split in ("train", "valid", "test"):
        assert pq.read_schema(first / "data/raw" / f"{split}.parquet").names == ["de", "en"]
    download = json.loads((first / "metrics/download.json").read_text())
    assert download["splits"]["valid"]["kept"] == E2E_PRESET["data"]["toy"]["valid_pairs"]
    vocab = json.loads((first / "metrics/vocab.json").read_text())
    assert vocab["size"] <= 500 and vocab["en"]["unknown_rate"] == 0.0
    survey = json.loads((first / "metrics/survey.json").read_text())
    assert survey["splits"]["train"]["pairs"] == download["splits"]["train"]["kept"]
    shard = json.loads((first / "metrics/shard.json").read_text())
    train = shard["splits"]["train"]
    assert train["pairs"] + train["dropped_over_max_len"] == survey["splits"]["train"]["pairs"]
    assert 0 <= train["padding_ratio"] < 0.5
    assert (first / "data/shards/train/meta.json").is_file()
    assert (first / "metrics/survey_hist.png").read_bytes()[:4] == b"\x89PNG"

    train = json.loads((first / "metrics/train.json").read_text())
    assert train["steps"] == 8 and train["valid_loss"] > 0
    model_config = json.loads((first / "data/model/config.json").read_text())
    assert model_config["averaged_steps"] == [6, 8] and model_config["model"]["d_model"] == 32
    assert (first / "data/model/model.safetensors").is_file()
    assert json.loads((first / "data/checkpoints/mlflow_run.json").read_text())["run_id"]
    hyps = (first / "data/translations/test.de").read_text(encoding="utf-8").splitlines()
    assert len(hyps) == E2E_PRESET["data"]["toy"]["test_pairs"]
    bleu = json.loads((first / "metrics/bleu.json").read_text())
    assert bleu["sentences"] == len(hyps) and 0 <= bleu["sacrebleu"]["score"] <= 100
    assert bleu["sacrebleu"]["signature"].startswith("nrefs:1|case:mixed")

    # Everything is cached, in a copy too: nothing to run. (`dvc status` alone also lists
    # the optional export pipeline until it has run: see export/dvc.yaml.)
    root, env = e2e_repo
    assert status(root, env) == set()
    check_the_export_pipeline(root, env, bleu)

    # A training parameter touches no data stage; a decoding one, translate and score (an
    # experiment that only decodes is scored, and logged, even if its output is the same);
    # averaging more re-runs average and what follows it.
    lr = yaml.safe_load((root / "params.yaml").read_text())["train"]["lr_scale"]
    set_params(root, train__lr_scale=lr + 2.0)
    assert status(root, env) == {"train"}
    set_params(root, train__lr_scale=lr, decode__beam=8)
    assert status(root, env) == {"translate", "score"}
    set_params(root, decode__beam=4, train__average_last=3)
    assert status(root, env) == {"average", "score"}
    log = repro(root, env)
    assert [s for s in STAGES if ran(log, s)] == ["average", "translate", "score"]

    # A vocabulary change re-runs vocab and what depends on it, never download.
    set_params(root, vocab__vocab_size=450)
    log = repro(root, env)
    assert not ran(log, "download") and ran(log, "vocab") and ran(log, "shard"), log
    assert ran(log, "train") and ran(log, "average")
    assert json.loads((root / "metrics/vocab.json").read_text())["size"] <= 450

    # A batch-size change touches shard alone of the data stages (what follows it re-runs
    # because shard's output changed, as the vocabulary change above showed).
    set_params(root, shard__max_tokens=256)
    assert status(root, env) == {"shard"}
    log = run(["dvc", "repro", "--single-item", "shard"], root, env).stdout
    assert [s for s in STAGES if ran(log, s)] == ["shard"]
    batches = np.load(root / "data/shards/train/batches.npy")
    shard = json.loads((root / "metrics/shard.json").read_text())
    assert len(batches) == shard["splits"]["train"]["batches"] and shard["max_tokens"] == 256


def check_the_export_pipeline(root: Path, env: dict, bleu: dict) -> None:
    """`dvc repro export/dvc.yaml` exports the model for both engines, with the BLEU of
    metrics/bleu.json in its card, and runs nothing of dvc.yaml that is up to date."""
    if not all(importlib.util.find_spec(m) for m in ("ctranslate2", "transformers")):
        return  # the export extras are not installed: tests/test_export.py says so
    log = run(["dvc", "repro", "export/dvc.yaml"], root, env).stdout
    assert ran(log, "export/dvc.yaml:export") and not any(ran(log, s) for s in STAGES), log
    for fmt, name in (("ctranslate2", "model.bin"), ("transformers", "model.safetensors")):
        folder = root / "data/export" / fmt
        assert (folder / name).is_file() and (folder / "tokenizer.json").is_file()
        card = (folder / "README.md").read_text(encoding="utf-8")
        assert f"| sacreBLEU | {bleu['sacrebleu']['score']:.1f} |" in card
        assert bleu["sacrebleu"]["signature"].replace("|", "\\|") in card
    # Now every pipeline is up to date, and `dvc repro` alone leaves the export alone.
    assert json.loads(run(["dvc", "status", "--json"], root, env).stdout) == {}
    assert not ran(repro(root, env), "export/dvc.yaml:export")


def test_dvc_exp_run_composes_presets_and_overrides(e2e_repo):
    root, env = e2e_repo
    tiny = ["model.d_model=32", "model.d_ff=64", "model.encoder_layers=1",
            "model.decoder_layers=1", "train.steps=2", "train.log_every=1",
            "train.valid_every=2", "train.checkpoint_every_minutes=0", "train.average_last=1"]
    overrides = ["experiment=demo", "data.toy.train_pairs=1200", "vocab.vocab_size=450",
                 "shard.max_tokens=512", "shard.max_len=64", *tiny]
    run(["dvc", "exp", "run", "-n", "small-vocab", *(a for o in overrides for a in ("-S", o))],
        root, env)
    shown = json.loads(run(["dvc", "exp", "show", "--json"], root, env).stdout)
    text = json.dumps(shown)
    assert "small-vocab" in text
    # The experiment's params are the Hydra composition: preset values plus the overrides.
    exp_params = run(["dvc", "exp", "show", "--json", "--only-changed"], root, env).stdout
    assert "450" in exp_params
    params = yaml.safe_load((root / "params.yaml").read_text())
    assert params["vocab"]["vocab_size"] == 450 and params["data"]["toy"]["train_pairs"] == 1200
    assert params["model"]["d_model"] == 32  # an override
    # from the (shrunk) conf/experiment/demo.yaml, over conf/config.yaml:
    assert params["train"]["warmup_steps"] == E2E_PRESET["train"]["warmup_steps"]
    assert params["data"]["source"] == "toy"
    vocab = json.loads((root / "metrics/vocab.json").read_text())
    assert vocab["requested_size"] == 450


def test_a_bad_param_stops_dvc_repro_before_any_work(tmp_path, cli_env):
    env = {**cli_env, **GIT_IDENTITY}
    root = copy_project(tmp_path / "repo", env, E2E_PRESET)
    set_params(root, model__heads=5)
    result = run(["dvc", "repro"], root, env, check=False)
    assert result.returncode != 0
    assert "model: d_model (32) must be divisible by heads (5)" in result.stderr
    assert not (root / "data/raw").exists()

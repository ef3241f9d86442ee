"""End to end: the data stages through `dvc repro` / `dvc exp run` in a temporary repository.

Checks that the pipeline runs on the toy source, writes what dvc.yaml declares, and that
DVC re-runs exactly the stages whose params or deps changed.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import GIT_IDENTITY, copy_project, run

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


# A small toy corpus and model keep the tests quick; everything else is the committed demo
# preset. Written into the copy's conf/experiment/demo.yaml, so `dvc exp run` composes it too.
SMALL = {"data": {"toy": {"train_pairs": 1500, "valid_pairs": 100, "test_pairs": 100}},
         "vocab": {"vocab_size": 600}, "shard": {"max_tokens": 512, "max_len": 64},
         "model": {"d_model": 32, "d_ff": 64, "encoder_layers": 1, "decoder_layers": 1},
         "train": {"steps": 6, "tokens_per_step": 1024, "warmup_steps": 3, "log_every": 2,
                   "valid_every": 3, "checkpoint_every_steps": 2,
                   "checkpoint_every_minutes": 0, "keep_checkpoints": 3, "average_last": 2}}


@pytest.fixture
def repo(tmp_path, cli_env) -> tuple[Path, dict]:
    """A copy of the project, shrunk by SMALL, as a fresh git + DVC repository."""
    env = {**cli_env, **GIT_IDENTITY}
    return copy_project(tmp_path / "repo", env, SMALL), env


def repro(root: Path, env: dict) -> str:
    result = run(["dvc", "repro"], root, env)
    return result.stdout + result.stderr


def ran(log: str, stage: str) -> bool:
    return f"Running stage '{stage}'" in log


def test_dvc_repro_runs_the_data_stages_and_reruns_only_what_changed(repo):
    root, env = repo
    log = repro(root, env)
    assert all(ran(log, s) for s in STAGES), log

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

    train = json.loads((root / "metrics/train.json").read_text())
    assert train["steps"] == 6 and train["valid_loss"] > 0
    model_config = json.loads((root / "data/model/config.json").read_text())
    assert model_config["averaged_steps"] == [4, 6] and model_config["model"]["d_model"] == 32
    assert (root / "data/model/model.safetensors").is_file()
    assert json.loads((root / "data/checkpoints/mlflow_run.json").read_text())["run_id"]
    hyps = (root / "data/translations/test.de").read_text(encoding="utf-8").splitlines()
    assert len(hyps) == 100
    bleu = json.loads((root / "metrics/bleu.json").read_text())
    assert bleu["sentences"] == 100 and 0 <= bleu["sacrebleu"]["score"] <= 100
    assert bleu["sacrebleu"]["signature"].startswith("nrefs:1|case:mixed")

    # Everything is cached: nothing to run. (`dvc status` alone also lists the optional
    # export pipeline until it has run: see export/dvc.yaml.)
    assert json.loads(run(["dvc", "status", "dvc.yaml", "--json"], root, env).stdout) == {}
    check_the_export_pipeline(root, env, bleu)

    # A training parameter touches no data stage; a decoding one, translate and score (an
    # experiment that only decodes is scored, and logged, even if its output is the same);
    # averaging more re-runs average and what follows it.
    lr = yaml.safe_load((root / "params.yaml").read_text())["train"]["lr_scale"]
    set_params(root, train__lr_scale=lr + 2.0)
    assert set(json.loads(run(["dvc", "status", "dvc.yaml", "--json"], root, env).stdout)) == {
        "train"}
    set_params(root, train__lr_scale=lr, decode__beam=8)
    assert set(json.loads(run(["dvc", "status", "dvc.yaml", "--json"], root, env).stdout)) == {
        "translate", "score"}
    set_params(root, decode__beam=4, train__average_last=3)
    assert set(json.loads(run(["dvc", "status", "dvc.yaml", "--json"], root, env).stdout)) == {
        "average", "score"}
    log = repro(root, env)
    assert [s for s in STAGES if ran(log, s)] == ["average", "translate", "score"]

    # A vocabulary change re-runs vocab and what depends on it, never download.
    set_params(root, vocab__vocab_size=500)
    log = repro(root, env)
    assert not ran(log, "download") and ran(log, "vocab") and ran(log, "shard"), log
    assert ran(log, "train") and ran(log, "average")
    assert json.loads((root / "metrics/vocab.json").read_text())["size"] <= 500

    # A batch-size change re-runs shard only.
    set_params(root, shard__max_tokens=256)
    log = repro(root, env)
    assert [s for s in DATA_STAGES if ran(log, s)] == ["shard"]
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


def test_dvc_exp_run_composes_presets_and_overrides(repo):
    root, env = repo
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
    assert params["train"]["warmup_steps"] == SMALL["train"]["warmup_steps"]
    assert params["data"]["source"] == "toy"
    vocab = json.loads((root / "metrics/vocab.json").read_text())
    assert vocab["requested_size"] == 450


def test_a_bad_param_stops_dvc_repro_before_any_work(repo):
    root, env = repo
    set_params(root, model__heads=5)
    result = run(["dvc", "repro"], root, env, check=False)
    assert result.returncode != 0
    assert "model: d_model (32) must be divisible by heads (5)" in result.stderr
    assert not (root / "data/raw").exists()

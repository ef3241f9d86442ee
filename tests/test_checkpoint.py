"""Checkpoints: atomic save, pruning, fallback on corruption, averaging, export, the stage."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from aiayn.data.tokenizer import save_tokenizer, train_bpe
from aiayn.errors import DataError
from aiayn.model import Transformer, TransformerConfig
from aiayn.training import checkpoint as ckpt
from aiayn.training.checkpoint import (
    average_checkpoints,
    checkpoint_path,
    checkpoint_step,
    export_model,
    file_sha256,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_model_files,
    save_checkpoint,
)
from tests.conftest import REPO, SENTENCES_DE, SENTENCES_EN


def tiny_config(vocab_size: int = 40) -> TransformerConfig:
    return TransformerConfig(vocab_size=vocab_size, d_model=16, heads=2, encoder_layers=1,
                             decoder_layers=1, d_ff=32, dropout=0.0, max_positions=32)


def tiny_model(seed: int, vocab_size: int = 40) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(tiny_config(vocab_size))


def batch(vocab_size: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    src = torch.randint(4, vocab_size, (3, 7), generator=g)
    tgt = torch.randint(4, vocab_size, (3, 5), generator=g)
    src[0, -2:] = 0  # some padding
    return src, tgt


def trainer_state(seed: int = 0, step: int = 1) -> tuple[dict, Transformer, torch.optim.Adam]:
    """What the trainer saves: model + Adam after a real step, RNG, data cursor, meta."""
    model = tiny_model(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=1e-9)
    src, tgt = batch()
    loss = model(src, tgt).logsumexp(-1).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "step": step,
        "rng": {"torch": torch.get_rng_state(), "cuda": []},
        "cursor": {"shard": 2, "batch": 17, "epoch": 0, "order": [3, 1, 2], "seed": 1},
        "meta": {"model_config": model.cfg.to_dict(), "vocab_size": 40,
                 "tokenizer_sha256": "ab" * 32, "mlflow_run_id": None, "step": step,
                 "tokens_seen": 12345},
        "loss": loss.item(),
        "schedule": (1.0, 4000),
    }
    return state, model, opt


def assert_same(a, b, where: str = "state") -> None:
    """Recursive equality; tensors must be bitwise equal with the same dtype and shape."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b and type(a) is type(b), where


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.iterdir()) if p.is_file()}


# --------------------------------------------------------------------------- save / load


def test_trainer_state_round_trips_with_weights_only(tmp_path):
    state, model, opt = trainer_state(step=7)
    path = save_checkpoint(tmp_path, 7, state, keep=3)
    assert path == tmp_path / "step-00000007.pt" == checkpoint_path(tmp_path, 7)
    # Independently of our loader: the file must load under the safe unpickler.
    assert_same(state, torch.load(path, map_location="cpu", weights_only=True))
    loaded = load_checkpoint(path)
    assert_same(state, loaded)
    assert loaded["optimizer"]["state"][0]["exp_avg"].abs().sum() > 0  # a real Adam state

    # Resuming from the file continues exactly like the run that wrote it.
    model2 = Transformer(tiny_config())
    opt2 = torch.optim.Adam(model2.parameters(), lr=0.5)  # hyperparameters come from the file
    model2.load_state_dict(loaded["model"])
    opt2.load_state_dict(loaded["optimizer"])
    src, tgt = batch()
    for m, o in ((model, opt), (model2, opt2)):
        m(src, tgt).logsumexp(-1).mean().backward()
        o.step()
    for (name, p1), p2 in zip(model.named_parameters(), model2.parameters(), strict=True):
        assert torch.equal(p1, p2), name


def test_load_rejects_arbitrary_pickles_and_missing_files(tmp_path):
    path = tmp_path / "step-00000001.pt"
    torch.save({"model": {}, "evil": Path("/etc/passwd")}, path)  # not allowed by weights_only
    with pytest.raises(DataError, match="step-00000001.pt: unreadable"):
        load_checkpoint(path)
    torch.save([1, 2], path)
    with pytest.raises(DataError, match="not a checkpoint dict"):
        load_checkpoint(path)
    with pytest.raises(DataError, match="nope.pt: no such checkpoint"):
        load_checkpoint(tmp_path / "nope.pt")


def test_keep_last_k_prunes_by_step_number(tmp_path):
    for step in (8, 9, 10, 11, 12):
        save_checkpoint(tmp_path, step, {"step": step}, keep=3)
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "step-00000010.pt", "step-00000011.pt", "step-00000012.pt"]
    assert [load_checkpoint(p)["step"] for p in list_checkpoints(tmp_path)] == [10, 11, 12]

    # The file just written always stays, even when older than what is there.
    save_checkpoint(tmp_path, 5, {"step": 5}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000005.pt",
                                                            "step-00000012.pt"]
    save_checkpoint(tmp_path, 13, {"step": 13}, keep=1)
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000013.pt"]
    with pytest.raises(ValueError, match="keep"):
        save_checkpoint(tmp_path, 14, {}, keep=0)


def test_list_orders_by_step_number_and_ignores_other_files(tmp_path):
    assert list_checkpoints(tmp_path / "missing") == []
    for name in ("step-10.pt", "step-9.pt", "step-00000100.pt", "step-2.pt",
                 ".step-00000011.pt.abc123.tmp", "step-x.pt", "step-3.pt.bak", "notes.txt"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "step-7.pt").mkdir()
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "step-2.pt", "step-9.pt", "step-10.pt", "step-00000100.pt"]


def test_failed_save_leaves_nothing_new_and_old_checkpoints_intact(tmp_path, monkeypatch):
    for step in (1, 2):
        save_checkpoint(tmp_path, step, trainer_state(seed=step, step=step)[0], keep=2)
    before = digest(tmp_path)

    def half_then_fail(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a zip file")
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(tmp_path, 3, trainer_state(step=3)[0], keep=2)
    monkeypatch.undo()
    assert digest(tmp_path) == before  # same names, same bytes: nothing pruned, no temp file
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert load_checkpoint(tmp_path / "step-00000002.pt")["step"] == 2


def test_save_cleans_temp_files_left_by_a_killed_writer(tmp_path):
    stale = tmp_path / ".step-00000004.pt.k1ll3d.tmp"
    stale.write_bytes(b"partial")
    save_checkpoint(tmp_path, 5, {"step": 5}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000005.pt"]


def test_latest_checkpoint_falls_back_past_corrupt_files(tmp_path, caplog):
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "missing") is None
    states = {}
    for step in (1, 2, 3):
        states[step] = trainer_state(seed=step, step=step)[0]
        save_checkpoint(tmp_path, step, states[step], keep=5)
    path, state = latest_checkpoint(tmp_path)
    assert path.name == "step-00000003.pt"
    assert_same(states[3], state)

    # Newest is garbage, the one before is cut short: fall back to step 1.
    checkpoint_path(tmp_path, 3).write_bytes(b"\x00garbage\xff" * 100)
    good = checkpoint_path(tmp_path, 2).read_bytes()
    checkpoint_path(tmp_path, 2).write_bytes(good[: len(good) // 2])
    with caplog.at_level(logging.WARNING, logger="aiayn"):
        path, state = latest_checkpoint(tmp_path)
    assert path.name == "step-00000001.pt"
    assert_same(states[1], state)
    assert "step-00000003.pt" in caplog.text and "step-00000002.pt" in caplog.text

    checkpoint_path(tmp_path, 1).write_bytes(b"")
    with pytest.raises(DataError, match="none of the 3 checkpoints"):
        latest_checkpoint(tmp_path)


# --------------------------------------------------------------------------- averaging


def write_models(folder: Path, models: list[dict]) -> list[Path]:
    return [save_checkpoint(folder, i + 1, {"model": m, "step": i + 1}, keep=100)
            for i, m in enumerate(models)]


def test_average_matches_hand_computation(tmp_path):
    values = [[1.0, 2.0, -3.0], [2.0, 2.0, 0.5], [4.0, 2.0, 1.0]]
    half = [[0.1, 60000.0], [0.2, 60000.0], [0.7, 60000.0]]  # the fp16 sum overflows
    brain = [[1.5], [2.25], [3.0]]
    models = [{"w": torch.tensor(v), "h": torch.tensor(h, dtype=torch.float16),
               "b": torch.tensor(b, dtype=torch.bfloat16),
               "d": torch.tensor(v, dtype=torch.float64),
               "count": torch.tensor([3, 4], dtype=torch.int64)}
              for v, h, b in zip(values, half, brain, strict=True)]
    paths = write_models(tmp_path, models)
    avg = average_checkpoints(paths)

    assert list(avg) == ["w", "h", "b", "d", "count"]
    assert torch.equal(avg["w"], torch.tensor([7 / 3, 2.0, -0.5], dtype=torch.float32))
    assert torch.equal(avg["d"], torch.tensor([7 / 3, 2.0, -0.5], dtype=torch.float64))
    # Expected from the stored fp16/bf16 values, averaged in Python floats.
    stored_h = [torch.tensor(h, dtype=torch.float16).tolist() for h in half]
    mean_h = [sum(col) / 3 for col in zip(*stored_h, strict=True)]
    assert avg["h"].dtype == torch.float16
    assert torch.equal(avg["h"], torch.tensor(mean_h, dtype=torch.float16))
    assert avg["h"][1].item() == 60000.0
    assert avg["b"].dtype == torch.bfloat16
    assert torch.equal(avg["b"], torch.tensor([2.25], dtype=torch.bfloat16))
    assert avg["count"].dtype == torch.int64 and avg["count"].tolist() == [3, 4]

    # One checkpoint: its own weights back, unchanged.
    assert_same(models[0], average_checkpoints(paths[:1]))


def test_average_rejects_mismatched_checkpoints(tmp_path):
    a = tmp_path / "a"
    pa = write_models(a, [{"w": torch.ones(2), "v": torch.ones(1)},
                          {"w": torch.ones(2), "u": torch.ones(1)}])
    with pytest.raises(DataError, match=r"step-00000001.pt and .*step-00000002.pt hold "
                                        r"different parameters.*\['v'\].*\['u'\]"):
        average_checkpoints(pa)

    b = tmp_path / "b"
    pb = write_models(b, [{"w": torch.ones(2)}, {"w": torch.ones(3)}])
    with pytest.raises(DataError, match=r"w is torch.float32 \(2,\) in the first"):
        average_checkpoints(pb)

    c = tmp_path / "c"
    pc = write_models(c, [{"n": torch.tensor([1])}, {"n": torch.tensor([2])}])
    with pytest.raises(DataError, match="non-floating tensor model.n"):
        average_checkpoints(pc)

    d = tmp_path / "d"
    save_checkpoint(d, 1, {"step": 1}, keep=2)
    with pytest.raises(DataError, match="no 'model' state dict"):
        average_checkpoints(list_checkpoints(d))


# --------------------------------------------------------------------------- export


def test_export_round_trip_gives_identical_logits(tmp_path):
    model = tiny_model(3).eval()
    config = {"model": model.cfg.to_dict(), "vocab_size": 40, "averaged_steps": [1, 2]}
    out = tmp_path / "model"
    out.mkdir()
    (out / "stale.bin").write_bytes(b"from an older export")
    export_model(out, model.state_dict(), config)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["model"], "no temporary folder left"

    tensors, loaded_config = load_model_files(out)
    assert loaded_config == config
    assert json.loads((out / "config.json").read_text()) == config
    assert_same(dict(model.state_dict()), {k: tensors[k] for k in model.state_dict()})
    assert set(tensors) == set(model.state_dict())

    again = Transformer(TransformerConfig(**loaded_config["model"])).eval()
    again.load_state_dict(tensors, strict=True)
    src, tgt = batch()
    with torch.no_grad():
        assert torch.equal(model(src, tgt), again(src, tgt))


def test_export_handles_views_and_shared_tensors(tmp_path):
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {"t": base.t(), "a": base, "alias": base}  # non-contiguous view and a repeat
    export_model(tmp_path / "m", state, {})
    tensors, _ = load_model_files(tmp_path / "m")
    for k, v in state.items():
        assert torch.equal(tensors[k], v), k


def test_failed_export_keeps_the_old_folder(tmp_path, monkeypatch):
    out = tmp_path / "model"
    export_model(out, {"w": torch.ones(2)}, {"v": 1})
    before = digest(out)
    monkeypatch.setattr(ckpt, "write_json", lambda *a, **k: (_ for _ in ()).throw(
        OSError("disk on fire")))
    with pytest.raises(OSError, match="disk on fire"):
        export_model(out, {"w": torch.zeros(2)}, {"v": 2})
    assert digest(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_load_model_files_names_what_is_missing(tmp_path):
    with pytest.raises(DataError, match=r"model.safetensors: missing; run `aiayn average`"):
        load_model_files(tmp_path)
    export_model(tmp_path / "m", {"w": torch.ones(1)}, {})
    (tmp_path / "m" / "config.json").unlink()
    with pytest.raises(DataError, match="config.json: missing"):
        load_model_files(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(DataError, match="not a readable safetensors file"):
        load_model_files(tmp_path / "m")


def test_file_sha256(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"abc" * 500_000)
    assert file_sha256(path) == hashlib.sha256(b"abc" * 500_000).hexdigest()


# --------------------------------------------------------------------------- the stage


@pytest.fixture
def trained(tmp_path) -> dict:
    """Three checkpoints of one tiny run, its tokenizer and a params file."""
    tok = train_bpe(SENTENCES_EN + SENTENCES_DE, 300, 1)
    tokenizer = tmp_path / "vocab" / "tokenizer.json"
    save_tokenizer(tok, tokenizer)
    sha = hashlib.sha256(tokenizer.read_bytes()).hexdigest()
    vocab = tok.get_vocab_size()
    folder = tmp_path / "checkpoints"
    models = {}
    for i, step in enumerate((100, 200, 300)):
        model = tiny_model(seed=10 + i, vocab_size=vocab)
        models[step] = model
        opt = torch.optim.Adam(model.parameters())
        save_checkpoint(folder, step, {
            "model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
            "rng": {"torch": torch.get_rng_state()}, "cursor": {"shard": 0, "batch": step},
            "meta": {"model_config": model.cfg.to_dict(), "vocab_size": vocab,
                     "tokenizer_sha256": sha, "step": step,
                     "tokens_seen": 1000 * step}}, keep=10)
    from aiayn.tracking import RUN_FILE, save_run_id

    # as the train stage records its MLflow run; in a store of its own, so that the average
    # stage (which logs into the run of the current store only) does not write to MLflow here
    save_run_id(folder / RUN_FILE, "run-abc", f"sqlite:///{tmp_path}/elsewhere.db")
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["train"]["average_last"] = 2
    params_path = tmp_path / "params.yaml"
    params_path.write_text(yaml.safe_dump(params))
    out = tmp_path / "model"
    args = ["--params", str(params_path), "--checkpoints", str(folder),
            "--tokenizer", str(tokenizer), "--out", str(out),
            "--metrics", str(tmp_path / "metrics" / "average.json")]
    return {"args": args, "models": models, "tokenizer": tokenizer, "sha": sha, "out": out,
            "folder": folder, "params": params_path, "vocab": vocab, "root": tmp_path}


def run_stage(args: list[str]):
    from stages.average import app

    return CliRunner().invoke(app, args)


def test_average_stage_exports_the_mean_of_the_last_checkpoints(trained):
    result = run_stage(trained["args"])
    assert result.exit_code == 0, result.output
    out = trained["out"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors",
                                                     "tokenizer.json"]
    assert (out / "tokenizer.json").read_bytes() == trained["tokenizer"].read_bytes()

    tensors, config = load_model_files(out)
    a, b = trained["models"][200].state_dict(), trained["models"][300].state_dict()
    assert set(tensors) == set(a)
    for name in a:
        expected = ((a[name].double() + b[name].double()) / 2).float()
        assert tensors[name].dtype == torch.float32
        assert torch.equal(tensors[name], expected), name
    assert not torch.equal(tensors["embedding.weight"], a["embedding.weight"])
    assert config == {"model": trained["models"][300].cfg.to_dict(),
                      "vocab_size": trained["vocab"], "tokenizer_sha256": trained["sha"],
                      "mlflow_run_id": "run-abc", "averaged_steps": [200, 300],
                      "tokens_seen": 300_000, "average": "last",
                      # the fixture's checkpoints were saved without validation BLEU
                      "averaged_valid_bleu": [None, None],
                      "average_candidates_valid_bleu": {}}
    assert json.loads((trained["root"] / "metrics" / "average.json").read_text()) == {
        "average": "last", "averaged": 2, "first_step": 200, "last_step": 300,
        "candidates": {}}
    model = Transformer(TransformerConfig(**config["model"]))
    model.load_state_dict(tensors, strict=True)


def test_average_stage_with_fewer_checkpoints_warns(trained, caplog):
    params = yaml.safe_load(trained["params"].read_text())
    params["train"]["average_last"] = 5
    trained["params"].write_text(yaml.safe_dump(params))
    checkpoint_path(trained["folder"], 100).unlink()
    with caplog.at_level(logging.WARNING, logger="aiayn"):
        result = run_stage(trained["args"])
    assert result.exit_code == 0, result.output
    assert "holds only 2 checkpoint(s)" in caplog.text
    _, config = load_model_files(trained["out"])
    assert config["averaged_steps"] == [200, 300]


def test_average_stage_refuses_a_changed_tokenizer(trained):
    save_tokenizer(train_bpe(SENTENCES_EN, 290, 1), trained["tokenizer"])
    result = run_stage(trained["args"])
    assert result.exit_code == 2
    assert "vocabulary changed since training; re-run training" in result.output
    assert str(trained["tokenizer"]) in result.output
    assert not trained["out"].exists()
    assert sorted(p.name for p in trained["root"].iterdir()) == [
        "checkpoints", "params.yaml", "vocab"]


def test_average_stage_without_checkpoints(trained):
    for path in list_checkpoints(trained["folder"]):
        path.unlink()
    result = run_stage(trained["args"])
    assert result.exit_code == 2
    assert f"no checkpoints in {trained['folder']}; run `aiayn train`" in result.output


def test_average_stage_refuses_checkpoints_of_different_runs(trained):
    path = checkpoint_path(trained["folder"], 200)
    state = load_checkpoint(path)
    state["meta"]["model_config"]["d_ff"] = 64
    torch.save(state, path)
    result = run_stage(trained["args"])
    assert result.exit_code == 2
    assert "differ in model_config" in result.output
    assert "step-00000200.pt" in result.output


# --------------------------------------------------------------------------- the library's average


def test_average_into_folder_writes_the_mean_of_the_last_checkpoints(trained):
    from aiayn.training.averaging import average_into_folder

    out = trained["root"] / "library"
    config = average_into_folder(trained["folder"], trained["tokenizer"], out, last=2)
    tensors, written = load_model_files(out)
    assert written == config == {
        "model": trained["models"][300].cfg.to_dict(), "vocab_size": trained["vocab"],
        "tokenizer_sha256": trained["sha"], "mlflow_run_id": "run-abc", "average": "last",
        "averaged_steps": [200, 300], "averaged_valid_bleu": [None, None],
        "average_candidates_valid_bleu": {}, "tokens_seen": 300_000}
    a, b = trained["models"][200].state_dict(), trained["models"][300].state_dict()
    assert set(tensors) == set(a)
    for name in a:  # the element-wise mean, computed here in float64
        assert torch.equal(tensors[name], ((a[name].double() + b[name].double()) / 2).float())
    assert (out / "tokenizer.json").read_bytes() == trained["tokenizer"].read_bytes()


def score_checkpoints(trained: dict, bleu: dict[int, float]) -> None:
    """Record ``bleu[step]`` as each checkpoint's validation BLEU, as training does."""
    for step, score in bleu.items():
        path = checkpoint_path(trained["folder"], step)
        state = load_checkpoint(path)
        state["meta"]["valid_bleu"] = score
        torch.save(state, path)


@pytest.mark.parametrize("how", ["last", "best"])
def test_the_stage_writes_the_folder_that_average_into_folder_writes(trained, how):
    from aiayn.training.averaging import average_into_folder

    score_checkpoints(trained, {100: 30.0, 200: 10.0, 300: 20.0})
    params = yaml.safe_load(trained["params"].read_text())
    params["train"].update(average=how, valid_bleu_every=params["train"][
        "checkpoint_every_steps"])
    trained["params"].write_text(yaml.safe_dump(params))
    result = run_stage([*trained["args"], "--no-mlflow"])
    assert result.exit_code == 0, result.output
    library = trained["root"] / "library"
    config = average_into_folder(trained["folder"], trained["tokenizer"], library, 2, how)
    assert config["averaged_steps"] == ([200, 300] if how == "last" else [100, 300])
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (library / name).read_bytes() == (trained["out"] / name).read_bytes(), name


def test_average_into_folder_fails_as_the_stage_does(trained, caplog):
    from aiayn.training.averaging import average_into_folder

    out = trained["root"] / "library"
    with caplog.at_level(logging.WARNING, logger="aiayn"):
        assert average_into_folder(trained["folder"], trained["tokenizer"], out, last=5)[
            "averaged_steps"] == [100, 200, 300]
    assert "5 checkpoint(s) asked for but" in caplog.text and "holds only 3" in caplog.text
    other = trained["root"] / "other.json"
    save_tokenizer(train_bpe(SENTENCES_EN, 290, 1), other)
    with pytest.raises(DataError, match=r"other.json: sha256 .* the checkpoints in .* were "
                                        "trained with: the vocabulary changed since training"):
        average_into_folder(trained["folder"], other, trained["root"] / "a")
    with pytest.raises(DataError, match="none of the 3 checkpoints in .* has a validation BLEU"):
        average_into_folder(trained["folder"], trained["tokenizer"], trained["root"] / "b",
                            how="best")
    path = checkpoint_path(trained["folder"], 200)
    state = load_checkpoint(path)
    state["meta"]["model_config"]["d_ff"] = 64
    torch.save(state, path)
    with pytest.raises(DataError, match=r"step-00000200.pt and .*step-00000300.pt differ in "
                                        "model_config"):
        average_into_folder(trained["folder"], trained["tokenizer"], trained["root"] / "c")
    assert average_into_folder(trained["folder"], trained["tokenizer"], trained["root"] / "d",
                               last=1)["averaged_steps"] == [300]  # 200 not among them
    with pytest.raises(DataError, match=r"no checkpoints in .*empty; run `aiayn train`"):
        average_into_folder(trained["root"] / "empty", trained["tokenizer"],
                            trained["root"] / "e")
    assert not any((trained["root"] / name).exists() for name in "abce")


def test_run_checkpoints_average_only_what_they_checked(trained):
    from aiayn.training.averaging import RunCheckpoints

    run = RunCheckpoints.open(trained["folder"], trained["tokenizer"], most=2)
    assert [checkpoint_step(p) for p in run.choose(2)[0]] == [200, 300]
    with pytest.raises(ValueError, match="3 checkpoints asked for, but only the 2"):
        run.write(trained["root"] / "out", 3)  # step 100 was never checked
    assert not (trained["root"] / "out").exists()


def rewrite_checkpoints(trained: dict, config: TransformerConfig, drop: tuple[str, ...] = ()
                        ) -> dict[int, dict]:
    """The fixture's checkpoints again, of models built from ``config``, their recorded
    model_config without the keys ``drop`` (as a version before those settings wrote it)."""
    states = {}
    for i, step in enumerate((100, 200, 300)):
        torch.manual_seed(20 + i)
        model = Transformer(config)
        recorded = {k: v for k, v in config.to_dict().items() if k not in drop}
        path = checkpoint_path(trained["folder"], step)
        state = load_checkpoint(path)
        state["model"] = model.state_dict()
        state["meta"]["model_config"] = recorded
        torch.save(state, path)
        states[step] = model.state_dict()
    return states


def test_average_stage_averages_learned_positions_and_records_the_head_sizes(trained):
    cfg = TransformerConfig(vocab_size=trained["vocab"], d_model=16, heads=2, d_k=4, d_v=6,
                            encoder_layers=1, decoder_layers=1, d_ff=32, dropout=0.0,
                            max_positions=32, positions="learned")
    states = rewrite_checkpoints(trained, cfg)
    result = run_stage(trained["args"])
    assert result.exit_code == 0, result.output
    tensors, config = load_model_files(trained["out"])
    assert {k: config["model"][k] for k in ("d_k", "d_v", "positions")} == {
        "d_k": 4, "d_v": 6, "positions": "learned"}
    expected = ((states[200]["positions"].double() + states[300]["positions"].double()) / 2)
    assert torch.equal(tensors["positions"], expected.float())
    model = Transformer(TransformerConfig(**config["model"]))
    model.load_state_dict(tensors, strict=True)
    assert model.decoder[0].cross_attn.kv_proj.weight.shape == (2 * 4 + 2 * 6, 16)


def test_checkpoints_and_folders_from_before_the_table3_settings_load_as_the_base(trained):
    from aiayn.decoding.translation import load_translator

    # Written by a version without d_k, d_v and positions: they were the paper's base.
    rewrite_checkpoints(trained, tiny_config(trained["vocab"]),
                        drop=("d_k", "d_v", "positions"))
    result = run_stage(trained["args"])
    assert result.exit_code == 0, result.output
    config = json.loads((trained["out"] / "config.json").read_text())
    assert {k: config["model"][k] for k in ("d_k", "d_v", "positions")} == {
        "d_k": 0, "d_v": 0, "positions": "sinusoidal"}  # the new fields, at their defaults
    # A folder whose config.json lacks them (exported before) loads and translates too.
    for key in ("d_k", "d_v", "positions"):
        del config["model"][key]
    (trained["out"] / "config.json").write_text(json.dumps(config))
    translator = load_translator(trained["out"], device="cpu")
    assert translator.model.cfg.key_size == 8 and translator.model.cfg.positions == "sinusoidal"

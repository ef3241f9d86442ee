"""Training: it learns, it resumes exactly, it fails clearly, DDP equals accumulation."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from aiayn.config import load_params, parse_params
from aiayn.data.subword import merge_parents
from aiayn.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, decode, load_tokenizer
from aiayn.data.toy import generate_pairs
from aiayn.errors import DataError
from aiayn.fast import extension
from aiayn.io import file_sha256, human_bytes
from aiayn.model import Transformer, TransformerConfig
from aiayn.precision import cpu_has_native_bf16, cpu_model
from aiayn.precision import hardware as precision_hardware
from aiayn.training.build import build_trainer
from aiayn.training.checkpoint import checkpoint_step, list_checkpoints, load_checkpoint
from aiayn.training.distributed import World
from aiayn.training.loop import Trainer, TrainingDiverged, TrainPaths
from aiayn.training.objective import label_smoothed_loss
from aiayn.training.schedule import cooldown_factor, noam_lr
from bench import harness
from tests.conftest import REPO, build_toy_workspace, merge, write_params


def paths(ws: Path, run: Path) -> TrainPaths:
    return TrainPaths(shards=ws / "data/shards", checkpoints=run / "checkpoints",
                      metrics=run / "train.json", train_log=run / "train_log.tsv",
                      valid_log=run / "valid_log.tsv")


# For tests that compare two computations of one function at fp32 rounding (1e-5): the
# committed params say precision auto, which is bf16 autocast on a CPU with native bf16, and
# there two computations that round differently differ at bf16 rounding (~1e-3).
FP32 = {"precision": "fp32"}


def make_trainer(ws: Path, run: Path, changes: dict | None = None) -> Trainer:
    run.mkdir(parents=True, exist_ok=True)
    p = load_params(write_params(run / "params.yaml", changes))
    tok = ws / "data/vocab/tokenizer.json"
    tokenizer = load_tokenizer(tok)
    return build_trainer(p, tokenizer.get_vocab_size(), file_sha256(tok), paths(ws, run),
                   World(), progress=False, merges=merge_parents(tokenizer))


def model_tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(path)["model"]


def without_key_biases(state: dict) -> dict:
    """The state dict without the key part of each attention bias. Its true gradient is 0
    (softmax ignores a constant added to all of a query's scores), so Adam turns float
    rounding there into full-size steps: two computations that round differently end with
    different key biases and the same function."""
    out = {}
    for name, t in state.items():
        if name.endswith("qkv_proj.bias"):  # [q | k | v]
            d = t.shape[0] // 3
            t = torch.cat([t[:d], t[2 * d:]])
        elif name.endswith("kv_proj.bias"):  # [k | v]
            t = t[t.shape[0] // 2:]
        out[name] = t
    return out


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_tiny_model_memorises_a_handful_of_toy_pairs(toy_workspace):
    tok = load_tokenizer(toy_workspace / "data/vocab/tokenizer.json")
    pairs = list(generate_pairs(6, seed=7, min_words=3, max_words=6))
    enc = [tok.encode(s, add_special_tokens=False).ids for pair in pairs for s in pair]
    src = [e + [EOS_ID] for e in enc[0::2]]
    tgt = [[BOS_ID] + e + [EOS_ID] for e in enc[1::2]]

    def pad(rows):
        width = max(map(len, rows))
        return torch.tensor([r + [PAD_ID] * (width - len(r)) for r in rows])

    src_t, tgt_t = pad(src), pad(tgt)
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(vocab_size=tok.get_vocab_size(), d_model=64, heads=4,
                                          encoder_layers=2, decoder_layers=2, d_ff=128,
                                          dropout=0.0, max_positions=64))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(150):
        loss, _, n = label_smoothed_loss(model(src_t, tgt_t[:, :-1]), tgt_t[:, 1:], 0.0, PAD_ID)
        opt.zero_grad()
        (loss / n).backward()
        opt.step()
    model.eval()
    # Greedy decoding through the cache reproduces every memorised target.
    state = model.start(src_t)
    out = torch.full((len(pairs), 1), BOS_ID)
    with torch.no_grad():
        for _ in range(tgt_t.shape[1]):
            out = torch.cat([out, model.decode_step(out[:, -1:], state)[:, -1].argmax(-1,
                            keepdim=True)], dim=1)
    for row, (_, german) in zip(out.tolist(), pairs, strict=True):
        assert decode(tok, row[1:row.index(EOS_ID)] if EOS_ID in row else row[1:]) == german


def test_a_run_writes_logs_metrics_and_checkpoints(toy_workspace, tmp_path):
    trainer = make_trainer(toy_workspace, tmp_path)
    summary = trainer.fit()
    trainer.write_logs()
    trainer.write_summary(summary)
    assert summary["steps"] == 12 and summary["accumulation"] == 2
    metrics = json.loads((tmp_path / "train.json").read_text())
    assert metrics["valid_ppl"] == pytest.approx(2.718281828 ** metrics["valid_nll"], rel=1e-6)
    rows = [line.split("\t") for line in (tmp_path / "train_log.tsv").read_text().splitlines()]
    assert rows[0][:4] == ["step", "loss", "nll", "lr"]
    steps = [int(r[0]) for r in rows[1:]]
    assert steps == [2, 4, 6, 8, 10, 12]
    for r in rows[1:]:  # the lr used by step s is the paper's formula at s
        assert float(r[3]) == pytest.approx(noam_lr(int(r[0]), 32, 4), rel=1e-5)
    assert float(rows[-1][1]) < float(rows[1][1])  # it learns
    valid = (tmp_path / "valid_log.tsv").read_text().splitlines()
    assert [int(line.split("\t")[0]) for line in valid[1:]] == [6, 12]
    ckpts = list_checkpoints(tmp_path / "checkpoints")
    assert [c.name for c in ckpts] == [f"step-{s:08d}.pt" for s in (3, 6, 9, 12)]
    assert summary["tokens_seen"] == load_checkpoint(ckpts[-1])["meta"]["tokens_seen"]


@pytest.mark.parametrize("split,precision,rdrop,rdrop_start,share",
                         [(0.0, "auto", 0.0, 0.0, 1.0), (0.3, "auto", 0.0, 0.0, 1.0),
                          (0.0, "fp16", 0.0, 0.0, 1.0), (0.0, "auto", 2.0, 0.0, 1.0),
                          (0.0, "auto", 2.0, 0.5, 1.0), (0.0, "auto", 2.0, 0.0, 0.5)],
                         ids=["plain", "subword_split", "fp16", "rdrop", "rdrop_late",
                              "rdrop_share"])
def test_an_interrupted_run_resumes_bitwise(toy_workspace, tmp_path, split, precision, rdrop,
                                            rdrop_start, share):
    # fp16: the loss scale (its value and growth tracker) resumes with the run too;
    # rdrop_late: stopped before R-Drop begins (step 8 of 12), it begins there after the resume;
    # rdrop_share: the resumed run draws the same sentences for their second pass
    changes = {"train": {"subword_split": split, "precision": precision, "rdrop": rdrop,
                         "rdrop_start": rdrop_start, "rdrop_fraction": share}}
    full = make_trainer(toy_workspace, tmp_path / "full", changes)
    full.fit()
    part = make_trainer(toy_workspace, tmp_path / "part", changes)
    part.fit(should_stop=lambda: part.state.step == 5)  # Ctrl-C after step 5
    assert list_checkpoints(tmp_path / "part/checkpoints")[-1].name == "step-00000005.pt"
    resumed = make_trainer(toy_workspace, tmp_path / "part", changes)
    assert resumed.state.step == 5
    resumed.fit()
    last = "checkpoints/step-00000012.pt"
    a, b = load_checkpoint(tmp_path / "full" / last), load_checkpoint(tmp_path / "part" / last)
    assert_bitwise_equal(a["model"], b["model"])
    # every log row (step, loss, NLL, lr, grad norm, tokens), the one the stop cut included
    assert [r[:6] for r in a["run"]["train_rows"]] == [r[:6] for r in b["run"]["train_rows"]]
    assert a["run"]["valid_rows"] == b["run"]["valid_rows"]
    # the checkpoint written only to stop is gone: the same ones as the unbroken run's
    assert ([c.name for c in list_checkpoints(tmp_path / "part/checkpoints")]
            == [c.name for c in list_checkpoints(tmp_path / "full/checkpoints")])


def test_checkpoints_leave_the_log_rows_as_they_are(toy_workspace, tmp_path):
    """A checkpoint between two log rows (every 3 steps, rows every 2) reads the loss sums
    of its steps; they still go into the next row, which holds what it holds with a single
    checkpoint at the end: each row's loss is the mean over its own steps."""
    rows = {}
    for every in (3, 12):
        trainer = make_trainer(toy_workspace, tmp_path / str(every),
                               {"train": {"checkpoint_every_steps": every, **FP32}})
        trainer.fit()
        rows[every] = [(r.step, r.loss, r.nll, r.tokens) for r in trainer.log.train]
    assert rows[3] == rows[12] and len(rows[3]) == 6


def test_a_stop_at_a_checkpoint_step_writes_it_once(toy_workspace, tmp_path, monkeypatch):
    trainer = make_trainer(toy_workspace, tmp_path)
    saved = []
    save = trainer.store.save
    monkeypatch.setattr(trainer.store, "save",
                        lambda step, *a, **k: saved.append(step) or save(step, *a, **k))
    trainer.fit(should_stop=lambda: trainer.state.step == 6)
    assert saved == [3, 6] and trainer.state.stopped_by == "interrupted"
    assert load_checkpoint(list_checkpoints(tmp_path / "checkpoints")[-1])["meta"][
        "interim"] is False


def test_repeated_stops_keep_only_the_newest_stop_checkpoint(toy_workspace, tmp_path):
    for stop in (4, 5):
        trainer = make_trainer(toy_workspace, tmp_path)
        trainer.fit(should_stop=lambda t=trainer, s=stop: t.state.step == s)
    steps = [checkpoint_step(c) for c in list_checkpoints(tmp_path / "checkpoints")]
    assert steps == [3, 5]  # 4, written only to stop, went when 5 replaced it
    make_trainer(toy_workspace, tmp_path).fit()
    assert [checkpoint_step(c) for c in list_checkpoints(tmp_path / "checkpoints")] == [
        3, 6, 9, 12]


def test_a_resume_on_another_number_of_processes_goes_on_in_the_same_data_order(
        toy_workspace, tmp_path):
    """Each epoch's order is one permutation of all batches for any world size, rank r
    taking every N-th from r; a run saved by 2 processes after p batches each has taken the
    first 2p of it, and one process goes on from the (2p+1)-th."""
    from aiayn.data.sampler import TokenBudgetSampler

    trainer = make_trainer(toy_workspace, tmp_path, {"train": {"steps": 40}})
    trainer.fit(should_stop=lambda: trainer.state.step == 5)
    path = list_checkpoints(tmp_path / "checkpoints")[-1]
    ckpt = load_checkpoint(path)
    position = ckpt["data"]["position"]
    ckpt["meta"]["world_size"] = 2  # as a run under torchrun with 2 processes saves it
    ckpt["data"] = {"epoch": 0, "position": position // 2}
    torch.save(ckpt, path)
    resumed = make_trainer(toy_workspace, tmp_path, {"train": {"steps": 40}})
    n = resumed.train_data.num_batches
    order = TokenBudgetSampler(n, seed=resumed.p.seed).order(0)
    assert resumed.loader.state_dict() == {"epoch": 0, "position": 2 * (position // 2)}
    first = next(iter(resumed.loader))
    expected = resumed.train_data.batch(int(order[2 * (position // 2)]))
    assert torch.equal(first.tgt_in, expected.tgt_in)


def test_a_resume_with_other_micro_batches_goes_on_at_the_same_share_of_the_epoch_and_says_so(
        toy_workspace, tmp_path, caplog):
    """A run saved with micro-batches of 160 tokens, resumed with one micro-batch of 320 a
    step (train.max_tokens 0: as a run moved to another GPU count): the epoch's rest is cut
    anew, the cursor keeps the epoch and the share of it already taken, and the log says
    what that means for the data order."""
    trainer = make_trainer(toy_workspace, tmp_path, {"train": {"steps": 40}})
    trainer.fit(should_stop=lambda: trainer.state.step == 5)
    ckpt = load_checkpoint(list_checkpoints(tmp_path / "checkpoints")[-1])
    assert ckpt["meta"]["batch_tokens"] == 160 and ckpt["meta"]["world_size"] == 1
    old_n = trainer.train_data.num_batches
    epoch, position = ckpt["data"]["epoch"], ckpt["data"]["position"]
    with caplog.at_level(logging.WARNING, logger="aiayn"):
        resumed = make_trainer(toy_workspace, tmp_path,
                               {"train": {"steps": 40, "max_tokens": 0}})
    assert resumed.plan.batch_tokens == 320 and resumed.plan.accumulation == 1
    assert resumed.state.step == 5  # the same run goes on
    new_n = resumed.train_data.num_batches
    assert new_n < old_n
    assert resumed.loader.state_dict() == {"epoch": epoch,
                                           "position": round(position / old_n * new_n)}
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "planned for 1 process(es) x <= 160 tokens" in said
    assert f"the rest of epoch {epoch} is cut anew" in said and "may come twice" in said
    resumed.fit()
    assert resumed.state.step == 40


def test_a_step_too_small_for_the_longest_pair_names_the_settings(toy_workspace, tmp_path):
    from aiayn.data.sampler import ShardDataset
    from aiayn.errors import ParamsError

    longest = ShardDataset(toy_workspace / "data/shards/train").longest_pair()
    with pytest.raises(ParamsError) as err:
        make_trainer(toy_workspace, tmp_path, {"train": {"tokens_per_step": longest - 1,
                                                         "max_tokens": 0}})
    assert str(err.value) == (
        f"train: 1 process(es) x 1 micro-batch(es) of <= {longest - 1} tokens per step "
        f"(train.tokens_per_step {longest - 1}): a micro-batch of {longest - 1} tokens cannot "
        f"hold the longest train pair of {toy_workspace / 'data/shards/train'} ({longest} "
        "tokens on one side, with its special token); raise train.tokens_per_step or "
        "train.max_tokens, train on fewer processes, or lower shard.max_len and re-run the "
        "shard stage")
    make_trainer(toy_workspace, tmp_path / "fits", {"train": {"tokens_per_step": longest,
                                                              "max_tokens": 0}})


def test_a_checkpoint_holds_the_time_of_the_validation_before_it(toy_workspace, tmp_path):
    """The time budget of a resumed run goes on from the checkpoint's elapsed time, which
    includes the validation BLEU pass of its step (bleu_seconds is part of elapsed_s)."""
    trainer = make_trainer(toy_workspace, tmp_path, {"train": {"valid_bleu_every": 3}})
    trainer.valid_bleu = lambda model, device, amp: time.sleep(0.5) or 10.0
    trainer.fit(should_stop=lambda: trainer.state.step == 3)
    run = load_checkpoint(list_checkpoints(tmp_path / "checkpoints")[-1])["run"]
    assert run["step"] == 3 and run["bleu_seconds"] >= 0.5
    assert run["elapsed_s"] >= run["bleu_seconds"]


def test_the_trainer_warns_of_a_deep_post_ln_stack_at_a_high_rate(toy_workspace, tmp_path,
                                                                   caplog):
    # The toy model's rate peaks at 32^-0.5 * 4^-0.5 = 0.088, far above the paper's 7e-4.
    make_trainer(toy_workspace, tmp_path / "shallow")
    assert "post-LN" not in caplog.text
    make_trainer(toy_workspace, tmp_path / "deep", {"model": {"decoder_layers": 5}})
    assert "1 + 5 post-LN layers (model.norm: post) at a peak learning rate of 8.84e-02" \
        in caplog.text
    caplog.clear()
    make_trainer(toy_workspace, tmp_path / "pre", {"model": {"decoder_layers": 5,
                                                             "norm": "pre"}})
    assert "post-LN" not in caplog.text


def test_a_run_resumed_with_fewer_steps_goes_back_to_its_checkpoint_at_the_new_end(
        toy_workspace, tmp_path, caplog):
    make_trainer(toy_workspace, tmp_path).fit()
    six = load_checkpoint(tmp_path / "checkpoints/step-00000006.pt")
    short = make_trainer(toy_workspace, tmp_path, {"train": {"steps": 6}})
    assert short.state.step == 6
    assert "beyond train.steps 6" in caplog.text
    summary = short.fit()
    assert summary["steps"] == 6 and summary["stopped_by"] == "steps"
    assert [checkpoint_step(c) for c in list_checkpoints(tmp_path / "checkpoints")] == [3, 6]
    assert_bitwise_equal(load_checkpoint(tmp_path / "checkpoints/step-00000006.pt")["model"],
                         six["model"])


def test_fp16_learns_as_fp32_does_with_its_loss_scale_in_the_checkpoint(toy_workspace,
                                                                         tmp_path):
    """train.precision fp16 (for GPUs without bf16): float16 autocast with dynamic loss
    scaling; on a tiny model it follows fp32's losses within fp16's rounding."""
    runs = {}
    for precision in ("fp32", "fp16"):
        trainer = make_trainer(toy_workspace, tmp_path / precision,
                               {"train": {"precision": precision}, "model": {"dropout": 0.0}})
        runs[precision] = (trainer, trainer.fit())
    (fp32, a), (fp16, b) = runs["fp32"], runs["fp16"]
    assert b["precision"] == "fp16" and a["precision"] == "fp32" and "loss_scale" not in a
    assert b["loss_scale"] == fp16.scaler.get_scale() > 0
    for ra, rb in zip(fp32.log.train, fp16.log.train, strict=True):
        assert rb.loss == pytest.approx(ra.loss, rel=2e-2)
    assert fp16.log.train[-1].loss < fp16.log.train[0].loss  # it learns
    saved = load_checkpoint(list_checkpoints(tmp_path / "fp16/checkpoints")[-1])["scaler"]
    assert saved["scale"] == b["loss_scale"] and "_growth_tracker" in saved
    assert load_checkpoint(list_checkpoints(tmp_path / "fp32/checkpoints")[-1])["scaler"] == {}


def test_an_fp16_step_whose_gradients_overflow_is_skipped_and_the_scale_halves(
        toy_workspace, tmp_path):
    trainer = make_trainer(toy_workspace, tmp_path, {"train": {"precision": "fp16"}})
    it = iter(trainer.loader)
    trainer.train_step(trainer.micro_batches(it))
    scale = trainer.scaler.get_scale()
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    weight = trainer.model.embedding.weight
    hook = weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    trainer.train_step(trainer.micro_batches(it))  # its gradients overflow
    hook.remove()
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # Adam did not step
    assert trainer.scaler.get_scale() == scale / 2
    trainer.train_step(trainer.micro_batches(it))  # the next step goes on as usual
    assert not torch.equal(trainer.model.embedding.weight, before["embedding.weight"])
    assert torch.isfinite(trainer.model.embedding.weight).all()


def test_subword_split_trains_on_more_target_tokens_of_the_same_batches(toy_workspace,
                                                                         tmp_path):
    seen = {}
    for split in (0.0, 0.3):
        trainer = make_trainer(toy_workspace, tmp_path / str(split),
                               {"train": {"steps": 3, "subword_split": split}})
        seen[split] = trainer.fit()["tokens_seen"]
    assert seen[0.3] > seen[0.0] > 0
    tok = toy_workspace / "data/vocab/tokenizer.json"
    p = load_params(write_params(tmp_path / "params.yaml", {"train": {"subword_split": 0.3}}))
    with pytest.raises(ValueError, match="needs the tokenizer's merges"):
        build_trainer(p, load_tokenizer(tok).get_vocab_size(), file_sha256(tok),
                paths(toy_workspace, tmp_path / "none"), World(), progress=False)


def test_a_changed_model_or_training_setting_starts_a_new_run_and_keeps_the_old(
        toy_workspace, tmp_path, caplog, monkeypatch):
    from types import SimpleNamespace

    from aiayn.training import run_store

    # Both set-asides below in the same second of the clock: two folders all the same.
    monkeypatch.setattr(run_store, "time", SimpleNamespace(strftime=lambda _: "20261206-120000"))
    make_trainer(toy_workspace, tmp_path, {"train": {"steps": 3}}).fit()
    fresh = make_trainer(toy_workspace, tmp_path, {"model": {"d_model": 48},
                                                   "train": {"steps": 3}})
    assert fresh.state.step == 0  # the old weights were not loaded
    assert "model.d_model: 32 -> 48" in caplog.text and "does not resume" in caplog.text
    kept = list((tmp_path / "checkpoints.replaced").glob("*/step-00000003.pt"))
    assert len(kept) == 1 and load_checkpoint(kept[0])["meta"]["model_config"]["d_model"] == 32
    assert list_checkpoints(tmp_path / "checkpoints") == []
    fresh.fit()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="aiayn"):
        again = make_trainer(toy_workspace, tmp_path, {"model": {"d_model": 48},
                                                       "train": {"steps": 3, "lr_scale": 2.0}})
    assert again.state.step == 0 and "train.lr_scale: 1.0 -> 2.0" in caplog.text
    # What is set aside is never deleted, so the trainer says how much has piled up.
    aside = [f for f in (tmp_path / "checkpoints.replaced").rglob("*") if f.is_file()]
    assert (f"checkpoints.replaced holds 2 set-aside folder(s), "
            f"{human_bytes(sum(f.stat().st_size for f in aside))} in all") in caplog.text
    assert sorted(d.name for d in (tmp_path / "checkpoints.replaced").iterdir()) == [
        "20261206-120000", "20261206-120000-2"]


def test_more_steps_or_other_logging_continue_the_same_run(toy_workspace, tmp_path):
    make_trainer(toy_workspace, tmp_path, {"train": {"steps": 3}}).fit()
    longer = make_trainer(toy_workspace, tmp_path, {"train": {"steps": 6, "log_every": 1,
                                                              "keep_checkpoints": 7}})
    assert longer.state.step == 3
    assert not (tmp_path / "checkpoints.replaced").exists()


def test_averaging_or_decoding_settings_changed_with_a_longer_run_still_resume(
        toy_workspace, tmp_path, caplog):
    """Averaging happens after training: changing what it averages together with anything
    that re-runs training (here a longer run) must resume, not start again at step 0."""
    make_trainer(toy_workspace, tmp_path, {"train": {"steps": 3}}).fit()
    with caplog.at_level(logging.INFO, logger="aiayn"):
        longer = make_trainer(toy_workspace, tmp_path, {
            "train": {"steps": 5, "average_candidates": [1, 2], "average_last": 2,
                      "valid_bleu_beam": 2},
            "decode": {"beam": 2, "alpha": 1.0}})
    assert longer.state.step == 3, caplog.text
    assert "does not resume" not in caplog.text
    assert not (tmp_path / "checkpoints.replaced").exists()


def test_a_setting_recorded_by_an_older_run_that_no_longer_shapes_training_is_ignored(
        toy_workspace, tmp_path):
    # Runs made before the declaration recorded train.average_candidates in their identity.
    make_trainer(toy_workspace, tmp_path, {"train": {"steps": 3}}).fit()
    last = list_checkpoints(tmp_path / "checkpoints")[-1]
    ckpt = load_checkpoint(last)
    ckpt["meta"]["identity"]["train.average_candidates"] = [1, 3, 5]
    torch.save(ckpt, last)
    assert make_trainer(toy_workspace, tmp_path, {"train": {"steps": 6}}).state.step == 3


def test_a_run_from_before_a_setting_existed_resumes_while_it_is_at_its_default(
        toy_workspace, tmp_path, caplog):
    make_trainer(toy_workspace, tmp_path, {"train": {"steps": 3}}).fit()
    last = list_checkpoints(tmp_path / "checkpoints")[-1]
    ckpt = load_checkpoint(last)
    del ckpt["meta"]["identity"]["train.cooldown"]  # as written before train.cooldown
    torch.save(ckpt, last)
    assert make_trainer(toy_workspace, tmp_path, {"train": {"steps": 6}}).state.step == 3
    assert not (tmp_path / "checkpoints.replaced").exists()
    cooled = make_trainer(toy_workspace, tmp_path, {"train": {"steps": 6, "cooldown": 0.5}})
    assert cooled.state.step == 0
    assert "train.cooldown: '(absent)' -> 0.5" in caplog.text


def test_a_run_from_before_the_output_vocabulary_setting_resumes_at_its_default(
        toy_workspace, tmp_path, caplog):
    make_trainer(toy_workspace, tmp_path, {"train": {"steps": 3}}).fit()
    last = list_checkpoints(tmp_path / "checkpoints")[-1]
    ckpt = load_checkpoint(last)
    del ckpt["meta"]["identity"]["model.output_vocab"]
    del ckpt["meta"]["model_config"]["output_vocab"]
    torch.save(ckpt, last)
    resumed = make_trainer(toy_workspace, tmp_path, {"train": {"steps": 6}})
    assert resumed.state.step == 3
    resumed.fit()
    # Its checkpoints, written before and after the setting existed, average as one run.
    from typer.testing import CliRunner

    from stages.average import app
    write_params(tmp_path / "params.yaml", {"train": {"steps": 6, "average_last": 2}})
    result = CliRunner().invoke(app, [
        "--params", str(tmp_path / "params.yaml"), "--checkpoints", str(tmp_path / "checkpoints"),
        "--tokenizer", str(toy_workspace / "data/vocab/tokenizer.json"),
        "--out", str(tmp_path / "model"), "--metrics", str(tmp_path / "average.json"),
        "--no-mlflow", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "average.json").read_text())["first_step"] == 3
    spanned = make_trainer(toy_workspace, tmp_path, {"train": {"steps": 6},
                                                     "model": {"output_vocab": "target"}})
    assert spanned.state.step == 0
    assert "model.output_vocab: 'shared' -> 'target'" in caplog.text  # step 6's identity


@pytest.mark.parametrize("kernels", ["fast", "plain"])
def test_nan_loss_stops_with_the_steps_and_keeps_the_last_good_checkpoint(
        toy_workspace, tmp_path, kernels):
    trainer = make_trainer(toy_workspace, tmp_path, {"train": {"kernels": kernels}})
    criterion = trainer.criterion  # the fused loss (fast) or the one on full logits (plain)

    def poisoned(net, batch):
        loss, nll, n = criterion(net, batch)
        if trainer.state.step >= 4:
            loss = loss * float("nan")
        return loss, nll, n

    trainer.criterion = poisoned
    # The loss is read at logging steps (every 2): step 5 goes bad, step 6 finds it, before
    # the checkpoint of step 6 could be written.
    with pytest.raises(TrainingDiverged, match="became nan between steps 5 and 6"):
        trainer.fit()
    assert [c.name for c in list_checkpoints(tmp_path / "checkpoints")] == ["step-00000003.pt"]


def test_shards_from_another_vocabulary_are_refused(toy_workspace, tmp_path):
    p = load_params(write_params(tmp_path / "params.yaml"))
    with pytest.raises(DataError, match="re-run `aiayn survey` and `aiayn shard`"):
        build_trainer(p, 999, "x", paths(toy_workspace, tmp_path), World(), progress=False)


def test_shards_from_another_tokenizer_of_the_same_size_are_refused(toy_workspace, tmp_path):
    """The vocabulary retrained (same size, other merges) and training run by hand without
    the survey and shard stages: the shards' ids are the old tokenizer's."""
    from aiayn.data.shards import SOURCE_FILE
    from aiayn.data.tokenizer import save_tokenizer, train_bpe

    tok = toy_workspace / "data/vocab/tokenizer.json"
    size = load_tokenizer(tok).get_vocab_size()
    assert json.loads((toy_workspace / "data/shards" / SOURCE_FILE).read_text())[
        "tokenizer_sha256"] == file_sha256(tok)
    other = tmp_path / "tokenizer.json"
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnop") for _ in range(6)) for _ in range(300)]
    save_tokenizer(train_bpe(iter(" ".join(rng.sample(words, 8)) for _ in range(2000)),
                             size, 1), other)
    assert load_tokenizer(other).get_vocab_size() == size
    p = load_params(write_params(tmp_path / "params.yaml"))
    with pytest.raises(DataError, match=rf"{SOURCE_FILE}: the shards hold the token ids of "
                                        r"the tokenizer of sha256 .*re-run `aiayn survey`"):
        build_trainer(p, size, file_sha256(other), paths(toy_workspace, tmp_path), World(),
                progress=False)


# --------------------------------------------------------------------------- subprocesses


def train_cmd(params: Path, run: Path, ws: Path) -> list[str]:
    """The train stage's flags for a run folder ``run`` over the workspace ``ws``."""
    return harness.train_stage_args(params, run, shards=ws / "data/shards",
                                    tokenizer=ws / "data/vocab/tokenizer.json",
                                    raw=ws / "data/raw")


def env_for_subprocess() -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


@pytest.mark.slow
def test_sigkill_at_an_arbitrary_step_then_resume_ends_bitwise_equal(toy_workspace, tmp_path):
    # Long enough that a fast machine cannot finish between the poll and the kill.
    steps = 160
    changes = {"train": {"steps": steps, "checkpoint_every_steps": 4, "keep_checkpoints": 3}}
    params = write_params(tmp_path / "params.yaml", changes)
    env = env_for_subprocess()
    base = [sys.executable, "-m", "stages.train"]
    subprocess.run(base + train_cmd(params, tmp_path / "full", toy_workspace), env=env,
                   check=True, capture_output=True, timeout=300)
    victim = subprocess.Popen(base + train_cmd(params, tmp_path / "killed", toy_workspace),
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    ckpts = tmp_path / "killed/checkpoints"
    while time.monotonic() < deadline and victim.poll() is None:
        if (ckpts / "step-00000012.pt").exists():
            break
        time.sleep(0.01)
    time.sleep(0.05)  # somewhere after step 12, likely between two checkpoints
    assert victim.poll() is None, "the run finished before it could be killed"
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    killed_at = list_checkpoints(ckpts)[-1]
    assert 12 <= int(killed_at.stem.split("-")[1]) < steps
    subprocess.run(base + train_cmd(params, tmp_path / "killed", toy_workspace), env=env,
                   check=True, capture_output=True, timeout=300)
    last = f"checkpoints/step-{steps:08d}.pt"
    a = load_checkpoint(tmp_path / "full" / last)
    b = load_checkpoint(tmp_path / "killed" / last)
    assert_bitwise_equal(a["model"], b["model"])
    for s_a, s_b in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values(),
                        strict=True):
        assert torch.equal(s_a["exp_avg_sq"], s_b["exp_avg_sq"])
    assert a["meta"]["tokens_seen"] == b["meta"]["tokens_seen"]


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_two_processes_equal_one_process_with_two_accumulation_steps(toy_workspace, tmp_path,
                                                                     compiled):
    # tokens_per_step = 2 x max_tokens: 1 process accumulates 2 batches, 2 processes take 1
    # each; no dropout, so both compute the same update on the same batches. Compiled: the
    # two processes run torch.compile(DDP(model)), the one process stays eager. fp32: the
    # tolerances are fp32 rounding's (see FP32).
    changes = {"model": {"dropout": 0.0}, "train": {"steps": 2, "tokens_per_step": 320,
                                                    "checkpoint_every_steps": 1, **FP32}}
    params = write_params(tmp_path / "params.yaml", changes)
    env = env_for_subprocess()
    one = tmp_path / "one"
    two = tmp_path / "two"
    subprocess.run([sys.executable, "-m", "stages.train", *train_cmd(params, one, toy_workspace)],
                   env=env, check=True, capture_output=True, timeout=300)
    params_two = write_params(tmp_path / "params2.yaml",
                              merge(changes, {"train": {"compile": compiled}}))
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "stages.train", *train_cmd(params_two, two, toy_workspace)],
        env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    for step in (1, 2):
        a = load_checkpoint(one / f"checkpoints/step-{step:08d}.pt")
        b = load_checkpoint(two / f"checkpoints/step-{step:08d}.pt")
        assert a["meta"]["world_size"] == 1 and b["meta"]["world_size"] == 2
        assert a["meta"]["tokens_seen"] == b["meta"]["tokens_seen"]
        ma, mb = without_key_biases(a["model"]), without_key_biases(b["model"])
        for k in ma:
            torch.testing.assert_close(ma[k], mb[k], rtol=1e-5, atol=1e-6)
    # The steps did change the weights (the comparison above is not between two no-ops).
    a1 = load_checkpoint(one / "checkpoints/step-00000001.pt")["model"]["embedding.weight"]
    a2 = load_checkpoint(one / "checkpoints/step-00000002.pt")["model"]["embedding.weight"]
    assert not torch.equal(a1, a2)


def steps_from(run: Path) -> list[dict]:
    """Per step of a run checkpointed every step: its target tokens and its loss row."""
    out, seen = [], 0
    for path in list_checkpoints(run / "checkpoints"):
        meta = load_checkpoint(path)["meta"]
        out.append({"step": meta["step"], "tokens": meta["tokens_seen"] - seen,
                    "batch_tokens": meta["batch_tokens"], "world_size": meta["world_size"]})
        seen = meta["tokens_seen"]
    return out


@pytest.mark.slow
def test_the_step_is_the_budget_on_one_or_two_processes_from_shards_cut_once(tmp_path):
    """Shards cut once, at the one-process step (as wmt14_base cuts 25,000-token batches),
    trained by 1 and by 2 processes (gloo): both take steps of train.tokens_per_step, no
    warning, no data stage again. And with the same micro-batches (train.max_tokens: half
    the step) 1 process accumulating two and 2 processes of one take the same steps.

    8,000 toy pairs: a corpus with enough pairs of each length that length-sorted batches
    are ~92% real tokens, as real corpora's are (the tiny toy's 400 pairs fill ~80%)."""
    budget, steps = 640, 10
    ws = build_toy_workspace(tmp_path / "ws", {
        "data": {"toy": {"train_pairs": 8000}}, "shard": {"max_tokens": budget}})
    shards = ws / "data/shards"
    stored = (shards / "train/batches.npy").read_bytes()
    changes = {"data": {"toy": {"train_pairs": 8000}}, "shard": {"max_tokens": budget},
               "model": {"dropout": 0.0},
               "train": {"steps": steps, "tokens_per_step": budget, "max_tokens": 0,
                         "checkpoint_every_steps": 1, "keep_checkpoints": steps,
                         "log_every": 1, **FP32}}
    env = env_for_subprocess()

    def train(name: str, nproc: int, extra: dict | None = None) -> str:
        params = write_params(tmp_path / f"{name}.yaml", merge(changes, extra or {}))
        launch = ([sys.executable, "-m", "stages.train"] if nproc == 1 else
                  [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={nproc}", "-m", "stages.train"])
        result = subprocess.run(launch + train_cmd(params, tmp_path / name, ws), env=env,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stderr

    logs = {"one": train("one", 1), "two": train("two", 2),
            "one_by_two": train("one_by_two", 1, {"train": {"max_tokens": budget // 2}})}
    runs = {name: steps_from(tmp_path / name) for name in logs}
    for name, log_text in logs.items():
        assert "warning:" not in log_text, (name, log_text[-2000:])
        assert len(runs[name]) == steps
        mean = sum(s["tokens"] for s in runs[name]) / steps
        assert 0.9 * budget <= mean <= budget, (name, runs[name])
    assert {(s["batch_tokens"], s["world_size"]) for s in runs["one"]} == {(budget, 1)}
    assert {(s["batch_tokens"], s["world_size"]) for s in runs["two"]} == {(budget // 2, 2)}
    assert "2 process(es) x 1 micro-batch(es) of <= 320 tokens" in logs["two"]
    assert "1 process(es) x 2 micro-batch(es) of <= 320 tokens" in logs["one_by_two"]
    assert (shards / "train/batches.npy").read_bytes() == stored  # nothing was cut again
    # the same micro-batches: the same steps (fp32 rounding apart)
    assert [s["tokens"] for s in runs["two"]] == [s["tokens"] for s in runs["one_by_two"]]
    for step in range(1, steps + 1):
        a = load_checkpoint(tmp_path / f"one_by_two/checkpoints/step-{step:08d}.pt")
        b = load_checkpoint(tmp_path / f"two/checkpoints/step-{step:08d}.pt")
        ma, mb = without_key_biases(a["model"]), without_key_biases(b["model"])
        for k in ma:
            torch.testing.assert_close(ma[k], mb[k], rtol=1e-5, atol=1e-6)
    losses = {name: [float(line.split("\t")[1]) for line in
                     (tmp_path / name / "train_log.tsv").read_text().splitlines()[1:]]
              for name in ("two", "one_by_two")}
    assert len(losses["two"]) == steps
    assert losses["two"] == pytest.approx(losses["one_by_two"], rel=1e-5)


def call_train_stage(toy_workspace: Path, tmp_path: Path, steps: int, mlflow: bool) -> None:
    """``aiayn train`` in this process on the toy workspace's shards, for ``steps`` steps,
    writing under TMP_PATH/run; the SIGINT and SIGTERM handlers the stage installs are
    replaced by the test process's own afterwards."""
    import stages.train as train_stage

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    run = tmp_path / "run"
    try:
        train_stage.train(
            params=write_params(tmp_path / "p.yaml", {"train": {"steps": steps}}),
            shards=toy_workspace / "data/shards",
            tokenizer=toy_workspace / "data/vocab/tokenizer.json",
            raw=toy_workspace / "data/raw", checkpoints=run / "checkpoints",
            metrics=run / "train.json", train_log=run / "train_log.tsv",
            valid_log=run / "valid_log.tsv", curves=run / "curves.png",
            progress=False, mlflow=mlflow)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def test_any_error_ends_the_train_stages_mlflow_run_failed(toy_workspace, tmp_path,
                                                         monkeypatch):
    """Not only the project's own errors: a kernel's RuntimeError or a CUDA out-of-memory
    must not leave the run RUNNING in the MLflow UI for ever. The experiment opens in
    MLflow's model-training view, and a run outside `dvc exp` is named for what it is."""
    from mlflow import MlflowClient

    import stages.train as train_stage
    from aiayn.tracking import git_commit

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    monkeypatch.chdir(REPO)  # stages run in the repository's root: conf/ and git are there

    def broken(self, should_stop=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(train_stage.Trainer, "fit", broken)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        call_train_stage(toy_workspace, tmp_path, steps=2, mlflow=True)
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("aiayn")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.status for r in runs] == ["FAILED"]
    # The tiny test params are the demo preset with a handful of settings changed.
    name, _, commit = runs[0].info.run_name.partition("@")
    assert name.startswith("demo+") and int(name.removeprefix("demo+")) > 0
    assert commit == (git_commit() or "")[:7]


@pytest.mark.filterwarnings("error::UserWarning")  # e.g. matplotlib's on a curve with no rows
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_train_stage_checkpoints_then_exits_nonzero(toy_workspace, tmp_path,
                                                                  monkeypatch, sig):
    """Ctrl-C (what `dvc queue kill` sends) or SIGTERM mid-run: the step ends, a checkpoint is
    written, and the stage exits as a process ended by that signal does (128 + its number),
    so that DVC runs no later stage on the partial run; running it again resumes."""
    import typer

    import stages.train as train_stage

    real_fit = train_stage.Trainer.fit

    def fit_then_signalled(self, should_stop):
        os.kill(os.getpid(), sig)  # the stage's handler asks the loop to stop after a step
        return real_fit(self, should_stop)

    monkeypatch.setattr(train_stage.Trainer, "fit", fit_then_signalled)
    with pytest.raises(typer.Exit) as stopped:
        call_train_stage(toy_workspace, tmp_path, steps=50, mlflow=False)
    run = tmp_path / "run"
    assert stopped.value.exit_code == 128 + sig
    summary = json.loads((run / "train.json").read_text())
    assert summary["stopped_by"] == "interrupted" and 0 < summary["steps"] < 50
    assert checkpoint_step(list_checkpoints(run / "checkpoints")[-1]) == summary["steps"]


def test_a_run_is_named_after_the_preset_its_params_equal(monkeypatch):
    from stages.params import compose
    from stages.train import preset_of

    monkeypatch.chdir(REPO)
    for preset in ("multi30k", "wmt14_base"):
        p = parse_params(yaml.safe_load(compose(REPO / "conf", preset, [])))
        assert preset_of(p, Path("conf")) == preset
        p.train.lr_scale, p.decode.beam = 3.0, 7
        assert preset_of(p, Path("conf")) == f"{preset}+2"
    assert preset_of(p, Path("no-such-conf")) == "params"


@pytest.mark.slow
def test_train_stage_logs_one_mlflow_run_and_a_resume_continues_it(toy_workspace, tmp_path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    # MKL capped to AVX2 (harmless for fp32): the run must say so in its tags.
    env = {**env_for_subprocess(), "MLFLOW_TRACKING_URI": uri, "DVC_EXP_NAME": "my-exp",
           "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    run = tmp_path / "run"
    bleu = {"valid_bleu_every": 2, "valid_bleu_beam": 1, "valid_bleu_sentences": 10}
    cmd = [sys.executable, "-m", "stages.train",
           *[a for a in train_cmd(write_params(tmp_path / "p.yaml",
                                               {"train": {"steps": 4, **bleu}}),
                                  run, toy_workspace) if a != "--no-mlflow"]]
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=300, cwd=tmp_path)
    run_id = json.loads((run / "checkpoints/mlflow_run.json").read_text())["run_id"]
    cmd[cmd.index("--params") + 1] = str(write_params(tmp_path / "p.yaml",
                                                      {"train": {"steps": 6, **bleu}}))
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=300, cwd=tmp_path)
    assert json.loads((run / "checkpoints/mlflow_run.json").read_text())["run_id"] == run_id
    client = MlflowClient(uri)
    logged = client.get_run(run_id)
    assert logged.data.params["model.d_model"] == "32"
    assert logged.data.params["train.label_smoothing"] == "0.1"
    assert logged.data.tags["dvc_experiment"] == "my-exp"
    assert logged.info.status == "FINISHED"
    history = client.get_metric_history(run_id, "train/loss")
    assert [m.step for m in history] == [2, 4, 6]   # the resumed steps in the same run
    assert [m.step for m in client.get_metric_history(run_id, "valid/loss")] == [2, 4, 6]
    bleu_history = client.get_metric_history(run_id, "valid/sacrebleu")
    assert [m.step for m in bleu_history] == [2, 4, 6]
    assert logged.data.metrics["final/steps"] == 6
    assert logged.data.metrics["final/best_valid_bleu"] == max(m.value for m in bleu_history)
    assert logged.data.tags["kernels"] == "fast" and logged.data.tags["stopped_by"] == "steps"
    assert logged.data.tags["precision"] in ("fp32", "bf16")
    assert logged.data.tags["hardware"] == cpu_model()
    assert "MKL_ENABLE_INSTRUCTIONS=AVX2" in logged.data.tags["instruction_caps"].split()


def test_rows_logged_after_the_last_checkpoint_are_not_logged_twice_on_resuming(
        toy_workspace, tmp_path):
    """A run killed after it logged step 6's rows but before the checkpoint of step 6 was
    on disk resumes from step 3 and computes the rows of steps 4 and 6 again: MLflow's
    history holds each step once."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    env = {**env_for_subprocess(), "MLFLOW_TRACKING_URI": uri}
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "stages.train",
           *[a for a in train_cmd(write_params(tmp_path / "p.yaml", {"train": {"steps": 6}}),
                                  run, toy_workspace) if a != "--no-mlflow"]]
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=300, cwd=tmp_path)
    (run / "checkpoints/step-00000006.pt").unlink()  # as if killed before it was written
    (run / "checkpoints.progress/step-00000006.pt").unlink(missing_ok=True)
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=300, cwd=tmp_path)
    run_id = json.loads((run / "checkpoints/mlflow_run.json").read_text())["run_id"]
    client = MlflowClient(uri)
    assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == [2, 4, 6]
    assert [m.step for m in client.get_metric_history(run_id, "valid/loss")] == [6]
    assert client.get_run(run_id).data.metrics["final/steps"] == 6


@pytest.mark.slow
def test_a_run_that_goes_on_from_before_its_cooldown_gets_a_new_mlflow_run_with_its_curves(
        toy_workspace, tmp_path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    env = {**env_for_subprocess(), "MLFLOW_TRACKING_URI": uri}
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "stages.train",
           *[a for a in train_cmd(write_params(tmp_path / "p.yaml",
                                               {"train": {**COOL, "steps": 12}}),
                                  run, toy_workspace) if a != "--no-mlflow"]]
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=300, cwd=tmp_path)
    first = json.loads((run / "checkpoints/mlflow_run.json").read_text())["run_id"]
    cmd[cmd.index("--params") + 1] = str(write_params(tmp_path / "p.yaml",
                                                      {"train": {**COOL, "steps": 24}}))
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=300, cwd=tmp_path)
    second = json.loads((run / "checkpoints/mlflow_run.json").read_text())["run_id"]
    assert second != first
    client = MlflowClient(uri)
    logged = client.get_run(second)
    assert logged.data.tags["branched_from_run"] == first
    assert logged.data.tags["branched_at_step"] == "6"
    assert logged.data.params["train.steps"] == "24"
    old = client.get_metric_history(first, "train/loss")
    new = client.get_metric_history(second, "train/loss")
    assert [m.step for m in old] == list(range(2, 13, 2))  # the first run is left as it was
    assert [m.step for m in new] == list(range(2, 25, 2))  # its curve up to step 6, then on
    assert [m.value for m in new[:3]] == [m.value for m in old[:3]]
    assert [m.step for m in client.get_metric_history(second, "valid/loss")] == [6, 12, 18, 24]


def test_out_of_memory_names_the_batch_budget_and_the_param(toy_workspace, tmp_path,
                                                            monkeypatch):
    from aiayn.training.loop import OutOfMemory

    trainer = make_trainer(toy_workspace, tmp_path)
    calls = {"n": 0}
    forward = trainer.net.forward

    def exhausted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return forward(*args, **kwargs)

    monkeypatch.setattr(trainer.net, "forward", exhausted)
    with pytest.raises(OutOfMemory) as err:
        trainer.fit()
    msg = str(err.value)
    assert "out of memory at step 3" in msg and "up to 160 tokens" in msg
    assert "set train.max_tokens below that" in msg and "no data stage re-runs" in msg
    assert "resumes from the last checkpoint" in msg


# --------------------------------------------------------------------------- fast path


def fast_and_plain_without_dropout(ws: Path, tmp_path: Path, precision: str, rel: float):
    """Train the toy model with the fast and with the plain kernels, no dropout, in
    ``precision``; check both logged the same steps and tokens, and losses (per logged step
    and on valid) within ``rel``. Returns (trainer, summary) of fast, then of plain."""
    runs = []
    for path in ("fast", "plain"):
        trainer = make_trainer(ws, tmp_path / path,
                               {"model": {"dropout": 0.0},
                                "train": {"kernels": path, "precision": precision}})
        runs.append((trainer, trainer.fit()))
    (fast, a), (plain, b) = runs
    assert a["kernels"] == "fast" and b["kernels"] == "plain"
    hardware = precision_hardware(torch.device("cpu"))  # what train.json says it ran on
    assert {k: a[k] for k in hardware} == {k: b[k] for k in hardware} == hardware
    for ra, rb in zip(fast.log.train, plain.log.train, strict=True):
        assert ra.step == rb.step and ra.tokens == rb.tokens
        assert ra.loss == pytest.approx(rb.loss, rel=rel)
    assert a["valid_loss"] == pytest.approx(b["valid_loss"], rel=rel)
    return runs


@pytest.mark.skipif(not cpu_has_native_bf16(),
                    reason="no native bf16 here: bf16 autocast would be emulated, ~100x slower")
def test_fast_and_plain_kernels_learn_alike_under_bf16_autocast(toy_workspace, tmp_path):
    """The path a CPU with native bf16 trains on (precision auto = bf16 autocast): the fast
    kernels' losses follow the plain path's to bf16 rounding. Measured on an AVX512-BF16
    CPU: at most 3.1e-4 apart over the 12 steps; a wrong loss or gradient moves them by %."""
    (_, a), (_, b) = fast_and_plain_without_dropout(toy_workspace, tmp_path, "bf16", rel=5e-3)
    assert a["precision"] == b["precision"] == "bf16"


def test_fast_and_plain_kernels_learn_the_same_without_dropout(toy_workspace, tmp_path):
    """Without dropout (the only random difference) the two paths compute one function:
    the same losses and the same outputs after training, up to float rounding."""
    (fast, a), (plain, b) = fast_and_plain_without_dropout(toy_workspace, tmp_path,
                                                           FP32["precision"], rel=1e-5)
    # Outputs, not weights: the key part of each attention bias has a true gradient of 0
    # (softmax ignores a constant added to all scores), so Adam turns rounding noise there
    # into full steps that differ between the paths, without changing the function.
    batch = fast.valid_data.batch(0)
    fast.model.eval()
    plain.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(fast.model(batch.src, batch.tgt_in),
                                   plain.model(batch.src, batch.tgt_in), rtol=1e-3, atol=1e-3)
    # The same checkpoint format: a plain run's checkpoint loads into a fast trainer.
    ck_a = load_checkpoint(list_checkpoints(tmp_path / "fast/checkpoints")[-1])
    ck_b = load_checkpoint(list_checkpoints(tmp_path / "plain/checkpoints")[-1])
    assert ck_a["model"].keys() == ck_b["model"].keys()
    assert ck_a["optimizer"]["state"].keys() == ck_b["optimizer"]["state"].keys()
    for sa, sb in zip(ck_a["optimizer"]["state"].values(), ck_b["optimizer"]["state"].values(),
                      strict=True):
        assert sa.keys() == sb.keys()
    fast.model.load_state_dict(ck_b["model"])
    fast.optimizer.load_state_dict(ck_b["optimizer"])


def test_switching_kernels_starts_a_new_run(toy_workspace, tmp_path, caplog):
    make_trainer(toy_workspace, tmp_path, {"train": {"steps": 3, "kernels": "plain"}}).fit()
    fresh = make_trainer(toy_workspace, tmp_path, {"train": {"steps": 3, "kernels": "fast"}})
    assert fresh.state.step == 0 and "train.kernels: 'plain' -> 'fast'" in caplog.text


@pytest.mark.parametrize("changes, builds", [
    ({"train": {"precision": "fp32"}}, True),     # post-LN: the residual blocks' kernel
    ({"train": {"precision": "bf16"}}, True),
    ({"model": {"norm": "pre"}, "train": {"precision": "bf16"}}, True),  # the loss's softmax
    ({"model": {"norm": "pre"}, "train": {"precision": "fp32"}}, True),  # attention
    ({"train": {"kernels": "plain"}}, False),     # torch's ops only
])
def test_the_cpu_kernels_are_built_before_the_clock_starts_where_training_takes_them(
        toy_workspace, tmp_path, monkeypatch, changes, builds):
    """The C++ kernels' one-time build (~30 s) happens while the trainer is set up, not
    inside the first step, whose time the step log and the minutes budget count."""
    calls = []
    monkeypatch.setattr(extension, "cpu_extension", lambda: calls.append(1))
    trainer = make_trainer(toy_workspace, tmp_path, changes)
    assert len(calls) == int(builds)
    trainer.loader.close()


def test_a_train_step_never_reads_a_tensor_back(toy_workspace, tmp_path, monkeypatch):
    """No host synchronisation inside a step (per micro-batch or per step): on a GPU the
    host queues work and runs ahead. Reading a tensor's value is what would wait."""
    trainer = make_trainer(toy_workspace, tmp_path, {"train": {"steps": 4}})
    it = iter(trainer.loader)
    batches = [trainer.micro_batches(it) for _ in range(3)]

    def forbidden(*args, **kwargs):
        raise AssertionError("a tensor was read back inside train_step")

    with monkeypatch.context() as m:
        # Python-level reads, and nonzero, whose output size a GPU would have to report.
        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__",
                     "nonzero"):
            m.setattr(torch.Tensor, name, forbidden)
        m.setattr(torch, "nonzero", forbidden)
        for micro in batches[:2]:
            trainer.train_step(micro)  # steps 1 and 2; step 2 logs, the norm stays a tensor
    trainer.train_step(batches[2])
    tokens, loss, _ = trainer.flush()  # the one read, at logging / checkpoint steps
    assert tokens == sum(b.tgt_tokens for micro in batches for b in micro) and loss > 0
    trainer.loader.close()


def test_the_time_budget_stops_at_a_checkpoint_and_a_larger_one_resumes(toy_workspace,
                                                                       tmp_path):
    # A budget of 60 microseconds is spent by the first step.
    first = make_trainer(toy_workspace, tmp_path, {"train": {"max_minutes": 1e-6}})
    summary = first.fit()
    assert summary["steps"] == 1 and summary["stopped_by"] == "time budget"
    assert summary["max_minutes"] == 1e-6
    assert [c.name for c in list_checkpoints(tmp_path / "checkpoints")] == ["step-00000001.pt"]
    assert first.log.valid[-1].step == 1 and first.log.train[-1].step == 1
    spent = summary["wall_time_s"]
    again = make_trainer(toy_workspace, tmp_path, {"train": {"max_minutes": 1e-6}})
    assert again.fit()["steps"] == 1  # still spent: nothing to train, nothing lost
    longer = make_trainer(toy_workspace, tmp_path, {"train": {"max_minutes": 60}})
    assert longer.state.step == 1  # the budget is not part of the run's identity
    done = longer.fit()
    assert done["steps"] == 12 and done["stopped_by"] == "steps"
    assert done["wall_time_s"] > spent  # the time of both sessions


def checkpoint_steps(folder: Path) -> list[int]:
    return [checkpoint_step(c) for c in list_checkpoints(folder)]


COOL = {"cooldown": 0.5, "keep_checkpoints": 2, "average_last": 2}


def test_a_longer_end_after_the_cooldown_began_goes_on_from_before_it_as_a_fresh_run_would(
        toy_workspace, tmp_path, caplog):
    short = make_trainer(toy_workspace, tmp_path / "ext", {"train": {**COOL, "steps": 12}})
    short.fit()
    # Checkpoints every 3 steps; the rate falls after step 6 (half of 12). The last
    # checkpoint at the full rate is kept beside the newest two.
    assert checkpoint_steps(tmp_path / "ext/checkpoints") == [6, 9, 12]
    longer = make_trainer(toy_workspace, tmp_path / "ext", {"train": {**COOL, "steps": 24}})
    assert longer.state.step == 6 and longer.store.branched_from["step"] == 6
    assert "train.steps 12 -> 24" in caplog.text and "goes on from step 6" in caplog.text
    moved = sorted(q.name for q in (tmp_path / "ext/checkpoints.replaced").glob("*/*.pt"))
    assert moved == ["step-00000009.pt", "step-00000012.pt"]  # kept, not deleted
    assert [r.step for r in longer.log.train] == [2, 4, 6]  # the logs rewind too
    longer.fit()
    fresh = make_trainer(toy_workspace, tmp_path / "fresh", {"train": {**COOL, "steps": 24}})
    fresh.fit()
    last = "checkpoints/step-00000024.pt"
    a, b = load_checkpoint(tmp_path / "ext" / last), load_checkpoint(tmp_path / "fresh" / last)
    assert_bitwise_equal(a["model"], b["model"])  # the 24-step run from scratch, exactly
    assert [r[:6] for r in a["run"]["train_rows"]] == [r[:6] for r in b["run"]["train_rows"]]
    assert a["run"]["valid_rows"] == b["run"]["valid_rows"]


def test_rdrop_start_trains_plain_steps_then_rdrop_ones(toy_workspace, tmp_path, caplog):
    """rdrop_start 0.5 of 12 steps: steps 1-7 (at most half done before them) are the plain
    run's, bit for bit; R-Drop trains steps 8-12, which then differ from the plain run's."""
    caplog.set_level(logging.INFO, logger="aiayn")
    late = make_trainer(toy_workspace, tmp_path / "late",
                        {"train": {"rdrop": 2.0, "rdrop_start": 0.5, "log_every": 1}})
    active = []
    step = late.train_step
    late.train_step = lambda batches: (step(batches), active.append(late.criterion.active))
    summary = late.fit()
    assert (summary["rdrop_start"], summary["rdrop_from_step"]) == (0.5, 8)
    assert active == [False] * 7 + [True] * 5
    assert "R-Drop on from step 8" in caplog.text
    plain = make_trainer(toy_workspace, tmp_path / "plain", {"train": {"log_every": 1}})
    plain.fit()
    a, b = late.log.train, plain.log.train
    assert [r.loss for r in a[:7]] == [r.loss for r in b[:7]]
    assert all(x.loss != y.loss for x, y in zip(a[7:], b[7:], strict=True))
    assert_bitwise_equal(model_tensors(tmp_path / "late/checkpoints/step-00000006.pt"),
                         model_tensors(tmp_path / "plain/checkpoints/step-00000006.pt"))


def test_a_longer_end_after_rdrop_began_goes_on_from_before_it_as_a_fresh_run_would(
        toy_workspace, tmp_path, caplog):
    """R-Drop's start moves with the end as the cooldown does: a run whose end moved after
    R-Drop began goes on from its last checkpoint before it, and ends as the longer run from
    scratch ends."""
    late = {"rdrop": 2.0, "rdrop_start": 0.5, "keep_checkpoints": 2, "average_last": 2}
    make_trainer(toy_workspace, tmp_path / "ext", {"train": {**late, "steps": 12}}).fit()
    assert checkpoint_steps(tmp_path / "ext/checkpoints") == [6, 9, 12]  # 6 kept for this
    longer = make_trainer(toy_workspace, tmp_path / "ext", {"train": {**late, "steps": 24}})
    assert longer.state.step == 6 and longer.store.branched_from["step"] == 6
    assert "goes on from step 6" in caplog.text
    longer.fit()
    fresh = make_trainer(toy_workspace, tmp_path / "fresh", {"train": {**late, "steps": 24}})
    fresh.fit()
    last = "checkpoints/step-00000024.pt"
    a, b = load_checkpoint(tmp_path / "ext" / last), load_checkpoint(tmp_path / "fresh" / last)
    assert_bitwise_equal(a["model"], b["model"])
    assert [r[:6] for r in a["run"]["train_rows"]] == [r[:6] for r in b["run"]["train_rows"]]
    assert a["run"]["rdrop_from_step"] == b["run"]["rdrop_from_step"] == 14


def test_an_unchanged_end_or_one_that_changes_no_rate_resumes_from_the_newest_checkpoint(
        toy_workspace, tmp_path):
    # Interrupted in its cooldown, the same settings resume where it stopped.
    part = make_trainer(toy_workspace, tmp_path / "cut", {"train": {**COOL, "steps": 12}})
    part.fit(should_stop=lambda: part.state.step == 8)
    again = make_trainer(toy_workspace, tmp_path / "cut", {"train": {**COOL, "steps": 12}})
    assert again.state.step == 8 and again.store.branched_from is None
    # A run whose time budget set its rates (spent at step 1: the rate there is already 0)
    # keeps them when only train.steps rises: it resumes, and has nothing left to train.
    timed = {**COOL, "max_minutes": 1e-6}
    first = make_trainer(toy_workspace, tmp_path / "timed", {"train": timed})
    assert first.fit()["stopped_by"] == "time budget"
    more = make_trainer(toy_workspace, tmp_path / "timed", {"train": {**timed, "steps": 24}})
    assert more.state.step == 1 and more.store.branched_from is None
    assert more.fit()["steps"] == 1
    assert not list(tmp_path.glob("*/checkpoints.replaced"))


def test_a_moved_end_without_a_checkpoint_before_the_cooldown_starts_a_new_run(
        toy_workspace, tmp_path, caplog):
    # A cooldown over all of training: the rate falls from the first step on.
    make_trainer(toy_workspace, tmp_path, {"train": {**COOL, "cooldown": 1.0}}).fit()
    longer = make_trainer(toy_workspace, tmp_path, {"train": {**COOL, "cooldown": 1.0,
                                                              "steps": 24}})
    assert longer.state.step == 0 and longer.store.branched_from is None
    assert "keeps no checkpoint from before its cooldown" in caplog.text
    assert list_checkpoints(tmp_path / "checkpoints") == []
    assert sorted(q.name for q in (tmp_path / "checkpoints.replaced").glob("*/*.pt")) == [
        "step-00000009.pt", "step-00000012.pt"]


def train_log(run: Path) -> list[dict]:
    lines = (run / "train_log.tsv").read_text().splitlines()
    head = lines[0].split("\t")
    return [dict(zip(head, map(float, line.split("\t")), strict=True)) for line in lines[1:]]


def test_the_cooldown_brings_the_rate_to_zero_at_the_last_step(toy_workspace, tmp_path):
    trainer = make_trainer(toy_workspace, tmp_path, {"train": {"cooldown": 0.5, "log_every": 1}})
    trainer.fit()
    trainer.write_logs()
    rows = train_log(tmp_path)
    assert [int(r["step"]) for r in rows] == list(range(1, 13))
    for r in rows:  # step s runs with (s - 1) of 12 steps done; the last 6 fall to 1/6
        s = int(r["step"])
        expected = noam_lr(s, 32, 4) * min(1.0, (1 - (s - 1) / 12) / 0.5)
        assert r["lr"] == pytest.approx(expected, rel=1e-5)
    assert rows[-1]["lr"] == pytest.approx(noam_lr(12, 32, 4) / 6, rel=1e-5)


def test_under_a_time_budget_the_cooldown_follows_the_clock(toy_workspace, tmp_path,
                                                            monkeypatch):
    # The trainer's clock advances 0.1 s per reading (whatever the machine's speed): the
    # 3-second budget ends a run of 10,000 steps after a few dozen, and the lr falls with
    # the time spent, to nearly zero at the last step.
    import types

    import aiayn.training.clock

    readings = iter(range(1, 1_000_000))
    clock = {k: getattr(time, k) for k in dir(time) if not k.startswith("_")}
    clock["perf_counter"] = lambda: 0.1 * next(readings)
    monkeypatch.setattr(aiayn.training.clock, "time", types.SimpleNamespace(**clock))
    budget_s = 3.0
    trainer = make_trainer(toy_workspace, tmp_path, {"train": {
        "cooldown": 0.5, "log_every": 1, "steps": 10_000, "max_minutes": budget_s / 60,
        "valid_every": 10_000, "checkpoint_every_steps": 10_000}})
    summary = trainer.fit()
    trainer.write_logs()
    assert summary["stopped_by"] == "time budget"
    rows = train_log(tmp_path)
    assert len(rows) >= 10
    cooled = 0
    for before, r in itertools.pairwise(rows):  # step s uses the time spent after step s - 1
        s = int(r["step"])
        progress = max((s - 1) / 10_000, before["elapsed_s"] / budget_s)
        factor = cooldown_factor(progress, 0.5)
        # (elapsed_s is logged to 6 digits: compare the multipliers, absolutely)
        assert r["lr"] / noam_lr(s, 32, 4) == pytest.approx(factor, abs=1e-4)
        cooled += factor < 0.9
    assert cooled >= 5  # the clock, not the step count (0.1% done), drove the rate down
    assert rows[-1]["lr"] < 0.2 * noam_lr(int(rows[-1]["step"]), 32, 4)


def test_the_logged_training_rate_leaves_out_validation_and_checkpoints(toy_workspace,
                                                                       tmp_path, monkeypatch):
    # A clock that moves only when the trainer works: 1 s a step, 50 s a validation pass,
    # 20 s a checkpoint. Every row's rate is then its window's tokens over its steps'
    # seconds, while the run's wall time holds all of it.
    import types

    import aiayn.training.clock

    now = [0.0]
    clock = {k: getattr(time, k) for k in dir(time) if not k.startswith("_")}
    clock["perf_counter"] = lambda: now[0]
    monkeypatch.setattr(aiayn.training.clock, "time", types.SimpleNamespace(**clock))
    trainer = make_trainer(toy_workspace, tmp_path, {"train": {
        "steps": 12, "log_every": 2, "valid_every": 3, "checkpoint_every_steps": 4,
        "checkpoint_every_minutes": 0, "valid_bleu_every": 0}})

    def taking(seconds, fn):
        def timed(*args, **kwargs):
            out = fn(*args, **kwargs)
            now[0] += seconds
            return out
        return timed

    trainer.train_step = taking(1.0, trainer.train_step)
    trainer.validate = taking(50.0, trainer.validate)
    trainer.checkpoint = taking(20.0, trainer.checkpoint)
    summary = trainer.fit()
    trainer.write_logs()
    rows = train_log(tmp_path)
    assert [int(r["step"]) for r in rows] == [2, 4, 6, 8, 10, 12]
    before = 0
    for r in rows:
        assert r["tokens_per_s"] == pytest.approx((r["tokens"] - before) / 2.0, rel=1e-4)
        before = r["tokens"]
    # validations at steps 3, 6, 9, 12 and checkpoints at 4 and 8 are in the wall time (the
    # last checkpoint, written after the run's clock stops, is not)
    assert summary["wall_time_s"] == pytest.approx(12 * 1.0 + 4 * 50.0 + 2 * 20.0)


def test_a_run_records_its_kernels_precision_and_end(toy_workspace, tmp_path):
    trainer = make_trainer(toy_workspace, tmp_path, {"train": {"steps": 2}})
    summary = trainer.fit()
    trainer.write_summary(summary)
    metrics = json.loads((tmp_path / "train.json").read_text())
    assert metrics["kernels"] == "fast" and metrics["precision"] in ("fp32", "bf16")
    assert metrics["stopped_by"] == "steps" and metrics["compile"] is False


@pytest.mark.slow
def test_compiled_training_matches_eager_with_two_graphs_whatever_the_shapes(toy_workspace,
                                                                            tmp_path,
                                                                            monkeypatch):
    from torch._dynamo.utils import counters

    # A cache of its own: graphs that earlier processes compiled from other shapes and left in
    # the machine's Inductor cache bring their own shape guards when reused (seen: 4 graphs).
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))

    # no dropout: Inductor draws its own dropout masks; fp32: see FP32
    changes = {"model": {"dropout": 0.0}, "train": FP32}
    eager = make_trainer(toy_workspace, tmp_path / "eager", changes)
    eager.fit()
    torch._dynamo.reset()
    counters.clear()
    compiled = make_trainer(toy_workspace, tmp_path / "compiled",
                            merge(changes, {"train": {"compile": True}}))
    shapes = set()
    micro_batches = compiled.micro_batches

    def seen(it):  # outside the compiled region, so that watching adds no guards
        batches = micro_batches(it)
        shapes.update((tuple(b.src.shape), tuple(b.tgt_in.shape)) for b in batches)
        return batches

    compiled.micro_batches = seen
    summary = compiled.fit()
    assert summary["compile"] is True and summary["steps"] == 12
    assert len(shapes) >= 6  # many batch shapes went through the compiled model...
    assert counters["stats"]["unique_graphs"] <= 2  # ...yet one static and one dynamic graph
    assert sum(counters["graph_break"].values()) == 0
    for a, b in zip(eager.log.train, compiled.log.train, strict=True):
        assert a.loss == pytest.approx(b.loss, rel=1e-4)


# --------------------------------------------------------------------------- validation BLEU


def bleu_trainer(ws: Path, run: Path, changes: dict | None = None) -> Trainer:
    """A trainer with the train stage's own validation-BLEU hook (greedy, the toy valid set)."""
    from stages.train import validation_bleu

    base = {"train": {"valid_bleu_every": 6, "valid_bleu_beam": 1}}
    trainer = make_trainer(ws, run, merge(base, changes or {}))
    trainer.valid_bleu = validation_bleu(trainer.p, ws / "data/raw",
                                         load_tokenizer(ws / "data/vocab/tokenizer.json"))
    return trainer


def test_validation_bleu_is_measured_logged_and_the_same_after_a_resume(toy_workspace,
                                                                        tmp_path):
    full = bleu_trainer(toy_workspace, tmp_path / "full")
    summary = full.fit()
    full.write_logs()
    bleu_rows = [(r.step, r.valid_bleu) for r in full.log.scored()]
    assert [step for step, _ in bleu_rows] == [6, 12]
    assert all(0 <= score <= 100 for _, score in bleu_rows)
    assert summary["valid_bleu"] == bleu_rows[-1][1]
    assert summary["best_valid_bleu"] == max(score for _, score in bleu_rows)
    assert summary["valid_bleu_seconds"] > 0 and 0 < summary["valid_bleu_share"] < 1
    lines = [line.split("\t") for line in (tmp_path / "full/valid_log.tsv").read_text()
             .splitlines()]
    assert lines[0][-1] == "valid_bleu" and float(lines[-1][-1]) == bleu_rows[-1][1]
    metas = {int(c.stem.split("-")[1]): load_checkpoint(c)["meta"]
             for c in list_checkpoints(tmp_path / "full/checkpoints")}
    assert metas[12]["valid_bleu"] == bleu_rows[-1][1] and metas[9]["valid_bleu"] is None

    part = bleu_trainer(toy_workspace, tmp_path / "part")
    part.fit(should_stop=lambda: part.state.step == 5)
    resumed = bleu_trainer(toy_workspace, tmp_path / "part")
    resumed.fit()
    assert resumed.log.valid == full.log.valid  # BLEU included


def test_the_last_validations_time_is_inside_the_runs_wall_time(toy_workspace, tmp_path):
    """wall_time_s (elapsed_s) covers the final step's validation, as bleu_seconds does: the
    hook's clock from its first call to the end of its last lies inside the run's, so
    valid_bleu_share stays below 1 however long the last BLEU pass takes."""
    trainer = make_trainer(toy_workspace, tmp_path, {"train": {"valid_bleu_every": 6}})
    clock = []

    def slow_bleu(*_):
        clock.append(time.perf_counter())
        time.sleep(3.0 if trainer.state.step == trainer.p.train.steps else 0.0)
        clock.append(time.perf_counter())
        return 50.0

    trainer.valid_bleu = slow_bleu
    summary = trainer.fit()
    assert len(clock) == 4  # steps 6 and 12
    assert summary["wall_time_s"] >= clock[-1] - clock[0]
    assert 0 < summary["valid_bleu_share"] < 1


def test_the_bleu_curve_file_holds_only_the_steps_that_have_a_bleu(toy_workspace, tmp_path):
    # Validation every 6 steps, BLEU every 4: steps 6 has a loss but no BLEU, and a plot of
    # valid_log.tsv's column would draw that gap as a zero.
    trainer = bleu_trainer(toy_workspace, tmp_path, {"train": {"valid_bleu_every": 4}})
    trainer.fit()
    trainer.write_logs()
    valid = [line.split("\t") for line in (tmp_path / "valid_log.tsv").read_text().splitlines()]
    assert [row[0] for row in valid[1:]] == ["4", "6", "8", "12"] and valid[2][-1] == ""
    bleu = [line.split("\t") for line in (tmp_path / "valid_bleu.tsv").read_text().splitlines()]
    assert bleu[0] == ["step", "valid_bleu"]
    expected = [(r.step, r.valid_bleu) for r in trainer.log.scored()]
    assert [int(a) for a, _ in bleu[1:]] == [step for step, _ in expected] == [4, 8, 12]
    assert [float(b) for _, b in bleu[1:]] == pytest.approx([v for _, v in expected], abs=1e-4)


def test_validation_bleu_is_off_at_zero(toy_workspace, tmp_path):
    calls = []
    trainer = make_trainer(toy_workspace, tmp_path, {"train": {"valid_bleu_every": 0}})
    trainer.valid_bleu = lambda *a: calls.append(a) or 50.0
    summary = trainer.fit()
    assert calls == [] and "best_valid_bleu" not in summary
    assert all(row.valid_bleu is None for row in trainer.log.valid)
    trainer.write_logs()
    last = (tmp_path / "valid_log.tsv").read_text().splitlines()[-1].split("\t")
    assert last[-1] == ""  # an empty cell, which DVC's plots skip


def train_with_scripted_bleu(ws: Path, run: Path, scores: dict[int, float],
                             changes: dict) -> list[int]:
    """Train the toy run with ``train.average: best`` and a validation-BLEU hook that
    returns ``scores[step]``, then average it with the stage's CLI; the kept steps."""
    from typer.testing import CliRunner

    from stages.average import app

    trainer = make_trainer(ws, run, {"train": {"average": "best", **changes}})
    trainer.valid_bleu = lambda model, device, amp: scores[trainer.state.step]
    trainer.fit()
    kept = [int(c.stem.split("-")[1]) for c in list_checkpoints(run / "checkpoints")]
    result = CliRunner().invoke(app, [
        "--params", str(run / "params.yaml"), "--checkpoints", str(run / "checkpoints"),
        "--tokenizer", str(ws / "data/vocab/tokenizer.json"),
        "--out", str(run / "model"), "--metrics", str(run / "average.json"), "--no-mlflow"])
    assert result.exit_code == 0, result.output
    return kept


def test_average_best_takes_the_best_bleu_checkpoints_and_training_keeps_them(
        toy_workspace, tmp_path):
    from aiayn.training.checkpoint import load_model_files

    kept = train_with_scripted_bleu(
        toy_workspace, tmp_path, {3: 10.0, 6: 30.0, 9: 20.0, 12: 5.0},
        {"valid_bleu_every": 3, "average_last": 2, "keep_checkpoints": 2})
    # keep_checkpoints 2 keeps 9 and 12 (the newest); 6, the best, is kept beyond those.
    assert kept == [6, 9, 12]
    weights, config = load_model_files(tmp_path / "model")
    assert config["average"] == "best" and config["averaged_steps"] == [6, 9]
    assert config["averaged_valid_bleu"] == [30.0, 20.0]
    six, nine = (load_checkpoint(tmp_path / f"checkpoints/step-0000000{s}.pt")["model"]
                 for s in (6, 9))
    for name, w in weights.items():
        if w.is_floating_point():
            torch.testing.assert_close(w, (six[name].double() + nine[name].double()).div(2)
                                       .to(w.dtype))


def test_average_best_with_candidates_keeps_as_many_best_checkpoints_as_it_may_try(
        toy_workspace, tmp_path):
    scores = {3: 40.0, 6: 30.0, 9: 5.0, 12: 1.0}
    trainer = make_trainer(toy_workspace, tmp_path, {"train": {
        "average": "best", "valid_bleu_every": 3, "average_last": 1, "keep_checkpoints": 2,
        "average_candidates": [1, 2]}})
    trainer.valid_bleu = lambda model, device, amp: scores[trainer.state.step]
    trainer.fit()
    # the average stage may try the best 2 (3 and 6): they stay beyond the newest two
    assert [checkpoint_step(c) for c in list_checkpoints(tmp_path / "checkpoints")] == [
        3, 6, 9, 12]


def test_average_best_needs_scored_checkpoints(toy_workspace, tmp_path):
    from aiayn.errors import ParamsError

    with pytest.raises(ParamsError, match="valid_bleu_every is 0"):
        load_params(write_params(tmp_path / "a.yaml", {"train": {"average": "best",
                                                                 "valid_bleu_every": 0}}))
    # BLEU at step 2 but checkpoints at 3, 6, ...: the scored weights would not be kept.
    with pytest.raises(ParamsError, match=r"valid_bleu_every \(2\) must be a multiple of "
                                          r"checkpoint_every_steps \(3"):
        load_params(write_params(tmp_path / "b.yaml", {"train": {"average": "best",
                                                                 "valid_bleu_every": 2}}))
    with pytest.raises(ParamsError, match="must be a multiple"):  # checkpoints by time only
        load_params(write_params(tmp_path / "c.yaml", {"train": {
            "average": "best", "valid_bleu_every": 3, "checkpoint_every_steps": 0,
            "checkpoint_every_minutes": 5}}))


def test_average_best_chooses_among_scored_checkpoints_only(toy_workspace, tmp_path):
    """BLEU every 6 steps, checkpoints every 3 (the multi30k preset's shape: 200 and 100):
    the unscored checkpoints 3 and 9 are never chosen, however recent."""
    from aiayn.training.checkpoint import load_model_files

    kept = train_with_scripted_bleu(toy_workspace, tmp_path, {6: 30.0, 12: 20.0},
                                    {"valid_bleu_every": 6, "average_last": 2,
                                     "keep_checkpoints": 4})
    assert kept == [3, 6, 9, 12]
    _, config = load_model_files(tmp_path / "model")
    assert config["averaged_steps"] == [6, 12]
    assert config["averaged_valid_bleu"] == [30.0, 20.0]


# --------------------------------------------------------------------------- averaging, chosen


def average_with_candidates(ws: Path, run: Path, candidates: list[int], mlflow: bool = False):
    """The toy run (checkpoints at steps 3, 6, 9, 12) averaged by the stage's CLI with
    ``train.average_candidates``; the CLI's result."""
    from typer.testing import CliRunner

    from stages.average import app

    if not (run / "checkpoints").is_dir():
        make_trainer(ws, run, {"train": {"keep_checkpoints": 5}}).fit()
    write_params(run / "params.yaml", {"train": {
        "keep_checkpoints": 5, "average_candidates": candidates, "valid_bleu_beam": 1}})
    return CliRunner().invoke(app, [
        "--params", str(run / "params.yaml"), "--checkpoints", str(run / "checkpoints"),
        "--tokenizer", str(ws / "data/vocab/tokenizer.json"), "--raw", str(ws / "data/raw"),
        "--out", str(run / "model"), "--metrics", str(run / "average.json"),
        "--mlflow" if mlflow else "--no-mlflow", "--device", "cpu"])


def test_average_candidates_are_scored_as_a_plain_decode_of_each_average(toy_workspace,
                                                                          tmp_path):
    """Each candidate's score is sacreBLEU (its own API) of a greedy decode of the valid set
    with that average; the export is the average of the best (of equals, the larger)."""
    import sacrebleu

    from aiayn.data.corpus import iter_raw
    from aiayn.decoding.beam import BeamConfig
    from aiayn.decoding.translation import Translator
    from aiayn.io import read_json
    from aiayn.training.checkpoint import average_checkpoints, load_model_files

    result = average_with_candidates(toy_workspace, tmp_path, [2, 1, 4, 5])
    assert result.exit_code == 0, result.output
    found = list_checkpoints(tmp_path / "checkpoints")
    assert [int(c.stem.split("-")[1]) for c in found] == [3, 6, 9, 12]

    rows = list(iter_raw(toy_workspace / "data/raw", "valid", columns=["en", "de"]))
    sources = [s for b in rows for s in b["en"]]
    references = [s for b in rows for s in b["de"]]
    tok = load_tokenizer(toy_workspace / "data/vocab/tokenizer.json")
    expected = {}
    for n in (1, 2, 4):  # 5: only 4 checkpoints exist, the same average as 4
        model = Transformer(TransformerConfig(**load_checkpoint(found[-1])["meta"]["model_config"]))
        model.load_state_dict(average_checkpoints(found[-n:]))
        hyps = Translator(model.eval(), tok, torch.device("cpu")).translate(
            sources, BeamConfig(beam=1), 64, truncate=True)
        expected[n] = sacrebleu.corpus_bleu(hyps, [references]).score
    best = max(expected, key=lambda n: (expected[n], n))

    weights, config = load_model_files(tmp_path / "model")
    scores = {int(n): v for n, v in config["average_candidates_valid_bleu"].items()}
    assert scores == pytest.approx(expected, abs=1e-9)
    assert len(config["averaged_steps"]) == best
    assert config["averaged_steps"] == [3, 6, 9, 12][-best:]
    mean = average_checkpoints(found[-best:])
    assert all(torch.equal(weights[k], mean[k]) for k in mean)
    metrics = read_json(tmp_path / "average.json")
    assert metrics == {"average": "last", "averaged": best,
                       "first_step": [3, 6, 9, 12][-best], "last_step": 12,
                       "candidates": {str(n): round(v, 4) for n, v in expected.items()},
                       "candidates_beam": 1}  # train.valid_bleu_beam, as decoded above


@pytest.mark.parametrize(("scripted", "chosen"), [
    ([20.0, 35.0, 35.0], 4),  # a tie: the larger count
    ([40.0, 35.0, 30.0], 1),
    ([10.0, 35.0, 30.0], 2),
])
def test_average_candidates_keep_the_best_score(toy_workspace, tmp_path, monkeypatch,
                                                scripted, chosen):
    from mlflow.tracking import MlflowClient

    from aiayn.decoding.translation import ValidationBleu
    from aiayn.tracking import Tracker, save_run_id
    from aiayn.training.checkpoint import load_model_files

    make_trainer(toy_workspace, tmp_path, {"train": {"keep_checkpoints": 5}}).fit()
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    tracker = Tracker()
    run_id = tracker.start("toy", {})
    tracker.end()
    save_run_id(tmp_path / "checkpoints/mlflow_run.json", run_id, uri)
    calls = iter(scripted)
    monkeypatch.setattr(ValidationBleu, "__call__", lambda self, *a: next(calls))
    result = average_with_candidates(toy_workspace, tmp_path, [1, 2, 4, 5], mlflow=True)
    assert result.exit_code == 0, result.output
    assert next(calls, None) is None  # 5 (the same checkpoints as 4) was not decoded again
    _, config = load_model_files(tmp_path / "model")
    assert config["averaged_steps"] == [3, 6, 9, 12][-chosen:]
    assert config["average_candidates_valid_bleu"] == dict(zip(("1", "2", "4"), scripted,
                                                               strict=True))
    run = MlflowClient(uri).get_run(run_id)
    assert run.data.metrics == {"averaged_checkpoints": chosen,
                                **{f"average/valid_bleu_last_{n}": v
                                   for n, v in zip((1, 2, 4), scripted, strict=True)}}
    assert run.data.tags["average_candidates"] == "1,2,4,5"
    assert run.data.tags["averaged_steps"] == ",".join(map(str, [3, 6, 9, 12][-chosen:]))


def test_average_candidates_are_checked(tmp_path):
    from aiayn.errors import ParamsError

    with pytest.raises(ParamsError, match=r"holds 12, more than keep_checkpoints \(5\)"):
        load_params(write_params(tmp_path / "a.yaml", {"train": {"average_candidates": [1, 12]}}))
    with pytest.raises(ParamsError, match="every count must be at least 1"):
        load_params(write_params(tmp_path / "b.yaml", {"train": {"average_candidates": [0, 3]}}))


class ParameterCasts(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts, per parameter, the copies of it cast from fp32 to bf16."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.names = {q.data_ptr(): name for name, q in model.named_parameters()}
        self.casts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is torch.ops.aten._to_copy.default and args[0].dtype == torch.float32
                and kwargs.get("dtype") == torch.bfloat16
                and args[0].data_ptr() in self.names):
            name = self.names[args[0].data_ptr()]
            self.casts[name] = self.casts.get(name, 0) + 1
        return func(*args, **kwargs)


def test_bf16_weights_are_cast_once_per_step_and_train_bit_for_bit_as_per_micro_batch(
        toy_workspace, tmp_path, monkeypatch):
    """Under bf16 autocast with two micro-batches a step, autocast casts each weight once
    per step (aiayn.precision.step_casts), not once per micro-batch: the same cast, so the
    weights after two steps equal, bit for bit, those of the same steps with the step scope
    taken out (each micro-batch casting anew, as before the scope existed). Tiny shapes: bf16
    is emulated on a CPU without native bf16, and slow, but exact either way."""
    import aiayn.training.loop as trainer_module

    changes = {"train": {"precision": "bf16", "steps": 2}}
    results = {}
    for mode in ("per_step", "per_micro_batch"):
        with monkeypatch.context() as m:
            if mode == "per_micro_batch":
                m.setattr(trainer_module, "step_casts", lambda *a: contextlib.nullcontext())
            trainer = make_trainer(toy_workspace, tmp_path / mode, changes)
            assert trainer.plan.accumulation == 2 and trainer.amp_dtype == torch.bfloat16
            it = iter(trainer.loader)
            counter = ParameterCasts(trainer.model)
            with counter:
                trainer.train_step(trainer.micro_batches(it))
            trainer.train_step(trainer.micro_batches(it))
            trainer.loader.close()
        results[mode] = (counter.casts, {k: v.clone() for k, v in
                                         trainer.model.state_dict().items()})
    once, weights_once = results["per_step"]
    every, weights_every = results["per_micro_batch"]
    # Every linear weight autocast casts: once a step now, once per micro-batch before.
    linear = {name for name, _ in trainer.model.named_parameters()
              if name.endswith(".weight") and "norm" not in name and "embedding" not in name}
    assert linear and all(once.get(n) == 1 and every.get(n) == 2 for n in linear), (once, every)
    assert sum(once.values()) < sum(every.values())
    assert_bitwise_equal(weights_once, weights_every)

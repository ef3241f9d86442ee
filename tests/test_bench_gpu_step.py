"""bench/gpu_step.py: the estimate table it prints without a GPU, the WMT-like batches it
measures on, and a measured run of the tiny configuration on the CPU (its smoke test)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from aiayn.model import Transformer
from bench import gpu_step


def test_estimate_hours_follow_from_the_models_own_weights():
    # An independent count: every nn.Linear weight of the real model (built on the meta
    # device, so no memory) and the tied output projection, 6 FLOPs per weight and target
    # token for forward + backward (the usual 6ND), at equal source and target lengths.
    # Attention's products add a little on top (QK^T and AV over ~30 tokens), under 2% here.
    tokens_per_step = 25_000
    rows = gpu_step.estimate_table(tokens_per_step)
    assert {(r["config"], r["hardware"], r["mfu"]) for r in rows} == {
        (c, h, m) for c in ("base", "big") for h in ("1 x H100 SXM", "8 x A100")
        for m in (0.3, 0.4, 0.5)}
    for name, steps in (("base", 100_000), ("big", 300_000)):
        cfg = gpu_step.config(name)
        with torch.device("meta"):
            model = Transformer(cfg)
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
        six_nd = 6 * (linear + cfg.vocab_size * cfg.d_model) * tokens_per_step
        mine = [r for r in rows if r["config"] == name]
        for r in mine:
            assert r["steps"] == steps
            counted = r["tflop_per_step"] * 1e12
            assert counted > six_nd  # attention's products come on top of the weights'
            assert counted == pytest.approx(six_nd, rel=0.02)
            peak = 989.4 if r["hardware"] == "1 x H100 SXM" else 8 * 312.0
            assert r["hours"] == pytest.approx(
                steps * r["tflop_per_step"] * 1e12 / (r["mfu"] * peak * 1e12) / 3600)
    # The paper's scale: base is ~65M parameters (Table 3), ~9.5 TFLOP per 25k-token step.
    base = next(r for r in rows if r["config"] == "base")
    assert 9.0 < base["tflop_per_step"] < 10.5


def test_batches_are_token_buckets_with_consistent_labels():
    max_tokens = 2000
    batches = gpu_step.make_batches(12, max_tokens, seed=3, device=torch.device("cpu"))
    assert len(batches) == 12
    seen: set[int] = set()
    for b in batches:
        rows, s_len = b.src.shape
        assert b.tgt_in.shape == b.tgt_out.shape and b.tgt_in.shape[0] == rows
        assert rows * max(s_len, b.tgt_in.shape[1]) <= max_tokens  # padded, each side
        assert b.src_tokens == int((b.src != 0).sum())
        assert b.tgt_tokens == int((b.tgt_out != 0).sum())
        assert torch.equal((b.tgt_in != 0), (b.tgt_out != 0))  # BOS + y and y + EOS align
        assert torch.equal(b.tgt_positions, torch.nonzero(b.tgt_out.flatten()).flatten())
        real = b.tgt_out[b.tgt_out != 0]
        assert int(real.min()) >= 4 and int(real.max()) < gpu_step.VOCAB  # no specials
        # every row is left-aligned: its real tokens first, then padding only
        for side in (b.src, b.tgt_in):
            lengths = (side != 0).sum(1)
            assert torch.equal(side != 0, torch.arange(side.shape[1]) < lengths[:, None])
        ids = set(b.rows.tolist())
        assert not ids & seen  # no pair in two batches
        seen |= ids
    again = gpu_step.make_batches(12, max_tokens, seed=3, device=torch.device("cpu"))
    assert all(torch.equal(a.src, b.src) and torch.equal(a.tgt_out, b.tgt_out)
               for a, b in zip(batches, again, strict=True))
    other = gpu_step.make_batches(12, max_tokens, seed=4, device=torch.device("cpu"))
    assert any(not torch.equal(a.rows, b.rows) for a, b in zip(batches, other, strict=True))


def test_tiny_config_measures_on_the_cpu_and_writes_its_json(tmp_path, capsys):
    out = tmp_path / "gpu_step.json"
    result = gpu_step.main(["--device", "cpu", "--configs", "tiny", "--steps", "2",
                            "--warmup", "1", "--tokens-per-step", "1200", "--max-tokens", "600",
                            "--precision", "fp32", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "measuring on CPU" in printed and "tiny: fp32, accumulation 2" in printed
    assert result["estimate"] is None and result["device"] == "CPU"
    (r,) = result["measured"]
    assert r["config"] == "tiny" and r["accumulation"] == 2 and r["precision"] == "fp32"
    assert r["tokens_per_s"] > 0 and r["tflops"] > 0 and r["step_s"] > 0
    parts = r["split_s"]
    assert set(parts) == {"forward+loss", "backward", "optimizer", "step"}
    # the parts are intervals inside the step (medians over 2 steps, each taken alone)
    assert all(0 < parts[k] for k in parts)
    assert "mfu" not in r  # no GPU, so no peak to divide by
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))


def test_profile_and_kernel_count_on_the_cpu(capsys):
    """--profile prints the first and the last step's operators (those two steps left out of
    the figures); --count-kernels records one more step's operators called from Python."""
    result = gpu_step.main(["--device", "cpu", "--configs", "tiny", "--steps", "2",
                            "--warmup", "1", "--tokens-per-step", "1200", "--max-tokens", "600",
                            "--precision", "fp32", "--profile", "--count-kernels"])
    printed = capsys.readouterr().out
    assert "profile of one step (first step, shapes new)" in printed
    assert "profile of one step (last step, shapes new)" in printed
    (r,) = result["measured"]
    assert set(r["launches_per_step"]) == {"ops"} and r["launches_per_step"]["ops"] > 0
    assert "per step " in printed and r["step_s"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="measures when a GPU is there")
def test_without_a_gpu_it_says_so_and_prints_the_estimate_only(capsys):
    result = gpu_step.main([])
    printed = capsys.readouterr().out
    assert "nothing was measured on a GPU" in printed
    assert "ESTIMATE, not a measurement" in printed
    assert result["measured"] == [] and len(result["estimate"]) == 12
    hours = [r["hours"] for r in result["estimate"]]
    assert np.all(np.isfinite(hours)) and min(hours) > 0


@pytest.mark.parametrize("argv, message", [
    (["--device", "cpu", "--profile", "--steps", "1"], "--steps 2 or more"),
    (["--device", "cpu", "--reuse", "--warmup", "0"], "--warmup 1 or more"),
    (["--device", "cpu", "--ddp"], "--ddp needs torchrun"),
    (["--device", "cpu", "--configs", "tiny,smal"], "unknown 'smal'; choose among base, big"),
    (["--device", "cpu", "--profile", "--warmup", "0", "--steps", "2"],
     "--steps 3 or more with --warmup 0"),
    # 276 steps of one 25,000-token batch: more than the corpus's 281 such batches
    (["--device", "cpu", "--max-tokens", "25000", "--warmup", "5", "--steps", "277"],
     "need 282 distinct batches; the synthetic corpus holds 281"),
])
def test_bad_arguments_stop_with_the_fix(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(SystemExit) as stop:
        gpu_step.main(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.4), ("NVIDIA H200 NVL", 835.0), ("NVIDIA GH200 480GB", 989.4),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A100 80GB PCIe", 312.0), ("NVIDIA L40S", 362.0),
    ("NVIDIA L40", 181.0), ("NVIDIA L4", 121.0), ("NVIDIA A10", 125.0),
    ("NVIDIA RTX A1000", None), ("NVIDIA A10G", None), ("Tesla V100-SXM2-16GB", None),
])
def test_peaks_are_found_by_whole_words_of_the_device_name(name, peak):
    """A name holding another GPU's name as a part of a word (L40 and L4, RTX A1000 and
    A100) is not that GPU: an unknown GPU gets no peak (--peak-tflops) rather than a
    wrong one."""
    assert gpu_step.peak_tflops(name) == peak


def test_the_corpus_limit_is_what_make_batches_can_draw():
    cpu = torch.device("cpu")
    have = gpu_step.available_batches(25_000)
    assert len(gpu_step.make_batches(have, 25_000, seed=1, device=cpu)) == have
    with pytest.raises(ValueError, match=f"holds {have} of <= 25000"):
        gpu_step.make_batches(have + 1, 25_000, seed=1, device=cpu)

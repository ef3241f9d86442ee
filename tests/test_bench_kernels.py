"""bench/attention.py, bench/loss_kernel.py and bench/linear_kernel.py: their references and
correctness gates, and short runs that return what they print (shapes far below the
benchmarks' own)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from aiayn import kernels
from bench import attention, harness, linear_kernel, loss_kernel
from tests.conftest import usage_error


@pytest.mark.parametrize("causal", [False, True])
def test_attention_reference_is_torchs_attention_in_float64(causal):
    q, k, v, mask, _ = attention.inputs(length=9, tokens=40, heads=2, d_head=8, seed=1)
    mask = None if causal else mask
    assert mask is None or not bool(mask.all())  # some keys really are padding
    ours = attention.reference(q, k, v, mask, causal)
    q64, k64, v64 = (x.detach().double() for x in (q, k, v))
    theirs = F.scaled_dot_product_attention(q64, k64, v64, attn_mask=mask, is_causal=causal)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


def test_attention_inputs_are_the_shard_stages_buckets():
    q, k, v, mask, upstream = attention.inputs(length=16, tokens=100, heads=3, d_head=4, seed=0)
    assert q.shape == k.shape == v.shape == upstream.shape == (6, 3, 16, 4)  # B = 100 // 16
    assert q.dtype == torch.bfloat16 and q.requires_grad
    lengths = mask.reshape(6, 16).sum(1)
    assert int(lengths[0]) == 16 and int(lengths.min()) >= 16 // 3  # one row is full
    assert torch.equal(mask.reshape(6, 16), torch.arange(16) < lengths[:, None])


def test_attention_run_reports_each_contenders_error_and_writes_json(tmp_path):
    out = tmp_path / "attention.json"
    results = attention.main(["--lengths", "8,12", "--tokens", "48", "--heads", "2",
                              "--d-head", "8", "--rounds", "2", "--json", str(out)])
    cases = {f"{kind} T={t}" for kind in ("encoder", "decoder") for t in (8, 12)}
    assert set(results) == cases | set(harness.RECORD_FIELDS)
    for case in map(results.get, cases):
        built = kernels.cpu_extension() is not None
        assert set(case["ms"]) == {"explicit", "flash32", "flash16", "eager"} | (
            {"kernel"} if built else set())
        assert all(ms > 0 for ms in case["ms"].values())
        # bf16 inputs and outputs: within bf16's rounding of the float64 reference, the fused
        # layout's contenders included (their output read back as heads)
        assert set(case["max_abs_error"]) == set(case["ms"])
        assert all(err < 0.05 for err in case["max_abs_error"].values())
        assert case["flash32_over_explicit"] > 0
        assert ("eager_over_kernel" in case) == built
    assert json.loads(out.read_text()) == results


def test_attention_in_fp32_times_the_fp32_steps_paths_within_fp32s_rounding():
    results = attention.main(["--precision", "fp32", "--lengths", "8", "--tokens", "48",
                              "--heads", "2", "--d-head", "8", "--rounds", "2"])
    built = kernels.cpu_extension() is not None
    for case in (results["encoder T=8"], results["decoder T=8"]):
        assert set(case["ms"]) == {"flash32", "eager"} | ({"kernel"} if built else set())
        assert set(case["max_abs_error"]) == set(case["ms"])
        assert all(err < 1e-5 for err in case["max_abs_error"].values())
        assert "flash32_over_explicit" not in case
        assert ("flash32_over_kernel" in case) == built


def test_attention_fused_layout_holds_the_same_heads():
    q, k, v, _, upstream = attention.inputs(length=5, tokens=20, heads=2, d_head=3, seed=2)
    qkv, up = attention.fused(q, k, v, upstream)
    assert qkv.shape == (4, 5, 3 * 2 * 3) and qkv.requires_grad
    for i, x in enumerate((q, k, v)):
        assert torch.equal(attention.as_heads(qkv[..., 6 * i:6 * (i + 1)], 2), x.detach())
    assert torch.equal(attention.as_heads(up, 2), upstream)


def test_loss_kernel_compares_both_widths(capsys):
    saved = kernels.VOCAB_ALIGN
    width = kernels.padded_width(101)
    assert width % saved == 0 and 101 <= width < 101 + saved
    result = loss_kernel.main(["--rows", "64", "--d-model", "16", "--vocab", "101",
                               "--rounds", "3"])
    assert [len(t) for t in result["times"].values()] == [3, 3]
    assert set(result["times"]) == {f"width {width} (VOCAB_ALIGN {saved})",
                                    "width 101 (VOCAB_ALIGN 1)"}
    assert result["ratio"] > 0
    assert "rounded / as is" in capsys.readouterr().out


def test_loss_kernel_compares_the_cpp_softmax_with_eager_blocks(capsys):
    if kernels.cpu_extension() is None:
        pytest.skip("the C++ kernels could not be built here")
    result = loss_kernel.main(["--rows", "64", "--d-model", "16", "--vocab", "101",
                               "--rounds", "2", "--compare", "softmax"])
    assert set(result["times"]) == {"C++ softmax pass",
                                    f"eager blocks of {kernels.SOFTMAX_ROWS} rows"}
    assert [len(t) for t in result["times"].values()] == [2, 2] and result["ratio"] > 0
    assert "C++ / eager" in capsys.readouterr().out
    # the module's switches are put back: the loss takes the C++ pass for bf16 only again
    assert kernels._softmax_extension(torch.device("cpu"), torch.bfloat16) is not None
    assert kernels._softmax_extension(torch.device("cpu"), torch.float32) is None


def test_loss_kernel_stops_when_the_widths_disagree(monkeypatch):
    def disagree(*_args, **_kwargs):
        raise AssertionError("the two widths' losses differ")

    monkeypatch.setattr(loss_kernel.torch.testing, "assert_close", disagree)
    with pytest.raises(AssertionError, match="differ"):
        loss_kernel.main(["--rows", "16", "--d-model", "8", "--vocab", "37", "--rounds", "1"])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_linear_kernel_times_every_shape_both_passes_and_writes_json(precision,
                                                                     tmp_path, capsys):
    """A short run on two small shapes: one row per shape and pass with both contenders'
    rates (fp32: the fast kernels' linear; bf16: the fused oneDNN primitive on bf16 copies),
    the ratios over all shapes, the JSON equal to what main returns. A CPU where oneDNN has
    no bf16 gets an error naming the fix instead."""
    out = tmp_path / "linear.json"
    argv = ["--rows", "24", "--rounds", "2", "--repeat", "1", "--shapes", "16:24,24:16:relu",
            "--precision", precision, "--json", str(out)]
    if precision == "bf16" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        with pytest.raises(SystemExit, match="run --precision fp32"):
            linear_kernel.main(argv)
        assert not out.exists()
        return
    result = linear_kernel.main(argv)
    assert json.loads(out.read_text()) == result
    assert result["precision"] == ("fp32" if precision == "fp32" else "bf16 autocast")
    other = "aiayn.kernels" if precision == "fp32" else "oneDNN bf16"
    assert list(result["shapes"]) == ["16->24", "24->16 relu"]
    for shape in result["shapes"].values():
        assert list(shape) == ["forward", "forward+backward"]
        for figures in shape.values():
            assert set(figures["gflops"]) == {"F.linear", other}
            assert min(figures["gflops"].values()) > 0 and figures["ratio"] > 0
    assert set(result["all_shapes"]) == {"forward", "forward+backward"}
    assert "all shapes" in capsys.readouterr().out


def test_linear_kernel_stops_when_the_contenders_disagree(monkeypatch):
    """The correctness gate runs before any timing: a kernel that drops the bias fails it."""
    monkeypatch.setattr(linear_kernel, "ours", lambda x, w, b, relu: linear_kernel.torchs(
        x, w, 0 * b, relu))
    with pytest.raises(AssertionError):
        linear_kernel.main(["--rows", "8", "--rounds", "1", "--repeat", "1", "--shapes", "8:8",
                            "--precision", "fp32"])


@pytest.mark.parametrize("argv, message", [
    (["--shapes", "8x8"], "--shapes '8x8': write IN:OUT or IN:OUT:relu"),
    (["--shapes", "8:8:gelu"], "--shapes '8:8:gelu': write IN:OUT or IN:OUT:relu"),
    (["--rounds", "0"], "--rounds (0) must be at least 1"),
])
def test_linear_kernel_argument_errors_name_the_fix(argv, message, capsys):
    assert message in usage_error(lambda: linear_kernel.main(argv), capsys)


def test_loss_kernel_counts_the_logits_far_under_their_rows_max(capsys):
    """Random logits of sd 40 put most terms more than 87 under their row's max (exp under
    fp32's smallest normal), unit-scale ones none."""
    sharp = loss_kernel.main(["--rows", "64", "--d-model", "16", "--vocab", "101",
                              "--rounds", "1", "--logit-scale", "40"])
    assert 0.5 < sharp["far_under_max"] < 1.0
    assert "logits' sd 40" in capsys.readouterr().out
    unit = loss_kernel.main(["--rows", "64", "--d-model", "16", "--vocab", "101", "--rounds",
                             "1"])
    assert unit["far_under_max"] == 0.0


@pytest.mark.parametrize("output_vocab", ["shared", "target"])
def test_loss_kernel_takes_a_trained_models_states_and_its_loss_is_the_models(
        toy_workspace, tmp_path, output_vocab):
    """--model/--shards: the rows are the model's decoder states at the first validation
    batches' labels, and the loss of them is the model's own (logits, then the plain loss)."""
    from aiayn.model import Transformer, TransformerConfig
    from aiayn.objective import label_smoothed_loss
    from aiayn.sampler import ShardDataset
    from aiayn.tokenizer import PAD_ID, load_tokenizer
    from tests.conftest import save_model_folder

    tokenizer = toy_workspace / "data/vocab/tokenizer.json"
    vocab_size = load_tokenizer(tokenizer).get_vocab_size()
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(vocab_size=vocab_size, d_model=16, heads=2,
                                          encoder_layers=1, decoder_layers=1, d_ff=32,
                                          max_positions=64, output_vocab=output_vocab)).eval()
    batch = ShardDataset(toy_workspace / "data/shards" / "valid").batch(0)
    if output_vocab == "target":  # a subset: the batch's labels, the padding and every other id
        model.set_output_vocab(torch.cat([batch.tgt_out.flatten(),
                                          torch.arange(0, vocab_size, 2)]).unique())
    folder = save_model_folder(model, tokenizer, tmp_path / "model")
    n = int((batch.tgt_out != PAD_ID).sum())
    hidden, weight, labels, pad = loss_kernel.model_rows(folder, toy_workspace / "data/shards",
                                                         n)
    assert hidden.shape == (n, 16) and labels.shape == (n,) and not (labels == pad).any()
    with torch.no_grad():
        logits = model(batch.src, batch.tgt_in)
        tgt = batch.tgt_out
        if output_vocab == "target":  # the spanned columns, labels as their columns
            vocab = model.output_vocab()
            logits, (tgt, want_pad) = logits[..., vocab.ids], vocab.loss_labels(tgt)
            assert want_pad == pad and weight.shape[0] < vocab_size
        want, _, count = label_smoothed_loss(logits, tgt, 0.3, pad)
        got, _, _ = kernels.projected_label_smoothed_loss(hidden.detach(), weight.detach(),
                                                          labels, 0.3, pad)
    assert int(count) == n
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    result = loss_kernel.main(["--rows", str(n), "--rounds", "1", "--model", str(folder),
                               "--shards", str(toy_workspace / "data/shards")])
    assert result["far_under_max"] == 0.0 and [len(t) for t in result["times"].values()] == [1, 1]


def test_loss_kernel_wants_model_and_shards_together(capsys):
    with pytest.raises(SystemExit) as exc:
        loss_kernel.main(["--model", "data/model"])
    assert exc.value.code == 2
    assert "--model and --shards go together" in capsys.readouterr().err

"""The Transformer against the paper and against recomputation."""

from __future__ import annotations

import math

import pytest
import torch

from aiayn import fast
from aiayn.fast import KernelConfig, Packing, avoid_cudnn_attention
from aiayn.model import Transformer, TransformerConfig, count_parameters, sinusoidal_positions
from aiayn.sdpa import attend

PAD = 0


def tiny(norm: str = "post", **kw) -> Transformer:
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=50, d_model=32, heads=4, encoder_layers=2,
                            decoder_layers=2, d_ff=64, norm=norm, max_positions=64, **kw)
    return Transformer(cfg).eval()


def batch(b=3, s=7, t=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(4, 50, (b, s), generator=g), torch.randint(4, 50, (b, t), generator=g))


def closed_form_count(V, d, dff, n_enc, n_dec, pre_norm):
    attn = 4 * (d * d + d)            # W_Q, W_K, W_V, W_O with biases
    ffn = d * dff + dff + dff * d + d  # W1, b1, W2, b2
    ln = 2 * d                         # gain and bias
    enc = attn + ffn + 2 * ln
    dec = 2 * attn + ffn + 3 * ln
    final = 2 * ln if pre_norm else 0
    return V * d + n_enc * enc + n_dec * dec + final   # one shared V x d matrix


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_base_parameter_count_matches_closed_form(norm):
    model = Transformer(TransformerConfig.base(37000, norm=norm))
    expected = closed_form_count(37000, 512, 2048, 6, 6, norm == "pre")
    assert count_parameters(model) == expected
    assert expected == 63_082_496 + (4 * 512 if norm == "pre" else 0)  # ~63M (paper: 65M)


def test_big_parameter_count_matches_closed_form():
    model = Transformer(TransformerConfig.big(37000))
    assert count_parameters(model) == closed_form_count(37000, 1024, 4096, 6, 6, False)
    assert model.cfg.dropout == 0.3


def test_one_shared_matrix_for_embeddings_and_output():
    model = tiny()
    vocab_sized = [n for n, p in model.named_parameters() if p.shape[0] == 50]
    assert vocab_sized == ["embedding.weight"]
    src, tgt = batch()
    model(src, tgt).sum().backward()
    assert model.embedding.weight.grad is not None


def test_sinusoidal_positions_follow_the_formula():
    pe = sinusoidal_positions(50, 16)
    for pos in (0, 1, 7, 49):
        for i in range(8):
            angle = pos / 10000 ** (2 * i / 16)
            assert pe[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_shapes():
    model = tiny()
    src, tgt = batch(b=3, s=7, t=6)
    assert model(src, tgt).shape == (3, 6, 50)
    assert model.encode(src).shape == (3, 7, 32)


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_causal_mask_no_earlier_logit_sees_a_later_token(norm):
    model = tiny(norm)
    src, tgt = batch()
    base = model(src, tgt)
    for j in range(1, tgt.shape[1]):
        changed = tgt.clone()
        changed[:, j] = (changed[:, j] + 1 - 4) % 46 + 4
        out = model(src, changed)
        torch.testing.assert_close(out[:, :j], base[:, :j], rtol=0, atol=1e-6)
        assert not torch.allclose(out[:, j:], base[:, j:])


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_padding_changes_no_real_position(norm):
    model = tiny(norm)
    src, tgt = batch(b=2, s=5, t=4)
    base = model(src, tgt)
    padded_src = torch.cat([src, torch.full((2, 3), PAD)], dim=1)
    padded_tgt = torch.cat([tgt, torch.full((2, 2), PAD)], dim=1)
    out = model(padded_src, padded_tgt)
    torch.testing.assert_close(out[:, :4], base, rtol=0, atol=1e-5)
    torch.testing.assert_close(model.encode(padded_src)[:, :5], model.encode(src),
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_cached_decoding_equals_full_forward(norm):
    model = tiny(norm).double()
    src, tgt = batch(b=3, s=7, t=9)
    src[1, 5:] = PAD  # ragged sources
    full = model(src, tgt)
    state = model.start(src)
    steps = [model.decode_step(tgt[:, i:i + 1], state) for i in range(tgt.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-10, atol=1e-10)
    # Several tokens per step (a prefix, then the rest) agree as well.
    state = model.start(src)
    chunks = [model.decode_step(tgt[:, :4], state), model.decode_step(tgt[:, 4:], state)]
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, rtol=1e-10, atol=1e-10)


def test_cached_decoding_fp32_tight():
    model = tiny()
    src, tgt = batch(b=2, s=6, t=8)
    full = model(src, tgt)
    state = model.start(src)
    steps = torch.cat([model.decode_step(tgt[:, i:i + 1], state) for i in range(8)], dim=1)
    torch.testing.assert_close(steps, full, rtol=1e-5, atol=1e-5)


def test_reordered_state_continues_like_recomputation():
    model = tiny().double()
    src, tgt = batch(b=3, s=5, t=6)
    state = model.start(src)
    for i in range(3):
        model.decode_step(tgt[:, i:i + 1], state)
    order = torch.tensor([2, 2, 0])
    state = state.reorder(order)
    out = model.decode_step(tgt[order, 3:4], state)
    expected = model(src[order], tgt[order, :4])[:, 3:4]
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


def test_attention_maps_are_distributions_and_match_the_fused_path():
    model = tiny().double()
    src, tgt = batch(b=2, s=6, t=5)
    src[0, 4:] = PAD
    maps = model.attention_maps(src, tgt)
    assert len(maps["encoder_self"]) == 2 and maps["cross"][0].shape == (2, 4, 5, 6)
    for kind in ("encoder_self", "decoder_self", "cross"):
        for w in maps[kind]:
            torch.testing.assert_close(w.sum(-1), torch.ones_like(w.sum(-1)))
    for w in maps["decoder_self"]:
        assert torch.all(w.triu(diagonal=1) == 0)            # nothing from the future
    for w in maps["cross"] + maps["encoder_self"]:
        assert torch.all(w[0, :, :, 4:] == 0)                 # nothing from padding
    # The explicit-weights path computes the same function as the fused kernel.
    memory, _ = model.encode(src, need_weights=True)
    torch.testing.assert_close(memory, model.encode(src), rtol=1e-10, atol=1e-10)


def test_config_rejects_bad_shapes():
    with pytest.raises(ValueError, match="divisible"):
        TransformerConfig(vocab_size=10, d_model=30, heads=4)
    with pytest.raises(ValueError, match="max_positions"):
        tiny()(torch.ones(1, 70, dtype=torch.long), torch.ones(1, 3, dtype=torch.long))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("explicit", [True, False])
def test_cpu_bf16_attention_matches_a_float64_reference(causal, explicit, monkeypatch):
    """bf16 attention on CPU (explicit fp32 scores, or flash past the length limit) against
    softmax(q k^T / sqrt(d)) v computed in float64 from the same bf16 inputs."""
    keys = 128 if explicit else 4  # the explicit path, or flash past its length limit
    g = torch.Generator().manual_seed(5)
    b, h, t, d = 3, 2, 9, 16
    q, k, v = (torch.randn(b, h, t, d, generator=g).bfloat16().requires_grad_()
               for _ in range(3))
    lengths = torch.tensor([9, 5, 1])
    mask = (torch.arange(t)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, T)
    upstream = torch.randn(b, h, t, d, generator=g)

    def reference():
        q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
        scores = q64 @ k64.transpose(-2, -1) / math.sqrt(d)
        allowed = mask.expand(b, 1, t, t)
        if causal:
            allowed = allowed & torch.ones(t, t, dtype=torch.bool).tril()
        out = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v64
        out.backward(upstream.double())
        return out, (q64.grad, k64.grad, v64.grad)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attend(q, k, v, mask, 0.0, causal, explicit_keys=keys)
    assert out.dtype == torch.bfloat16
    out.float().backward(upstream)
    ref, ref_grads = reference()
    # bf16 output and bf16 weights in the weighted sum: a few bf16 ulps of the result.
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
    for got, want in zip((q.grad, k.grad, v.grad), ref_grads, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=5e-2, atol=5e-2)


def test_cpu_bf16_attention_keeps_a_sequence_with_no_key_finite():
    """An empty sequence in a batch (every key masked) must not turn the step NaN: its rows
    stay finite forward and backward, and the other sequences' rows are untouched."""
    g = torch.Generator().manual_seed(6)
    b, h, t, d = 3, 2, 5, 8
    q, k, v = (torch.randn(b, h, t, d, generator=g).bfloat16().requires_grad_()
               for _ in range(3))
    mask = (torch.arange(t)[None, :] < torch.tensor([5, 0, 3])[:, None])[:, None, None, :]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attend(q, k, v, mask, 0.0, False)
        alone = attend(q[[0, 2]], k[[0, 2]], v[[0, 2]], mask[[0, 2]], 0.0, False)
    out.float().sum().backward()
    assert torch.isfinite(out).all()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))
    assert torch.equal(out[[0, 2]], alone)


@pytest.mark.parametrize("fast_masks", [True, False])
def test_cpu_bf16_attention_dropout_matches_a_float64_reference_with_the_same_masks(fast_masks):
    """Attention dropout on the explicit bf16 path: softmax(q k^T / sqrt(d)) * M / (1 - p) v
    in float64, with M the masks the same generator state gives the fast kernels' dropout
    (as the fast layers pass it) or ``F.dropout`` (plain) on a tensor of the weights' shape;
    forward and backward."""
    import torch.nn.functional as F

    from aiayn.fast.dropout import dropout, eager_dropout

    g = torch.Generator().manual_seed(8)
    b, h, t, d, p = 3, 2, 9, 16, 0.3
    q, k, v = (torch.randn(b, h, t, d, generator=g).bfloat16().requires_grad_()
               for _ in range(3))
    mask = (torch.arange(t)[None, :] < torch.tensor([9, 6, 2])[:, None])[:, None, None, :]
    upstream = torch.randn(b, h, t, d, generator=g)

    torch.manual_seed(21)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attend(q, k, v, mask, p, True, dropout=eager_dropout if fast_masks else F.dropout)
    out.float().backward(upstream)
    torch.manual_seed(21)
    ones = torch.ones(b, h, t, t)
    scaled_keep = dropout(ones, p) if fast_masks else F.dropout(ones, p)
    dropped = (scaled_keep == 0).float().mean().item()
    assert 0.2 < dropped < 0.4  # the masks really drop, at about p

    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    allowed = mask.expand(b, 1, t, t) & torch.ones(t, t, dtype=torch.bool).tril()
    weights = (q64 @ k64.transpose(-2, -1) / math.sqrt(d)).masked_fill(~allowed, float("-inf"))
    ref = (weights.softmax(-1) * scaled_keep.double()) @ v64
    ref.backward(upstream.double())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, rtol=3e-2, atol=3e-2)
    for got, want in zip((q.grad, k.grad, v.grad), (q64.grad, k64.grad, v64.grad), strict=True):
        torch.testing.assert_close(got.double(), want, rtol=6e-2, atol=6e-2)


def test_training_with_attention_dropout_under_cpu_bf16_skips_torch_attention(monkeypatch):
    """A fast model with attention dropout trains under CPU bf16 autocast on the explicit
    path or the C++ kernel (PyTorch's CPU attention would take its slow math path with
    dropout); in eval mode
    it gives the same output as the model without attention dropout."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=50, d_model=32, heads=4, encoder_layers=2,
                            decoder_layers=2, d_ff=64, max_positions=64, dropout=0.0,
                            attention_dropout=0.2)
    model = fast.apply(Transformer(cfg))
    plain = fast.apply(Transformer(TransformerConfig(**{**cfg.to_dict(),
                                                        "attention_dropout": 0.0})))
    plain.load_state_dict(model.state_dict())
    src, tgt = batch()

    def refuse(*args, **kwargs):
        raise AssertionError("torch's attention was called")

    monkeypatch.setattr(F, "scaled_dot_product_attention", refuse)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model.train()
        first, second = model(src, tgt), model(src, tgt)
        first.float().sum().backward()
        model.eval()
        evaluated = model(src, tgt)
        plain.eval()
        reference = plain(src, tgt)
    assert model.embedding.weight.grad is not None
    assert torch.isfinite(model.embedding.weight.grad).all()
    assert not torch.equal(first, second)  # fresh attention masks each call (no other dropout)
    assert torch.equal(evaluated, reference)


def test_avoid_cudnn_attention_takes_out_cudnn_alone_and_only_for_cuda():
    """cuDNN attention builds a plan per new shape (bench/README.md, gpu_step.py): on CUDA the
    trainer and the translator take it out of SDPA's choice, leaving the other kernels."""
    backends = torch.backends.cuda
    flags = {name: getattr(backends, f"{name}_sdp_enabled")()
             for name in ("cudnn", "flash", "mem_efficient", "math")}
    try:
        backends.enable_cudnn_sdp(True)
        avoid_cudnn_attention(torch.device("cpu"))
        assert backends.cudnn_sdp_enabled()  # nothing changes for CPU work
        avoid_cudnn_attention(torch.device("cuda", 0))
        assert not backends.cudnn_sdp_enabled()
        for name in ("flash", "mem_efficient", "math"):
            assert getattr(backends, f"{name}_sdp_enabled")() == flags[name]
    finally:
        for name, on in flags.items():
            getattr(backends, f"enable_{name}_sdp")(on)


def test_the_kernels_are_applied_to_every_layer_in_place_and_change_no_parameter():
    """fast.apply swaps each layer's class for its fast variant, in place: the parameters are
    the very tensors they were (an optimizer built before sees them), the state dict and the
    training mode are unchanged, and every variant takes the config; applied again, the
    config is replaced."""
    from aiayn.fast import modules

    cfg = TransformerConfig(vocab_size=50, d_model=32, heads=4, encoder_layers=2,
                            decoder_layers=2, d_ff=64, max_positions=64)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    before = dict(model.named_parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    config = KernelConfig(softmax_rows=7)
    assert fast.apply(model, config) is model
    chosen = [m for m in model.modules() if type(m) in modules.VARIANTS.values()]
    # 2+2 layers: attentions (2 + 2x2), their projections, the FFNs' two, dropouts, ...
    assert len(chosen) > 40 and not any(type(m) in modules.VARIANTS for m in model.modules())
    configured = [m for m in chosen if hasattr(m, "kernel_config")]
    assert configured and all(m.kernel_config is config for m in configured)
    assert dict(model.named_parameters()).keys() == before.keys()
    assert all(q is before[k] for k, q in model.named_parameters())
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert not model.training
    other = KernelConfig(softmax_rows=9)
    fast.apply(model, other)
    assert all(m.kernel_config is other for m in configured)


# -- Table 3's settings: d_k, d_v apart from d_model / heads, learned positions ----------------

SHAPES = {  # name: TransformerConfig settings on tiny()'s d_model 32
    "A: one head of 32": dict(heads=1, d_k=32, d_v=32),
    "B: d_k 2 < d_v 8": dict(d_k=2, d_v=8),
    "d_k 12 > d_v 4, 3 heads": dict(heads=3, d_k=12, d_v=4),
    "E: learned positions": dict(positions="learned"),
}


def tiny_shaped(name: str, fast_kernels: bool = False) -> Transformer:
    kw = dict(SHAPES[name])
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=50, d_model=32, heads=kw.pop("heads", 4),
                            encoder_layers=2, decoder_layers=2, d_ff=64, max_positions=64, **kw)
    model = Transformer(cfg).eval()
    return fast.apply(model) if fast_kernels else model


def closed_form_attention_count(d, h, d_k, d_v):
    return d * h * d_k * 2 + 2 * h * d_k + d * h * d_v + h * d_v + h * d_v * d + d


@pytest.mark.parametrize("name", list(SHAPES))
def test_table3_shapes_count_as_the_closed_form(name):
    model = tiny_shaped(name)
    cfg = model.cfg
    attn_default = 4 * (32 * 32 + 32)
    attn = closed_form_attention_count(32, cfg.heads, cfg.key_size, cfg.value_size)
    positions = 64 * 32 if cfg.positions == "learned" else 0
    expected = closed_form_count(50, 32, 64, 2, 2, False) + 6 * (attn - attn_default) + positions
    assert count_parameters(model) == expected
    first = model.decoder[0]
    hk, hv = cfg.heads * cfg.key_size, cfg.heads * cfg.value_size
    assert first.self_attn.qkv_proj.weight.shape == (2 * hk + hv, 32)
    assert first.cross_attn.q_proj.weight.shape == (hk, 32)
    assert first.cross_attn.kv_proj.weight.shape == (hk + hv, 32)
    assert first.cross_attn.out_proj.weight.shape == (32, hv)



@pytest.mark.parametrize("std", [0.0, 0.71])
def test_learned_positions_start_at_their_set_size(std):
    """Learned positions ~ N(0, position_init_std), by default d_model^-1/2 (fairseq's and
    tensor2tensor's): 1/sqrt(d) of the scaled token embeddings' size. The sinusoids' own
    size per dimension is 1/sqrt(2)."""
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=50, d_model=64, heads=4, encoder_layers=1,
                            decoder_layers=1, d_ff=64, max_positions=512,
                            positions="learned", position_init_std=std)
    model = Transformer(cfg)
    want = std or 64 ** -0.5
    table = model.positions.detach()
    # 32,768 draws: the sample's std is within 2% of sigma with odds far beyond 5 sigma.
    assert table.std().item() == pytest.approx(want, rel=0.02)
    assert table.mean().abs().item() < 5 * want / 181
    tokens = (model.embedding.weight[1:] * 64 ** 0.5).std().item()
    assert tokens == pytest.approx(1.0, rel=0.02)  # what the positions are added to
    assert sinusoidal_positions(512, 64).pow(2).mean().sqrt().item() == pytest.approx(
        2 ** -0.5, rel=0.01)
    with pytest.raises(ValueError, match="position_init_std"):
        TransformerConfig(vocab_size=50, positions="learned", position_init_std=-0.1)


@pytest.mark.parametrize("name", ["base", *SHAPES])
def test_grouped_state_decodes_as_one_row_per_hypothesis(name):
    """Beam search's state keeps each source once for its g rows (``group``): every step,
    a reorder of the rows within their sources, and one that drops a source, agree with the
    full forward pass over the sources repeated row by row."""
    model = (tiny() if name == "base" else tiny_shaped(name)).double()
    g = 3
    src, tgt = batch(b=2, s=6, t=5)
    src[1, 4:] = PAD
    tgt = tgt.repeat_interleave(g, 0) - torch.arange(2 * g)[:, None] % 2  # rows differ
    rows = torch.arange(2).repeat_interleave(g)  # the source of each row
    state = model.start(src, group=g)
    steps = [model.decode_step(tgt[:, i:i + 1], state) for i in range(2)]
    torch.testing.assert_close(torch.cat(steps, 1), model(src[rows], tgt[:, :2]),
                               rtol=1e-10, atol=1e-10)
    within = torch.tensor([2, 2, 0, 3, 5, 4])  # each row among its own source's rows
    state = state.reorder(within)
    tgt = torch.cat([tgt[within, :2], tgt[:, 2:]], 1)
    torch.testing.assert_close(model.decode_step(tgt[:, 2:3], state),
                               model(src[rows], tgt[:, :3])[:, 2:3], rtol=1e-10, atol=1e-10)
    keep = torch.tensor([4, 4, 3])  # source 0 is done; source 1's rows go on
    state = state.reorder(keep, sources=torch.tensor([1]))
    tgt = tgt[keep]
    torch.testing.assert_close(model.decode_step(tgt[:, 3:4], state),
                               model(src[[1, 1, 1]], tgt[:, :4])[:, 3:4],
                               rtol=1e-10, atol=1e-10)
    assert state.memory.shape[0] == 1 and state.caches[0]["cross"][0].shape[0] == 1

@pytest.mark.parametrize("name", list(SHAPES))
def test_table3_shapes_decode_incrementally_as_the_full_forward(name):
    model = tiny_shaped(name).double()
    src, tgt = batch(b=3, s=7, t=9)
    src[1, 5:] = PAD
    full = model(src, tgt)
    state = model.start(src)
    steps = [model.decode_step(tgt[:, i:i + 1], state) for i in range(tgt.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-10, atol=1e-10)
    state = model.start(src).reorder(torch.tensor([2, 0, 0]))
    torch.testing.assert_close(model.decode_step(tgt[[2, 0, 0], :3], state),
                               full[[2, 0, 0], :3], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", list(SHAPES))
def test_table3_shapes_attention_maps_and_fast_kernels_compute_the_same(name):
    model = tiny_shaped(name).double()
    src, tgt = batch(b=2, s=6, t=5)
    src[0, 4:] = PAD
    maps = model.attention_maps(src, tgt)
    assert maps["cross"][0].shape == (2, model.cfg.heads, 5, 6)
    for w in maps["encoder_self"] + maps["cross"]:
        torch.testing.assert_close(w.sum(-1), torch.ones_like(w.sum(-1)))
        assert torch.all(w[0, :, :, 4:] == 0)
    memory, _ = model.encode(src, need_weights=True)  # the explicit 1/sqrt(d_k) path
    torch.testing.assert_close(memory, model.encode(src), rtol=1e-10, atol=1e-10)
    quick = tiny_shaped(name, fast_kernels=True)
    assert quick.state_dict().keys() == model.state_dict().keys()
    quick.load_state_dict(tiny_shaped(name).state_dict())
    packed = Packing.positions(tgt, PAD)
    rows = quick(src, tgt, packed=packed)
    plain = tiny_shaped(name)(src, tgt, hidden=True)
    torch.testing.assert_close(rows, plain.reshape(-1, 32)[packed], rtol=1e-4, atol=1e-4)


def test_attention_maps_of_an_empty_source_are_uniform_not_nan():
    """A source of padding only (an empty line) has no key to attend: the weights are uniform
    over its keys, as the attention kernel and attend's explicit path average the values,
    not NaN; the other sequence's maps are untouched."""
    model = tiny().double().eval()
    src, tgt = batch(b=2, s=6, t=5)
    src[1, :] = PAD
    maps = model.attention_maps(src, tgt)
    for w in maps["encoder_self"] + maps["cross"]:
        assert torch.isfinite(w).all()
        torch.testing.assert_close(w[1], torch.full_like(w[1], 1 / 6))
    alone = model.attention_maps(src[:1], tgt[:1])
    torch.testing.assert_close(maps["cross"][0][0], alone["cross"][0][0])


def test_the_attention_scale_is_one_over_sqrt_d_k():
    """Section 3.2.1: softmax(Q K^T / sqrt(d_k)) V with d_k apart from d_v: one head's
    output against the formula, through the fused kernel and the explicit path."""
    from aiayn import model as model_mod

    torch.manual_seed(3)
    attn = model_mod.MultiHeadAttention(16, 2, 3, 5, 0.0, cross=False).double().eval()
    x = torch.randn(1, 4, 16, dtype=torch.double)
    q, k, v = attn.qkv_proj(x).split([6, 6, 10], dim=-1)
    heads = []
    for h in range(2):
        qh, kh, vh = q[0, :, 3 * h:3 * h + 3], k[0, :, 3 * h:3 * h + 3], v[0, :, 5 * h:5 * h + 5]
        heads.append((qh @ kh.T / math.sqrt(3)).softmax(-1) @ vh)
    expected = attn.out_proj(torch.cat(heads, dim=-1))[None]
    for need_weights in (False, True):
        out, _ = attn(x, need_weights=need_weights)
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


def test_learned_positions_are_saved_trained_parameters_and_sinusoids_are_not():
    learned, sinusoid = tiny_shaped("E: learned positions"), tiny()
    assert "positions" in dict(learned.named_parameters())
    assert "positions" in learned.state_dict() and "positions" not in sinusoid.state_dict()
    assert learned.positions.shape == (64, 32)
    assert learned.positions.std().item() == pytest.approx(32 ** -0.5, rel=0.1)
    src, tgt = batch()
    learned.train()
    learned(src, tgt).sum().backward()
    assert learned.positions.grad[:tgt.shape[1]].abs().sum() > 0  # the decoder's positions
    assert learned.positions.grad[max(7, tgt.shape[1]):].abs().sum() == 0  # never read


def test_config_checks_d_k_d_v_and_positions():
    with pytest.raises(ValueError, match="d_k .* must be positive"):
        TransformerConfig(vocab_size=10, d_k=-1)
    with pytest.raises(ValueError, match="positions must be"):
        TransformerConfig(vocab_size=10, positions="rotary")
    with pytest.raises(ValueError, match="divisible"):
        TransformerConfig(vocab_size=10, d_model=30, heads=4, d_k=8)  # d_v left at d/h
    cfg = TransformerConfig(vocab_size=10, d_model=30, heads=4, d_k=8, d_v=6)
    assert (cfg.key_size, cfg.value_size) == (8, 6)
    base = TransformerConfig(vocab_size=10)
    assert (base.d_k, base.key_size, base.value_size) == (0, 64, 64)  # 0 kept: old configs


def test_initial_scales_are_xavier_of_each_fused_matrix():
    """Each linear layer starts Xavier-uniform over its own (fused) shape, biases zero: the
    bound sqrt(6 / (fan_in + fan_out)), i.e. std sqrt(2 / (fan_in + fan_out)); so
    self-attention's q, k, v start at 1/sqrt(2) of a separate d x d matrix's std and
    cross-attention's k, v at sqrt(2/3). The embedding ~ N(0, d^-1/2), its PAD row zero."""
    torch.manual_seed(0)
    d = 256
    model = Transformer(TransformerConfig(vocab_size=3000, d_model=d, heads=4, encoder_layers=1,
                                          decoder_layers=1, d_ff=1024, max_positions=64))
    separate = math.sqrt(2 / (2 * d))
    layer = model.decoder[0]
    for weight, ratio in [(layer.self_attn.qkv_proj.weight, 1 / math.sqrt(2)),
                          (layer.cross_attn.kv_proj.weight, math.sqrt(2 / 3)),
                          (layer.cross_attn.q_proj.weight, 1.0),
                          (layer.self_attn.out_proj.weight, 1.0)]:
        bound = math.sqrt(6 / sum(weight.shape))
        assert weight.abs().max() <= bound
        assert weight.std().item() == pytest.approx(separate * ratio, rel=0.02)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            assert not module.bias.any()
    emb = model.embedding.weight
    assert not emb[PAD].any()
    assert emb[PAD + 1:].std().item() == pytest.approx(d ** -0.5, rel=0.02)

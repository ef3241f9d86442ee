"""bench/flops.py: the analytic FLOPs that the benchmarks' GFLOP/s and MFU figures divide by,
checked against PyTorch's own count of the model's matrix products."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from aiayn.model import Transformer, TransformerConfig
from bench import flops

SHAPES = [  # (encoder layers, decoder layers, d_model, heads, d_ff, source, target lengths,
    #          d_k, d_v; 0: d_model / heads)
    (2, 3, 16, 2, 24, [7, 7], [5, 5], 0, 0),
    (1, 2, 32, 4, 48, [4], [9], 0, 0),
    (3, 1, 24, 3, 40, [6, 6, 6], [6, 6, 6], 0, 0),
    (1, 2, 32, 4, 48, [5], [6], 2, 8),  # as Table 3 (B): d_k below d_v
    (2, 1, 24, 2, 40, [6, 6], [4, 4], 16, 4),  # d_k above d_v, wider than d_model / heads
]


def make(enc, dec, d, heads, d_ff, d_k=0, d_v=0) -> Transformer:
    torch.manual_seed(0)
    return Transformer(TransformerConfig(vocab_size=50, d_model=d, heads=heads,
                                         encoder_layers=enc, decoder_layers=dec, d_ff=d_ff,
                                         dropout=0.0, max_positions=64, d_k=d_k, d_v=d_v))


@pytest.mark.parametrize("enc, dec, d, heads, d_ff, src_len, tgt_len, d_k, d_v", SHAPES)
def test_train_flops_match_pytorchs_count_of_a_training_step(enc, dec, d, heads, d_ff,
                                                            src_len, tgt_len, d_k, d_v):
    # PyTorch's FlopCounterMode counts every matrix product (2 n k m) of the forward and the
    # backward; the math attention backend makes attention plain products it can see. It
    # computes the causal self-attention's masked half too, which the formula leaves out
    # (t (t + 1) / 2 of the t^2 products), so that half is added back here.
    model = make(enc, dec, d, heads, d_ff, d_k, d_v)
    src = torch.randint(1, 50, (len(src_len), src_len[0]))
    tgt = torch.randint(1, 50, (len(tgt_len), tgt_len[0]))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(src, tgt).logsumexp(-1).sum().backward()
    width = heads * ((d_k or d // heads) + (d_v or d // heads))  # h d_k + h d_v
    masked = sum(6 * width * dec * (t * t - t * (t + 1) / 2) for t in tgt_len)
    assert counter.get_total_flops() == flops.train_flops(model.cfg, src_len, tgt_len) + masked


@pytest.mark.parametrize("enc, dec, d, heads, d_ff, d_k, d_v",
                         [s[:5] + s[7:] for s in SHAPES])
def test_weight_params_are_the_models_projection_matrices(enc, dec, d, heads, d_ff, d_k, d_v):
    model = make(enc, dec, d, heads, d_ff, d_k, d_v)

    def matrices(layers: nn.Module) -> int:
        return sum(m.weight.numel() for m in layers.modules() if isinstance(m, nn.Linear))

    assert flops.weight_params(model.cfg) == (matrices(model.encoder), matrices(model.decoder))


def test_a_shorter_source_costs_less_through_the_cross_attention():
    # The cross-attention's key and value projections read the encoder's output: they scale
    # with the source's length, not the target's.
    cfg = make(1, 2, 16, 2, 24).cfg
    longer, shorter = flops.train_flops(cfg, [8], [6]), flops.train_flops(cfg, [7], [6])
    own = 6 * cfg.encoder_layers * (4 * 16 * 16 + 2 * 16 * 24)  # one more encoder token
    attention = 12 * 16 * (cfg.encoder_layers * (64 - 49) + cfg.decoder_layers * 6)
    assert longer - shorter == own + 6 * cfg.decoder_layers * 2 * 16 * 16 + attention

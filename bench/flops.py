"""Model FLOPs of a training step, counted analytically (shared by the bench scripts).

A matmul (n x k) @ (k x m) is 2 n k m FLOPs; backward costs twice forward. For a pair with
s source and t target tokens (EOS/BOS included), only real (non-pad) tokens counted::

    A = 2 d (h d_k + h d_v)                                one attention's four projections
    P_enc = L_enc (A + 2 d d_ff)   P_dec = L_dec (2 A + 2 d d_ff)   weight matrices
    6 P_enc s + 6 (P_dec - L_dec K) t + 6 L_dec K s          the weight matmuls
    + 6 (h d_k + h d_v) (L_enc s^2 + L_dec t (t + 1) / 2 + L_dec t s)   QK^T and AV (causal: half)
    + 6 d V t                                               the tied output projection

with K = d (h d_k + h d_v), the cross-attention's key and value projections, which run over
the s source tokens (the rest of the decoder over the t target tokens). With the paper's
base d_k = d_v = d / h: A = 4 d^2, K = 2 d^2, and the attention products 12 d per pair.
(V: the vocabulary the softmax spans; with ``model.output_vocab: target`` the target side's
tokens only, ``output_vocab`` below.) Table 3's rows (A), (B) and (C) set d_k and d_v apart
from d / h (``model.d_k``, ``model.d_v``).

Biases, LayerNorms, softmax and the embedding lookup are left out, as is usual for MFU.
"""

from __future__ import annotations

import numpy as np


def weight_params(cfg) -> tuple[int, int]:
    """(P_enc, P_dec): the parameters of the encoder's and decoder's weight matrices."""
    d, f = cfg.d_model, cfg.d_ff
    attention = 2 * d * head_width(cfg)
    return (cfg.encoder_layers * (attention + 2 * d * f),
            cfg.decoder_layers * (2 * attention + 2 * d * f))


def head_width(cfg) -> int:
    """h d_k + h d_v: the widths of all heads' keys and values together (2 d in the paper's
    base; ``key_size``/``value_size`` are d_k and d_v, d / h unless the config sets them)."""
    return cfg.heads * (cfg.key_size + cfg.value_size)


def train_flops(cfg, src_len, tgt_len, output_vocab: int | None = None) -> float:
    """Model FLOPs of one training step (forward + backward) over pairs of these lengths,
    the softmax spanning ``output_vocab`` tokens (default: the whole vocabulary)."""
    p_enc, p_dec = weight_params(cfg)
    d, V = cfg.d_model, output_vocab or cfg.vocab_size
    s = np.asarray(src_len, dtype=np.float64)
    t = np.asarray(tgt_len, dtype=np.float64)
    heads = head_width(cfg)
    cross_kv = cfg.decoder_layers * d * heads  # projects the encoder's output: s tokens
    return float(6 * p_enc * s.sum() + 6 * (p_dec - cross_kv) * t.sum() + 6 * cross_kv * s.sum()
                 + 6 * heads * (cfg.encoder_layers * (s * s).sum()
                                + cfg.decoder_layers * (t * (t + 1) / 2).sum()
                                + cfg.decoder_layers * (t * s).sum())
                 + 6 * d * V * t.sum())

"""Model FLOPs of a training step, counted analytically (shared by the bench scripts).

A matmul (n x k) @ (k x m) is 2 n k m FLOPs; backward costs twice forward. For a pair with
s source and t target tokens (EOS/BOS included), only real (non-pad) tokens counted::

    P_enc = L_enc (4 d^2 + 2 d d_ff)   P_dec = L_dec (8 d^2 + 2 d d_ff)   weight matrices
    6 P_enc s + 6 (P_dec - 2 L_dec d^2) t + 12 L_dec d^2 s  the weight matmuls
    + 12 d (L_enc s^2 + L_dec t (t + 1) / 2 + L_dec t s)     QK^T and AV (causal: half)
    + 6 d V t                                               the tied output projection

(V: the vocabulary the softmax spans; with ``model.output_vocab: target`` the target side's
tokens only, ``output_vocab`` below.) The cross-attention's key and value projections (2 d^2
of each decoder layer's 8 d^2) run over the s source tokens, the rest of the decoder over the
t target tokens.

Biases, LayerNorms, softmax and the embedding lookup are left out, as is usual for MFU.
"""

from __future__ import annotations

import numpy as np


def weight_params(cfg) -> tuple[int, int]:
    """(P_enc, P_dec): the parameters of the encoder's and decoder's weight matrices."""
    d, f = cfg.d_model, cfg.d_ff
    return (cfg.encoder_layers * (4 * d * d + 2 * d * f),
            cfg.decoder_layers * (8 * d * d + 2 * d * f))


def train_flops(cfg, src_len, tgt_len, output_vocab: int | None = None) -> float:
    """Model FLOPs of one training step (forward + backward) over pairs of these lengths,
    the softmax spanning ``output_vocab`` tokens (default: the whole vocabulary)."""
    p_enc, p_dec = weight_params(cfg)
    d, V = cfg.d_model, output_vocab or cfg.vocab_size
    s = np.asarray(src_len, dtype=np.float64)
    t = np.asarray(tgt_len, dtype=np.float64)
    cross_kv = cfg.decoder_layers * 2 * d * d  # projects the encoder's output: s tokens
    return float(6 * p_enc * s.sum() + 6 * (p_dec - cross_kv) * t.sum() + 6 * cross_kv * s.sum()
                 + 12 * d * (cfg.encoder_layers * (s * s).sum()
                             + cfg.decoder_layers * (t * (t + 1) / 2).sum()
                             + cfg.decoder_layers * (t * s).sum())
                 + 6 * d * V * t.sum())

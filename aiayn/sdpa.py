"""Scaled dot-product attention as the model computes it (Section 3.2.1):
``F.scaled_dot_product_attention`` (torch's fused kernels where available), except under CPU
bf16 autocast, where the scores and the softmax are written out in fp32.

Apart from the model's file because it is how a precision runs on one kind of device, not
the paper's formula (which :class:`aiayn.model.MultiHeadAttention` writes out on its path
that returns the weights); every use of the model takes it: training with the fast kernels
or the plain ones, validation, decoding and export.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

# Longest key sequence for which CPU bf16 attention takes attend's explicit path (longer
# sequences take fp32 flash attention; bench/README.md, "bf16 attention written out, and the
# loss's softmax in cache-sized blocks").
EXPLICIT_ATTENTION_KEYS = 128


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float,
           is_causal: bool, explicit_keys: int = EXPLICIT_ATTENTION_KEYS,
           dropout=F.dropout) -> Tensor:
    """``F.scaled_dot_product_attention``, or under CPU bf16 autocast fp32 scores and softmax.

    PyTorch's CPU kernel (flash attention) is slower in bf16 than in fp32, and even in fp32
    spends more on its blocking than on the products when sequences are as short as the
    ones sentence-level batches hold. So under CPU bf16 autocast, up to ``explicit_keys``
    keys (-1: never), the scores and the softmax are computed in fp32 (as precise as the
    flash kernel's) and only the weighted sum of the values multiplies bf16 (the weights
    rounded to bf16, as autocast rounds any product's inputs, and as FlashAttention rounds
    them on GPUs); bench/README.md, "bf16 attention written out, ...", has the measurements.
    Longer sequences take fp32 flash attention. Attention dropout (``dropout_p > 0``, in
    training) drops the fp32 weights before they are rounded, with ``dropout(weights, p)``:
    by default ``F.dropout``, the masks PyTorch's math path (which CPU attention with dropout
    takes) would draw; the fast kernels pass their own (``aiayn.fast``). Past the length
    limit, attention with dropout takes that math path. fp32 inputs and other devices take
    the plain call.
    """
    # (Shapes are read only on this path: compiled fp32 and GPU graphs get no guard on them.)
    if (q.device.type == "cpu" and q.dtype == torch.bfloat16
            and (dropout_p == 0.0 or k.shape[-2] <= explicit_keys)):
        with torch.autocast("cpu", enabled=False):  # autocast would cast back to bf16
            if k.shape[-2] > explicit_keys:
                out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                     attn_mask=mask, is_causal=is_causal)
                return out.to(q.dtype)
            scores = torch.matmul(q.float(), k.float().transpose(-2, -1))
            scores.mul_(1.0 / math.sqrt(q.shape[-1]))
            # The lowest finite float, not -inf: a row with no key allowed (a batch's empty
            # sequence) then averages the values instead of turning NaN, as it would in
            # both directions through the softmax; flash attention skips such rows.
            low = torch.finfo(scores.dtype).min
            if is_causal:  # queries and keys line up (no cache): the upper triangle is out
                tq, tk = scores.shape[-2:]
                scores.masked_fill_(torch.ones(tq, tk, dtype=torch.bool,
                                               device=q.device).triu(1), low)
            if mask is not None:
                scores.masked_fill_(~mask, low)
            weights = scores.softmax(dim=-1)
            if dropout_p > 0.0:
                weights = dropout(weights, dropout_p)
            return torch.matmul(weights.to(q.dtype), v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                          is_causal=is_causal)

"""Dropout masks from 16 random bits per element.

``F.dropout`` on a CPU draws a float per element (``bernoulli_``). Filling int64 words with
random bits and reading them as four int16 values is several times cheaper (bench/README.md,
"the fast kernels"): an element is kept when its int16 is at least a threshold, with
probability ``1 - k / 65536`` for ``k = round(p * 65536)``, and scaled by the exact inverse
of that probability, so the expectation is unchanged. The bits come from torch's generator
(CPU or CUDA), so a run is as reproducible, and resumes as exactly, as with ``F.dropout``;
they are other masks than ``F.dropout`` draws, so fast and plain runs agree in
distribution, not bit for bit. The C++ kernels keep the same rule with bits of their own
counter-based generator, seeded from torch's (:func:`dropout_seed`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def keep_threshold(p: float) -> tuple[int, float]:
    """(int16 threshold, scale): keep an element when its int16 >= threshold, whose
    probability is 1 - k / 65536 for k = round(p * 65536); scale = its inverse."""
    if not 0 <= p < 1:
        raise ValueError(f"dropout probability {p} must lie in [0, 1)")
    k = min(round(p * 65536), 65535)  # p within 2^-17 of 1 drops all but 1 in 65536
    return k - 32768, 65536 / (65536 - k)


def random_int16(shape: torch.Size, device: torch.device) -> Tensor:
    """Uniform int16 values from torch's generator, four per 64 random bits."""
    n = 1
    for s in shape:
        n *= s
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=device)
    words.random_(-2 ** 63, 2 ** 63 - 1)  # every bit random; the default range leaves the top bit 0
    return words.view(torch.int16)[:n].view(shape)


class _Dropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, p: float) -> Tensor:
        threshold, scale = keep_threshold(p)
        keep = random_int16(x.shape, x.device) >= threshold
        mask = keep.to(x.dtype).mul_(scale)
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, grad: Tensor):
        (mask,) = ctx.saved_tensors
        return grad * mask, None


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """``F.dropout(x, p, training)`` with masks from :func:`random_int16` (see above)."""
    if not training or p == 0.0:
        return x
    return _Dropout.apply(x, p)


def eager_dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """:func:`dropout`, except under ``torch.compile``, where ``F.dropout`` becomes
    Inductor's own fused random mask."""
    if torch.compiler.is_compiling():
        return F.dropout(x, p, training)
    return dropout(x, p, training)


def dropout_seed() -> Tensor:
    """A seed for one mask of the C++ kernels, drawn from torch's CPU generator as a
    one-element int64 tensor (the kernel reads it; Python never does), so that a run
    restored with its RNG state draws the same masks."""
    return torch.randint(0, 2 ** 62, (), dtype=torch.int64)

"""The post-LN residual block in one C++ pass each way, on a CPU in training.

``LayerNorm(x + Dropout(out))`` takes eight eager kernels forward (dropout's random bits,
compare, cast, scale, multiply, the sum, layer norm) and as many backward, each a pass over
a (rows x d_model) tensor and an autograd node. The C++ kernel draws the mask from a
counter-based generator seeded from torch's (so masks depend on the seed, not on the
threads; a run restored with its RNG state repeats), keeps :mod:`aiayn.fast.dropout`'s keep
rule, sums, normalises, and saves the normalised rows and a byte mask; backward forms layer
norm's gradient and dropout's in the same loop (bench/README.md, "the residual block in one
C++ pass each way"). Pre-LN blocks, GPUs and ``torch.compile`` keep torch's ops."""

from __future__ import annotations

import torch
from torch import Tensor

from aiayn.fast.config import KernelConfig
from aiayn.fast.dropout import dropout_seed, keep_threshold
from aiayn.fast.extension import cpu_extension


class _ResidualNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, out: Tensor, weight: Tensor, bias: Tensor, p: float,
                eps: float, seed: Tensor) -> tuple[Tensor, Tensor]:
        threshold, scale = keep_threshold(p)
        y, xhat, mask, rstd = cpu_extension().forward(x, out, weight, bias, threshold,
                                                      scale, eps, seed)
        ctx.save_for_backward(xhat, mask, rstd, weight)
        ctx.scale, ctx.out_dtype = scale, out.dtype
        ctx.mark_non_differentiable(mask)
        return y, mask

    @staticmethod
    def backward(ctx, grad: Tensor, _mask_grad):
        xhat, mask, rstd, weight = ctx.saved_tensors
        dx, dout, dw, db = cpu_extension().backward(grad, xhat, mask, rstd, weight,
                                                    ctx.scale, ctx.out_dtype)
        return dx, dout, dw, db, None, None, None


def residual_norm_applies(x: Tensor, out: Tensor, weight: Tensor,
                          config: KernelConfig) -> bool:
    """Whether :func:`residual_norm` takes these tensors: CPU, fp32 ``x`` and weights,
    ``out`` fp32 or bf16 of ``x``'s shape, not under ``torch.compile``, and the kernel
    allowed by ``config`` and built."""
    return (x.device.type == "cpu" and x.dtype == torch.float32
            and out.dtype in (torch.float32, torch.bfloat16) and out.shape == x.shape
            and weight.dtype == torch.float32 and x.numel() > 0
            and not torch.compiler.is_compiling() and config.cpu_extension
            and cpu_extension() is not None)


def residual_norm(x: Tensor, out: Tensor, weight: Tensor, bias: Tensor, p: float,
                  eps: float = 1e-5, seed: int | None = None,
                  return_mask: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """``F.layer_norm(x + dropout(out, p), weight, bias, eps)`` in one pass each way, the
    post-LN residual block of Section 3.1: fp32 output, ``out``'s gradient in ``out``'s
    dtype. Masks follow :func:`aiayn.fast.dropout.dropout`'s keep rule; their bits come from
    ``seed`` (default: drawn from torch's generator). ``return_mask``: also the uint8 mask
    (1 = kept), for tests. Check :func:`residual_norm_applies` first."""
    seed = dropout_seed() if seed is None else torch.tensor(seed, dtype=torch.int64)
    y, mask = _ResidualNorm.apply(x.contiguous(), out.contiguous(), weight, bias, float(p),
                                  float(eps), seed)
    return (y, mask) if return_mask else y

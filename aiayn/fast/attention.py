"""Attention's fast paths: on a CPU, short sequences in one C++ pass per (sequence, head);
on CUDA, SDPA without cuDNN's kernel.

The eager path (``aiayn.model.attend``) moves every head out of the fused QKV product into
(B, H, T, d), (under bf16) casts it to fp32, runs each product through the batched GEMM or
PyTorch's flash kernel, whose set-up outweighs the products of sentence-length sequences,
and puts the heads back for the output projection; backward does as much again, plus the
split's concatenation. The C++ pass has each thread take one (sequence, head) at a time: q,
k and v are read where the projection wrote them, the scores, the softmax and the six
products stay in fp32 in the thread's cache, each a small register-blocked product (P is kept
for backward, dropout's mask drawn again from its seed with :mod:`aiayn.fast.dropout`'s keep
rule; denormals flushed to zero), the output is written as (B, Tq, H * d_v), and backward
writes the gradient of the fused input in place. Past ``KernelConfig.attention_kernel_keys``
keys the eager path wins and takes over (bench/README.md, "attention in one C++ pass" and
"attention's products in registers")."""

from __future__ import annotations

import torch
from torch import Tensor

from aiayn.fast.config import KernelConfig
from aiayn.fast.dropout import dropout_seed, keep_threshold
from aiayn.fast.extension import cpu_extension


def avoid_cudnn_attention(device: torch.device) -> None:
    """On a CUDA device, take cuDNN's kernel out of ``F.scaled_dot_product_attention``'s
    choice, leaving flash, memory-efficient and math attention.

    Where PyTorch prefers it (Hopper GPUs), cuDNN attention builds an execution plan for
    every new shape, milliseconds of host time per call, and token-bucket batches and
    decoding bring new shapes all the time; the other kernels have no per-shape cost
    (bench/README.md, "gpu_step.py"; docs/results/gpu-h200/). A process-wide switch, so that
    compiled graphs see it too, named here so that the trainer and the translator take it as
    a step of their own; nothing happens on other devices."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


class _Attention(torch.autograd.Function):
    """Attention of ``heads`` heads whose queries, keys and values are column ranges of the
    projections' outputs: self-attention reads all three from ``qkv`` (``kv`` None),
    cross-attention queries from ``qkv`` and keys and values from ``kv``. The gradient of each
    input is one tensor, written by the kernel in place (no split, no concatenation)."""

    @staticmethod
    def forward(ctx, qkv: Tensor, kv: Tensor | None, hk: int, hv: int, heads: int,
                mask: Tensor, causal: bool, p: float, seed: Tensor, offsets: Tensor,
                length: int) -> Tensor:
        q, k, v = operands(qkv, kv, hk, hv)
        threshold, scale = keep_threshold(p)
        out, probs = cpu_extension().attention_forward(q, k, v, mask, heads, causal, p > 0.0,
                                                       threshold, scale, seed, offsets, length)
        ctx.save_for_backward(qkv, kv, mask, probs, seed, offsets)
        ctx.args = hk, hv, heads, causal, p, length
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        qkv, kv, mask, probs, seed, offsets = ctx.saved_tensors
        hk, hv, heads, causal, p, length = ctx.args
        q, k, v = operands(qkv, kv, hk, hv)
        grad_qkv = torch.empty_like(qkv)
        grad_kv = None if kv is None else torch.empty_like(kv)
        dq, dk, dv = operands(grad_qkv, grad_kv, hk, hv)
        threshold, scale = keep_threshold(p)
        cpu_extension().attention_backward(grad, q, k, v, mask, probs, heads, causal, p > 0.0,
                                           threshold, scale, seed, dq, dk, dv, offsets, length)
        return grad_qkv, grad_kv, None, None, None, None, None, None, None, None, None


def operands(qkv: Tensor, kv: Tensor | None, hk: int,
             hv: int) -> tuple[Tensor, Tensor, Tensor]:
    """(q, k, v) as column views: of ``qkv`` (queries, keys, values), or queries from ``qkv``
    and (keys, values) from ``kv``."""
    if kv is None:
        return tuple(qkv.split([hk, hk, hv], dim=-1))
    return (qkv, *kv.split([hk, hv], dim=-1))


def attention_applies(device: torch.device, dtype: torch.dtype, keys: int,
                      mask: Tensor | None, causal: bool, config: KernelConfig) -> bool:
    """Whether :func:`attention` takes operands of ``dtype`` on ``device`` with ``keys`` keys:
    CPU, at most ``config.attention_kernel_keys`` for ``dtype`` (none for a dtype not in it),
    no mask beyond key padding ((B, 1, 1, Tk)), not causal and masked at once, not under
    ``torch.compile``, and the kernel allowed by ``config`` and built."""
    # Compiling first: a length compared while compiling would guard the graph on it.
    return (device.type == "cpu" and not torch.compiler.is_compiling()
            and 0 < keys <= config.attention_kernel_keys.get(dtype, 0)
            and (mask is None or (not causal and mask.dim() == 4 and mask.shape[1:3] == (1, 1)))
            and config.cpu_extension and cpu_extension() is not None)


def attention(qkv: Tensor, kv: Tensor | None, heads: int, d_k: int, d_v: int,
              mask: Tensor | None, causal: bool, p: float = 0.0,
              seed: int | None = None, packed: tuple[Tensor, int] | None = None) -> Tensor:
    """Scaled dot-product attention in one C++ pass per (sequence, head) each way, reading
    queries, keys and values where the projections wrote them and writing (B, Tq, heads *
    d_v), the output projection's input: ``qkv`` (B, T, heads * (2 d_k + d_v)) for
    self-attention (``kv`` None), else queries ``qkv`` (B, Tq, heads * d_k) and ``kv`` (B, Tk,
    heads * (d_k + d_v)). ``mask``: bool (B, 1, 1, Tk), True where a key is allowed;
    ``causal``: query i sees keys up to i. Attention dropout ``p`` follows
    :func:`aiayn.fast.dropout.dropout`'s keep rule with bits from ``seed`` (default: drawn
    from torch's generator). ``packed`` (offsets, length): ``qkv`` holds packed rows, (N,
    width), sequence b's in rows offsets[b] .. offsets[b + 1] (int64, B + 1), at most
    ``length`` each, as :meth:`aiayn.fast.Packing.offsets` gives them, and so does the
    output, (N, heads * d_v): the decoder's rows go in and come out without a padded copy.
    Check :func:`attention_applies` first."""
    hk, hv = heads * d_k, heads * d_v
    widths = ((qkv, 2 * hk + hv, "qkv"),) if kv is None else ((qkv, hk, "q"),
                                                             (kv, hk + hv, "kv"))
    for t, width, name in widths:
        dims, layout = (2, "N") if packed is not None and t is qkv else (3, "B, T")
        if t.dim() != dims or t.shape[-1] != width:
            raise ValueError(f"attention: {name} must be ({layout}, {width}) for {heads} heads "
                             f"of d_k={d_k}, d_v={d_v}; got {tuple(t.shape)}")
    flat = (qkv.new_empty(0, dtype=torch.bool) if mask is None
            else mask.reshape(mask.shape[0], mask.shape[-1]).contiguous())
    if seed is None:  # no draw without dropout: the generator's stream stays the eager path's
        seed = dropout_seed() if p > 0.0 else torch.zeros((), dtype=torch.int64)
    else:
        seed = torch.tensor(seed, dtype=torch.int64)
    offsets, length = packed if packed is not None else (_NO_OFFSETS, 0)
    return _Attention.apply(qkv, kv, hk, hv, heads, flat, bool(causal), float(p), seed,
                            offsets, int(length))


_NO_OFFSETS = torch.empty(0, dtype=torch.int64)

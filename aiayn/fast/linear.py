"""Linear layers and the feed-forward network on a CPU.

* **fp32 products through oneDNN** (:func:`linear`). torch multiplies fp32 matrices on a CPU
  with MKL; oneDNN's GEMM (``torch.ops.mkldnn._linear_pointwise``, what torch itself uses
  for bf16) ran this model's forward products faster, while MKL stayed faster for the weight
  gradient (bench/README.md, "the fast kernels"). So the forward product goes through
  oneDNN and backward stays with MKL; the FFN's ReLU rides on its first product as oneDNN's
  post-op (:func:`linear_relu`). Elsewhere (a GPU, autocast, a torch without oneDNN) it is
  ``F.linear``.
* **Products whose shapes repeat, under autocast on a CPU** (:func:`padded_rows`). oneDNN
  builds (JIT-compiles) a primitive for every new shape of a 16-bit product and caches it
  by shape, and token-bucket batches bring a new row count at almost every step. So a
  layer's rows are padded with zeros up to a multiple of ``KernelConfig.row_multiple``
  (from ``pad_rows_from`` rows on), and a run meets a few dozen row counts, each built once:
  the padded copy is the cast autocast makes anyway, and the zero rows add nothing to any
  result (bench/README.md, "products on recurring row counts"). In fp32 only the forward
  products go through oneDNN, and they are left unpadded (the copy cost what the builds
  did, same section). The padded layers cast their fp32 weights themselves, once per
  micro-batch: autocast's cache of one cast per step (``aiayn.precision.step_casts``)
  serves its own products only.
* **The FFN in one function** (:func:`feed_forward`): its hidden layer stays on its padded
  rows between the two products; where the CPU runs bf16 natively the products go through
  oneDNN's fused linear with the bias and the ReLU as post-ops; the ReLU's gradient is one
  branch-free C++ pass over the bits. The same numbers bit for bit as the layers apart
  (bench/README.md, "the FFN in one function").
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from aiayn.fast.config import DEFAULTS, KernelConfig
from aiayn.fast.extension import cpu_extension


def padded_rows(rows: int, multiple: int, start: int) -> int:
    """The rows a product of ``rows`` rows runs on: ``rows`` rounded up to a multiple of
    ``multiple`` from ``start`` rows on, else ``rows`` as it is."""
    if multiple <= 1 or rows < start:
        return rows
    return -(-rows // multiple) * multiple


def _onednn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                            "_linear_pointwise")


ONEDNN_LINEAR = _onednn_linear_available()


class _Linear(torch.autograd.Function):
    """y = x W^T + b [then ReLU]: oneDNN forward, MKL backward."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, relu: bool) -> Tensor:
        y = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "relu" if relu else "none",
                                               [], "")
        ctx.save_for_backward(x, weight, y if relu else None)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight, y = ctx.saved_tensors
        if y is not None:  # ReLU: no gradient where the output was clipped to 0
            grad = torch.ops.aten.threshold_backward(grad, y, 0)
        g = grad.reshape(-1, grad.shape[-1])
        grad_x = torch.mm(g, weight).view(x.shape) if ctx.needs_input_grad[0] else None
        grad_w = torch.mm(g.t(), x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        grad_b = g.sum(dim=0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


def _use_onednn(x: Tensor, weight: Tensor) -> bool:
    return (ONEDNN_LINEAR and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32 and not torch.is_autocast_enabled("cpu")
            and not torch.compiler.is_compiling())


def pad_rows_into(x: Tensor, rows: int, dtype: torch.dtype) -> Tensor:
    """(m, k) ``x`` as a new (rows, k) tensor of ``dtype``: x cast into the first m rows,
    zeros after."""
    m = x.shape[0]
    out = x.new_empty(rows, x.shape[1], dtype=dtype)
    out[:m].copy_(x)
    out[m:].zero_()
    return out


@functools.cache
def onednn_takes(dtype: torch.dtype) -> bool:
    """Whether oneDNN's fused linear runs ``dtype`` (bf16, fp16) products on this CPU: with
    native instructions for them (AVX512-BF16, AMX; AMX-FP16), not on AVX2 alone."""
    if not ONEDNN_LINEAR:
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float16 and bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def bias_product(xp: Tensor, w: Tensor, bias: Tensor | None, relu: bool,
                 onednn: bool | None = None) -> Tensor:
    """``xp @ w.T + bias`` [then ReLU] in ``xp``'s 16-bit dtype (``w`` cast already, ``bias``
    not): with ``onednn`` (default: where :func:`onednn_takes` the dtype) oneDNN's fused
    linear, its bias and ReLU post-ops of the product (the same numbers as ``addmm`` then
    ``relu_``, which copied the bias into the output first and took a second pass for the
    ReLU); else ``addmm`` [then ``relu_``]."""
    b = None if bias is None else bias.to(xp.dtype)
    if onednn is None:
        onednn = onednn_takes(xp.dtype)
    if onednn:
        return torch.ops.mkldnn._linear_pointwise(xp, w, b, "relu" if relu else "none", [], "")
    y = torch.mm(xp, w.t()) if b is None else torch.addmm(b, xp, w.t())
    return y.relu_() if relu else y


class _RowPaddedLinear(torch.autograd.Function):
    """y = x W^T + b [then ReLU] in ``dtype`` on rows padded to ``rows``: what autocast
    computes (input, weight and bias cast to ``dtype``, the gradients cast back), on products
    whose row count recurs."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, relu: bool,
                dtype: torch.dtype, rows: int) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xp = pad_rows_into(x2, rows, dtype)
        w = weight.to(dtype)
        y = bias_product(xp, w, bias, relu)
        ctx.save_for_backward(xp, w, y if relu else None)
        ctx.m, ctx.x_dtype, ctx.w_dtype = x2.shape[0], x.dtype, weight.dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        return y[:ctx.m].view(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad: Tensor):
        xp, w, y = ctx.saved_tensors
        m = ctx.m
        g = grad.reshape(-1, grad.shape[-1])
        gp = xp.new_empty(xp.shape[0], g.shape[1])
        if y is not None:  # ReLU: no gradient where the output was clipped to 0
            torch.ops.aten.threshold_backward.grad_input(g.to(gp.dtype), y[:m], 0,
                                                         grad_input=gp[:m])
        else:
            gp[:m].copy_(g)
        gp[m:].zero_()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.mm(gp, w)[:m].to(ctx.x_dtype).view(*grad.shape[:-1], w.shape[1])
        if ctx.needs_input_grad[1]:
            grad_w = torch.mm(gp.t(), xp).to(ctx.w_dtype)
        if ctx.b_dtype is not None and ctx.needs_input_grad[2]:
            grad_b = gp[:m].sum(dim=0).to(ctx.b_dtype)
        return grad_x, grad_w, grad_b, None, None, None


def _relu_backward_(grad: Tensor, out: Tensor, use_extension: bool) -> Tensor:
    """``grad`` zeroed in place where the ReLU's output ``out`` is <= 0, as
    ``aten.threshold_backward(grad, out, 0)``: for 16-bit tensors on a CPU by the C++
    module's branch-free pass over their bits (a plain copy's time; bench/README.md, "the FFN
    in one function") where ``use_extension``, else by aten."""
    ext = (cpu_extension() if use_extension and grad.device.type == "cpu"
           and grad.dtype in (torch.bfloat16, torch.float16) else None)
    if ext is not None:
        ext.relu_backward_(grad, out)
    else:
        torch.ops.aten.threshold_backward.grad_input(grad, out, 0, grad_input=grad)
    return grad


class _RowPaddedFeedForward(torch.autograd.Function):
    """FFN(x) = ReLU(x W1^T + b1) W2^T + b2 in ``dtype`` on rows padded to ``rows``: the two
    :class:`_RowPaddedLinear` layers in one function, whose hidden layer stays padded
    between the products. Apart, the second layer copied the first's (rows x d_ff) output
    into a padded buffer of its own, and backward wrote the ReLU's gradient into another.
    The padded hidden rows hold ReLU(b1), not zeros: their gradient rows are zero, so they
    add nothing to any weight's or bias's gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None,
                dtype: torch.dtype, rows: int, use_extension: bool) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xp = pad_rows_into(x2, rows, dtype)
        w1c, w2c = w1.to(dtype), w2.to(dtype)
        h = bias_product(xp, w1c, b1, True)
        y = bias_product(h, w2c, b2, False)
        ctx.save_for_backward(xp, w1c, h, w2c)
        ctx.m, ctx.x_dtype, ctx.use_extension = x2.shape[0], x.dtype, use_extension
        ctx.dtypes = (w1.dtype, None if b1 is None else b1.dtype,
                      w2.dtype, None if b2 is None else b2.dtype)
        return y[:ctx.m].view(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad: Tensor):
        xp, w1c, h, w2c = ctx.saved_tensors
        m, (w1_dtype, b1_dtype, w2_dtype, b2_dtype) = ctx.m, ctx.dtypes
        need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:5]
        gp = pad_rows_into(grad.reshape(-1, grad.shape[-1]), xp.shape[0], xp.dtype)
        grad_x = grad_w1 = grad_b1 = grad_w2 = grad_b2 = None
        if need_w2:
            grad_w2 = torch.mm(gp.t(), h).to(w2_dtype)
        if b2_dtype is not None and need_b2:
            grad_b2 = gp[:m].sum(dim=0).to(b2_dtype)
        if need_x or need_w1 or need_b1:
            gh = torch.mm(gp, w2c)  # zero on the padded rows, as gp is
            _relu_backward_(gh, h, ctx.use_extension)  # none where the ReLU clipped to 0
            if need_x:
                grad_x = (torch.mm(gh, w1c)[:m].to(ctx.x_dtype)
                          .view(*grad.shape[:-1], w1c.shape[1]))
            if need_w1:
                grad_w1 = torch.mm(gh.t(), xp).to(w1_dtype)
            if b1_dtype is not None and need_b1:
                grad_b1 = gh[:m].sum(dim=0).to(b1_dtype)
        return grad_x, grad_w1, grad_b1, grad_w2, grad_b2, None, None, None


def _padded_product(x: Tensor, weight: Tensor,
                    config: KernelConfig) -> tuple[torch.dtype, int] | None:
    """(autocast dtype, padded rows) where a linear layer on ``x`` takes
    :class:`_RowPaddedLinear` (CPU autocast to a 16-bit type, fp32 weights, rows to pad);
    else None."""
    if (x.device.type != "cpu" or not torch.is_autocast_enabled("cpu")
            or weight.dtype != torch.float32 or torch.compiler.is_compiling()):
        return None
    dtype = torch.get_autocast_dtype("cpu")
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    rows = padded_rows(m, config.row_multiple, config.pad_rows_from)
    if dtype not in (torch.bfloat16, torch.float16) or rows == m:
        return None
    return dtype, rows


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None, relu: bool,
            config: KernelConfig) -> Tensor:
    """The one choice of path behind :func:`linear` and :func:`linear_relu`."""
    if _use_onednn(x, weight):
        return _Linear.apply(x, weight, bias, relu)
    if padded := _padded_product(x, weight, config):
        return _RowPaddedLinear.apply(x, weight, bias, relu, *padded)
    y = F.linear(x, weight, bias)
    return F.relu(y) if relu else y


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None,
           config: KernelConfig = DEFAULTS) -> Tensor:
    """``F.linear``, with the forward product by oneDNN for fp32 on a CPU, and under CPU
    autocast on rows padded to a recurring count (see above)."""
    return _linear(x, weight, bias, False, config)


def linear_relu(x: Tensor, weight: Tensor, bias: Tensor | None = None,
                config: KernelConfig = DEFAULTS) -> Tensor:
    """``F.relu(F.linear(x, weight, bias))``, fused for fp32 on a CPU, on padded rows under
    CPU autocast (see above)."""
    return _linear(x, weight, bias, True, config)


def feed_forward(x: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None,
                 config: KernelConfig = DEFAULTS) -> Tensor:
    """``F.linear(F.relu(F.linear(x, w1, b1)), w2, b2)``: under CPU autocast on padded rows,
    both products in one function whose hidden layer stays padded
    (:class:`_RowPaddedFeedForward`); elsewhere :func:`linear_relu` then :func:`linear`."""
    padded = _padded_product(x, w1, config)
    if padded and w2.dtype == torch.float32:
        return _RowPaddedFeedForward.apply(x, w1, b1, w2, b2, *padded, config.cpu_extension)
    return linear(linear_relu(x, w1, b1, config), w2, b2, config)

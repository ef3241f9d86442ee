"""The output projection and the label-smoothed loss in one pass over the vocabulary.

The plain path multiplies every target position, padding included, by the shared embedding
matrix, materialises the (positions x vocab) logits, then fp32 log-probabilities, then in
backward as many tensors again for the gradients of ``log_softmax``, ``gather`` and
``mean``, much of its time the page faults of freshly allocated tensors. Here only the
non-padding rows are projected, ``chunk_rows`` rows at a time into one reused buffer, and
each chunk's gradient with respect to the logits, ``softmax - (1 - eps) onehot - eps / V``,
is formed in place and multiplied straight into the gradients of the hidden states and of
the embedding matrix. The logits never exist whole; the loss is the same sum (up to float
rounding), as tested against the plain path. Under bf16 autocast on a CPU each chunk's
softmax, loss and gradient take one C++ pass per row (``label_smoothed_softmax_``) where
eager PyTorch takes about ten ops per block and two fp32 copies; fp32 logits keep the eager
blocks, which work in place (``KernelConfig.softmax_kernel_dtypes``; bench/README.md, "the
fast kernels" and "the loss's softmax in one C++ pass"). R-Drop's loss
(:func:`projected_rdrop_loss`) follows the same pattern on pairs of rows.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from aiayn.fast.config import DEFAULTS, KernelConfig
from aiayn.fast.extension import cpu_extension
from aiayn.fast.linear import padded_rows


def padded_width(vocab: int, align: int) -> int:
    """The columns the fused loss multiplies on: ``vocab`` rounded up to a multiple of
    ``align`` (1: the width as it is)."""
    return -(-vocab // align) * align


def loss_blocks(device: torch.device, vocab: int,
                config: KernelConfig = DEFAULTS) -> tuple[int, int]:
    """(chunk_rows, softmax_rows) of the fused loss on ``device`` for ``vocab`` outputs:
    sized for the CPU's heap and cache (``config.chunk_bytes``, ``softmax_rows``), or on
    CUDA for few launches (``cuda_chunk_bytes``, the whole chunk)."""
    if device.type == "cuda":
        chunk = max(64, config.cuda_chunk_bytes // (4 * vocab))
        return chunk, chunk
    return max(64, config.chunk_bytes // (4 * vocab)), config.softmax_rows


def tail_window(rows: int, total: int, device: torch.device, multiple: int) -> int:
    """The rows the loss multiplies for a chunk of ``rows`` rows that ends at the last of
    ``total``: on a CPU ``rows`` rounded up to a multiple of ``multiple``
    (``KernelConfig.row_multiple``) where ``total`` holds that many, so that the last chunk's
    products recur in shape as the linear layers' do (:mod:`aiayn.fast.linear`); else
    ``rows``."""
    if device.type != "cpu":
        return rows
    window = padded_rows(rows, multiple, start=0)
    return window if window <= total else rows


def _compute_dtype(device: torch.device) -> torch.dtype:
    """The dtype autocast would multiply in here (float32 when autocast is off)."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return torch.float32


class _GradientsFormedInForward(torch.autograd.Function):
    """The fused losses' common end: their forward forms the gradients of the rows and of
    the weight chunk by chunk (the loss is the graph's last operation, so none is wasted),
    and backward only scales them by the incoming gradient. A subclass's forward takes nine
    inputs, the first two the rows and the weight, and returns :meth:`finish`'s result."""

    @staticmethod
    def operands(rows: Tensor, weight: Tensor, n: int, dtype: torch.dtype, need_grad: bool,
                 align: int) -> tuple[Tensor, Tensor, int, Tensor, Tensor, Tensor | None,
                                      Tensor | None]:
        """What a forward works on, with autocast off: (rows and weight in ``dtype``, the
        product width, ``n`` losses and NLLs in fp32, and with ``need_grad`` the gradients
        to fill: the rows', and the weight's in fp32, zeroed). The products run on ``width``
        >= vocab columns, a multiple of ``align``: the extra rows of the weight are zeros,
        their logits are set to -inf before the softmax (so they add nothing to it) and
        their gradient rows are dropped."""
        vocab = weight.shape[0]
        width = padded_width(vocab, align)
        a, w = rows.to(dtype), weight.to(dtype)
        if width != vocab:
            w = torch.cat([w, w.new_zeros(width - vocab, w.shape[1])])
        loss = torch.empty(n, dtype=torch.float32, device=rows.device)
        nll = torch.empty_like(loss)
        grad_rows = torch.empty_like(rows) if need_grad else None
        grad_weight = torch.zeros(width, weight.shape[1], dtype=torch.float32,
                                  device=weight.device) if need_grad else None
        return a, w, width, loss, nll, grad_rows, grad_weight

    @staticmethod
    def finish(ctx, loss: Tensor, nll: Tensor, grad_rows: Tensor | None,
               grad_weight: Tensor | None, weight: Tensor, width: int, name: str
               ) -> tuple[Tensor, Tensor]:
        """Keeps the gradients (``grad_weight`` of ``width`` >= vocab rows, cut to the
        vocabulary) for backward and returns (loss sum, NLL sum), the NLL without gradient;
        ``name``, the public function's, is what backward's error names."""
        if grad_weight is not None and width != weight.shape[0]:
            grad_weight = grad_weight[:weight.shape[0]]
        ctx.save_for_backward(grad_rows, grad_weight)
        ctx.weight_dtype, ctx.loss_name = weight.dtype, name
        ctx.mark_non_differentiable(nll)
        return loss.sum(), nll.sum()

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_nll: Tensor):
        grad_rows, grad_weight = ctx.saved_tensors
        if grad_rows is None:
            raise RuntimeError(f"{ctx.loss_name} was computed without gradients "
                               "(under torch.no_grad) and cannot be backpropagated")
        return (grad_rows * grad_loss.to(grad_rows.dtype),
                (grad_weight * grad_loss).to(ctx.weight_dtype), None, None, None, None, None,
                None, None)


class _ProjectedLabelSmoothedLoss(_GradientsFormedInForward):
    """Sum over rows of the label-smoothed loss of ``rows @ weight.T``, and of the NLL.

    Gradients are computed during the forward pass, chunk by chunk, and scaled by the
    incoming gradient in backward: the loss is the last operation of the graph, so nothing
    is wasted, and the chunks' logits can be dropped as soon as they are used.
    """

    @staticmethod
    def forward(ctx, rows: Tensor, weight: Tensor, labels: Tensor, epsilon: float,
                chunk_rows: int, softmax_rows: int, dtype: torch.dtype, need_grad: bool,
                config: KernelConfig):
        n, vocab = rows.shape[0], weight.shape[0]
        with torch.autocast(rows.device.type, enabled=False):
            a, w, width, loss, nll, grad_rows, grad_weight = _GradientsFormedInForward.operands(
                rows, weight, n, dtype, need_grad, config.vocab_align)
            # The buffer holds a whole chunk, or the last chunk's window where that is more
            # (its real length is in [1, chunk_rows]: chunk_rows when n is a multiple).
            last = n - (n - 1) // chunk_rows * chunk_rows
            buf_rows = min(n, max(chunk_rows, tail_window(last, n, rows.device,
                                                          config.row_multiple)))
            buf = torch.empty(buf_rows, width, dtype=dtype, device=rows.device)
            # The mean logit of a row is its dot product with the mean embedding row.
            mean_all = rows.float() @ weight.float().mean(dim=0)  # (N,)
            # Each chunk's softmax, loss and gradient (in place in ``buf``, ready for the two
            # products): on CPU one C++ pass per row; elsewhere eager ops on blocks of
            # softmax_rows rows, under autocast in fp32 in one reused buffer that stays in cache.
            if (fused := _softmax_extension(rows.device, dtype, config)) is not None:
                softmax = fused.label_smoothed_softmax_
            else:
                wide = None if dtype == torch.float32 else torch.empty(
                    min(softmax_rows, chunk_rows, n), width, dtype=torch.float32,
                    device=rows.device)
                off = torch.tensor(-epsilon / vocab, dtype=torch.float32, device=rows.device)
                softmax = functools.partial(_softmax_blocks, softmax_rows=softmax_rows,
                                            wide=wide, off=off)
            for start in range(0, n, chunk_rows):
                end = min(start + chunk_rows, n)
                # The products run on rows [first, end): the chunk itself, or on CPU for a
                # short last chunk a window of a multiple of config.row_multiple rows ending
                # at the last row, whose shape recurs (tail_window); its rows before
                # ``start`` were done by the previous chunk and get no gradient here.
                first = (end - tail_window(end - start, n, rows.device, config.row_multiple)
                         if end == n else start)
                a_c = a[first:end]
                g = torch.mm(a_c, w.t(), out=buf[:end - first])  # (c, width) logits
                if start > first:
                    g[:start - first] = 0.0
                softmax(g[start - first:], labels[start:end], mean_all[start:end],
                        loss[start:end], nll[start:end], vocab, epsilon, need_grad)
                if need_grad:
                    grad_rows[start:end] = torch.mm(g, w)[start - first:]
                    if dtype == torch.float32:
                        grad_weight.addmm_(g.t(), a_c)
                    else:
                        grad_weight += torch.mm(g.t(), a_c).float()
        return _GradientsFormedInForward.finish(ctx, loss, nll, grad_rows, grad_weight,
                                                weight, width, "projected_label_smoothed_loss")


def _softmax_blocks(g: Tensor, labels: Tensor, mean_all: Tensor, loss: Tensor, nll: Tensor,
                    vocab: int, epsilon: float, need_grad: bool, *, softmax_rows: int,
                    wide: Tensor | None, off: Tensor) -> None:
    """The eager twin of the C++ ``label_smoothed_softmax_``: writes each row's loss and NLL
    of the logits ``g`` (rows, width) into ``loss`` and ``nll``; with ``need_grad``, turns
    ``g`` into their gradient in place. Runs in fp32 blocks of ``softmax_rows`` rows
    (through ``wide`` when ``g`` is 16-bit); columns past ``vocab`` add nothing."""
    if g.shape[1] != vocab:
        g[:, vocab:] = float("-inf")
    for lo in range(0, g.shape[0], softmax_rows):
        hi = min(lo + softmax_rows, g.shape[0])
        z_c, y = g[lo:hi], labels[lo:hi, None]
        z = z_c if wide is None else wide[:hi - lo].copy_(z_c)
        target = z.gather(1, y).squeeze(1)
        top = z.amax(dim=1, keepdim=True)
        z.sub_(top).exp_()
        total = z.sum(dim=1)
        lse = top.squeeze(1) + total.log()
        nll[lo:hi] = lse - target
        # -sum_v q_v log p_v with q = (1 - eps) onehot + eps / V
        loss[lo:hi] = lse - (1.0 - epsilon) * target - epsilon * mean_all[lo:hi]
        if need_grad:
            # d loss / d logits = softmax - (1 - eps) onehot - eps / V, in place.
            torch.addcmul(off, z, total.reciprocal().unsqueeze(1), out=z)
            z.scatter_add_(1, y, torch.full_like(y, -(1.0 - epsilon), dtype=z.dtype))
            if wide is not None:
                z_c.copy_(z)


def _softmax_extension(device: torch.device, dtype: torch.dtype, config: KernelConfig):
    """The compiled module whose ``label_smoothed_softmax_`` the loss takes for logits of
    ``dtype`` on ``device`` (CPU, a dtype of ``config.softmax_kernel_dtypes``, the
    extension allowed, not under ``torch.compile``), else None."""
    if (device.type != "cpu" or dtype not in config.softmax_kernel_dtypes
            or not config.cpu_extension or torch.compiler.is_compiling()):
        return None
    return cpu_extension()


def projected_label_smoothed_loss(hidden: Tensor, weight: Tensor, labels: Tensor,
                                  epsilon: float, pad_id: int, chunk_rows: int | None = None,
                                  positions: Tensor | None = None,
                                  softmax_rows: int | None = None,
                                  config: KernelConfig = DEFAULTS
                                  ) -> tuple[Tensor, Tensor, int]:
    """:func:`aiayn.training.objective.label_smoothed_loss` of the logits ``hidden @ weight.T``.

    ``hidden`` (B, T, d) are the decoder's outputs before the tied projection (``weight``
    (V, d), the shared embedding matrix, Section 3.4), or already only those at the
    non-pad labels, as (N, d) rows in row-major order (``Transformer(..., packed=...)``);
    ``labels`` (B, T); ``positions`` the flat positions of its non-pad labels if known
    (``Batch.tgt_positions``: then nothing waits for a GPU). Returns the same
    (smoothed loss sum, NLL sum, number of non-pad labels), the log-probabilities in fp32,
    the products in autocast's dtype when autocast is on; padding positions are never
    projected. ``chunk_rows`` and ``softmax_rows`` (rows of logits formed at once, and of
    their softmax at once) default to :func:`loss_blocks` for the device and ``config``,
    which also says how the products' vocabulary is aligned, where their last chunk's rows
    are rounded and which logits the C++ softmax takes (:class:`KernelConfig`).
    """
    flat = labels.reshape(-1)
    keep = (flat != pad_id).nonzero().squeeze(1) if positions is None else positions
    if hidden.dim() == 2:  # packed rows
        if hidden.shape[0] != keep.numel():
            raise ValueError(f"{hidden.shape[0]} packed rows for {keep.numel()} non-pad labels")
        rows = hidden
    else:
        rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, keep)  # (N, d)
    dtype = _compute_dtype(hidden.device)
    default_chunk, default_softmax = loss_blocks(hidden.device, weight.shape[0], config)
    chunk_rows = chunk_rows or default_chunk
    softmax_rows = softmax_rows or default_softmax
    need_grad = torch.is_grad_enabled() and (rows.requires_grad or weight.requires_grad)
    loss, nll = _ProjectedLabelSmoothedLoss.apply(rows, weight, flat.index_select(0, keep),
                                                  float(epsilon), int(chunk_rows),
                                                  int(softmax_rows), dtype, need_grad,
                                                  config)
    return loss, nll, keep.numel()


class _ProjectedRDropLoss(_GradientsFormedInForward):
    """R-Drop's loss (:func:`aiayn.training.objective.rdrop_loss`) of ``rows @ weight.T``, rows
    [0, N) the first pass and [N, 2N) the second, by the fused loss's pattern: chunk by
    chunk, gradients formed in forward and scaled in backward, logits never kept whole."""

    @staticmethod
    def forward(ctx, rows: Tensor, weight: Tensor, labels: Tensor, epsilon: float,
                alpha: float, chunk_rows: int, dtype: torch.dtype, need_grad: bool,
                config: KernelConfig):
        n, vocab = labels.numel(), weight.shape[0]
        with torch.autocast(rows.device.type, enabled=False):
            a, w, width, loss, nll, grad_rows, grad_weight = _GradientsFormedInForward.operands(
                rows, weight, n, dtype, need_grad, config.vocab_align)
            buf = torch.empty(2, min(chunk_rows, max(n, 1)), width, dtype=dtype,
                              device=rows.device)
            mean_all = rows.float() @ weight.float().mean(dim=0)  # (2N,) mean logits
            fused = (cpu_extension() if rows.device.type == "cpu" and config.cpu_extension
                     and not torch.compiler.is_compiling() else None)
            pair = fused.rdrop_softmax_ if fused is not None else _rdrop_eager
            for start in range(0, n, chunk_rows):
                end = min(start + chunk_rows, n)
                c = end - start
                a1, a2 = a[start:end], a[n + start:n + end]
                g1 = torch.mm(a1, w.t(), out=buf[0, :c])
                g2 = torch.mm(a2, w.t(), out=buf[1, :c])
                pair(g1, g2, labels[start:end], mean_all[start:end],
                     mean_all[n + start:n + end], loss[start:end], nll[start:end], vocab,
                     epsilon, alpha, need_grad)
                if need_grad:
                    grad_rows[start:end] = torch.mm(g1, w)
                    grad_rows[n + start:n + end] = torch.mm(g2, w)
                    if dtype == torch.float32:
                        grad_weight.addmm_(g1.t(), a1).addmm_(g2.t(), a2)
                    else:
                        grad_weight += (torch.mm(g1.t(), a1) + torch.mm(g2.t(), a2)).float()
        return _GradientsFormedInForward.finish(ctx, loss, nll, grad_rows, grad_weight,
                                                weight, width, "projected_rdrop_loss")


def _rdrop_eager(g1: Tensor, g2: Tensor, labels: Tensor, mean1: Tensor, mean2: Tensor,
                 loss: Tensor, nll: Tensor, vocab: int, epsilon: float, alpha: float,
                 need_grad: bool) -> None:
    """The eager twin of the C++ ``rdrop_softmax_`` (its comment has the formulas): writes
    each row pair's loss and NLL; with ``need_grad``, turns ``g1`` and ``g2`` into their
    gradients in place. fp32; columns past ``vocab`` add nothing and get 0."""
    z1, z2 = g1[:, :vocab].float(), g2[:, :vocab].float()
    y = labels[:, None]
    l1, l2 = torch.log_softmax(z1, dim=1), torch.log_softmax(z2, dim=1)
    p1, p2 = l1.exp(), l2.exp()
    d = l1 - l2
    both = ((p1 - p2) * d).sum(dim=1)
    lse1, lse2 = z1.gather(1, y) - l1.gather(1, y), z2.gather(1, y) - l2.gather(1, y)
    ls1 = lse1.squeeze(1) - (1 - epsilon) * z1.gather(1, y).squeeze(1) - epsilon * mean1
    ls2 = lse2.squeeze(1) - (1 - epsilon) * z2.gather(1, y).squeeze(1) - epsilon * mean2
    nll.copy_(-(l1.gather(1, y) + l2.gather(1, y)).squeeze(1) / 2)
    loss.copy_((ls1 + ls2) / 2 + alpha / 4 * both)
    if not need_grad:
        return
    q = torch.full_like(z1, epsilon / vocab).scatter_add_(
        1, y, torch.full_like(y, 1 - epsilon, dtype=z1.dtype))
    d1 = (d * p1).sum(dim=1, keepdim=True)
    d2 = (d * p2).sum(dim=1, keepdim=True)
    grad1 = (p1 - q) / 2 + alpha / 4 * (p1 * (d - d1) + p1 - p2)
    grad2 = (p2 - q) / 2 + alpha / 4 * (p2 * (d2 - d) + p2 - p1)
    g1[:, vocab:] = 0
    g2[:, vocab:] = 0
    g1[:, :vocab] = grad1
    g2[:, :vocab] = grad2


def projected_rdrop_loss(rows: Tensor, weight: Tensor, labels: Tensor, epsilon: float,
                         alpha: float, chunk_rows: int | None = None,
                         config: KernelConfig = DEFAULTS) -> tuple[Tensor, Tensor, int]:
    """:func:`aiayn.training.objective.rdrop_loss` of the logits ``rows @ weight.T``, the loss's
    fused way: ``rows`` (2N, d) are the decoder's outputs at the N labels ``labels`` (N,),
    from the first pass, then the second (``Transformer(..., packed=...)`` of the batch
    stacked on itself). Returns (loss sum, mean of the two NLL sums, N); the products in
    autocast's dtype, the softmax in fp32 (a C++ pass per row pair on a CPU); ``config`` as
    :func:`projected_label_smoothed_loss`'s."""
    n = labels.numel()
    if rows.dim() != 2 or rows.shape[0] != 2 * n:
        raise ValueError(f"projected_rdrop_loss wants (2N, d) rows for N = {n} labels, got "
                         f"{tuple(rows.shape)}")
    dtype = _compute_dtype(rows.device)
    chunk_rows = chunk_rows or loss_blocks(rows.device, weight.shape[0], config)[0] // 2
    need_grad = torch.is_grad_enabled() and (rows.requires_grad or weight.requires_grad)
    loss, nll = _ProjectedRDropLoss.apply(rows, weight, labels, float(epsilon), float(alpha),
                                          int(chunk_rows), dtype, need_grad, config)
    return loss, nll, n


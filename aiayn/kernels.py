"""The fast training step's kernels: the plain path's math with fewer passes over memory.

``train.kernels: fast`` (the default) swaps six pieces of the training step; ``plain``
keeps torch's own operators, readable against the paper (``aiayn/model.py``,
``aiayn/objective.py``). Measured by ``bench/train_throughput.py``.

1. **The output projection and the label-smoothed loss in one pass over the vocabulary**
   (:func:`projected_label_smoothed_loss`). The plain path multiplies every target position,
   padding included, by the shared embedding matrix, materialises the (positions x vocab)
   logits, then fp32 log-probabilities, then in backward as many tensors again for the
   gradients of ``log_softmax``, ``gather`` and ``mean``: about 0.5 s of a 3 s step of the
   ``multi30k`` model on a 2-core CPU, much of it the page faults of freshly allocated
   130 MB tensors. Here only the non-padding rows are projected, ``chunk_rows`` rows at a
   time into one reused buffer, and each chunk's gradient with respect to the logits,
   ``softmax - (1 - eps) onehot - eps / V``, is formed in place and multiplied straight
   into the gradients of the hidden states and of the embedding matrix. The logits never
   exist whole; the loss is the same sum (up to float rounding), as tested against the plain
   path. Under bf16 autocast on CPU each chunk's softmax, loss and gradient take one C++
   pass per row (``label_smoothed_softmax_`` in ``csrc/cpu_kernels.cpp``, built as section 5
   says) where eager PyTorch takes about ten ops per block of :data:`SOFTMAX_ROWS` rows and
   two fp32 copies: 11 against 28 ms for the ``multi30k`` step's 3,600 x 5,408 bf16 logits
   on 2 AMX cores, the loss forward + backward 1.45-1.49x, the step 1.05x
   (bench/README.md, "the loss's softmax in one C++ pass"). fp32 logits keep the eager
   blocks, which work in place and were as fast (:data:`SOFTMAX_KERNEL_DTYPES`).

2. **Dropout masks from 16 random bits per element** (:func:`dropout`). ``F.dropout`` on CPU
   draws a float per element (``bernoulli_``): about 10 ms per million elements here, a
   sixth of the step. Filling int64 words with random bits and reading them as four int16
   values is about 5x cheaper; an element is kept when its int16 is at least a threshold,
   with probability ``1 - k / 65536`` for ``k = round(p * 65536)`` (0.100006 for p = 0.1),
   and scaled by the exact inverse of that probability, so the expectation is unchanged.
   The masks come from torch's generator (CPU or CUDA), so a run is as reproducible, and
   resumes as exactly, as with ``F.dropout``; they are other masks than ``F.dropout``
   draws, so fast and plain runs agree in distribution, not bit for bit. On a GPU the
   model's dropout layers keep ``F.dropout`` (``aiayn.model.Dropout``): its fused kernel
   draws the mask and writes the output in one launch, where these masks take five.

3. **fp32 linear layers on CPU through oneDNN** (:func:`linear`). torch multiplies fp32
   matrices on CPU with MKL; oneDNN's GEMM (``torch.ops.mkldnn._linear_pointwise``, what
   torch itself uses for bf16) runs the forward products of this model's layers 10-25%
   faster on an AVX2 AMD EPYC (124-129 against 101-115 GFLOP/s at 4000 rows), while MKL
   stays faster for the weight gradient. So the forward product goes through oneDNN and
   backward stays with MKL; the FFN's ReLU rides on its first product as oneDNN's post-op
   (:func:`linear_relu`). Elsewhere (a GPU, autocast, a torch without oneDNN) it is
   ``F.linear``.

4. **Products whose shapes repeat, under bf16 autocast on CPU** (:func:`linear`,
   :func:`padded_rows`). oneDNN builds (JIT-compiles) a primitive for every new shape of a
   bf16 product and caches it by shape. Token-bucket batches bring a new row count at
   almost every step (``B x S`` source positions, ``N`` real target positions), so a
   cache miss for nearly every product of the step: in the ``multi30k`` step on a 2-core
   CPU with AMX, ~39 misses per step at 1-10 ms each (``ONEDNN_VERBOSE=profile``), where
   the products themselves take a few ms. Here a linear layer's rows are padded with zeros
   up to a multiple of :data:`ROW_MULTIPLE` (from :data:`PAD_ROWS_FROM` rows on), so that
   the step meets a few dozen row counts over a whole run, each built once: the padded
   copy is the bf16 cast autocast makes anyway, the zero rows add at most
   ``ROW_MULTIPLE - 1`` rows of work (<2% at 4,000 rows) and nothing to any result. The
   fused loss's last chunk is likewise a window of a multiple of ``ROW_MULTIPLE`` rows that
   ends at the last row (its first rows, already done, get no gradient there). On that
   CPU the ``multi30k`` step builds 6 primitives instead of 31 and runs 1.15x faster,
   the demo's 1.50x, side by side (bench/README.md, "products on recurring row counts").
   In fp32 only the forward products of section 3 go through oneDNN; they are left
   unpadded: padded too, they built no primitive instead of ~3 a step, and the step ran at
   1.02x and 0.99x in two runs (AVX2 emulated), the input's copy costing what the builds
   did.
   The padded layers cast their fp32 weights themselves, once per micro-batch (autocast's
   cache of one cast per step, ``aiayn.precision.step_casts``, serves its own products
   only): the same bf16 values, a few per cent of the input casts' bytes.
   The FFN's two layers run as one function (:func:`feed_forward`) whose hidden layer stays
   on its padded rows between the products (apart, the second layer copied it into a padded
   buffer of its own, and saved it again); their products go through oneDNN's fused linear
   where the CPU runs bf16 natively, the bias and the ReLU as post-ops of the product
   (``addmm`` copied the bias into the output first, ``relu_`` took a second pass); and the
   ReLU's gradient is one branch-free C++ pass over the bits. The same numbers bit for bit;
   the ``multi30k`` step on 2 AMX cores 1.02x, 1.02x and 1.05x for the three, each
   against the tree before, and 1.04x for all three in one run (bench/README.md, "the FFN in
   one function").

5. **The post-LN residual block in one C++ pass each way, on CPU in training**
   (:func:`residual_norm`, ``csrc/cpu_kernels.cpp``). ``LayerNorm(x + Dropout(out))``
   takes eight eager kernels forward (dropout's random bits, compare, cast, scale, multiply,
   the sum, layer norm) and as many backward, each a pass over a (rows x d_model) tensor and
   an autograd node. The kernel draws the mask from a counter-based generator seeded from
   torch's (so masks depend on the seed, not on the threads; a run restored with its RNG
   state repeats), keeps section 2's rule, sums, normalises, and saves the normalised rows
   and a byte mask; backward forms layer norm's gradient and dropout's in the same loop.
   On 2 AMX cores a ``multi30k`` block (3,600 rows x 256) takes 2.4-2.9 ms forward and
   backward against 5.0-5.7 ms eager, and the step runs 1.08x faster (bench/README.md,
   "the residual block in one C++ pass"); in fp32 on AVX2 and for the demo's small model
   the step does not measurably change. It is built with torch's own extension builder when
   the trainer sets up (~30 s, cached per machine); where it cannot be (no compiler), a
   warning says so and the block takes torch's ops. Pre-LN blocks, GPUs and
   ``torch.compile`` keep torch's ops.

6. **Attention over short sequences in one C++ pass per (sequence, head), in fp32 or under
   bf16 autocast on CPU** (:func:`attention`, ``csrc/cpu_kernels.cpp``). The eager path
   (``aiayn.model.attend``) moves every head out of the fused QKV product into
   (B, H, T, d), (under bf16) casts it to fp32, runs each product through the batched GEMM
   or PyTorch's flash kernel, whose set-up outweighs the products of ~23-token sequences,
   and puts the heads back for the output projection; backward does as much again, plus the
   split's concatenation. Here each thread takes one (sequence, head) at a time: q, k and v
   are read where the projection wrote them, the scores, softmax and the six products stay
   in fp32 in the thread's cache, each a small register-blocked product (P is kept for
   backward, dropout's mask drawn again from its seed, section 5's keep rule and
   generator; denormals flushed to zero), the output is written as (B, Tq, H * d_v), and
   backward writes the gradient of the fused input in place. Forward + backward from and
   to the projections' layout: bf16 on 2 AMX cores 2.0-2.1x the eager path at 23 keys
   (1.6x at 32) before the products were register-blocked, which made the pass itself
   1.0-1.4x faster at 16-23 keys (0.84-1.08x at 10) and 1.05-2x at 32-128 (2-core AVX-512
   CPU); fp32 1.2-2.0x
   PyTorch's flash kernel at 10-23 keys (AVX-512 and AVX2). Past
   :data:`ATTENTION_KERNEL_KEYS` keys (bf16 64, fp32 32) the eager path wins and takes over
   (bench/README.md, "attention's products in registers").

Attention splits its (sequence, head) tasks over torch's threads with ``at::parallel_for``,
whose code is OpenMP pragmas, so the extension is built with ``-fopenmp``; so do the row
kernels (sections 1 and 5) with their rows, each row computed alike whatever the split. With
attention, the step ran 1.16x the tree before both (AMX, bf16, side by side); the row kernels
on two threads added 1.08x (bench/README.md, "the row kernels on two threads").
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

# Rows of logits formed at once: chunk x vocab floats stay at about 32 MiB, so the buffer is
# reused from glibc's heap instead of being mapped afresh (see aiayn.memory).
CHUNK_BYTES = 32 << 20
# Rows of the softmax and its gradient at once: 256 x vocab fp32 (8 MB at 8k) stay in the
# last-level cache between the passes over them. Under bf16 autocast on a 2-core AMD EPYC
# with native bf16 (AVX512-BF16) this made the loss 1.25x faster (bench/README.md); fp32 is
# unchanged (within noise there; not measured on an AVX2-only CPU).
SOFTMAX_ROWS = 256
# On a GPU neither reason holds (no CPU cache to stay in, no glibc heap), and each chunk and
# block costs a handful of kernel launches from a host that already bounds the step: on an
# H200 the 256-row blocks of the base model's loss took 34 of its 87 ms of GPU time per
# step (docs/results/gpu-h200/). There a chunk holds up to CUDA_CHUNK_BYTES of logits (a
# whole 6,250-token batch at a 37k vocabulary) and its softmax runs in one block.
CUDA_CHUNK_BYTES = 1 << 30
# The loss multiplies on a vocabulary rounded up to a multiple of this many tokens (zero rows,
# masked logits). A row of logits whose length is not a multiple of 8 floats misaligns every
# row after the first: on a 2-core AVX2 AMD EPYC, MKL ran the three products of the
# multi30k model's 5,399 spanned tokens at 72 / 92 / 115 GFLOP/s against 100 / 138 / 139 at
# 5,408: the loss 1.10x faster (bench/loss_kernel.py), the step 1.00-1.02x (the loss is
# ~15% of it; bench/train_throughput.py). 16 floats are one cache line.
VOCAB_ALIGN = 16


# Rows of a bf16 product on CPU are rounded up to a multiple of this (section 4 above), from
# PAD_ROWS_FROM rows on: below it (decoding, tiny batches) padding would cost more than a
# new shape.
ROW_MULTIPLE = 64
PAD_ROWS_FROM = 1024


def padded_rows(rows: int, multiple: int | None = None, start: int | None = None) -> int:
    """The rows a product of ``rows`` rows runs on: ``rows`` rounded up to a multiple of
    ``multiple`` (default ROW_MULTIPLE) from ``start`` (PAD_ROWS_FROM) rows on, else
    ``rows`` as it is."""
    multiple = ROW_MULTIPLE if multiple is None else multiple
    if multiple <= 1 or rows < (PAD_ROWS_FROM if start is None else start):
        return rows
    return -(-rows // multiple) * multiple


def padded_width(vocab: int, align: int = VOCAB_ALIGN) -> int:
    """The columns the fused loss multiplies on: ``vocab`` rounded up to a multiple of
    ``align`` (VOCAB_ALIGN; 1: the width as it is)."""
    return -(-vocab // align) * align


def loss_blocks(device: torch.device, vocab: int) -> tuple[int, int]:
    """(chunk_rows, softmax_rows) of the fused loss on ``device`` for ``vocab`` outputs:
    sized for the CPU's heap and cache (CHUNK_BYTES, SOFTMAX_ROWS), or on CUDA for few
    launches (CUDA_CHUNK_BYTES, the whole chunk)."""
    if device.type == "cuda":
        chunk = max(64, CUDA_CHUNK_BYTES // (4 * vocab))
        return chunk, chunk
    return max(64, CHUNK_BYTES // (4 * vocab)), SOFTMAX_ROWS


# --------------------------------------------------------------------------- the loss


def tail_window(rows: int, total: int, device: torch.device,
                multiple: int | None = None) -> int:
    """The rows the loss multiplies for a chunk of ``rows`` rows that ends at the last of
    ``total``: on CPU ``rows`` rounded up to a multiple of ``multiple`` (default
    ROW_MULTIPLE) where ``total`` holds that many (see :func:`padded_rows`), else ``rows``."""
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
                align: int):
        n, vocab = rows.shape[0], weight.shape[0]
        with torch.autocast(rows.device.type, enabled=False):
            a, w, width, loss, nll, grad_rows, grad_weight = \
                _GradientsFormedInForward.operands(rows, weight, n, dtype, need_grad, align)
            # The buffer holds a whole chunk, or the last chunk's window where that is more
            # (its real length is in [1, chunk_rows]: chunk_rows when n is a multiple).
            last = n - (n - 1) // chunk_rows * chunk_rows
            buf_rows = min(n, max(chunk_rows, tail_window(last, n, rows.device)))
            buf = torch.empty(buf_rows, width, dtype=dtype, device=rows.device)
            # The mean logit of a row is its dot product with the mean embedding row.
            mean_all = rows.float() @ weight.float().mean(dim=0)  # (N,)
            # Each chunk's softmax, loss and gradient (in place in ``buf``, ready for the two
            # products): on CPU one C++ pass per row; elsewhere eager ops on blocks of
            # softmax_rows rows, under autocast in fp32 in one reused buffer that stays in cache.
            if (fused := _softmax_extension(rows.device, dtype)) is not None:
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
                # short last chunk a window of a multiple of ROW_MULTIPLE rows ending at the
                # last row, whose shape recurs (section 4); its rows before ``start`` were
                # done by the previous chunk and get no gradient here.
                first = end - tail_window(end - start, n, rows.device) if end == n else start
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


# Logits whose softmax the C++ pass computes on CPU. bf16 only: in fp32 eager PyTorch works
# in place on the logits without copies and is as fast or faster (the C++ pass's loss 1.09x on
# AMX but 0.91x on AVX2, and the AVX2 fp32 step 0.95-0.96x with it; bench/README.md). The
# kernel itself takes fp32 too (tests and bench/loss_kernel.py set this to both).
SOFTMAX_KERNEL_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16,)


def _softmax_extension(device: torch.device, dtype: torch.dtype):
    """The compiled module whose ``label_smoothed_softmax_`` the loss takes for logits of
    ``dtype`` on ``device`` (CPU, a dtype of :data:`SOFTMAX_KERNEL_DTYPES`, not under
    ``torch.compile``), else None."""
    if (device.type != "cpu" or dtype not in SOFTMAX_KERNEL_DTYPES
            or torch.compiler.is_compiling()):
        return None
    return cpu_extension()


def projected_label_smoothed_loss(hidden: Tensor, weight: Tensor, labels: Tensor,
                                  epsilon: float, pad_id: int, chunk_rows: int | None = None,
                                  positions: Tensor | None = None,
                                  softmax_rows: int | None = None,
                                  align: int = VOCAB_ALIGN) -> tuple[Tensor, Tensor, int]:
    """:func:`aiayn.objective.label_smoothed_loss` of the logits ``hidden @ weight.T``.

    ``hidden`` (B, T, d) are the decoder's outputs before the tied projection (``weight``
    (V, d), the shared embedding matrix, Section 3.4), or already only those at the
    non-pad labels, as (N, d) rows in row-major order (``Transformer(..., packed=...)``);
    ``labels`` (B, T); ``positions`` the flat positions of its non-pad labels if known
    (``Batch.tgt_positions``: then nothing waits for a GPU). Returns the same
    (smoothed loss sum, NLL sum, number of non-pad labels), the log-probabilities in fp32,
    the products in autocast's dtype when autocast is on; padding positions are never
    projected. ``chunk_rows`` and ``softmax_rows`` (rows of logits formed at once, and of
    their softmax at once) default to :func:`loss_blocks` for the device; ``align`` rounds the
    vocabulary the products run on up to its multiple (:data:`VOCAB_ALIGN`; 1: as it is).
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
    default_chunk, default_softmax = loss_blocks(hidden.device, weight.shape[0])
    chunk_rows = chunk_rows or default_chunk
    softmax_rows = softmax_rows or default_softmax
    need_grad = torch.is_grad_enabled() and (rows.requires_grad or weight.requires_grad)
    loss, nll = _ProjectedLabelSmoothedLoss.apply(rows, weight, flat.index_select(0, keep),
                                                  float(epsilon), int(chunk_rows),
                                                  int(softmax_rows), dtype, need_grad,
                                                  int(align))
    return loss, nll, keep.numel()


class _ProjectedRDropLoss(_GradientsFormedInForward):
    """R-Drop's loss (:func:`aiayn.objective.rdrop_loss`) of ``rows @ weight.T``, rows
    [0, N) the first pass and [N, 2N) the second, by the fused loss's pattern: chunk by
    chunk, gradients formed in forward and scaled in backward, logits never kept whole."""

    @staticmethod
    def forward(ctx, rows: Tensor, weight: Tensor, labels: Tensor, epsilon: float,
                alpha: float, chunk_rows: int, dtype: torch.dtype, need_grad: bool,
                align: int):
        n, vocab = labels.numel(), weight.shape[0]
        with torch.autocast(rows.device.type, enabled=False):
            a, w, width, loss, nll, grad_rows, grad_weight = \
                _GradientsFormedInForward.operands(rows, weight, n, dtype, need_grad, align)
            buf = torch.empty(2, min(chunk_rows, max(n, 1)), width, dtype=dtype,
                              device=rows.device)
            mean_all = rows.float() @ weight.float().mean(dim=0)  # (2N,) mean logits
            fused = (cpu_extension() if rows.device.type == "cpu"
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
                         align: int = VOCAB_ALIGN) -> tuple[Tensor, Tensor, int]:
    """:func:`aiayn.objective.rdrop_loss` of the logits ``rows @ weight.T``, the loss's
    fused way: ``rows`` (2N, d) are the decoder's outputs at the N labels ``labels`` (N,),
    from the first pass, then the second (``Transformer(..., packed=...)`` of the batch
    stacked on itself). Returns (loss sum, mean of the two NLL sums, N); the products in
    autocast's dtype, the softmax in fp32 (a C++ pass per row pair on CPU)."""
    n = labels.numel()
    if rows.dim() != 2 or rows.shape[0] != 2 * n:
        raise ValueError(f"projected_rdrop_loss wants (2N, d) rows for N = {n} labels, got "
                         f"{tuple(rows.shape)}")
    dtype = _compute_dtype(rows.device)
    chunk_rows = chunk_rows or loss_blocks(rows.device, weight.shape[0])[0] // 2
    need_grad = torch.is_grad_enabled() and (rows.requires_grad or weight.requires_grad)
    loss, nll = _ProjectedRDropLoss.apply(rows, weight, labels, float(epsilon), float(alpha),
                                          int(chunk_rows), dtype, need_grad, int(align))
    return loss, nll, n


# --------------------------------------------------------------------------- dropout


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


# --------------------------------------------------------------------------- linear


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


def _pad_rows_into(x: Tensor, rows: int, dtype: torch.dtype) -> Tensor:
    """(m, k) ``x`` as a new (rows, k) tensor of ``dtype``: x cast into the first m rows,
    zeros after."""
    m = x.shape[0]
    out = x.new_empty(rows, x.shape[1], dtype=dtype)
    out[:m].copy_(x)
    out[m:].zero_()
    return out


@functools.cache
def _onednn_takes(dtype: torch.dtype) -> bool:
    """Whether oneDNN's fused linear runs ``dtype`` (bf16, fp16) products on this CPU: with
    native instructions for them (AVX512-BF16, AMX; AMX-FP16), not on AVX2 alone."""
    if not ONEDNN_LINEAR:
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float16 and bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def _bias_product(xp: Tensor, w: Tensor, bias: Tensor | None, relu: bool) -> Tensor:
    """``xp @ w.T + bias`` [then ReLU] in ``xp``'s 16-bit dtype (``w`` cast already, ``bias``
    not): oneDNN's fused linear where it takes the dtype, its bias and ReLU post-ops of the
    product (the same numbers as ``addmm`` then ``relu_``, which copied the bias into the
    output first and took a second pass for the ReLU: 0.8 against 2.0 ms for the FFN's
    first layer on 4,032 rows, 0.3-0.9 against 0.4-1.0 ms for the others, on 2 AMX cores);
    else ``addmm`` [then ``relu_``]."""
    b = None if bias is None else bias.to(xp.dtype)
    if _onednn_takes(xp.dtype):
        return torch.ops.mkldnn._linear_pointwise(xp, w, b, "relu" if relu else "none", [], "")
    y = torch.mm(xp, w.t()) if b is None else torch.addmm(b, xp, w.t())
    return y.relu_() if relu else y


class _RowPaddedLinear(torch.autograd.Function):
    """y = x W^T + b [then ReLU] in ``dtype`` on rows padded to ``rows`` (section 4): what
    autocast computes (input, weight and bias cast to ``dtype``, the gradients cast back),
    on products whose row count recurs."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, relu: bool,
                dtype: torch.dtype, rows: int) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xp = _pad_rows_into(x2, rows, dtype)
        w = weight.to(dtype)
        y = _bias_product(xp, w, bias, relu)
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


def _relu_backward_(grad: Tensor, out: Tensor) -> Tensor:
    """``grad`` zeroed in place where the ReLU's output ``out`` is <= 0, as
    ``aten.threshold_backward(grad, out, 0)``: for 16-bit tensors on CPU by the C++ module's
    branch-free pass over their bits (0.31 against 0.99 ms for 4,032 x 1,024 bf16 on 2 AMX
    cores, a plain copy's time), else by aten."""
    ext = (cpu_extension() if grad.device.type == "cpu"
           and grad.dtype in (torch.bfloat16, torch.float16) else None)
    if ext is not None:
        ext.relu_backward_(grad, out)
    else:
        torch.ops.aten.threshold_backward.grad_input(grad, out, 0, grad_input=grad)
    return grad


class _RowPaddedFeedForward(torch.autograd.Function):
    """FFN(x) = ReLU(x W1^T + b1) W2^T + b2 in ``dtype`` on rows padded to ``rows``
    (section 4): the two :class:`_RowPaddedLinear` layers in one function, whose hidden
    layer stays padded between the products. Apart, the second layer copied the first's
    (rows x d_ff) output into a padded buffer of its own, and backward wrote the ReLU's
    gradient into another. The padded hidden rows hold ReLU(b1), not zeros: their gradient
    rows are zero, so they add nothing to any weight's or bias's gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None,
                dtype: torch.dtype, rows: int) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xp = _pad_rows_into(x2, rows, dtype)
        w1c, w2c = w1.to(dtype), w2.to(dtype)
        h = _bias_product(xp, w1c, b1, True)
        y = _bias_product(h, w2c, b2, False)
        ctx.save_for_backward(xp, w1c, h, w2c)
        ctx.m, ctx.x_dtype = x2.shape[0], x.dtype
        ctx.dtypes = (w1.dtype, None if b1 is None else b1.dtype,
                      w2.dtype, None if b2 is None else b2.dtype)
        return y[:ctx.m].view(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad: Tensor):
        xp, w1c, h, w2c = ctx.saved_tensors
        m, (w1_dtype, b1_dtype, w2_dtype, b2_dtype) = ctx.m, ctx.dtypes
        need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:5]
        gp = _pad_rows_into(grad.reshape(-1, grad.shape[-1]), xp.shape[0], xp.dtype)
        grad_x = grad_w1 = grad_b1 = grad_w2 = grad_b2 = None
        if need_w2:
            grad_w2 = torch.mm(gp.t(), h).to(w2_dtype)
        if b2_dtype is not None and need_b2:
            grad_b2 = gp[:m].sum(dim=0).to(b2_dtype)
        if need_x or need_w1 or need_b1:
            gh = torch.mm(gp, w2c)  # zero on the padded rows, as gp is
            _relu_backward_(gh, h)  # none where the ReLU's output was clipped to 0
            if need_x:
                grad_x = (torch.mm(gh, w1c)[:m].to(ctx.x_dtype)
                          .view(*grad.shape[:-1], w1c.shape[1]))
            if need_w1:
                grad_w1 = torch.mm(gh.t(), xp).to(w1_dtype)
            if b1_dtype is not None and need_b1:
                grad_b1 = gh[:m].sum(dim=0).to(b1_dtype)
        return grad_x, grad_w1, grad_b1, grad_w2, grad_b2, None, None


def _padded_product(x: Tensor, weight: Tensor) -> tuple[torch.dtype, int] | None:
    """(autocast dtype, padded rows) where a linear layer on ``x`` takes
    :class:`_RowPaddedLinear` (CPU autocast to a 16-bit type, fp32 weights, rows to pad);
    else None."""
    if (x.device.type != "cpu" or not torch.is_autocast_enabled("cpu")
            or weight.dtype != torch.float32 or torch.compiler.is_compiling()):
        return None
    dtype = torch.get_autocast_dtype("cpu")
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    rows = padded_rows(m)
    if dtype not in (torch.bfloat16, torch.float16) or rows == m:
        return None
    return dtype, rows


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None, relu: bool) -> Tensor:
    """The one choice of path behind :func:`linear` and :func:`linear_relu`."""
    if _use_onednn(x, weight):
        return _Linear.apply(x, weight, bias, relu)
    if padded := _padded_product(x, weight):
        return _RowPaddedLinear.apply(x, weight, bias, relu, *padded)
    y = F.linear(x, weight, bias)
    return F.relu(y) if relu else y


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear``, with the forward product by oneDNN for fp32 on CPU, and under CPU
    autocast on rows padded to a recurring count (see above)."""
    return _linear(x, weight, bias, False)


def linear_relu(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.relu(F.linear(x, weight, bias))``, fused for fp32 on CPU, on padded rows under
    CPU autocast (see above)."""
    return _linear(x, weight, bias, True)


def feed_forward(x: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor,
                 b2: Tensor | None) -> Tensor:
    """``F.linear(F.relu(F.linear(x, w1, b1)), w2, b2)``: under CPU autocast on padded rows,
    both products in one function whose hidden layer stays padded
    (:class:`_RowPaddedFeedForward`); elsewhere :func:`linear_relu` then :func:`linear`."""
    padded = _padded_product(x, w1)
    if padded and w2.dtype == torch.float32:
        return _RowPaddedFeedForward.apply(x, w1, b1, w2, b2, *padded)
    return linear(linear_relu(x, w1, b1), w2, b2)


# ---------------------------------- the C++ extension (sections 1, 5 and 6), the residual block

# Set to 0 to keep PyTorch's own ops for the residual block, the loss's softmax, attention
# and the FFN's ReLU gradient (sections 5, 1, 6 and 4) and build nothing.
EXTENSION_ENV = "AIAYN_CPU_EXTENSION"
_SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.cpp"
# What the compiler may target, by the instruction set torch's own kernels dispatch to
# (torch.backends.cpu.get_cpu_capability(), which ATEN_CPU_CAPABILITY caps): one build each,
# so a cache shared by machines of different kinds never runs an instruction one lacks.
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx2", "-mfma",
               "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}
# -fassociative-math (and what gcc needs beside it) lets the compiler vectorize the rows'
# sums; -ffast-math's finite-math assumptions are left out, so NaN and inf propagate.
_CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
           "-fno-trapping-math"]
_extension: object | None = None
_extension_tried = False


def cpu_extension():
    """The compiled module of ``csrc/cpu_kernels.cpp``, built on first call (about 30 s,
    once per machine and instruction set, cached by torch under ``TORCH_EXTENSIONS_DIR``,
    default ``~/.cache/torch_extensions``); None where it cannot be built (no C++ compiler or
    Python headers; a warning says so, once) or where ``AIAYN_CPU_EXTENSION=0``."""
    global _extension, _extension_tried
    if _extension_tried:
        return _extension
    _extension_tried = True
    if os.environ.get(EXTENSION_ENV, "1") == "0":
        return None
    isa = torch.backends.cpu.get_cpu_capability()
    flags = _CFLAGS + _ISA_FLAGS.get(isa, [])
    try:
        from torch.utils import cpp_extension

        source = _SOURCE.read_text()
        name = _build_name(source, isa, flags)
        _say_if_building(cpp_extension, name, isa)
        # warnings: torch's note that the compiler differs from the one it was built with
        with _project_ninja(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # load_inline copies the source into the build folder, so that checkouts in other
            # places (a `dvc exp run --queue` runs in a temporary copy) build nothing again.
            _extension = cpp_extension.load_inline(name, [source], extra_cflags=flags)
    except Exception as e:  # noqa: BLE001 - any build failure means the eager path
        warnings.warn(
            f"aiayn: could not build the CPU kernels {_SOURCE.name} ({type(e).__name__}: "
            f"{_build_error(str(e))}); the loss's softmax, attention, the residual "
            f"blocks and the FFN's ReLU gradient run on PyTorch's own ops instead (slower "
            f"steps on CPU). It "
            f"needs a C++ compiler and Python's headers (Debian/Ubuntu: apt install g++ "
            f"python3-dev); set {EXTENSION_ENV}=0 to skip the build and this warning.",
            RuntimeWarning,
            stacklevel=2)
        _extension = None
    return _extension


def prepare_cpu_extension(device: torch.device, post_norm: bool,
                          amp_dtype: torch.dtype | None) -> None:
    """Build (or load) the extension now if a fast training step with these settings will
    take one of its kernels: on CPU, the post-LN residual blocks (section 5), the loss's
    softmax for :data:`SOFTMAX_KERNEL_DTYPES` logits (section 1) or attention of the dtypes
    in :data:`ATTENTION_KERNEL_KEYS` (section 6; ``amp_dtype`` None: fp32). The trainer calls
    this while it sets up, so that the one-time build is not paid inside the first step."""
    if device.type == "cpu" and (post_norm or amp_dtype in SOFTMAX_KERNEL_DTYPES
                                 or (amp_dtype or torch.float32) in ATTENTION_KERNEL_KEYS):
        cpu_extension()


def _build_error(message: str) -> str:
    """The line of a failed build's output that says why: the compiler's first error, else
    the last line."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return next((line for line in lines if "error:" in line), lines[-1] if lines else "?")


def _build_name(source: str, isa: str, flags: list[str]) -> str:
    """The build's name, hence its folder under torch's cache: the instruction set, and a
    digest of what the compiled module depends on (the source, the flags, and the torch
    and Python whose headers and libraries it is built against). One build per version of
    each; never one folder that two environments take turns rebuilding."""
    import sysconfig

    digest = hashlib.sha256("\0".join([
        source, " ".join(flags), torch.__version__, str(Path(torch.__file__).parent),
        sysconfig.get_paths()["include"]]).encode()).hexdigest()[:12]
    return f"aiayn_cpu_kernels_{isa.lower().replace(' ', '_')}_{digest}"


@contextlib.contextmanager
def _project_ninja():
    """The ``ninja`` package's binary (a dependency, installed beside the interpreter) first
    on PATH while torch builds, whether or not the environment is activated: ninja versions
    hash a build's command differently, so a system ninja (1.11) and the package's (1.13)
    taking turns rebuilt the kernel (~30 s) at every switch between an activated and a bare
    ``.venv/bin/python``. Where the package is missing, the ninja on PATH builds."""
    old = os.environ.get("PATH", "")
    try:
        import ninja
    except ImportError:
        yield
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + old
    try:
        yield
    finally:
        os.environ["PATH"] = old


def _say_if_building(cpp_extension, name: str, isa: str) -> None:
    """One line on stderr before a build (not before a load from torch's cache), so that
    the pause is explained."""
    try:
        built = Path(cpp_extension._get_build_directory(name, False)) / f"{name}.so"
    except Exception:  # noqa: BLE001 - a private helper; without it, say nothing
        return
    if not built.exists():
        print(f"aiayn: building the CPU kernels {_SOURCE.name} for {isa} (once per machine, "
              f"~30 s; cached in {built.parent})", file=sys.stderr, flush=True)


def dropout_seed() -> Tensor:
    """A seed for one fused dropout mask, drawn from torch's CPU generator as a one-element
    int64 tensor (the kernel reads it; Python never does), so that a run restored with its
    RNG state draws the same masks."""
    return torch.randint(0, 2 ** 62, (), dtype=torch.int64)


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


def residual_norm_applies(x: Tensor, out: Tensor, weight: Tensor) -> bool:
    """Whether :func:`residual_norm` takes these tensors: CPU, fp32 ``x`` and weights,
    ``out`` fp32 or bf16 of ``x``'s shape, not under ``torch.compile``, and the kernel
    built."""
    return (x.device.type == "cpu" and x.dtype == torch.float32
            and out.dtype in (torch.float32, torch.bfloat16) and out.shape == x.shape
            and weight.dtype == torch.float32 and x.numel() > 0
            and not torch.compiler.is_compiling() and cpu_extension() is not None)


def residual_norm(x: Tensor, out: Tensor, weight: Tensor, bias: Tensor, p: float,
                  eps: float = 1e-5, seed: int | None = None,
                  return_mask: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """``F.layer_norm(x + dropout(out, p), weight, bias, eps)`` in one pass each way
    (``csrc/cpu_kernels.cpp``), the post-LN residual block of Section 3.1: fp32 output,
    ``out``'s gradient in ``out``'s dtype. Masks follow :func:`dropout`'s keep rule; their
    bits come from ``seed`` (default: drawn from torch's generator). ``return_mask``: also
    the uint8 mask (1 = kept), for tests. Check :func:`residual_norm_applies` first."""
    seed = dropout_seed() if seed is None else torch.tensor(seed, dtype=torch.int64)
    y, mask = _ResidualNorm.apply(x.contiguous(), out.contiguous(), weight, bias, float(p),
                                  float(eps), seed)
    return (y, mask) if return_mask else y


# --------------------------------------------------------------------------- attention

# The longest key sequence the C++ pass takes (section 6), by the dtype of its inputs; other
# dtypes keep the eager path. Past these lengths the eager path's batched products (bf16) and
# PyTorch's flash kernel (fp32) win (bench/attention.py, forward + backward from and to the
# projections' layout; bench/README.md, "attention's products in registers"). Longer
# sequences take aiayn.model.attend.
ATTENTION_KERNEL_KEYS: dict[torch.dtype, int] = {torch.bfloat16: 64, torch.float32: 32}


class _Attention(torch.autograd.Function):
    """Attention of ``heads`` heads whose queries, keys and values are column ranges of the
    projections' outputs: self-attention reads all three from ``qkv`` (``kv`` None),
    cross-attention queries from ``qkv`` and keys and values from ``kv``. The gradient of each
    input is one tensor, written by the kernel in place (no split, no concatenation)."""

    @staticmethod
    def forward(ctx, qkv: Tensor, kv: Tensor | None, hk: int, hv: int, heads: int,
                mask: Tensor, causal: bool, p: float, seed: Tensor, offsets: Tensor,
                length: int) -> Tensor:
        q, k, v = _attention_operands(qkv, kv, hk, hv)
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
        q, k, v = _attention_operands(qkv, kv, hk, hv)
        grad_qkv = torch.empty_like(qkv)
        grad_kv = None if kv is None else torch.empty_like(kv)
        dq, dk, dv = _attention_operands(grad_qkv, grad_kv, hk, hv)
        threshold, scale = keep_threshold(p)
        cpu_extension().attention_backward(grad, q, k, v, mask, probs, heads, causal, p > 0.0,
                                           threshold, scale, seed, dq, dk, dv, offsets, length)
        return grad_qkv, grad_kv, None, None, None, None, None, None, None, None, None


def _attention_operands(qkv: Tensor, kv: Tensor | None, hk: int,
                        hv: int) -> tuple[Tensor, Tensor, Tensor]:
    """(q, k, v) as column views: of ``qkv`` (queries, keys, values), or queries from ``qkv``
    and (keys, values) from ``kv``."""
    if kv is None:
        return tuple(qkv.split([hk, hk, hv], dim=-1))
    return (qkv, *kv.split([hk, hv], dim=-1))


def attention_applies(device: torch.device, dtype: torch.dtype, keys: int, max_keys: int,
                      mask: Tensor | None, causal: bool) -> bool:
    """Whether :func:`attention` takes operands of ``dtype`` on ``device`` with ``keys`` keys:
    CPU, at most ``max_keys`` keys (``aiayn.model``'s limit of its explicit path; -1: never)
    and at most :data:`ATTENTION_KERNEL_KEYS` for ``dtype`` (none for a dtype not in it), no
    mask beyond key padding ((B, 1, 1, Tk)), not causal and masked at once, not under
    ``torch.compile``, and the kernel built."""
    # Compiling first: a length compared while compiling would guard the graph on it.
    return (device.type == "cpu" and not torch.compiler.is_compiling()
            and 0 < keys <= min(max_keys, ATTENTION_KERNEL_KEYS.get(dtype, 0))
            and (mask is None or (not causal and mask.dim() == 4 and mask.shape[1:3] == (1, 1)))
            and cpu_extension() is not None)


def attention(qkv: Tensor, kv: Tensor | None, heads: int, d_k: int, d_v: int,
              mask: Tensor | None, causal: bool, p: float = 0.0,
              seed: int | None = None, packed: tuple[Tensor, int] | None = None) -> Tensor:
    """Scaled dot-product attention in one C++ pass per (sequence, head) each way
    (``csrc/cpu_kernels.cpp``), reading queries, keys and values where the projections wrote
    them and writing (B, Tq, heads * d_v), the output projection's input: ``qkv`` (B, T,
    heads * (2 d_k + d_v)) for self-attention (``kv`` None), else queries ``qkv`` (B, Tq,
    heads * d_k) and ``kv`` (B, Tk, heads * (d_k + d_v)). ``mask``: bool (B, 1, 1, Tk), True
    where a key is allowed; ``causal``: query i sees keys up to i. Attention dropout ``p``
    follows :func:`dropout`'s keep rule with bits from ``seed`` (default: drawn from torch's
    generator). ``packed`` (offsets, length): ``qkv`` holds packed rows, (N, width), sequence
    b's in rows offsets[b] .. offsets[b + 1] (int64, B + 1), at most ``length`` each, as
    :meth:`aiayn.model.Packing.offsets` gives them, and so does the output, (N, heads * d_v):
    the decoder's rows go in and come out without a padded copy. Check
    :func:`attention_applies` first."""
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

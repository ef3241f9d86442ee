"""The fast kernels compute what the plain operators compute (aiayn/fast/)."""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from aiayn import fast
from aiayn.fast import KernelConfig, Packing, extension, modules
from aiayn.fast.attention import attention, attention_applies, operands
from aiayn.fast.dropout import dropout, keep_threshold, random_int16
from aiayn.fast.linear import (
    bias_product,
    feed_forward,
    linear,
    linear_relu,
    onednn_takes,
    padded_rows,
)
from aiayn.fast.loss import (
    loss_blocks,
    padded_width,
    projected_label_smoothed_loss,
    projected_rdrop_loss,
    tail_window,
)
from aiayn.fast.residual import residual_norm, residual_norm_applies
from aiayn.model import Transformer, TransformerConfig
from aiayn.training.objective import label_smoothed_loss, rdrop_loss

PAD = 0
DEFAULTS = KernelConfig()
EAGER_SOFTMAX = KernelConfig(softmax_kernel_dtypes=())  # the loss's softmax in eager blocks
EAGER = KernelConfig(cpu_extension=False)  # no C++ kernel at all, as where none is built


def rows_of(m: int) -> int:
    """The rows a product of m rows runs on under CPU autocast, by default."""
    return padded_rows(m, DEFAULTS.row_multiple, DEFAULTS.pad_rows_from)


def softmax_config(softmax: str, **fields) -> KernelConfig:
    """The loss's softmax in eager blocks, or through the C++ pass for fp32 logits too
    (training takes it for bf16 only), with ``fields`` besides."""
    if softmax == "eager":
        return KernelConfig(softmax_kernel_dtypes=(), **fields)
    if extension.cpu_extension() is None:
        pytest.skip("the C++ extension could not be built here")
    return KernelConfig(softmax_kernel_dtypes=(torch.float32, torch.bfloat16), **fields)


def padded_labels(batch: int, length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Labels with padding at the end of most rows (one row full, one a single token)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(1, vocab, (batch, length), generator=g)
    for row in range(batch):
        real = int(torch.randint(1, length, (1,), generator=g))
        labels[row, {0: length, 1: 1}.get(row, real):] = PAD
    return labels


# --------------------------------------------------------------------------- the loss


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 37, 48, 5399, 8000])
def test_padded_width_is_the_smallest_multiple_of_vocab_align_that_holds_the_vocabulary(vocab):
    align = DEFAULTS.vocab_align
    smallest = next(w for w in range(vocab, vocab + align) if w % align == 0)
    assert padded_width(vocab, align) == smallest


@pytest.mark.parametrize("epsilon", [0.0, 0.1, 0.3])
@pytest.mark.parametrize("chunk_rows,softmax_rows", [(3, 256), (7, 256), (1000, 256),
                                                      (7, 2), (1000, 4)])
# 37 and 40 tokens are multiplied as 48 (padded_width), 48 as they are.
@pytest.mark.parametrize("vocab", [37, 40, 48])
@pytest.mark.parametrize("softmax", ["c++", "eager"])
def test_projected_loss_equals_the_plain_loss_of_the_logits(epsilon, chunk_rows, softmax_rows,
                                                            vocab, softmax):
    config = softmax_config(softmax, softmax_rows=softmax_rows)
    torch.manual_seed(0)
    hidden = torch.randn(5, 9, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, 16, dtype=torch.float64, requires_grad=True)
    labels = padded_labels(5, 9, vocab)
    # The reference: full logits, then the plain path's loss (log_softmax, gather, mean).
    ref_loss, ref_nll, ref_n = label_smoothed_loss(hidden @ weight.t(), labels, epsilon, PAD)
    ref_grads = torch.autograd.grad(ref_loss, (hidden, weight))
    loss, nll, n = projected_label_smoothed_loss(hidden, weight, labels, epsilon, PAD,
                                                 chunk_rows=chunk_rows, config=config)
    grads = torch.autograd.grad(loss, (hidden, weight))
    assert n == int(ref_n) == int((labels != PAD).sum())
    # Both keep their log-probabilities in fp32, hence float32-level agreement.
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(nll, ref_nll, rtol=1e-6, atol=1e-4)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
    assert grads[0][labels == PAD].abs().max() == 0  # padding gets no gradient


def test_loss_blocks_by_device_and_the_explicit_arguments():
    vocab, c = 37_000, DEFAULTS
    # CPU: chunks of chunk_bytes of fp32 logits, softmax blocks of softmax_rows.
    assert loss_blocks(torch.device("cpu"), vocab, c) == (c.chunk_bytes // (4 * vocab),
                                                          c.softmax_rows)
    # CUDA: chunks of cuda_chunk_bytes, whole: a 6,250-token batch in one chunk and block.
    chunk, block = loss_blocks(torch.device("cuda"), vocab, c)
    assert chunk == block == c.cuda_chunk_bytes // (4 * vocab) >= 6250
    assert loss_blocks(torch.device("cpu"), 10, c) == (c.chunk_bytes // 40, 256)
    other = KernelConfig(chunk_bytes=4000, softmax_rows=3, cuda_chunk_bytes=40_000)
    assert loss_blocks(torch.device("cpu"), 10, other) == (100, 3)
    assert loss_blocks(torch.device("cuda"), 10, other) == (1000, 1000)
    # The blocks passed as arguments, not through the config, give the same sums.
    torch.manual_seed(2)
    hidden = torch.randn(5, 9, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(40, 16, dtype=torch.float64, requires_grad=True)
    labels = padded_labels(5, 9, 40)
    ref = projected_label_smoothed_loss(hidden, weight, labels, 0.1, PAD)
    for chunk_rows, softmax_rows in [(7, 2), (64, 64), (3, 1000)]:
        got = projected_label_smoothed_loss(hidden, weight, labels, 0.1, PAD,
                                                    chunk_rows=chunk_rows,
                                                    softmax_rows=softmax_rows)
        # per-row losses are kept in fp32 (as in the test above), hence fp32-level agreement
        torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(got[1], ref[1], rtol=1e-6, atol=1e-5)


def test_projected_loss_takes_packed_rows_and_known_positions():
    torch.manual_seed(1)
    hidden = torch.randn(4, 6, 8, requires_grad=True)
    weight = torch.randn(30, 8, requires_grad=True)
    labels = padded_labels(4, 6, 30, seed=3)
    positions = Packing.positions(labels, PAD)
    rows = hidden.reshape(-1, 8)[positions]
    full = projected_label_smoothed_loss(hidden, weight, labels, 0.1, PAD)
    packed = projected_label_smoothed_loss(rows, weight, labels, 0.1, PAD,
                                                   positions=positions)
    torch.testing.assert_close(packed[0], full[0])
    assert packed[2] == full[2] == positions.numel()
    with pytest.raises(ValueError, match="packed rows"):
        projected_label_smoothed_loss(rows[:-1], weight, labels, 0.1, PAD)


def test_projected_loss_scales_with_the_incoming_gradient_and_handles_no_grad():
    torch.manual_seed(2)
    hidden = torch.randn(3, 5, 8, requires_grad=True)
    weight = torch.randn(20, 8, requires_grad=True)
    labels = padded_labels(3, 5, 20)
    loss, _, _ = projected_label_smoothed_loss(hidden, weight, labels, 0.1, PAD)
    (g1,) = torch.autograd.grad(loss, hidden, retain_graph=True)
    (g3,) = torch.autograd.grad(3.0 * loss, hidden)
    torch.testing.assert_close(g3, 3.0 * g1)
    with torch.no_grad():  # validation: the same numbers, no gradient work
        again, _, _ = projected_label_smoothed_loss(hidden, weight, labels, 0.1, PAD)
    torch.testing.assert_close(again, loss.detach())


def test_projected_loss_under_bf16_autocast_stays_close_to_fp32():
    torch.manual_seed(3)
    hidden = torch.randn(4, 7, 32, requires_grad=True)
    weight = (0.2 * torch.randn(50, 32)).requires_grad_()
    labels = padded_labels(4, 7, 50)
    ref, _, _ = label_smoothed_loss(hidden @ weight.t(), labels, 0.1, PAD)
    ref_grad = torch.autograd.grad(ref, weight)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _, _ = projected_label_smoothed_loss(hidden, weight, labels, 0.1, PAD)
    assert loss.dtype == torch.float32
    (grad,) = torch.autograd.grad(loss, weight)
    assert grad.dtype == weight.dtype
    torch.testing.assert_close(loss, ref, rtol=2e-2, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("softmax_rows", [1, 3, 5])
def test_projected_loss_under_bf16_is_the_same_whatever_the_softmax_blocks(softmax_rows):
    """Rows are independent: blocks of any size give the same bits as one block per chunk."""
    torch.manual_seed(4)
    hidden = torch.randn(4, 7, 32, requires_grad=True)
    weight = (0.2 * torch.randn(50, 32)).requires_grad_()
    labels = padded_labels(4, 7, 50)

    def run(rows):
        config = KernelConfig(softmax_kernel_dtypes=(), softmax_rows=rows)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, nll, _ = projected_label_smoothed_loss(hidden, weight, labels, 0.1, PAD,
                                                         chunk_rows=11, config=config)
        return (loss, nll, *torch.autograd.grad(loss, (hidden, weight)))

    for got, want in zip(run(softmax_rows), run(1000), strict=True):
        assert torch.equal(got, want)


def reference_softmax(logits: torch.Tensor, labels: torch.Tensor, vocab: int, eps: float):
    """Per-row label-smoothed loss, NLL and gradient of ``logits[:, :vocab]`` in float64 by
    torch's log_softmax; the gradient is zero past ``vocab``."""
    z = logits[:, :vocab].double()
    lp = z.log_softmax(dim=1)
    nll = -lp.gather(1, labels[:, None]).squeeze(1)
    loss = (1 - eps) * nll - eps * lp.mean(dim=1)
    grad = torch.zeros(logits.shape, dtype=torch.float64)
    grad[:, :vocab] = lp.exp() - eps / vocab
    grad[torch.arange(len(labels)), labels] -= 1 - eps
    return loss, nll, grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width,vocab,scale", [(37, 48, 37, 1.0), (5, 5408, 5399, 3.0),
                                                    (64, 16, 16, 40.0), (3, 1000, 1, 1.0)])
@pytest.mark.parametrize("eps", [0.0, 0.3])
def test_the_cpp_softmax_gives_the_float64_loss_and_gradient(built, dtype, rows, width,
                                                             vocab, scale, eps):
    """``label_smoothed_softmax_`` against log_softmax in float64: large logits (scale 40:
    terms down to e^-200, under fp32's range) and a one-token vocabulary included."""
    g = torch.Generator().manual_seed(rows)
    logits = (scale * torch.randn(rows, width, generator=g)).to(dtype)
    labels = torch.randint(0, vocab, (rows,), generator=g)
    mean = logits[:, :vocab].double().mean(dim=1).float()
    ref_loss, ref_nll, ref_grad = reference_softmax(logits, labels, vocab, eps)
    for grad in (False, True):
        z, loss, nll = logits.clone(), torch.empty(rows), torch.empty(rows)
        built.label_smoothed_softmax_(z, labels, mean, loss, nll, vocab, eps, grad)
        torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(nll.double(), ref_nll, rtol=1e-5, atol=1e-5)
        if not grad:
            assert torch.equal(z, logits)  # the logits are left as they were
            continue
        assert z.dtype == dtype
        # bf16 rounds the gradient once: 2^-8 of its size; fp32 to its polynomial's ~1e-7.
        tol = 4e-3 if dtype == torch.bfloat16 else 1e-6
        torch.testing.assert_close(z.double(), ref_grad, rtol=tol, atol=tol)
        assert (z[:, vocab:] == 0).all()


def test_the_cpp_softmax_passes_nan_on_and_rejects_bad_input(built):
    logits = torch.randn(3, 16)
    logits[1, 5] = float("nan")
    labels, mean = torch.tensor([0, 1, 2]), torch.zeros(3)
    loss, nll = torch.empty(3), torch.empty(3)
    built.label_smoothed_softmax_(logits, labels, mean, loss, nll, 16, 0.1, True)
    assert loss.isnan().tolist() == [False, True, False]  # the trainer's NaN check sees it
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        built.label_smoothed_softmax_(torch.randn(3, 16), torch.tensor([0, 16, 1]), mean,
                                          loss, nll, 16, 0.1, True)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        built.label_smoothed_softmax_(torch.randn(3, 16).double(), labels, mean, loss, nll,
                                          16, 0.1, True)
    with pytest.raises(RuntimeError, match="vocab"):
        built.label_smoothed_softmax_(torch.randn(3, 16), labels, mean, loss, nll, 17, 0.1,
                                          True)


def test_the_projected_loss_under_bf16_is_the_same_through_cpp_and_eager(built):
    """The C++ pass and the eager fp32 blocks compute one function: under bf16 autocast the
    same loss and NLL to fp32 rounding, gradients to the bf16 rounding of the logits'."""
    torch.manual_seed(5)
    hidden = torch.randn(6, 11, 32, requires_grad=True)
    weight = (0.3 * torch.randn(77, 32)).requires_grad_()
    labels = padded_labels(6, 11, 77)

    assert_bf16_cpp_equals_eager(
        lambda config: projected_label_smoothed_loss(hidden, weight, labels, 0.1, PAD,
                                                     chunk_rows=13, config=config),
        (hidden, weight), EAGER_SOFTMAX)


def assert_bf16_cpp_equals_eager(loss_of, leaves, eager: KernelConfig) -> None:
    """A fused loss, ``loss_of(config)``, under bf16 autocast through the C++ pass (the
    default config) and through eager ops (``eager``): the same loss and NLL to fp32
    rounding, the gradients of ``leaves`` to the bf16 rounding of the logits'."""
    def run(config):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, nll, _ = loss_of(config)
        return loss, nll, *torch.autograd.grad(loss, leaves)

    fused, plain = run(DEFAULTS), run(eager)
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(fused[1], plain[1], rtol=1e-5, atol=1e-4)
    for a, b in zip(fused[2:], plain[2:], strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


# --------------------------------------------------------------------------- R-Drop's loss


def reference_rdrop(z1: torch.Tensor, z2: torch.Tensor, labels: torch.Tensor, vocab: int,
                    eps: float, alpha: float):
    """Per row pair, in float64 from torch's own cross-entropy and KL divergence, and the
    gradients by autograd: (loss, nll, d loss / d z1, d loss / d z2), past ``vocab`` 0."""
    a = z1[:, :vocab].double().requires_grad_()
    b = z2[:, :vocab].double().requires_grad_()
    ce = [F.cross_entropy(x, labels, label_smoothing=eps, reduction="none") for x in (a, b)]
    la, lb = F.log_softmax(a, dim=1), F.log_softmax(b, dim=1)
    kl = (F.kl_div(lb, la, log_target=True, reduction="none").sum(1)
          + F.kl_div(la, lb, log_target=True, reduction="none").sum(1))
    loss = (ce[0] + ce[1]) / 2 + alpha * kl / 4
    nll = (F.nll_loss(la, labels, reduction="none") + F.nll_loss(lb, labels, reduction="none")) / 2
    ga, gb = torch.autograd.grad(loss.sum(), (a, b))
    pad = z1.shape[1] - vocab
    return (loss.detach(), nll.detach(), F.pad(ga, (0, pad)), F.pad(gb, (0, pad)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width,vocab,scale", [(37, 48, 37, 1.0), (5, 5408, 5399, 3.0),
                                                    (64, 16, 16, 20.0), (3, 1000, 1, 1.0)])
@pytest.mark.parametrize("eps,alpha", [(0.0, 0.0), (0.3, 5.0)])
def test_the_cpp_rdrop_pass_gives_the_float64_loss_and_gradients(built, dtype, rows, width,
                                                                 vocab, scale, eps, alpha):
    g = torch.Generator().manual_seed(rows)
    z1 = (scale * torch.randn(rows, width, generator=g)).to(dtype)
    z2 = (z1.float() + scale * 0.5 * torch.randn(rows, width, generator=g)).to(dtype)
    labels = torch.randint(0, vocab, (rows,), generator=g)
    mean1 = z1[:, :vocab].double().mean(dim=1).float()
    mean2 = z2[:, :vocab].double().mean(dim=1).float()
    ref_loss, ref_nll, ref1, ref2 = reference_rdrop(z1, z2, labels, vocab, eps, alpha)
    for grad in (False, True):
        a, b, loss, nll = z1.clone(), z2.clone(), torch.empty(rows), torch.empty(rows)
        built.rdrop_softmax_(a, b, labels, mean1, mean2, loss, nll, vocab, eps, alpha, grad)
        torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(nll.double(), ref_nll, rtol=1e-5, atol=1e-4)
        if not grad:
            assert torch.equal(a, z1) and torch.equal(b, z2)
            continue
        tol = 4e-3 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(a.double(), ref1, rtol=tol, atol=tol)
        torch.testing.assert_close(b.double(), ref2, rtol=tol, atol=tol)


def test_the_cpp_rdrop_pass_rejects_bad_input(built):
    z, labels, mean = torch.randn(3, 16), torch.tensor([0, 1, 2]), torch.zeros(3)
    loss, nll = torch.empty(3), torch.empty(3)
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        built.rdrop_softmax_(z, z.clone(), torch.tensor([0, 16, 1]), mean, mean, loss, nll,
                                 16, 0.1, 1.0, True)
    with pytest.raises(RuntimeError, match="alike"):
        built.rdrop_softmax_(z, torch.randn(3, 17), labels, mean, mean, loss, nll, 16, 0.1,
                                 1.0, True)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        built.rdrop_softmax_(z.double(), z.double(), labels, mean, mean, loss, nll, 16, 0.1,
                                 1.0, True)


@pytest.mark.parametrize("softmax", ["c++", "eager"])
@pytest.mark.parametrize("chunk_rows", [3, 1000])
@pytest.mark.parametrize("vocab", [37, 48])
def test_projected_rdrop_loss_equals_the_rdrop_loss_of_the_logits(softmax, chunk_rows, vocab):
    """fp32: the fused loss against :func:`aiayn.training.objective.rdrop_loss` of the full logits,
    and its gradients with respect to the rows and the matrix against autograd's."""
    config = EAGER if softmax == "eager" else DEFAULTS
    torch.manual_seed(3)
    n = 11
    rows = torch.randn(2 * n, 24, requires_grad=True)
    weight = (0.4 * torch.randn(vocab, 24)).requires_grad_()
    labels = torch.randint(0, vocab, (n,))
    loss, nll, count = projected_rdrop_loss(rows, weight, labels, 0.1, 5.0,
                                            chunk_rows=chunk_rows, config=config)
    got = torch.autograd.grad(loss, (rows, weight))
    want, want_nll = rdrop_loss((rows @ weight.t()).view(2, n, vocab), labels, 0.1, 5.0)
    expected = torch.autograd.grad(want, (rows, weight))
    assert count == n
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(nll, want_nll, rtol=1e-5, atol=1e-4)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match=r"\(2N, d\) rows"):
        projected_rdrop_loss(rows[:-1], weight, labels, 0.1, 5.0)


def test_projected_rdrop_loss_under_bf16_is_the_same_through_cpp_and_eager(built):
    torch.manual_seed(5)
    rows = torch.randn(2 * 40, 32, requires_grad=True)
    weight = (0.3 * torch.randn(77, 32)).requires_grad_()
    labels = torch.randint(0, 77, (40,))

    assert_bf16_cpp_equals_eager(
        lambda config: projected_rdrop_loss(rows, weight, labels, 0.1, 5.0, chunk_rows=13,
                                            config=config),
        (rows, weight), EAGER)


# --------------------------------------------------------------------------- dropout


def test_keep_threshold_gives_the_probability_it_claims():
    for p in (0.1, 0.3, 0.5, 0.0):
        threshold, scale = keep_threshold(p)
        kept = 32767 - threshold + 1  # int16 values >= threshold
        assert kept / 65536 == pytest.approx(1 - p, abs=1 / 65536)
        assert scale == pytest.approx(65536 / kept)
    with pytest.raises(ValueError):
        keep_threshold(1.0)
    with pytest.raises(ValueError):
        keep_threshold(-0.1)
    # Within 2^-17 of 1 (the config accepts any p < 1): all but one int16 value dropped.
    threshold, scale = keep_threshold(0.999995)
    assert (32767 - threshold + 1, scale) == (1, 65536.0)


@pytest.mark.parametrize("softmax", ["c++", "eager"])
def test_projected_loss_of_a_whole_number_of_chunks_writes_in_its_buffer(softmax):
    """n rows, a multiple of chunk_rows (100, not a multiple of the CPU's 64-row windows):
    the last chunk's window (128 rows) fits the logits buffer, so torch.mm never resizes its
    output (a deprecated behaviour it warns of), and the loss is the plain one."""
    config = softmax_config(softmax)
    torch.manual_seed(0)
    hidden = torch.randn(1, 300, 8, requires_grad=True)
    weight = torch.randn(40, 8, requires_grad=True)
    labels = torch.randint(1, 40, (1, 300))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss, _, n = projected_label_smoothed_loss(hidden, weight, labels, 0.1, PAD,
                                                   chunk_rows=100, config=config)
        loss.backward()
    ref, _, _ = label_smoothed_loss(hidden.detach().double() @ weight.detach().double().t(),
                                    labels, 0.1, PAD)
    assert n == 300
    torch.testing.assert_close(loss.double(), ref.double(), rtol=1e-5, atol=1e-4)


def test_random_int16_is_uniform_in_every_lane():
    torch.manual_seed(0)
    bits = random_int16(torch.Size([1 << 20]), torch.device("cpu")).view(-1, 4)
    negative = (bits < 0).double().mean(0)
    # Each of the four int16 lanes of a 64-bit word: half negative (the top bit is random).
    assert torch.all((negative - 0.5).abs() < 0.005), negative
    assert bits.min() == -32768 and bits.max() == 32767


@pytest.mark.parametrize("p", [0.1, 0.3])
def test_dropout_keeps_the_right_fraction_scaled_and_is_reproducible(p):
    x = torch.ones(400_000, requires_grad=True)
    torch.manual_seed(7)
    y = dropout(x, p)
    kept = (y != 0).double().mean().item()
    # Binomial: 5 standard deviations of the kept fraction.
    assert abs(kept - (1 - p)) < 5 * math.sqrt(p * (1 - p) / x.numel())
    assert torch.allclose(y[y != 0], torch.tensor(1 / (1 - p)), rtol=1e-4)
    assert abs(y.mean().item() - 1.0) < 0.01  # unbiased
    (grad,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(grad, y.detach())  # d(x * mask)/dx = mask
    torch.manual_seed(7)
    assert torch.equal(dropout(x, p), y)  # torch's generator drives it
    assert dropout(x, p, training=False) is x and dropout(x, 0.0) is x


def test_bf16_dropout_scales_kept_values_by_the_scale_rounded_to_bf16():
    x = torch.ones(100_000, dtype=torch.bfloat16, requires_grad=True)
    torch.manual_seed(3)
    y = dropout(x, 0.2)
    assert y.dtype == torch.bfloat16
    _, scale = keep_threshold(0.2)
    kept = y[y != 0]
    assert kept.numel() > 0 and torch.all(kept == torch.tensor(scale).bfloat16())
    (grad,) = torch.autograd.grad(y.float().sum(), x)
    assert torch.equal(grad, y.detach())  # the same mask scales the gradient


# --------------------------------------------------------------------------- linear


@pytest.mark.parametrize("fn,ref", [
    (linear, F.linear),
    (linear_relu, lambda x, w, b: F.relu(F.linear(x, w, b))),
])
def test_fast_linear_equals_f_linear_with_gradients(fn, ref):
    torch.manual_seed(4)
    x = torch.randn(6, 11, 32, requires_grad=True)
    w = torch.randn(48, 32, requires_grad=True)
    b = torch.randn(48, requires_grad=True)
    y, y_ref = fn(x, w, b), ref(x, w, b)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y)
    for a, r in zip(torch.autograd.grad(y, (x, w, b), g), torch.autograd.grad(y_ref, (x, w, b), g),
                    strict=True):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-4)


# ------------------------------------------------- products on recurring row counts (CPU)


class ProductRows(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the shapes of the matrix products torch runs (mm, addmm, oneDNN's fused
    linear, and their operands), to see which row counts oneDNN would have to build
    primitives for."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            a, b = args[-2], args[-1]
            self.shapes.append((tuple(a.shape), tuple(b.shape)))
        elif func == torch.ops.mkldnn._linear_pointwise.default:  # x, weight, ...
            self.shapes.append((tuple(args[0].shape), tuple(args[1].shape)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("rows", [1, 63, 1000, 1023, 1024, 1025, 1087, 1088, 1089, 4000])
def test_padded_rows_is_the_smallest_multiple_from_the_threshold_on(rows):
    multiple, start = DEFAULTS.row_multiple, DEFAULTS.pad_rows_from
    expected = (rows if rows < start
                else next(r for r in range(rows, rows + multiple) if r % multiple == 0))
    assert padded_rows(rows, multiple, start) == expected == rows_of(rows)
    assert padded_rows(rows, 1, start) == rows


def test_tail_window_is_a_multiple_that_fits_on_cpu_only():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert tail_window(207, 3313, cpu, 64) == 256      # fits: a multiple of 64
    assert tail_window(256, 3313, cpu, 64) == 256
    assert tail_window(50, 60, cpu, 64) == 50          # 64 rows are more than there are
    assert tail_window(207, 3313, cuda, 64) == 207     # GPUs have no primitive cache


@pytest.mark.parametrize("fn,ref", [
    (linear, F.linear),
    (linear_relu, lambda x, w, b: F.relu(F.linear(x, w, b))),
])
@pytest.mark.parametrize("shape", [(2, 515, 24), (1030, 24), (1088, 24), (700, 24)])
def test_linear_under_cpu_bf16_autocast_equals_autocast_f_linear(fn, ref, shape):
    """Padded to a recurring row count or not, the layer computes what autocast's F.linear
    computes: the same dtypes, outputs and gradients (fp32 for the fp32 leaves)."""
    torch.manual_seed(7)
    x = torch.randn(*shape, requires_grad=True)
    w = torch.randn(40, 24, requires_grad=True)
    b = torch.randn(40, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y_ref = fn(x, w, b), ref(x, w, b)
    assert y.dtype == y_ref.dtype == torch.bfloat16 and y.shape == y_ref.shape
    torch.testing.assert_close(y, y_ref, rtol=1e-2, atol=1e-2)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, w, b), g)
    want = torch.autograd.grad(y_ref, (x, w, b), g)
    for a, r in zip(got, want, strict=True):
        assert a.dtype == r.dtype == torch.float32
        torch.testing.assert_close(a, r, rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape,dtype", [((2, 515, 24), torch.bfloat16),
                                         ((1030, 24), torch.bfloat16),
                                         ((1088, 24), torch.bfloat16),
                                         ((700, 24), torch.bfloat16),
                                         ((1030, 24), torch.float16)])
def test_feed_forward_under_cpu_autocast_equals_autocast_f_linear(shape, dtype, bias):
    """The FFN in one function on padded rows computes what autocast's F.linear, F.relu,
    F.linear compute (outputs and fp32 gradients of every leaf), and the very numbers of
    its two padded layers apart: the padded hidden rows (ReLU(b1), not zeros) add nothing."""
    torch.manual_seed(17)
    x = torch.randn(*shape, requires_grad=True)
    w1, w2 = torch.randn(40, 24, requires_grad=True), torch.randn(24, 40, requires_grad=True)
    b1 = torch.randn(40, requires_grad=True) if bias else None
    b2 = torch.randn(24, requires_grad=True) if bias else None
    leaves = [t for t in (x, w1, b1, w2, b2) if t is not None]
    with torch.autocast("cpu", dtype=dtype):
        with ProductRows() as mode:
            y = feed_forward(x, w1, b1, w2, b2)
        apart = linear(linear_relu(x, w1, b1), w2, b2)
        ref = F.linear(F.relu(F.linear(x, w1, b1)), w2, b2)
    assert y.dtype == ref.dtype == dtype and y.shape == ref.shape
    torch.testing.assert_close(y, ref, rtol=1e-2, atol=5e-2)
    assert torch.equal(y, apart)
    m = x.numel() // 24
    assert {a[0] for a, _ in mode.shapes} == {rows_of(m)}
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, leaves, g)
    for a, b, r in zip(got, torch.autograd.grad(apart, leaves, g),
                       torch.autograd.grad(ref, leaves, g), strict=True):
        assert a.dtype == r.dtype == torch.float32
        torch.testing.assert_close(a, r, rtol=2e-2, atol=2e-1)
        assert torch.equal(a, b)


@pytest.mark.parametrize("onednn", [True, False])
@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_bias_product_is_the_product_plus_bias_then_relu_on_either_path(onednn, relu, bias):
    """The padded layers' product: oneDNN's fused linear (bias and ReLU as its post-ops,
    where the CPU runs bf16 natively) or addmm then relu_, both against a float64
    reference of the same bf16 operands, within the bf16 output's rounding."""
    if onednn and not onednn_takes(torch.bfloat16):
        pytest.skip("oneDNN runs no bf16 linear on this CPU (no AVX512-BF16 or AMX)")
    torch.manual_seed(19)
    xp = torch.randn(1088, 40).bfloat16()
    w = torch.randn(24, 40).bfloat16()
    b = torch.randn(24) if bias else None
    y = bias_product(xp, w, b, relu, onednn=onednn)
    ref = xp.double() @ w.double().t() + (0 if b is None else b.bfloat16().double())
    ref = ref.relu() if relu else ref
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    torch.testing.assert_close(y.double(), ref, rtol=2 ** -7, atol=1e-2)
    if relu:
        assert (y >= 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_relu_backward_in_cpp_is_atens_threshold_backward(built, dtype):
    """The C++ pass over the bits zeroes the gradient exactly where aten's
    threshold_backward(grad, out, 0) does: out <= 0 (+0, -0, negatives), but not NaN of
    either sign, +inf or the smallest subnormal; odd lengths and a tail past the vector."""
    torch.manual_seed(20)
    special = torch.tensor([float("nan"), -float("nan"), 0.0, -0.0, float("inf"),
                            -float("inf"), -1.0, 1.0], dtype=dtype)
    tiny = torch.tensor([1, -32767], dtype=torch.int16).view(dtype)  # +-smallest subnormal
    for n in (1, 7, 1031, 70_001):
        out = torch.randn(n, dtype=torch.float32).to(dtype)
        out[:min(n, 8)] = special[:min(n, 8)]
        if n > 10:
            out[8:10] = tiny
        grad = torch.randn(n, dtype=torch.float32).to(dtype)
        want = torch.ops.aten.threshold_backward(grad, out, 0)
        got = grad.clone()
        built.relu_backward_(got, out)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), n
    with pytest.raises(RuntimeError, match="bf16 or fp16"):
        built.relu_backward_(torch.zeros(4), torch.zeros(4))


def test_feed_forward_keeps_one_padded_hidden_layer_for_backward():
    """On padded rows the FFN saves its padded input, the hidden layer and the two bf16
    weights: one (rows x d_ff) tensor, where its two layers apart saved two."""
    torch.manual_seed(18)
    x = torch.randn(1030, 24, requires_grad=True)
    w1, w2 = torch.randn(64, 24, requires_grad=True), torch.randn(24, 64, requires_grad=True)
    b1, b2 = torch.randn(64, requires_grad=True), torch.randn(24, requires_grad=True)

    def saved_hidden(fn):
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                fn()
        return shapes.count((rows_of(1030), 64))

    assert saved_hidden(lambda: feed_forward(x, w1, b1, w2, b2)) == 1
    assert saved_hidden(lambda: linear(linear_relu(x, w1, b1), w2, b2)) == 2


def test_linear_products_under_cpu_bf16_autocast_meet_few_row_counts():
    """Forward and backward of a linear layer on 1,024-1,279 rows run their products on
    multiples of 64 rows: 1,024 itself, then 1,088 for 1,025-1,088 and so on up to 1,280,
    5 row counts for 256 batch sizes (oneDNN builds 5 primitives per product, not 256);
    below the threshold the rows are left as they are."""
    torch.manual_seed(8)
    w = torch.randn(16, 8, requires_grad=True)
    b = torch.randn(16, requires_grad=True)
    seen = set()
    for rows in (*range(1024, 1280), 700):
        x = torch.randn(rows, 8, requires_grad=True)
        with ProductRows() as mode:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = linear_relu(x, w, b)
            y.sum().backward()
        # forward x @ w.T, grad_x = g @ w, grad_w = g.T @ x: each holds the padded row count
        for a, bb in mode.shapes:
            seen.add(a[0] if a[0] != 16 else bb[0])
    assert seen == {700, 1024, 1088, 1152, 1216, 1280}


def test_the_loss_tail_window_gives_the_plain_loss_and_recurring_products():
    """A last chunk of fewer rows runs on a window of a multiple of 64 rows ending at the last
    row: the loss and gradients stay the plain path's, and every product has chunk_rows or
    a multiple of 64 rows."""
    torch.manual_seed(9)
    hidden = torch.randn(12, 30, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    labels = padded_labels(12, 30, 37)
    n = int((labels != PAD).sum())
    chunk = 100
    assert (n % chunk) % 64 and n > 64  # a last chunk of other than 64k rows, and room
    ref_loss, ref_nll, _ = label_smoothed_loss(hidden @ weight.t(), labels, 0.1, PAD)
    ref_grads = torch.autograd.grad(ref_loss, (hidden, weight))
    with ProductRows() as mode:
        loss, nll, _ = projected_label_smoothed_loss(hidden, weight, labels, 0.1, PAD,
                                                             chunk_rows=chunk)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(nll, ref_nll, rtol=1e-6, atol=1e-4)
    for g, r in zip(torch.autograd.grad(loss, (hidden, weight)), ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
    # every dimension but d (16) and the vocabulary the products run on (37 -> 48) is a row
    rows = {d for a, b in mode.shapes for d in (*a, *b)} - {16, padded_width(37, 16)}
    assert rows and all(r == chunk or r % 64 == 0 for r in rows)
    assert -(-(n % chunk) // 64) * 64 in rows


# --------------------------------------------------------------------------- the model


def tiny_model(config: KernelConfig | None = DEFAULTS, dropout: float = 0.0) -> Transformer:
    """A small model with the fast kernels of ``config`` (None: the plain model)."""
    torch.manual_seed(5)
    model = Transformer(TransformerConfig(vocab_size=60, d_model=32, heads=4, encoder_layers=2,
                                          decoder_layers=2, d_ff=64, dropout=dropout,
                                          max_positions=64))
    return model if config is None else fast.apply(model, config)


def test_packed_decoder_equals_the_padded_one_at_real_positions():
    model = tiny_model().double()  # float64: torch's own ops in every fast layer
    src = padded_labels(5, 9, 60, seed=8)
    tgt = padded_labels(5, 11, 60, seed=9)
    hidden = model(src, tgt, hidden=True)
    positions = Packing.positions(tgt, PAD)
    rows = model(src, tgt, packed=positions)
    torch.testing.assert_close(rows, hidden.reshape(-1, 32)[positions], rtol=1e-12, atol=1e-12)
    g = torch.randn_like(rows)
    params = [p for p in model.parameters()]
    ga = torch.autograd.grad((hidden.reshape(-1, 32)[positions] * g).sum(), params)
    gb = torch.autograd.grad((rows * g).sum(), params)
    for a, b in zip(ga, gb, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_fast_and_plain_models_share_parameters_and_outputs():
    plain, quick = tiny_model(None), tiny_model()
    assert plain.state_dict().keys() == quick.state_dict().keys()
    for k, v in plain.state_dict().items():
        assert torch.equal(v, quick.state_dict()[k])
    src, tgt = padded_labels(4, 8, 60, seed=10), padded_labels(4, 9, 60, seed=11)
    torch.testing.assert_close(quick(src, tgt), plain(src, tgt), rtol=1e-4, atol=1e-4)
    quick.load_state_dict(plain.state_dict())  # the same checkpoint format either way


def test_the_fast_model_under_cpu_bf16_autocast_learns_the_same_on_padded_rows():
    """A batch of 1,200 source and ~1,000+ target positions: the fast model's linear layers
    run on padded rows (padded_rows), and its output and every parameter's gradient
    are those of the same model with padding switched off."""
    model = tiny_model()
    src, tgt = padded_labels(40, 30, 60, seed=12), padded_labels(40, 31, 60, seed=13)
    assert src.numel() >= DEFAULTS.pad_rows_from and rows_of(src.numel()) > 1200

    def run():
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(src, tgt)
        out.float().square().mean().backward()
        return out, {k: q.grad.clone() for k, q in model.named_parameters()}

    with ProductRows() as mode:
        out, grads = run()
    assert {a[0] for a, _ in mode.shapes} & {1216}  # 1,200 rows multiplied as 1,216
    fast.apply(model, KernelConfig(pad_rows_from=10 ** 9))
    ref_out, ref_grads = run()
    torch.testing.assert_close(out, ref_out, rtol=1e-2, atol=1e-2)
    for k, g in grads.items():
        torch.testing.assert_close(g, ref_grads[k], rtol=2e-2, atol=2e-2, msg=k)


def test_the_loss_is_the_same_at_any_alignment_of_the_vocabulary():
    """``align`` only pads the products with zero rows whose logits are masked: the loss and
    both gradients equal those at the vocabulary's own width."""
    torch.manual_seed(3)
    hidden = torch.randn(50, 16, requires_grad=True)
    weight = (0.25 * torch.randn(37, 16)).requires_grad_()
    labels = torch.randint(1, 37, (50,))
    assert padded_width(37, 1) == 37 and padded_width(37, 16) == 48
    results = []
    for align in (1, 16, 64):
        hidden.grad = weight.grad = None
        loss, nll, n = projected_label_smoothed_loss(hidden, weight, labels, 0.1, 0,
                                                     config=KernelConfig(vocab_align=align))
        loss.backward()
        results.append((loss.detach(), nll, hidden.grad.clone(), weight.grad.clone()))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- residual block


@pytest.fixture
def built():
    """The C++ extension's module (skipped where it cannot be built)."""
    ext = extension.cpu_extension()
    if ext is None:
        pytest.skip("the CPU kernel csrc/cpu_kernels.cpp could not be built here (see the "
                    "warning): no C++ compiler or Python headers")
    return ext


def reference_residual_norm(x, out, weight, bias, mask, p, eps=1e-5):
    """LayerNorm(x + out * mask * scale) in float64 with torch's own ops."""
    _, scale = keep_threshold(p)
    return F.layer_norm(x + out * mask.double() * scale, (x.shape[-1],), weight, bias, eps)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,p", [((37, 3, 24), 0.3), ((50, 6), 0.1), ((9, 37), 0.0),
                                     ((4, 256), 0.2), ((600, 24), 0.2)])
def test_residual_norm_equals_layer_norm_of_the_sum_with_its_mask(built, out_dtype, shape,
                                                                   p):
    """Forward and all four gradients against torch's float64 layer norm of
    ``x + dropout(out)`` with the mask the kernel reports."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g, requires_grad=True)
    out = torch.randn(shape, generator=g).to(out_dtype).requires_grad_()
    weight = (1 + 0.5 * torch.randn(shape[-1], generator=g)).requires_grad_()
    bias = torch.randn(shape[-1], generator=g, requires_grad=True)
    y, mask = residual_norm(x, out, weight, bias, p, seed=11, return_mask=True)
    assert y.dtype == torch.float32 and mask.dtype == torch.uint8 and mask.shape == x.shape
    leaves = [t.detach().double().requires_grad_() for t in (x, out, weight, bias)]
    ref = reference_residual_norm(*leaves, mask, p)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    grad = torch.randn(shape, generator=g)
    y.backward(grad)
    ref.backward(grad.double())
    for name, ours, theirs in zip(("x", "out", "weight", "bias"), (x, out, weight, bias), leaves,
                                  strict=True):
        assert ours.grad.dtype == ours.dtype, name
        # bf16's gradient is rounded to 8 bits of mantissa: 2^-8 of its size.
        tol = 1e-2 if ours.dtype == torch.bfloat16 else 1e-4
        torch.testing.assert_close(ours.grad.double(), theirs.grad, rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("p", [0.1, 0.3])
def test_residual_norm_keeps_the_dropout_fraction_in_every_column(built, p):
    rows, d = 4000, 64
    x, out = torch.zeros(rows, d), torch.ones(rows, d)
    _, mask = residual_norm(x, out, torch.ones(d), torch.zeros(d), p, seed=3,
                                    return_mask=True)
    n = mask.numel()
    kept = mask.double().mean().item()
    threshold, _ = keep_threshold(p)
    expected = (32768 - threshold) / 65536  # int16 values >= threshold
    assert abs(kept - expected) < 5 * math.sqrt(p * (1 - p) / n)
    # Every column (each of the four int16 lanes of a random word, and more) alike.
    per_column = mask.double().mean(0)
    assert torch.all((per_column - expected).abs() < 5 * math.sqrt(p * (1 - p) / rows))
    # Neighbouring rows and columns are not the same draws.
    assert not torch.equal(mask[0], mask[1]) and not torch.equal(mask[:, 0], mask[:, 1])


def on_threads(n, fn):
    """``fn()`` with torch's thread count set to ``n``, restored after."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(n)
        return fn()
    finally:
        torch.set_num_threads(threads)


def test_residual_norm_masks_follow_the_seed_not_the_threads(built):
    g = torch.Generator().manual_seed(2)
    x, out = torch.randn(300, 40, generator=g), torch.randn(300, 40, generator=g)
    w, b = torch.ones(40), torch.zeros(40)
    y1, m1 = residual_norm(x, out, w, b, 0.3, seed=5, return_mask=True)
    y2, m2 = on_threads(1, lambda: residual_norm(x, out, w, b, 0.3, seed=5,
                                                         return_mask=True))
    assert torch.equal(m1, m2) and torch.equal(y1, y2)
    _, m3 = residual_norm(x, out, w, b, 0.3, seed=6, return_mask=True)
    assert not torch.equal(m1, m3)
    # Without a seed, torch's generator draws it: a run restored with its RNG state repeats.
    torch.manual_seed(9)
    y4 = residual_norm(x, out, w, b, 0.3)
    torch.manual_seed(9)
    assert torch.equal(residual_norm(x, out, w, b, 0.3), y4)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_residual_norm_gives_the_same_bits_on_one_thread_and_two(built, out_dtype):
    """The row kernels split their rows over torch's threads; every output and gradient,
    the weight's and bias's sums over 700 rows (blocks of 256) included, is the same bit for
    bit on one thread and on two."""
    g = torch.Generator().manual_seed(3)
    x, out = torch.randn(700, 48, generator=g), torch.randn(700, 48, generator=g).to(out_dtype)
    weight, bias = 1 + 0.5 * torch.randn(48, generator=g), torch.randn(48, generator=g)
    grad = torch.randn(700, 48, generator=g)

    def run():
        leaves = [t.clone().requires_grad_() for t in (x, out, weight, bias)]
        y = residual_norm(*leaves, 0.2, seed=7)
        y.backward(grad)
        return [y.detach()] + [t.grad for t in leaves]

    for one, two in zip(on_threads(1, run), on_threads(2, run), strict=True):
        assert torch.equal(one, two)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpp_softmax_gives_the_same_bits_on_one_thread_and_two(built, dtype):
    g = torch.Generator().manual_seed(4)
    logits = (4 * torch.randn(500, 80, generator=g)).to(dtype)
    labels = torch.randint(0, 75, (500,), generator=g)
    mean = torch.randn(500, generator=g)

    def run():
        z, loss, nll = logits.clone(), torch.empty(500), torch.empty(500)
        built.label_smoothed_softmax_(z, labels, mean, loss, nll, 75, 0.1, True)
        return z, loss, nll

    for one, two in zip(on_threads(1, run), on_threads(2, run), strict=True):
        assert torch.equal(one, two)


def test_residual_norm_rejects_what_it_cannot_compute(built):
    x, w, b = torch.randn(4, 8), torch.ones(8), torch.zeros(8)
    with pytest.raises(ValueError, match="dropout probability"):  # keep_threshold's
        residual_norm(x, torch.randn(4, 8), w, b, 1.0)
    with pytest.raises(RuntimeError, match="differ in shape"):
        residual_norm(x, torch.randn(4, 7), w, b, 0.1)
    with pytest.raises(RuntimeError, match="out must be float32 or bfloat16"):
        residual_norm(x, torch.randn(4, 8).half(), w, b, 0.1)
    assert residual_norm_applies(x, x, w, DEFAULTS)
    assert not residual_norm_applies(x.double(), x.double(), w, DEFAULTS)
    assert not residual_norm_applies(x, x.half(), w, DEFAULTS)
    assert not residual_norm_applies(x, x, w, EAGER)


def test_the_fast_model_trains_through_the_fused_block_as_through_torch_ops(built,
                                                                              monkeypatch):
    """Without dropout the post-LN model in training mode computes the same outputs and
    gradients whether its residual blocks take the C++ kernel or torch's ops (with dropout
    they draw other masks, as fast and plain do)."""
    calls = []
    monkeypatch.setattr(modules, "residual_norm",  # counted where the layers call it
                        lambda *a, **k: calls.append(1) or residual_norm(*a, **k))
    src, tgt = padded_labels(6, 9, 60, seed=14), padded_labels(6, 10, 60, seed=15)

    def run(config):
        model = tiny_model(config).train()
        out = model(src, tgt)
        out.square().mean().backward()
        return out, {k: q.grad for k, q in model.named_parameters()}

    out, grads = run(DEFAULTS)
    assert len(calls) == 2 * 2 + 3 * 2  # every residual block of 2 + 2 layers
    calls.clear()
    ref_out, ref_grads = run(EAGER)  # as where the extension cannot be built
    assert not calls
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    for k, gr in grads.items():
        torch.testing.assert_close(gr, ref_grads[k], rtol=1e-4, atol=1e-5, msg=k)


# --------------------------------------------------------------------------- attention


def attention_inputs(b, tq, tk, heads, d_k, d_v, dtype, cross, seed=0, lengths=None):
    """Operands as the projections lay them out: fused (B, T, H(2d_k + d_v)) for
    self-attention, else queries (B, Tq, H d_k) and keys+values (B, Tk, H(d_k + d_v)); a key
    padding mask from ``lengths``."""
    g = torch.Generator().manual_seed(seed)
    if cross:
        qkv = torch.randn(b, tq, heads * d_k, generator=g).to(dtype).requires_grad_()
        kv = torch.randn(b, tk, heads * (d_k + d_v), generator=g).to(dtype).requires_grad_()
    else:
        qkv = torch.randn(b, tq, heads * (2 * d_k + d_v), generator=g).to(dtype).requires_grad_()
        kv = None
    mask = None if lengths is None else (
        torch.arange(tk)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]
    return qkv, kv, mask


def reference_attention(qkv, kv, heads, d_k, d_v, mask, causal, keep=None):
    """softmax(q k^T / sqrt(d_k)) [* keep] v in float64 with torch's ops, (B, Tq, H d_v); masked
    scores filled with the lowest float (as aiayn.model.attend)."""
    hk, hv = heads * d_k, heads * d_v
    q, k, v = operands(qkv, kv, hk, hv)
    b, tq, tk = q.shape[0], q.shape[1], k.shape[1]
    q, k = (x.double().view(b, -1, heads, d_k).transpose(1, 2) for x in (q, k))
    v = v.double().view(b, tk, heads, d_v).transpose(1, 2)
    scores = q @ k.transpose(-2, -1) / math.sqrt(d_k)
    allowed = torch.ones(b, 1, tq, tk, dtype=torch.bool)
    if mask is not None:
        allowed = allowed & mask
    if causal:
        allowed = allowed & torch.ones(tq, tk, dtype=torch.bool).tril()
    weights = scores.masked_fill(~allowed, torch.finfo(torch.float64).min).softmax(-1)
    if keep is not None:
        weights = weights * keep
    return (weights @ v).transpose(1, 2).reshape(b, tq, hv)


def grads_of(out, inputs, upstream):
    return torch.autograd.grad(out, [x for x in inputs if x is not None], upstream)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [
    # (b, tq, tk, heads, d_k, d_v, cross, causal, lengths); length 0: a sequence of no key
    (5, 7, 7, 2, 16, 16, False, False, [7, 3, 5, 0, 1]),
    (4, 9, 9, 3, 16, 16, False, True, None),
    (3, 6, 6, 1, 20, 20, False, False, None),  # a head size that is not a multiple of 16
    (4, 5, 11, 2, 16, 32, True, False, [11, 4, 1, 8]),  # cross: d_k != d_v, Tq != Tk
    (2, 1, 3, 4, 8, 8, True, False, None),
])
def test_cpp_attention_equals_float64_attention_forward_and_backward(built, dtype, case):
    b, tq, tk, heads, d_k, d_v, cross, causal, lengths = case
    qkv, kv, mask = attention_inputs(b, tq, tk, heads, d_k, d_v, dtype, cross, lengths=lengths)
    out = attention(qkv, kv, heads, d_k, d_v, mask, causal)
    assert out.shape == (b, tq, heads * d_v) and out.dtype == dtype
    leaves = [None if x is None else x.detach().double().requires_grad_() for x in (qkv, kv)]
    ref = reference_attention(*leaves, heads, d_k, d_v, mask, causal)
    # bf16: the inputs are exact in fp32, the output rounded once (2^-8 relative).
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    ours = grads_of(out, (qkv, kv), upstream.to(dtype))
    theirs = grads_of(ref, leaves, upstream.double())
    for got, want in zip(ours, theirs, strict=True):
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, rtol=3 * tol, atol=3 * tol)


def dropout_keep(qkv, kv, heads, d_k, p, seed, causal):
    """The kernel's kept-and-scaled weights, (B, H, Tq, Tk): read off with values that are the
    keys' one-hot rows (each output column is then one weight), divided by the weights
    without dropout. Masks depend on the seed and positions only, not on the values."""
    b, tq = qkv.shape[:2]
    tk = tq if kv is None else kv.shape[1]
    eye = torch.eye(tk, dtype=qkv.dtype).expand(b, heads, tk, tk).transpose(1, 2).reshape(
        b, tk, heads * tk)
    if kv is None:
        probe = torch.cat([qkv.detach()[..., :2 * heads * d_k], eye], -1), None
    else:
        probe = qkv.detach(), torch.cat([kv.detach()[..., :heads * d_k], eye], -1)
    with torch.no_grad():
        dropped = attention(*probe, heads, d_k, tk, None, causal, p, seed=seed)
        plain = attention(*probe, heads, d_k, tk, None, causal, 0.0)
    split = (x.view(b, tq, heads, tk).transpose(1, 2).double() for x in (dropped, plain))
    dropped, plain = split
    return torch.where(plain > 0, dropped / plain.clamp_min(1e-30), torch.zeros(()))


@pytest.mark.parametrize("cross,causal", [(False, True), (True, False)])
def test_cpp_attention_dropout_is_a_mask_with_the_keep_rule_and_its_gradient(built, cross,
                                                                          causal):
    heads, d_k, p = 2, 16, 0.3
    tq = 12
    qkv, kv, _ = attention_inputs(6, tq, tq, heads, d_k, d_k, torch.float32, cross, seed=4)
    keep = dropout_keep(qkv, kv, heads, d_k, p, 17, causal)
    _, scale = keep_threshold(p)
    live = keep[keep != 0]
    torch.testing.assert_close(live, torch.full_like(live, scale), rtol=1e-5, atol=1e-5)
    threshold, _ = keep_threshold(p)
    expected = (32768 - threshold) / 65536
    allowed = keep.numel() if not causal else keep.shape[0] * heads * tq * (tq + 1) // 2
    kept = (keep != 0).sum().item() / allowed
    assert abs(kept - expected) < 5 * math.sqrt(p * (1 - p) / allowed)
    # With these masks the kernel computes softmax(.) * keep @ v, forward and backward.
    out = attention(qkv, kv, heads, d_k, d_k, None, causal, p, seed=17)
    leaves = [None if x is None else x.detach().double().requires_grad_() for x in (qkv, kv)]
    ref = reference_attention(*leaves, heads, d_k, d_k, None, causal, keep=keep)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    for got, want in zip(grads_of(out, (qkv, kv), upstream),
                         grads_of(ref, leaves, upstream.double()), strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cross", [False, True])
def test_cpp_attention_on_packed_rows_is_the_padded_pass_on_the_real_rows(built, dtype,
                                                                          cross):
    """Queries (and, for self-attention, keys and values) as packed rows, (N, width), placed
    by Packing.offsets: the output and every gradient are the padded pass's at the real
    positions, bit for bit (the rows past a sequence's end are zeros either way), an empty
    sequence and a full one among them, with dropout."""
    lengths, t, heads, d = [5, 0, 7, 2], 7, 2, 8
    qkv, kv, _ = attention_inputs(4, t, 6, heads, d, d, dtype, cross, seed=21)
    mask = (torch.arange(6)[None, :] < torch.tensor([6, 3, 1, 4])[:, None])[:, None, None, :] \
        if cross else None
    real = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
    packing = Packing(real.reshape(-1).nonzero().squeeze(1), 4, t)
    offsets = packing.offsets()
    assert offsets.tolist() == [0, 5, 5, 12, 14]
    with torch.no_grad():
        padded_in = qkv * real[:, :, None]  # the zeros Packing.pad leaves at the padding
    padded_in.requires_grad_()
    rows = packing.unpad(padded_in.detach()).requires_grad_()
    upstream = torch.randn(14, heads * d, generator=torch.Generator().manual_seed(2)).to(dtype)
    full = attention(padded_in, kv, heads, d, d, mask, not cross, 0.3, seed=4)
    full_rows = packing.unpad(full)
    kv2 = None if kv is None else kv.detach().clone().requires_grad_()
    packed = attention(rows, kv2, heads, d, d, mask, not cross, 0.3, seed=4,
                               packed=(offsets, t))
    assert packed.shape == (14, heads * d) and torch.equal(packed, full_rows)
    full_rows.backward(upstream)
    packed.backward(upstream)
    assert torch.equal(rows.grad, packing.unpad(padded_in.grad))
    if cross:
        assert torch.equal(kv2.grad, kv.grad)


def test_packing_offsets_only_where_each_sequence_is_its_first_rows():
    tokens = torch.tensor([[5, 6, 0, 0], [7, 0, 0, 0], [8, 9, 4, 3]])
    packing = Packing(Packing.positions(tokens, 0), 3, 4)
    assert packing.offsets().tolist() == [0, 2, 3, 7]
    gap = torch.tensor([[5, 0, 6, 0], [7, 8, 0, 0]])  # a pad inside the first sequence
    assert Packing(Packing.positions(gap, 0), 2, 4).offsets() is None
    with pytest.raises(RuntimeError, match="offsets must run from 0"):
        qkv = torch.randn(7, 3 * 8)
        attention(qkv, None, 1, 8, 8, None, True, packed=(torch.tensor([0, 2, 3, 6]), 4))


def test_cpp_attention_masks_follow_the_seed_not_the_threads(built):
    qkv, _, _ = attention_inputs(8, 10, 10, 2, 16, 16, torch.bfloat16, False, seed=6)
    out = attention(qkv, None, 2, 16, 16, None, False, 0.2, seed=3)
    alone = on_threads(1, lambda: attention(qkv, None, 2, 16, 16, None, False, 0.2,
                                                    seed=3))
    assert torch.equal(out, alone)
    assert not torch.equal(out, attention(qkv, None, 2, 16, 16, None, False, 0.2, seed=4))
    torch.manual_seed(9)  # without a seed, torch's generator draws it
    first = attention(qkv, None, 2, 16, 16, None, False, 0.2)
    torch.manual_seed(9)
    assert torch.equal(attention(qkv, None, 2, 16, 16, None, False, 0.2), first)


def test_cpp_attention_says_what_it_cannot_compute(built):
    cpu = torch.device("cpu")
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    c = DEFAULTS
    assert attention_applies(cpu, torch.bfloat16, 5, mask, False, c)
    assert attention_applies(cpu, torch.float32, 5, mask, False, c)
    assert not attention_applies(cpu, torch.float16, 5, mask, False, c)
    assert not attention_applies(cpu, torch.bfloat16, 129, None, True, c)
    for dtype, limit in c.attention_kernel_keys.items():
        assert attention_applies(cpu, dtype, limit, None, True, c)
        assert not attention_applies(cpu, dtype, limit + 1, None, True, c)
    shorter = KernelConfig(attention_kernel_keys={torch.bfloat16: 7})
    assert attention_applies(cpu, torch.bfloat16, 7, None, True, shorter)
    assert not attention_applies(cpu, torch.bfloat16, 8, None, True, shorter)
    assert not attention_applies(cpu, torch.float32, 5, None, True, shorter)  # not named
    assert not attention_applies(cpu, torch.bfloat16, 5, None, True, EAGER)
    assert not attention_applies(cpu, torch.bfloat16, 5, mask, True, c)
    assert not attention_applies(cpu, torch.bfloat16, 5,
                                 torch.ones(2, 1, 5, 5, dtype=torch.bool), False, c)
    assert not attention_applies(torch.device("meta"), torch.bfloat16, 5, None, False, c)
    qkv = torch.randn(2, 5, 3 * 16)
    with pytest.raises(ValueError, match=r"qkv must be \(B, T, 45\) for 3 heads"):
        attention(qkv, None, 3, 5, 5, None, False)
    with pytest.raises(ValueError, match=r"kv must be \(B, T, 32\)"):
        attention(qkv[..., :16], qkv, 1, 16, 16, None, False)
    with pytest.raises(RuntimeError, match="must all be float32 or all bfloat16"):
        attention(qkv.double(), None, 1, 16, 16, None, False)
    with pytest.raises(RuntimeError, match="as many queries as keys"):
        attention(torch.randn(2, 4, 16), torch.randn(2, 5, 32), 1, 16, 16, None, True)
    with pytest.raises(RuntimeError, match="mask must be bool"):
        attention(qkv, None, 1, 16, 16, torch.ones(2, 1, 1, 4, dtype=torch.bool), False)


@pytest.mark.parametrize("gap", [False, True], ids=["padding-at-the-end", "a-gap"])
@pytest.mark.parametrize("autocast", [True, False], ids=["bf16-autocast", "fp32"])
def test_the_fast_model_attends_through_the_kernel_as_through_torch(built, monkeypatch,
                                                                     autocast, gap):
    """Every attention of the fast model in training on CPU, under bf16 autocast or in fp32,
    takes the C++ pass (encoder self, decoder self on packed rows, cross), and the model's
    output and gradients are those of the eager path (the explicit bf16 path; fp32: PyTorch's
    flash attention) within bf16's rounding, or fp32's. The decoder's packed rows go to the
    pass as they are (Packing.offsets); with a pad inside a target (no offsets), through a
    padded copy."""
    calls = []
    monkeypatch.setattr(modules, "attention", lambda *a, **k: calls.append(
        (a[1] is None, k.get("packed") is not None)) or attention(*a, **k))
    src, tgt = padded_labels(6, 9, 60, seed=14), padded_labels(6, 10, 60, seed=15)
    if gap:
        tgt[0, 3] = PAD  # row 0 is full: a pad inside it

    def run(config):
        model = tiny_model(config).train()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(src, tgt, packed=Packing.positions(tgt, PAD))
        out.float().square().mean().backward()
        return out.float(), {k: q.grad for k, q in model.named_parameters()}

    out, grads = run(DEFAULTS)
    # encoder self x2, then decoder self and cross x2 (on packed rows unless there is a gap)
    assert calls == [(True, False)] * 2 + [(True, not gap), (False, not gap)] * 2
    calls.clear()
    ref_out, ref_grads = run(KernelConfig(attention_kernel_keys={}))
    assert not calls
    # fp32: the gradients of both paths are ~1% from the model's float64 ones (a sum of
    # cancelling terms), and within 0.25% of each other.
    tol, share = (5e-2, 0.1) if autocast else (1e-5, 1e-2)
    torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol)
    for k, gr in grads.items():
        scale = ref_grads[k].abs().max().item() + 1e-6
        assert (gr - ref_grads[k]).abs().max().item() < share * scale, k


def test_longer_sequences_than_the_kernels_limit_take_the_eager_path(built, monkeypatch):
    """Sources of 9 tokens and targets of 10 against a limit of 9 keys: the encoder and the
    cross-attention (9 keys) take the kernel, the decoder's self-attention (10) does not."""
    calls = []
    monkeypatch.setattr(modules, "attention",
                        lambda *a, **k: calls.append(a[1] is None) or attention(*a, **k))
    src, tgt = padded_labels(3, 9, 60, seed=1), padded_labels(3, 10, 60, seed=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tiny_model(KernelConfig(attention_kernel_keys={torch.bfloat16: 9})).train()(src, tgt)
    assert calls == [True, True, False, False]  # encoder self x2, then cross x2


def test_the_kernels_run_on_torchs_threads(built):
    """The kernels split rows with at::parallel_for, OpenMP in torch's builds: compiled
    without -fopenmp its pragmas vanish and every kernel runs on one thread."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert built.parallel_threads(1000) == 2
        torch.set_num_threads(1)
        assert built.parallel_threads(1000) == 1
    finally:
        torch.set_num_threads(threads)


def test_a_failed_build_warns_once_and_leaves_torch_ops(monkeypatch, tmp_path):
    missing = tmp_path / "missing.cpp"
    with pytest.warns(RuntimeWarning, match=r"missing\.cpp.*AIAYN_CPU_EXTENSION=0"):
        assert extension.load(missing) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert extension.load(missing) is None  # tried once; no second warning or build
        monkeypatch.setenv(extension.EXTENSION_ENV, "0")
        assert extension.load(tmp_path / "other.cpp") is None  # switched off: no build


def test_a_failed_build_is_explained_by_the_compilers_first_error():
    out = ("Error building extension 'x':\n[1/2] c++ -c main.cpp\nFAILED: main.o\n"
           "main.cpp:3:1: error: 'foo' was not declared\nmain.cpp:9:1: error: later\n"
           "ninja: build stopped: subcommand failed.\n")
    assert extension.build_error(out) == "main.cpp:3:1: error: 'foo' was not declared"
    assert extension.build_error("no such file\n") == "no such file"


def test_the_build_uses_the_ninja_package_whether_or_not_the_venv_is_activated(monkeypatch):
    """Two ninja versions hash a build's command differently; taking turns, they rebuilt the
    kernel at every switch. While torch builds, the package's ninja comes first on PATH,
    and PATH is as it was afterwards."""
    import shutil

    ninja = pytest.importorskip("ninja")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    with extension.project_ninja():
        assert shutil.which("ninja") == str(Path(ninja.BIN_DIR) / "ninja")
    assert os.environ["PATH"] == "/usr/bin:/bin"


def test_the_train_stage_depends_on_the_kernels_source():
    """A change to the C++ kernel changes what training computes: DVC must re-run it."""
    import yaml

    repo = Path(__file__).resolve().parents[1]
    deps = yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]["train"]["deps"]
    assert str(extension.SOURCE.relative_to(repo)) in deps


def test_a_build_is_announced_and_a_load_from_the_cache_is_not(tmp_path, monkeypatch, capsys):
    """Before torch builds the kernels (~30 s) one line says why the pause; where the built
    library is already in torch's cache, nothing is said."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = extension.build_name("int x;", "AVX2", ["-O3"])
    extension._say_if_building(cpp_extension, name, "AVX2", extension.SOURCE)
    said = capsys.readouterr().err
    assert said.startswith("aiayn: building the CPU kernels cpu_kernels.cpp for AVX2")
    assert str(tmp_path / name) in said
    (tmp_path / name / f"{name}.so").write_bytes(b"")
    extension._say_if_building(cpp_extension, name, "AVX2", extension.SOURCE)
    assert capsys.readouterr().err == ""


def test_a_build_is_named_by_what_it_is_built_from():
    """One cache folder per source, flags and environment: a checkout elsewhere (a queued
    DVC experiment's temporary copy) finds the same build; an edited source gets a new one."""
    a = extension.build_name("int x;", "AVX2", ["-O3"])
    assert a == extension.build_name("int x;", "AVX2", ["-O3"])
    assert a.startswith("aiayn_cpu_kernels_avx2_")
    assert a != extension.build_name("int y;", "AVX2", ["-O3"])
    assert a != extension.build_name("int x;", "AVX2", ["-O2"])


@pytest.mark.slow
@pytest.mark.parametrize("isa", sorted(extension.ISA_FLAGS))
def test_no_kernel_loop_is_versioned_by_its_buffers_addresses(built, tmp_path, isa):
    """The compiler's own report: built with the extension's flags, no loop of
    csrc/cpu_kernels.cpp is versioned for aliasing (a run-time choice, by the buffers'
    addresses, between a vectorized and a scalar loop that round differently), and its loops
    are still vectorized. Compiles the source (~30 s per instruction set)."""
    import shutil
    import subprocess
    import sysconfig

    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")  # what torch's builder runs (the extension built)
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler ({compiler}) here")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    if "clang" in version.lower():
        pytest.skip("the report's wording is gcc's")
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    done = subprocess.run(
        [compiler, "-std=c++20", "-fPIC", "-DTORCH_EXTENSION_NAME=probe",
         "-DTORCH_API_INCLUDE_EXTENSION_H", *(f"-isystem{i}" for i in includes),
         *extension.CFLAGS, *extension.ISA_FLAGS[isa], "-fopt-info-vec-optimized", "-c",
         str(extension.SOURCE), "-o", str(tmp_path / "kernels.o")],
        capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    ours = [line for line in done.stderr.splitlines()
            if line.startswith(str(extension.SOURCE)) and "optimized" in line]
    versioned = [line for line in ours if "versioned" in line]
    assert versioned == []
    vectorized = {line.split(":")[1] for line in ours if "loop vectorized" in line}
    assert len(vectorized) >= 20, ours  # the row kernels', attention's and the ReLU's loops

"""The fast kernels' settings: one object, passed to :func:`aiayn.fast.apply` and to the fused
losses, so that a test or a benchmark that wants other settings builds another one instead
of rewriting a module's globals. The defaults are the measured choices; each field names the
bench/README.md section that measured it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch


def _attention_kernel_keys() -> dict[torch.dtype, int]:
    return {torch.bfloat16: 64, torch.float32: 32}


@dataclass(frozen=True)
class KernelConfig:
    """What the fast kernels take, and on what sizes.

    The fused loss (:mod:`aiayn.fast.loss`):

    * ``chunk_bytes``: rows of logits formed at once on a CPU, as bytes of fp32 logits: a
      buffer this size is reused from glibc's heap instead of being mapped afresh
      (``aiayn.training.memory``);
    * ``cuda_chunk_bytes``: the same on a GPU, whose chunks are sized for few kernel launches
      (no CPU cache, no glibc heap) and whose softmax runs on a whole chunk at once
      (docs/results/gpu-h200/);
    * ``softmax_rows``: rows of the softmax and its gradient at once on a CPU, a block that
      stays in the last-level cache between its passes (bench/README.md, "bf16 attention
      written out, and the loss's softmax in cache-sized blocks");
    * ``softmax_kernel_dtypes``: logits whose softmax takes the C++ pass on a CPU; bf16 only,
      since in fp32 eager PyTorch works in place and was as fast (bench/README.md, "the loss's
      softmax in one C++ pass");
    * ``vocab_align``: the products run on a vocabulary rounded up to a multiple of this, so
      that every row of logits starts aligned (bench/README.md, "the loss on a vocabulary
      width rounded up to 16"; 1: the width as it is).

    Products on recurring row counts under CPU autocast (:mod:`aiayn.fast.linear`, and the
    fused loss's last chunk; bench/README.md, "products on recurring row counts"):

    * ``row_multiple``: rows of a 16-bit product are rounded up to a multiple of this, so
      that oneDNN builds a primitive for a few row counts per run, not one per batch;
    * ``pad_rows_from``: from this many rows on (below, in decoding and tiny batches, padding
      costs more than a new shape).

    Attention (:mod:`aiayn.fast.attention`):

    * ``attention_kernel_keys``: the longest key sequence the C++ pass takes, by the dtype of
      its operands (autocast's, else the inputs'); a dtype not named keeps the eager path,
      and so do longer sequences (bench/README.md, "attention's products in registers").

    Dropout (:mod:`aiayn.fast.dropout`):

    * ``int16_dropout_on_cuda``: the dropout layers draw int16 masks on a GPU too; off by
      default, since there ``F.dropout`` is one fused kernel where these masks take five
      (``bench.gpu_step --int16-dropout`` measures it).

    The C++ extension (:mod:`aiayn.fast.extension`):

    * ``cpu_extension``: its kernels may be taken where they apply (False: PyTorch's own ops
      throughout, as where it cannot be built). ``AIAYN_CPU_EXTENSION=0`` in the environment
      still keeps it from being built at all.
    """

    chunk_bytes: int = 32 << 20
    cuda_chunk_bytes: int = 1 << 30
    softmax_rows: int = 256
    softmax_kernel_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)
    vocab_align: int = 16
    row_multiple: int = 64
    pad_rows_from: int = 1024
    attention_kernel_keys: Mapping[torch.dtype, int] = field(
        default_factory=_attention_kernel_keys)
    int16_dropout_on_cuda: bool = False
    cpu_extension: bool = True


# The defaults, for the functions' default arguments (never rewritten: pass another config).
DEFAULTS = KernelConfig()

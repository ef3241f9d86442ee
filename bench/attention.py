"""CPU attention under bf16 autocast, or in fp32: the trainer's paths against flash attention.

``aiayn.model.attend`` computes attention on CPU under bf16 autocast (up to
``EXPLICIT_ATTENTION_KEYS`` keys) as fp32 scores and softmax followed by a bf16 weighted sum
of the values; past that length, and before, PyTorch's flash kernel in fp32. This script
times forward + backward of each, side by side in one process, for sentence-level batches
of ``--tokens`` tokens (B = tokens // T sequences of T tokens, the shard stage's buckets),
encoder self-attention (key padding mask) and decoder self-attention (causal):

* ``explicit`` - ``attend`` as the trainer calls it (the explicit path where it applies);
* ``flash32``  - ``attend`` with the explicit path off: fp32 flash attention, the code before;
* ``flash16``  - ``F.scaled_dot_product_attention`` on the bf16 tensors (PyTorch's bf16 kernel);
* ``eager``    - the fast model's eager path from the projections' layout: q, k and v read as
  column ranges of one fused (B, T, 3 H d) tensor, split into heads, ``attend``, and the
  heads put back as (B, T, H d) for the output projection (these copies count, as in the
  step);
* ``kernel``   - ``aiayn.kernels.attention``, the C++ pass the fast step takes under bf16
  autocast, from and to the same layout (left out where the extension cannot be built).

``eager/kernel`` is the ratio the training step sees. ``--precision fp32`` times the fp32
step's contenders, with no autocast: ``flash32`` (PyTorch's kernel, which ``attend`` calls in
fp32), ``eager`` and ``kernel``.

Contenders take turns within every round and the order rotates, so a noisy machine's drift
hits all alike; the table gives medians, and ratios are medians of per-round ratios. Each
contender's output is compared with a float64 reference of the same inputs.

    .venv/bin/python -m bench.attention                    # lengths 16..160, 4096 tokens
    .venv/bin/python -m bench.attention --lengths 23 --rounds 30
    .venv/bin/python -m bench.attention --precision fp32 --lengths 10,16,23,32,64
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from aiayn import kernels
from aiayn import model as model_mod
from bench import harness

# Contenders that take the fused (B, T, 3 H d) layout and give (B, T, H d).
FUSED = ("eager", "kernel")


def contenders(precision: str = "bf16") -> dict:
    def explicit(q, k, v, mask, causal):
        return model_mod.attend(q, k, v, mask, 0.0, causal)

    def flash32(q, k, v, mask, causal):
        return model_mod.attend(q, k, v, mask, 0.0, causal, explicit_keys=-1)

    def flash16(q, k, v, mask, causal):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)

    def eager(qkv, mask, causal, heads):
        b, t, _ = qkv.shape
        q, k, v = (x.view(b, t, heads, -1).transpose(1, 2) for x in qkv.chunk(3, dim=-1))
        out = model_mod.attend(q, k, v, mask, 0.0, causal, True)
        return out.transpose(1, 2).reshape(b, t, -1)

    def kernel(qkv, mask, causal, heads):
        d = qkv.shape[-1] // (3 * heads)
        return kernels.attention(qkv, None, heads, d, d, mask, causal)

    fns = {"explicit": explicit, "flash32": flash32, "flash16": flash16, "eager": eager}
    if precision == "fp32":  # no autocast: attend is PyTorch's kernel, there is no bf16 path
        fns = {"flash32": flash32, "eager": eager}
    if kernels.cpu_extension() is not None:
        fns["kernel"] = kernel
    return fns


def fused(q, k, v, upstream):
    """The same q, k, v as one (B, T, 3 H d) leaf, as the fused projection writes them, and
    the upstream gradient as (B, T, H d)."""
    def flat(x):
        return x.detach().transpose(1, 2).reshape(x.shape[0], x.shape[2], -1)
    qkv = torch.cat([flat(q), flat(k), flat(v)], dim=-1).requires_grad_()
    return qkv, flat(upstream)


def as_heads(out, heads):
    """(B, T, H d) -> (B, H, T, d)."""
    b, t, _ = out.shape
    return out.view(b, t, heads, -1).transpose(1, 2)


def inputs(length: int, tokens: int, heads: int, d_head: int, seed: int,
           dtype: torch.dtype = torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    b = max(1, tokens // length)
    q, k, v = (torch.randn(b, heads, length, d_head, generator=g).to(dtype).requires_grad_()
               for _ in range(3))
    lengths = torch.randint(max(1, length // 3), length + 1, (b,), generator=g)
    lengths[0] = length
    mask = (torch.arange(length)[None, :] < lengths[:, None])[:, None, None, :]
    upstream = torch.randn(b, heads, length, d_head, generator=g).to(dtype)
    return q, k, v, mask, upstream


def reference(q, k, v, mask, causal) -> torch.Tensor:
    q64, k64, v64 = (x.detach().double() for x in (q, k, v))
    t = q.shape[-2]
    scores = q64 @ k64.transpose(-2, -1) / math.sqrt(q.shape[-1])
    allowed = mask.expand(-1, 1, t, t) if mask is not None else torch.ones(t, t, dtype=bool)
    if causal:
        allowed = allowed & torch.ones(t, t, dtype=torch.bool).tril()
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v64


def measure(length: int, causal: bool, args, fns: dict) -> dict:
    """One case: each contender's error against float64 (untimed, also the warm-up), then
    forward + backward timed in alternating rounds."""
    dtype = torch.float32 if args.precision == "fp32" else torch.bfloat16
    q, k, v, mask, upstream = inputs(length, args.tokens, args.heads, args.d_head, length, dtype)
    mask = mask if not causal else None
    ref = reference(q, k, v, mask, causal)
    qkv, upstream_fused = fused(q, k, v, upstream)

    def call(name, fn):
        if name in FUSED:
            return as_heads(fn(qkv, mask, causal, args.heads), args.heads)
        return fn(q, k, v, mask, causal)

    def timed(name, fn):
        def run() -> float:
            for x in (q, k, v, qkv):
                x.grad = None
            t0 = time.perf_counter()
            if name in FUSED:
                fn(qkv, mask, causal, args.heads).backward(upstream_fused)
            else:
                fn(q, k, v, mask, causal).backward(upstream)
            return time.perf_counter() - t0
        return run

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        with torch.no_grad():
            errors = {n: float((call(n, f).double() - ref).abs().max()) for n, f in fns.items()}
        times = harness.alternate({n: timed(n, f) for n, f in fns.items()}, args.rounds)
    result = {"ms": {n: statistics.median(t) * 1e3 for n, t in times.items()},
              "max_abs_error": errors}
    if "explicit" in times:
        result["flash32_over_explicit"] = harness.ratio(times["flash32"],
                                                        times["explicit"]).median
    if "kernel" in times:
        result["eager_over_kernel"] = harness.ratio(times["eager"], times["kernel"]).median
        if "explicit" not in times:
            result["flash32_over_kernel"] = harness.ratio(times["flash32"],
                                                          times["kernel"]).median
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(__doc__)
    ap.add_argument("--lengths", default="16,23,32,64,128,160",
                    help="sequence lengths T (comma-separated); 23 is Multi30k's mean")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per batch (B = tokens//T)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--d-head", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                    help="bf16: under bf16 autocast (the bf16 step's paths); fp32: no autocast")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    harness.require_positive(ap, args, "tokens", "heads", "d_head", "rounds", "threads")
    lengths = harness.int_list(ap, "--lengths", args.lengths, "length")
    if args.threads:
        torch.set_num_threads(args.threads)
    fns = contenders(args.precision)
    print(harness.machine_line())
    if args.precision == "fp32":
        print(f"fp32, no autocast; the kernel up to "
              f"{kernels.ATTENTION_KERNEL_KEYS.get(torch.float32, 0)} keys in the step")
        ratios = (("flash32_over_kernel", "flash32/kernel"), ("eager_over_kernel", "eager/kernel"))
        errors = ("flash32",)
    else:
        print(f"explicit path up to {model_mod.EXPLICIT_ATTENTION_KEYS} keys; the kernel up to "
              f"{kernels.ATTENTION_KERNEL_KEYS.get(torch.bfloat16, 0)}")
        ratios = (("flash32_over_explicit", "flash32/explicit"),
                  ("eager_over_kernel", "eager/kernel"))
        errors = ("explicit", "flash32")
    print(f"batches of {args.tokens} tokens, {args.heads} heads of {args.d_head}; "
          f"forward + backward")
    results = {}
    head = f"{'case':<14}" + "".join(f"{n + ' ms':>13}" for n in fns)
    head += "".join(f"{label:>18}" for _, label in ratios)
    head += f"{'max |err| ' + '/'.join(errors):>29}"
    print(head)
    for length in lengths:
        for kind, causal in (("encoder", False), ("decoder", True)):
            case = f"{kind} T={length}"
            r = results[case] = measure(length, causal, args, fns)
            error = " / ".join(f"{r['max_abs_error'][e]:.4f}" for e in errors)
            print(f"{case:<14}" + "".join(f"{r['ms'][n]:>13.1f}" for n in fns)
                  + "".join(f"{r[key]:>17.2f}x" if key in r else f"{'-':>18}"
                            for key, _ in ratios)
                  + f"{error:>29}")
    return harness.save(results, args.json, argv)


if __name__ == "__main__":
    main()

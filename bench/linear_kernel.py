"""Linear layers on the multi30k model's shapes: ``F.linear`` against the fast kernels'
way of computing them, in the precision training computes in.

    .venv/bin/python -m bench.linear_kernel                   # bf16 where the CPU has it
    .venv/bin/python -m bench.linear_kernel --precision fp32  # the fp32 oneDNN forward
    .venv/bin/python -m bench.linear_kernel --rows 2048 --rounds 20

Each shape of the model's linear layers (d 256, d_ff 1024: q/k/v 256->768, cross-attention
256->256 and 256->512, the output projection 256->256, the FFN's 256->1024 with its ReLU and
1024->256) is timed on ``--rows`` rows of fp32 input, forward and forward + backward, once
per contender per round, the order alternating, both with their bias:

* ``F.linear`` - torch's: MKL in fp32; under bf16 autocast aten's bf16 ``addmm`` (the
  casts of input and weights by autocast, the bias a pass of its own);
* in fp32, ``aiayn.kernels`` - ``kernels.linear`` / ``linear_relu`` as training runs them:
  oneDNN's fused primitive forward (bias and ReLU as post-ops), MKL backward;
* in bf16, ``oneDNN bf16`` - the same fused primitive and backward (``kernels._Linear``)
  fed bf16 copies of the input and weights, cast on each call as autocast casts them once
  per step. Training does not use it: measured here, it did not pay (bench/README.md).

Before timing, both contenders' outputs and gradients are compared (they must agree to the
precision's rounding). Printed: achieved GFLOP/s (medians over rounds) and the median of
the per-round ratios, per shape and for all shapes together.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from aiayn import kernels
from aiayn.precision import autocast_dtype
from bench import harness

# (inputs, outputs, ReLU) of the multi30k model's linear layers
SHAPES = ((256, 768, False), (256, 256, False), (256, 512, False), (256, 1024, True),
          (1024, 256, False))


def ours(x, w, b, relu):
    return (kernels.linear_relu if relu else kernels.linear)(x, w, b)


def onednn_bf16(x, w, b, relu):
    bf16 = torch.bfloat16
    return kernels._Linear.apply(x.to(bf16), w.to(bf16), None if b is None else b.to(bf16),
                                 relu)


def torchs(x, w, b, relu):
    y = F.linear(x, w, b)
    return F.relu(y) if relu else y


def measure(fn, backward: bool, case: tuple, amp) -> list[torch.Tensor]:
    """One product (forward, or forward and backward) of ``fn`` on ``case``: the output, and
    the gradients of input, weight and bias."""
    x, w, b, g, relu = case
    with amp():
        y = fn(x, w, b, relu)
    if not backward:
        return [y]
    return [y, *torch.autograd.grad(y, (x, w, b), g.to(y.dtype))]


def parse_shapes(parser: argparse.ArgumentParser, text: str | None) -> tuple:
    """``--shapes`` (IN:OUT[:relu],...) as SHAPES holds them; None: SHAPES."""
    if not text:
        return SHAPES
    try:
        shapes = tuple((int(f[0]), int(f[1]), f[2:] == ["relu"])
                       for f in (s.split(":") for s in text.split(","))
                       if len(f) in (2, 3) and f[2:] in ([], ["relu"]))
    except ValueError:
        shapes = ()
    if len(shapes) != len(text.split(",")):
        parser.error(f"--shapes {text!r}: write IN:OUT or IN:OUT:relu, comma-separated")
    return shapes


def measure_shape(shape: tuple, contenders: dict, args, amp, tol: dict) -> dict:
    """One shape: both contenders' outputs and gradients compared, then each pass timed in
    alternating rounds; {pass: {contender: seconds per product, per round}}."""
    k, n, relu = shape
    torch.manual_seed(k * 7 + n)
    x = torch.randn(args.rows, k, requires_grad=True)
    w = (k ** -0.5 * torch.randn(n, k)).requires_grad_()
    b = (0.1 * torch.randn(n)).requires_grad_()
    g = torch.randn(args.rows, n)

    def run(fn, backward: bool) -> list[torch.Tensor]:
        return measure(fn, backward, (x, w, b, g, relu), amp)

    reference, candidate = (run(fn, True) for fn in contenders.values())
    for a, r in zip(candidate, reference, strict=True):  # correctness before speed
        assert a.dtype == r.dtype, (a.dtype, r.dtype)
        torch.testing.assert_close(a.float(), r.float(), **tol)

    def timed(fn, backward: bool):
        def products() -> float:
            start = time.perf_counter()
            for _ in range(args.repeat):
                run(fn, backward)
            return (time.perf_counter() - start) / args.repeat
        return products

    return {mode: harness.alternate({c: timed(fn, backward) for c, fn in contenders.items()},
                                    args.rounds)
            for mode, backward in (("forward", False), ("forward+backward", True))}


def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser(__doc__)
    parser.add_argument("--rows", type=int, default=4096, help="rows per product (4096)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=5,
                        help="products per timing, so that one timing is not a few µs (5)")
    parser.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                        help="as train.precision (auto: bf16 where the CPU has it natively)")
    parser.add_argument("--shapes", default=None, metavar="IN:OUT[:relu],...",
                        help="other shapes, e.g. 64:128,128:64:relu")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: torch's default)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    harness.require_positive(parser, args, "rows", "rounds", "repeat", "threads")
    shapes = parse_shapes(parser, args.shapes)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = autocast_dtype(args.precision, torch.device("cpu"))
    amp = (lambda: torch.autocast("cpu", dtype=dtype)) if dtype else contextlib.nullcontext
    tol = {"rtol": 2e-2, "atol": 5e-2} if dtype else {"rtol": 1e-4, "atol": 1e-3}
    if dtype and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        raise SystemExit("error: oneDNN runs no bf16 linear on this CPU (it needs AVX512-BF16, "
                         "AMX or AVX-NE-CONVERT); run --precision fp32")
    contenders = {"F.linear": torchs, "oneDNN bf16" if dtype else "aiayn.kernels":
                  onednn_bf16 if dtype else ours}
    other = list(contenders)[1]
    label = "bf16 autocast" if dtype else "fp32"
    facts = harness.machine_facts()
    print(harness.machine_line(facts))
    print(f"{label}; {args.rows} rows, {args.rounds} rounds of {args.repeat} products each")
    print(f"{'shape':>14} {'pass':>17} " + " ".join(f"{n:>14}" for n in contenders)
          + f" {'F.linear time / its':>20}")
    results, totals = {}, {name: {"forward": [], "forward+backward": []} for name in contenders}
    for k, n, relu in shapes:
        name = f"{k}->{n}{' relu' if relu else ''}"
        results[name] = {}
        passes = measure_shape((k, n, relu), contenders, args, amp, tol)
        for (mode, times), mult in zip(passes.items(), (1, 3), strict=True):
            r = harness.ratio(times["F.linear"], times[other]).median
            rate = {c: mult * 2 * args.rows * k * n / statistics.median(t) / 1e9
                    for c, t in times.items()}
            results[name][mode] = {"gflops": rate, "ratio": r}
            for c in contenders:
                totals[c][mode].append(times[c])
            print(f"{name:>14} {mode:>17} " + " ".join(f"{rate[c]:9.0f} GF/s" for c in contenders)
                  + f" {r:19.2f}x")
    summed = {}
    for mode in ("forward", "forward+backward"):
        per_round = {c: [sum(t[r] for t in totals[c][mode]) for r in range(args.rounds)]
                     for c in contenders}
        summed[mode] = harness.ratio(per_round["F.linear"], per_round[other]).median
        print(f"{'all shapes':>14} {mode:>17} {'':>29} {summed[mode]:19.2f}x")
    out = {"cpu": facts["cpu"], "precision": label, "rows": args.rows,
           "rounds": args.rounds, "shapes": results, "all_shapes": summed}
    return harness.save(out, args.json, argv, facts)


if __name__ == "__main__":
    main()

"""Linear layers on the multi30k model's shapes: ``F.linear`` against the fast kernels'
way of computing them, in the precision training computes in.

    .venv/bin/python bench/linear_kernel.py                   # bf16 where the CPU has it
    .venv/bin/python bench/linear_kernel.py --precision fp32  # the fp32 oneDNN forward
    .venv/bin/python bench/linear_kernel.py --rows 2048 --rounds 20

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
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: make `bench` importable
    sys.path.insert(0, str(REPO))

from aiayn import kernels  # noqa: E402
from aiayn.precision import autocast_dtype  # noqa: E402
from bench.cli import require_positive  # noqa: E402
from bench.machine import cpu_model, describe_caps  # noqa: E402

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


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    require_positive(parser, args, "rows", "rounds", "repeat")
    shapes = SHAPES
    if args.shapes:
        try:
            shapes = tuple((int(f[0]), int(f[1]), f[2:] == ["relu"])
                           for f in (s.split(":") for s in args.shapes.split(","))
                           if len(f) in (2, 3) and f[2:] in ([], ["relu"]))
        except ValueError:
            shapes = ()
        if len(shapes) != len(args.shapes.split(",")):
            parser.error(f"--shapes {args.shapes!r}: write IN:OUT or IN:OUT:relu, "
                         "comma-separated")
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
    print(f"{cpu_model()}{describe_caps()}, {torch.get_num_threads()} threads, {label}; "
          f"{args.rows} rows, {args.rounds} rounds of {args.repeat} products each")
    print(f"{'shape':>14} {'pass':>17} " + " ".join(f"{n:>14}" for n in contenders)
          + f" {'F.linear time / its':>20}")
    results, totals = {}, {name: {"forward": [], "forward+backward": []} for name in contenders}
    for k, n, relu in shapes:
        torch.manual_seed(k * 7 + n)
        x = torch.randn(args.rows, k, requires_grad=True)
        w = (k ** -0.5 * torch.randn(n, k)).requires_grad_()
        b = (0.1 * torch.randn(n)).requires_grad_()
        g = torch.randn(args.rows, n)

        def run(fn, backward: bool, case=(x, w, b, g, relu)) -> list[torch.Tensor]:
            return measure(fn, backward, case, amp)

        reference, candidate = (run(fn, True) for fn in contenders.values())
        for a, r in zip(candidate, reference, strict=True):  # correctness before speed
            assert a.dtype == r.dtype, (a.dtype, r.dtype)
            torch.testing.assert_close(a.float(), r.float(), **tol)
        flops = 2 * args.rows * k * n
        name = f"{k}->{n}{' relu' if relu else ''}"
        results[name] = {}
        for mode, backward, mult in (("forward", False, 1), ("forward+backward", True, 3)):
            times = {c: [] for c in contenders}
            order = list(contenders)
            for _ in range(args.rounds):
                for c in order:
                    start = time.perf_counter()
                    for _ in range(args.repeat):
                        run(contenders[c], backward)
                    times[c].append((time.perf_counter() - start) / args.repeat)
                order.reverse()
            ratios = [a / b for a, b in zip(times["F.linear"], times[other], strict=True)]
            rate = {c: mult * flops / statistics.median(t) / 1e9 for c, t in times.items()}
            results[name][mode] = {"gflops": rate, "ratio": statistics.median(ratios)}
            for c in contenders:
                totals[c][mode].append(times[c])
            print(f"{name:>14} {mode:>17} " + " ".join(f"{rate[c]:9.0f} GF/s" for c in contenders)
                  + f" {statistics.median(ratios):19.2f}x")
    summed = {}
    for mode in ("forward", "forward+backward"):
        per_round = {c: [sum(t[r] for t in totals[c][mode]) for r in range(args.rounds)]
                     for c in contenders}
        ratio = statistics.median(a / b for a, b in zip(per_round["F.linear"],
                                                       per_round[other], strict=True))
        summed[mode] = ratio
        print(f"{'all shapes':>14} {mode:>17} {'':>29} {ratio:19.2f}x")
    out = {"cpu": cpu_model(), "precision": label, "rows": args.rows, "rounds": args.rounds,
           "shapes": results, "all_shapes": summed}
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()

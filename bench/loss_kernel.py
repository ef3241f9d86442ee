"""The fused loss (aiayn.kernels.projected_label_smoothed_loss) at a vocabulary width rounded
up to kernels.VOCAB_ALIGN against the same loss multiplied at the width as it is; with
``--compare softmax``, its softmax and gradient in one C++ pass per row (csrc/cpu_kernels.cpp)
against eager PyTorch blocks of kernels.SOFTMAX_ROWS rows.

    .venv/bin/python -m bench.loss_kernel                 # the multi30k preset's shapes
    .venv/bin/python -m bench.loss_kernel --vocab 8000    # a width that needs no rounding
    .venv/bin/python -m bench.loss_kernel --compare softmax --precision bf16
    .venv/bin/python -m bench.loss_kernel --model data/model --shards data/shards  # real logits

Each round times forward and backward of one step's loss (``--rows`` decoder states of
``--d-model``, ``--vocab`` outputs, label smoothing 0.3) once per contender, the order
alternating, and prints the medians and the median of the per-round ratios. Both
contenders' losses and gradients are compared before timing (they must agree to float
rounding). The default shapes are the multi30k preset's: d 256, the 5,399 tokens its
softmax spans (output_vocab target, en->de), ~3,600 target tokens per step; the logits of
random states have a standard deviation of ``--logit-scale``. With ``--model`` (a trained
model's folder: model.safetensors, config.json) the rows are instead that model's decoder
states on the first validation batches of ``--shards`` (teacher forcing, no dropout) and the
weight its output rows, so the logits are as sharp as training makes them. The share of
logits more than 87 under their row's max is printed: PyTorch's CPU exp computes results
under fp32's smallest normal (e^-87) ~10x slower (bench/README.md, "exp under fp32's
smallest normal").
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from aiayn import kernels
from bench import harness

# exp(x) for x below this is under fp32's smallest normal, where PyTorch's CPU exp is ~10x
# slower (bench/README.md); the C++ softmax pass floors its exponents here.
SLOW_EXP_BELOW = -87.0


def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser(__doc__)
    parser.add_argument("--rows", type=int, default=3600, help="non-pad target tokens")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=5399, help="outputs the softmax spans")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: torch's default)")
    parser.add_argument("--compare", choices=("width", "softmax"), default="width",
                        help="width: VOCAB_ALIGN against the width as it is (default); "
                             "softmax: the C++ softmax pass against eager blocks")
    parser.add_argument("--logit-scale", type=float, default=1.0,
                        help="standard deviation of the random logits (default 1; 40 puts "
                             "most more than 87 under their row's max, which the preset's "
                             "trained model's do not reach: bench/README.md)")
    parser.add_argument("--model", type=Path, default=None,
                        help="a trained model's folder (data/model): its decoder states and "
                             "output rows instead of random ones; needs --shards")
    parser.add_argument("--shards", type=Path, default=None,
                        help="the shard folder (data/shards) whose valid/ batches --model reads")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="bf16: under CPU bf16 autocast, as training on a bf16 CPU")
    args = parser.parse_args(argv)
    harness.require_positive(parser, args, "rows", "d_model", "vocab", "rounds", "threads")
    if (args.model is None) != (args.shards is None):
        parser.error("--model and --shards go together: the model's folder (data/model) and "
                     "the shards it was trained on (data/shards)")
    if args.threads:
        torch.set_num_threads(args.threads)
    aligned = kernels.VOCAB_ALIGN
    if args.model is not None:
        from aiayn.errors import DataError

        try:
            hidden, weight, labels, pad = model_rows(args.model, args.shards, args.rows)
        except (DataError, OSError, ValueError, KeyError) as exc:
            parser.error(f"--model {args.model} --shards {args.shards}: {exc}")
        args.rows, args.d_model, args.vocab = hidden.shape[0], hidden.shape[1], weight.shape[0]
    else:
        torch.manual_seed(0)
        hidden = (args.logit_scale * torch.randn(args.rows, args.d_model)).requires_grad_()
        weight = (args.d_model ** -0.5 * torch.randn(args.vocab, args.d_model)
                  ).requires_grad_()
        labels, pad = torch.randint(1, args.vocab, (args.rows,)), 0
    width = kernels.padded_width(args.vocab)
    with torch.no_grad():
        logits = hidden @ weight.t()
        under = (logits - logits.amax(dim=1, keepdim=True) < SLOW_EXP_BELOW
                 ).float().mean().item()
        del logits

    bf16 = args.precision == "bf16"
    find_softmax, dtypes = kernels._softmax_extension, kernels.SOFTMAX_KERNEL_DTYPES

    def step(align: int, fused: bool = True) -> tuple[float, list[torch.Tensor]]:
        hidden.grad = weight.grad = None
        if args.compare == "softmax":  # the C++ pass for fp32 logits too (training: bf16)
            kernels.SOFTMAX_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
            if not fused:
                kernels._softmax_extension = lambda device, dtype: None
        try:
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss, nll, _ = kernels.projected_label_smoothed_loss(hidden, weight, labels,
                                                                     0.3, pad, align=align)
            loss.backward()
            seconds = time.perf_counter() - start
        finally:
            kernels._softmax_extension, kernels.SOFTMAX_KERNEL_DTYPES = find_softmax, dtypes
        return seconds, [loss.detach(), nll, hidden.grad, weight.grad]

    if args.compare == "softmax":
        if kernels.cpu_extension() is None:
            parser.error("--compare softmax: the C++ kernels could not be built here "
                         "(see the warning above)")
        contenders = {"C++ softmax pass": (aligned, True),
                      f"eager blocks of {kernels.SOFTMAX_ROWS} rows": (aligned, False)}
        label = "C++ / eager"
    else:
        contenders = {f"width {width} (VOCAB_ALIGN {aligned})": (aligned, True),
                      f"width {args.vocab} (VOCAB_ALIGN 1)": (1, True)}
        label = "rounded / as is"
    outputs = {name: step(*how)[1] for name, how in contenders.items()}  # a warm-up
    first, second = outputs.values()
    # Losses agree to fp32 rounding; under bf16 the gradients to the rounding of bf16 logits.
    grads = dict(rtol=2e-2, atol=2e-3) if bf16 else dict(rtol=1e-5, atol=1e-5)
    for i, (a, b) in enumerate(zip(first, second, strict=True)):
        torch.testing.assert_close(a, b, **(grads if i >= 2 else dict(rtol=1e-5, atol=1e-5)))
    times = harness.alternate({name: lambda how=how: step(*how)[0]
                               for name, how in contenders.items()}, args.rounds)
    print(harness.machine_line())
    source = (f"decoder states of {args.model}" if args.model is not None
              else f"random states, logits' sd {args.logit_scale:g}")
    print(f"{args.rows} rows x d {args.d_model} -> {args.vocab} outputs, {args.precision}; "
          f"{args.rounds} rounds, forward + backward of the loss")
    print(f"  {source}; {100 * under:.1f}% of the logits are more than 87 under their "
          "row's max")
    names = list(contenders)
    for name in names:
        print(f"  {name:<28} median {1e3 * statistics.median(times[name]):7.1f} ms")
    ratio = harness.ratio(times[names[1]], times[names[0]])
    print(f"  {label}: {ratio.median:.2f}x faster (median of per-round ratios; "
          f"{ratio.low:.2f}-{ratio.high:.2f})")
    return {"ratio": ratio.median, "times": times, "far_under_max": under}


def model_rows(model_dir: Path, shards: Path, rows: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(decoder states, output rows, labels, the padding's label) of the trained model in
    ``model_dir`` on the first validation batches of ``shards`` that hold at least ``rows``
    target tokens (all of them if they hold fewer): the loss's inputs as training meets
    them, in fp32."""
    from aiayn.export import load_model_folder
    from aiayn.sampler import ShardDataset

    model = load_model_folder(model_dir).model  # eval mode; a bad folder is a DataError
    data = ShardDataset(shards / "valid")
    states, targets = [], []
    with torch.no_grad():
        for index in range(data.num_batches):
            batch = data.batch(index)
            real = batch.tgt_out != model.cfg.pad_id
            states.append(model(batch.src, batch.tgt_in, hidden=True)[real])
            targets.append(batch.tgt_out[real])
            if sum(len(t) for t in targets) >= rows:
                break
    hidden, labels = torch.cat(states)[:rows], torch.cat(targets)[:rows]
    weight, pad = model.embedding.weight.detach(), model.cfg.pad_id
    if (vocab := model.output_vocab()) is not None:  # the spanned tokens only, as in training
        weight = vocab.rows(weight)
        labels, pad = vocab.loss_labels(labels)
        if (labels < 0).any():
            raise ValueError("the validation targets hold tokens outside the model's output "
                             "vocabulary: the model was not trained on these shards")
    return hidden.clone().requires_grad_(), weight.clone().requires_grad_(), labels, pad


if __name__ == "__main__":
    main()

"""Training throughput on CPU: ``aiayn.model.Transformer`` against ``torch.nn.Transformer``.

Usage (from the repository root)::

    .venv/bin/python bench/train_throughput.py                       # 5 rounds x 3 steps
    .venv/bin/python bench/train_throughput.py --threads 1,2 --json out.json
    .venv/bin/python bench/train_throughput.py --baseline old_model.py --models ours,base
    .venv/bin/python bench/train_throughput.py --profile --rounds 1  # + torch.profiler tables
    .venv/bin/python bench/train_throughput.py --help

Models
------
Same sizes for all (d_model 256, 3+3 layers, d_ff 1024, 4 heads, vocabulary 8000, dropout
0.1, post-LN) and the same input and output code: one shared embedding matrix scaled by
sqrt(d), sinusoidal positions, embedding dropout, tied pre-softmax projection. For
``torch.nn.Transformer(norm_first=False, batch_first=True)`` that code is literally ours
(``Transformer.embed`` and ``Transformer.logits`` bound to the wrapper), so only the
encoder-decoder stack differs. ``nn.Transformer`` always appends a LayerNorm to each stack,
which post-LN does not have (its stacks already end in a sub-layer's LayerNorm); the wrapper
drops those two so that both stacks compute the same network. Initialisation is ours for
both (N(0, d^-1/2) embedding, Xavier-uniform matrices, zero biases).

Masks: ``nn.Transformer`` gets the three key-padding masks (source, target, memory) and a
causal mask. Ours masks source keys in encoder and cross-attention and uses the causal mask
in decoder self-attention; target padding follows every real token, so the causal mask
already hides it from real queries (pad queries carry no loss).

Dropout: ``nn.Transformer(dropout=0.1)`` applies 0.1 to every residual branch, to the
attention probabilities and to the FFN activation. Our config separates these; its defaults
follow the paper (residual and embedding dropout only, ``attention_dropout =
activation_dropout = 0``). Hence two rows for our model:

* ``ours``       - our defaults (the paper's dropout), what ``aiayn`` trains;
* ``ours+drop``  - ``attention_dropout = activation_dropout = 0.1``: nn.Transformer's dropout
  placement, the same work as ``nn`` (the like-for-like comparison);
* ``nn``         - torch.nn.Transformer in the wrapper above;
* ``base``, ``base+drop`` - ``Transformer`` of another model file (``--baseline
  path/to/model.py``), to measure a change of ``aiayn/model.py`` side by side.

The step
--------
Timed from ``zero_grad`` to the end of ``optimizer.step()``: forward (inside
``torch.autocast("cpu", dtype=torch.bfloat16)`` for bf16; weights and Adam state stay
fp32), the loss ``F.cross_entropy(logits.float().view(-1, V), labels.view(-1),
ignore_index=0, label_smoothing=0.1, reduction="sum") / ntokens``, backward, Adam
(betas 0.9/0.98, eps 1e-9).

Batches: variable-length pairs in token buckets, as the shard stage makes them. Source
lengths are lognormal (median 20 tokens, long tail, 2..100) + EOS, target length = source x
N(1, 0.1) + BOS/EOS; a pool of 40k pairs is sorted by length and cut into batches of at
most ``--max-tokens`` (4096) positions per side including padding (rows x longest row);
``--steps`` of those batches, drawn at random once, are what every configuration runs in
every round (with the defaults: 71 x 48/57, 67 x 50/61 and 341 x 11/12 pairs x source/
target positions; 3.5k source and 4.1k target positions, 3.4k non-pad target tokens per
batch on average). Words are Zipf-distributed; the target is a fixed permutation
of the source words, so the loss check has something to learn.

Protocol
--------
Each configuration (model x precision x thread count) runs ``--warmup`` steps; then
``--rounds`` rounds, in each of which every configuration runs the same ``--steps``
batches, in an order rotated by one configuration per round. The machine may be shared:
only configurations measured side by side mean anything, so every ratio is the median over
rounds of the per-round ratio; absolute figures are medians over rounds. CPU seconds per step
(``time.process_time``, all threads) are reported next to wall seconds: their gap shows time
lost to other processes (or spent spinning in OpenMP barriers).

FLOPs (analytic, the same formula for every model; model FLOPs of non-pad tokens only)::

    a matmul (n x k) @ (k x m) is 2 n k m FLOPs; forward + backward = 3 x forward.
    P_enc = L_enc (4 d^2 + 2 d d_ff)  weight-matrix parameters of the encoder and of the
    P_dec = L_dec (8 d^2 + 2 d d_ff)  decoder (no biases, LayerNorms or embeddings)
    per pair with s source and t target non-pad tokens (EOS/BOS included):
        6 P_enc s + 6 P_dec t                                        weight matmuls
      + 12 d (L_enc s^2 + L_dec t (t + 1) / 2 + L_dec t s)           QK^T and AV (causal:
                                                                     lower triangle only)
      + 6 d V t                                                      tied output projection
    achieved FLOP/s = sum over the batch / step time.

Loss check: from the same initial weights, on the same ``--loss-steps`` batches (fresh ones,
not the timing batches), with the same dropout seed, each model trains ``--loss-steps``
steps in fp32 and in bf16 (Adam at a constant 1e-3, about the paper schedule's peak at
d=256, so that the loss moves within a few steps); reported: the loss of step 1 (same
weights: the pure precision effect) and the mean of the last 5 steps.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: make `aiayn` importable without installing
    sys.path.insert(0, str(REPO))

from aiayn.model import Transformer, TransformerConfig, sinusoidal_positions  # noqa: E402
from aiayn.precision import cpu_has_native_bf16  # noqa: E402
from bench.machine import cpu_model  # noqa: E402

PAD, BOS, EOS = 0, 1, 2
FIRST_WORD = 4  # ids below are special tokens
KINDS = ("ours", "ours+drop", "nn", "base", "base+drop")


# --------------------------------------------------------------------------- models


class TorchTransformer(nn.Module):
    """torch.nn.Transformer inside our embedding, positions and tied output projection."""

    # The very same code as our model's: only the encoder-decoder stack differs.
    embed = Transformer.embed
    logits = Transformer.logits

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        assert cfg.norm == "post"
        self.cfg = cfg
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        self.register_buffer("positions", sinusoidal_positions(cfg.max_positions, cfg.d_model),
                             persistent=False)
        self.stack = nn.Transformer(
            d_model=cfg.d_model, nhead=cfg.heads, num_encoder_layers=cfg.encoder_layers,
            num_decoder_layers=cfg.decoder_layers, dim_feedforward=cfg.d_ff,
            dropout=cfg.dropout, batch_first=True, norm_first=False)
        # Post-LN stacks end in a sub-layer LayerNorm; nn.Transformer adds one more per stack.
        self.stack.encoder.norm = None
        self.stack.decoder.norm = None
        nn.init.normal_(self.embedding.weight, mean=0.0, std=cfg.d_model ** -0.5)
        with torch.no_grad():
            self.embedding.weight[cfg.pad_id].zero_()
        for name, p in self.stack.named_parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)
            elif "norm" not in name:
                nn.init.zeros_(p)

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        src_pad, tgt_pad = src == self.cfg.pad_id, tgt_in == self.cfg.pad_id
        t = tgt_in.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=src.device).triu(1)  # True: masked
        y = self.stack(self.embed(src), self.embed(tgt_in), tgt_mask=causal,
                       src_key_padding_mask=src_pad, tgt_key_padding_mask=tgt_pad,
                       memory_key_padding_mask=src_pad, tgt_is_causal=True)
        return self.logits(y)


def load_module(path: Path):
    """Import a model file under its own name (a baseline copy of aiayn/model.py)."""
    name = f"baseline_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def make_model(kind: str, cfg: TransformerConfig, baseline=None) -> nn.Module:
    if kind == "nn":
        return TorchTransformer(cfg)
    d = cfg.to_dict()
    if kind.endswith("+drop"):  # nn.Transformer's dropout placement
        d.update(attention_dropout=cfg.dropout, activation_dropout=cfg.dropout)
    if kind.startswith("ours"):
        return Transformer(TransformerConfig(**d))
    if kind.startswith("base"):
        if baseline is None:
            raise SystemExit(f"--models {kind} needs --baseline path/to/model.py")
        return baseline.Transformer(baseline.TransformerConfig(**d))
    raise SystemExit(f"unknown model {kind!r}; choose from {', '.join(KINDS)}")


# --------------------------------------------------------------------------- FLOPs


def matmul_params(cfg: TransformerConfig) -> tuple[int, int]:
    d, f = cfg.d_model, cfg.d_ff
    return (cfg.encoder_layers * (4 * d * d + 2 * d * f),
            cfg.decoder_layers * (8 * d * d + 2 * d * f))


def train_flops(cfg: TransformerConfig, src_len: np.ndarray, tgt_len: np.ndarray) -> float:
    """Model FLOPs of one training step (forward + backward) over pairs of these lengths."""
    p_enc, p_dec = matmul_params(cfg)
    d, V = cfg.d_model, cfg.vocab_size
    s, t = src_len.astype(np.float64), tgt_len.astype(np.float64)
    weights = 6 * p_enc * s.sum() + 6 * p_dec * t.sum()
    attention = 12 * d * (cfg.encoder_layers * (s * s).sum()
                          + cfg.decoder_layers * (t * (t + 1) / 2).sum()
                          + cfg.decoder_layers * (t * s).sum())
    output = 6 * d * V * t.sum()
    return float(weights + attention + output)


# --------------------------------------------------------------------------- data


def make_batches(cfg: TransformerConfig, n: int, max_tokens: int, seed: int) -> list[dict]:
    """``n`` token-bucket batches drawn from a length-sorted pool of variable-length pairs."""
    rng = np.random.default_rng(seed)
    pairs = 40_000
    src_len = np.clip(np.round(rng.lognormal(math.log(20), 0.55, pairs)), 2, 100).astype(int)
    tgt_len = np.clip(np.round(src_len * rng.normal(1.0, 0.1, pairs)), 2, 100).astype(int)
    buckets, rows, longest = [], [], 0
    for i in np.lexsort((tgt_len, src_len)):  # by source length, then target length
        length = max(src_len[i], tgt_len[i]) + 1  # + EOS (source, labels) / BOS (input)
        if rows and max(longest, length) * (len(rows) + 1) > max_tokens:
            buckets.append(rows)
            rows, longest = [], 0
        rows.append(i)
        longest = max(longest, length)
    buckets.append(rows)
    # Zipf-like words, and a fixed source -> target word mapping.
    words = np.arange(FIRST_WORD, cfg.vocab_size)
    p = 1.0 / (np.arange(len(words)) + 10.0)
    p /= p.sum()
    mapping = np.arange(cfg.vocab_size)
    mapping[FIRST_WORD:] = rng.permutation(words)
    out = []
    for b in rng.choice(len(buckets), size=n, replace=False):
        idx = buckets[b]
        s, t = src_len[idx], tgt_len[idx]
        src = np.full((len(idx), s.max() + 1), PAD)
        tgt_in = np.full((len(idx), t.max() + 1), PAD)
        tgt_out = np.full_like(tgt_in, PAD)
        for r, (si, ti) in enumerate(zip(s, t, strict=True)):
            sent = rng.choice(words, size=si, p=p)
            trans = mapping[sent[np.arange(ti) % si]]
            src[r, :si], src[r, si] = sent, EOS
            tgt_in[r, 0], tgt_in[r, 1:ti + 1] = BOS, trans
            tgt_out[r, :ti], tgt_out[r, ti] = trans, EOS
        out.append({"src": torch.from_numpy(src), "tgt_in": torch.from_numpy(tgt_in),
                    "tgt_out": torch.from_numpy(tgt_out), "ntokens": int((tgt_out != PAD).sum()),
                    "flops": train_flops(cfg, s + 1, t + 1)})
    return out


# --------------------------------------------------------------------------- training step


class Runner:
    """One model, its Adam, and a training step in fp32 or under bf16 autocast."""

    def __init__(self, model: nn.Module, lr: float = 1e-4):
        self.model = model.train()
        self.opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.98), eps=1e-9)
        self.V = model.cfg.vocab_size

    def step(self, batch: dict, bf16: bool) -> float:
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = self.model(batch["src"], batch["tgt_in"])
        loss = F.cross_entropy(logits.float().view(-1, self.V), batch["tgt_out"].view(-1),
                               ignore_index=PAD, label_smoothing=0.1,
                               reduction="sum") / batch["ntokens"]
        loss.backward()
        self.opt.step()
        return loss.item()


def timed_steps(runner: Runner, batches: list[dict], bf16: bool) -> dict:
    cpu, wall = time.process_time(), time.perf_counter()
    for b in batches:
        runner.step(b, bf16)
    return {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu,
            "tokens": sum(b["ntokens"] for b in batches),
            "flops": sum(b["flops"] for b in batches)}


def loss_check(cfg: TransformerConfig, kinds: list[str], batches: list[dict], seed: int,
               baseline=None) -> dict:
    """Same init, same data, same dropout seed: the loss curve in fp32 and in bf16."""
    out = {}
    for kind in kinds:
        torch.manual_seed(seed)
        init = make_model(kind, cfg, baseline).state_dict()
        curves = {}
        for prec in ("fp32", "bf16"):
            model = make_model(kind, cfg, baseline)
            model.load_state_dict(init)
            runner = Runner(model, lr=1e-3)
            torch.manual_seed(seed + 1)  # the same dropout masks in both precisions
            curves[prec] = [runner.step(b, prec == "bf16") for b in batches]
        tail = min(5, len(batches))
        out[kind] = {p: {"step1": c[0], "last": c[-1], "mean_last5": statistics.fmean(c[-tail:]),
                         "curve": c} for p, c in curves.items()}
    return out


def profile(runners: dict, configs: list, batches: list[dict], steps: int = 2) -> None:
    """torch.profiler over ``steps`` steps per configuration, sorted by self CPU time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for kind, prec, threads in configs:
        torch.set_num_threads(threads)
        with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for b in batches[:steps]:
                runners[kind].step(b, prec == "bf16")
        print(f"\n=== profile: {kind} {prec}, {threads} threads, {steps} steps ===")
        averages = prof.key_averages()
        print(averages.table(sort_by="self_cpu_time_total", row_limit=25,
                             max_name_column_width=50))
        print(prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=40,
            max_shapes_column_width=70))


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds (default 5)")
    ap.add_argument("--steps", type=int, default=3,
                    help="steps (distinct batches) per configuration per round (default 3)")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up steps per configuration")
    ap.add_argument("--threads", default=None,
                    help="torch.set_num_threads; a comma-separated list (e.g. 1,2) alternates "
                         "thread counts as further configurations (default: torch's default)")
    ap.add_argument("--max-tokens", type=int, default=4096, help="positions per batch side")
    ap.add_argument("--models", default="ours,ours+drop,nn",
                    help=f"comma-separated, from {', '.join(KINDS)} (default ours,ours+drop,nn)")
    ap.add_argument("--precisions", default=None,
                    help="fp32, bf16 or both (default: both on a CPU with native bf16, else "
                         "fp32: emulated bf16 is ~100x slower)")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="another model.py, run as models base / base+drop")
    ap.add_argument("--loss-steps", type=int, default=20, help="0 skips the loss check")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true",
                    help="before timing, profile 2 steps per configuration (torch.profiler)")
    ap.add_argument("--json", type=Path, default=None, help="write all results here")
    args = ap.parse_args(argv)

    thread_counts = ([int(t) for t in args.threads.split(",")] if args.threads
                     else [torch.get_num_threads()])
    if args.precisions is None:
        args.precisions = "fp32,bf16" if cpu_has_native_bf16() else "fp32"
        if args.precisions == "fp32":
            print("this CPU has no native bf16 (see aiayn/precision.py): fp32 only; "
                  "--precisions fp32,bf16 measures bf16 anyway", flush=True)
    kinds, precs = args.models.split(","), args.precisions.split(",")
    baseline = load_module(args.baseline) if args.baseline else None
    cfg = TransformerConfig(vocab_size=8000, d_model=256, heads=4, encoder_layers=3,
                            decoder_layers=3, d_ff=1024, dropout=0.1, norm="post")
    configs = [(k, p, t) for t in thread_counts for p in precs for k in kinds]
    multi = len(thread_counts) > 1

    def name(k: str, p: str, t: int) -> str:
        return f"{k} {p}" + (f" t{t}" if multi else "")

    info = {"torch": torch.__version__, "default_threads": torch.get_num_threads(),
            "threads": thread_counts, "cpu": cpu_model(), "logical_cpus": os.cpu_count(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "python": platform.python_version(), "config": cfg.to_dict(),
            "models": kinds, "baseline": str(args.baseline) if args.baseline else None,
            "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
            "command": " ".join(sys.argv)}
    print(f"torch {info['torch']}  torch.get_num_threads() {info['default_threads']}  "
          f"measured with threads {thread_counts}  CPU {info['cpu']} "
          f"({info['logical_cpus']} logical CPUs, {info['cpu_capability']})")
    info["load_average"] = os.getloadavg()
    print("load average (1, 5, 15 min): " + " ".join(f"{x:.1f}" for x in info["load_average"]))

    batches = make_batches(cfg, args.steps, args.max_tokens, args.seed)
    info["batches"] = [f"{tuple(b['src'].shape)}/{tuple(b['tgt_in'].shape)}" for b in batches]
    mean = statistics.fmean
    print(f"batches (src/tgt shapes): {' '.join(info['batches'])}")
    print(f"per batch on average: {mean(b['src'].numel() for b in batches):.0f} source / "
          f"{mean(b['tgt_in'].numel() for b in batches):.0f} target positions with padding, "
          f"{mean(b['ntokens'] for b in batches):.0f} non-pad target tokens, "
          f"{mean(b['flops'] for b in batches) / 1e9:.1f} GFLOP per training step")
    p_enc, p_dec = matmul_params(cfg)
    print(f"FLOPs = 6 (P_enc s + P_dec t) + 12 d (L_enc s^2 + L_dec t(t+1)/2 + L_dec t s) "
          f"+ 6 d V t per pair; P_enc {p_enc:,}, P_dec {p_dec:,}, d V {cfg.d_model * 8000:,}")

    runners = {}
    for k in kinds:
        torch.manual_seed(args.seed)
        runners[k] = Runner(make_model(k, cfg, baseline))

    t0 = time.perf_counter()
    for k, p, t in configs:  # warm-up: allocator, oneDNN kernels, Adam state
        torch.set_num_threads(t)
        for i in range(args.warmup):
            runners[k].step(batches[i % len(batches)], p == "bf16")
    print(f"warm-up {time.perf_counter() - t0:.0f} s", flush=True)

    if args.profile:
        profile(runners, configs, batches)

    names = [name(*c) for c in configs]
    runs = {n: [] for n in names}
    for r in range(args.rounds):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for k, p, t in order:
            torch.set_num_threads(t)
            runs[name(k, p, t)].append(timed_steps(runners[k], batches, p == "bf16"))
        line = "  ".join(f"{n} {runs[n][-1]['tokens'] / runs[n][-1]['wall']:.0f}" for n in names)
        print(f"round {r + 1}/{args.rounds} tok/s: {line}", flush=True)

    med = statistics.median
    tps = {n: [x["tokens"] / x["wall"] for x in v] for n, v in runs.items()}
    results = {n: {"tokens_per_s": med(tps[n]),
                   "gflop_per_s": med(x["flops"] / x["wall"] for x in v) / 1e9,
                   "wall_s_per_step": med(x["wall"] for x in v) / args.steps,
                   "cpu_s_per_step": med(x["cpu"] for x in v) / args.steps,
                   "tokens_per_s_rounds": tps[n], "rounds": v}
               for n, v in runs.items()}

    def ratio(a: str, b: str) -> float:
        return med(x / y for x, y in zip(tps[a], tps[b], strict=True))

    ratios = {}
    for t in thread_counts:
        for k in kinds:
            if k != "nn" and "nn" in kinds:
                for p in precs:
                    ratios[f"{name(k, p, t)} / {name('nn', p, t)}"] = \
                        ratio(name(k, p, t), name("nn", p, t))
            if k.startswith("ours") and k.replace("ours", "base") in kinds:
                b = k.replace("ours", "base")
                for p in precs:
                    ratios[f"{name(k, p, t)} / {name(b, p, t)}"] = \
                        ratio(name(k, p, t), name(b, p, t))
        if len(precs) == 2:
            for k in kinds:
                ratios[f"{name(k, 'bf16', t)} / {name(k, 'fp32', t)}"] = \
                    ratio(name(k, "bf16", t), name(k, "fp32", t))
    if multi:
        for k, p in ((k, p) for p in precs for k in kinds):
            hi, lo = max(thread_counts), min(thread_counts)
            ratios[f"{name(k, p, hi)} / {name(k, p, lo)}"] = \
                ratio(name(k, p, hi), name(k, p, lo))

    width = max(len(n) for n in names) + 2
    print(f"\n{'configuration':<{width}}{'target tok/s':>13}{'GFLOP/s':>9}{'wall s/step':>13}"
          f"{'CPU s/step':>12}{'tok/s over rounds':>26}")
    for n in names:
        r = results[n]
        print(f"{n:<{width}}{r['tokens_per_s']:>13.0f}{r['gflop_per_s']:>9.1f}"
              f"{r['wall_s_per_step']:>13.2f}{r['cpu_s_per_step']:>12.2f}"
              f"{min(tps[n]):>17.0f} .. {max(tps[n]):.0f}")
    print("\nratios of target tokens/s (median over rounds of the per-round ratio):")
    for n, v in ratios.items():
        print(f"  {n:<{2 * width + 3}}{v:6.2f}x")

    loss = {}
    if args.loss_steps:
        torch.set_num_threads(thread_counts[0])
        loss_kinds = [k for k in kinds if not k.startswith("base")]
        loss_batches = make_batches(cfg, args.loss_steps, args.max_tokens, args.seed + 1)
        print(f"\nloss, fp32 vs bf16 autocast: same init, same {args.loss_steps} batches, same "
              f"dropout seed, Adam lr 1e-3, threads {thread_counts[0]}):")
        loss = loss_check(cfg, loss_kinds, loss_batches, args.seed, baseline)
        for k, v in loss.items():
            f, b = v["fp32"], v["bf16"]
            print(f"  {k:<10} step 1: fp32 {f['step1']:.4f} bf16 {b['step1']:.4f} "
                  f"({b['step1'] - f['step1']:+.4f}) | mean of the last "
                  f"{min(5, args.loss_steps)}: fp32 {f['mean_last5']:.4f} bf16 "
                  f"{b['mean_last5']:.4f} ({b['mean_last5'] - f['mean_last5']:+.4f})")

    out = {"info": info, "results": results, "ratios": ratios, "loss": loss}
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
        print(f"\nwrote {args.json}")
    return out


if __name__ == "__main__":
    main()

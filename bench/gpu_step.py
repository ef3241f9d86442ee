"""The training step on a GPU: tokens/s, where the time goes, and model FLOPs utilisation.

The trainer's step (fast kernels, bf16 autocast, fused Adam) for the paper's base and big
models on token buckets of WMT-like lengths, new shapes every step (``--reuse``: shapes met
before), timed with CUDA events; it prints target tokens/s, the step's split, peak memory,
MFU and the paper's schedule in hours. Without a GPU it measures nothing, says so, and
prints an estimate from the counted FLOPs. The guide: bench/README.md, ``gpu_step.py``.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from aiayn import fast
from aiayn.data.batching import plan_step
from aiayn.data.sampler import Batch
from aiayn.data.shards import cut_batches
from aiayn.model import Transformer, TransformerConfig
from aiayn.precision import autocast_dtype, no_autocast, precision_name, step_casts
from aiayn.training.objective import make_criterion, make_optimizer
from bench import harness
from bench.flops import train_flops

VOCAB = 37000
CONFIGS = {
    "base": dict(d_model=512, heads=8, encoder_layers=6, decoder_layers=6, d_ff=2048,
                 dropout=0.1),
    "big": dict(d_model=1024, heads=16, encoder_layers=6, decoder_layers=6, d_ff=4096,
                dropout=0.3),
    "tiny": dict(d_model=64, heads=4, encoder_layers=2, decoder_layers=2, d_ff=128,
                 dropout=0.1),  # a smoke test of this script, on any device
}
PAPER_STEPS = {"base": 100_000, "big": 300_000, "tiny": 1000}
# Dense (not sparse) bf16 peaks, by the words of torch.cuda.get_device_name: "NVIDIA H100
# 80GB HBM3" is the SXM part, "NVIDIA H100 NVL" and "NVIDIA H200 NVL" the lower-clocked ones.
PEAK_BF16_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.4, "H200 NVL": 835.0,
                    "H200": 989.4, "GH200": 989.4, "A100": 312.0, "A800": 312.0,
                    "L40S": 362.0, "L40": 181.0, "L4": 121.0, "A10": 125.0}
MEAN_LENGTH = 30.0  # BPE tokens per WMT14 sentence incl. EOS (~27 words, 37k BPE)


def config(name: str) -> TransformerConfig:
    return TransformerConfig(vocab_size=VOCAB, max_positions=258, **CONFIGS[name])


def flops_per_target_token(cfg: TransformerConfig, length: float = MEAN_LENGTH) -> float:
    return train_flops(cfg, [length], [length]) / length


def estimate_table(tokens_per_step: int) -> list[dict]:
    """Hours for the paper's schedules at given MFUs on 1 x H100 and 8 x A100."""
    rows = []
    for name in ("base", "big"):
        step = flops_per_target_token(config(name)) * tokens_per_step
        for hardware, peak in (("1 x H100 SXM", PEAK_BF16_TFLOPS["H100"]),
                               ("8 x A100", 8 * PEAK_BF16_TFLOPS["A100"])):
            for mfu in (0.3, 0.4, 0.5):
                seconds = PAPER_STEPS[name] * step / (mfu * peak * 1e12)
                rows.append({"config": name, "steps": PAPER_STEPS[name], "hardware": hardware,
                             "mfu": mfu, "tflop_per_step": step / 1e12, "hours": seconds / 3600})
    return rows


def print_estimate(tokens_per_step: int) -> list[dict]:
    rows = estimate_table(tokens_per_step)
    print(f"\nESTIMATE, not a measurement: model FLOPs counted for sentences of {MEAN_LENGTH:.0f} "
          f"BPE tokens and {tokens_per_step:,} target tokens per step (bench.flops)")
    print(f"{'config':<7}{'steps':>9}{'TFLOP/step':>12}  {'hardware':<14}"
          + "".join(f"{f'{m:.0%} MFU':>10}" for m in (0.3, 0.4, 0.5)))
    for i in range(0, len(rows), 3):
        r = rows[i]
        print(f"{r['config']:<7}{r['steps']:>9,}{r['tflop_per_step']:>12.1f}  {r['hardware']:<14}"
              + "".join(f"{x['hours']:>9.1f}h" for x in rows[i:i + 3]))
    return rows


def _synthetic_cut(rng: np.random.Generator, max_tokens: int) -> tuple:
    """The synthetic corpus's lengths (200,000 WMT-like pairs), their order and the batch
    bounds the shard stage's cut gives (lengths + EOS / + BOS)."""
    pairs = 200_000
    src = np.clip(np.round(rng.lognormal(np.log(26), 0.55, pairs)), 2, 254).astype(int)
    tgt = np.clip(np.round(src * rng.normal(1.0, 0.1, pairs)), 2, 254).astype(int)
    order = np.lexsort((tgt, src))
    return src, tgt, order, cut_batches(src[order] + 1, tgt[order] + 1, max_tokens)


def available_batches(max_tokens: int, seed: int = 1) -> int:
    """How many batches :func:`make_batches` can draw (each at most once)."""
    return len(_synthetic_cut(np.random.default_rng(seed), max_tokens)[3]) - 2


def make_batches(n: int, max_tokens: int, seed: int, device: torch.device) -> list[Batch]:
    """Token-bucket batches of WMT-like lengths, as the shard stage cuts them."""
    rng = np.random.default_rng(seed)
    src, tgt, order, bounds = _synthetic_cut(rng, max_tokens)
    if n > len(bounds) - 2:
        raise ValueError(f"{n} batches asked, but the synthetic corpus holds "
                         f"{len(bounds) - 2} of <= {max_tokens} tokens")
    out = []
    # Drawn from all batches but the last (the longest pairs' remainder), as before.
    for b in rng.choice(len(bounds) - 2, size=n, replace=False):
        idx = order[bounds[b]:bounds[b + 1]]
        s, t = src[idx] + 1, tgt[idx] + 1  # + EOS / + BOS
        src_t = np.zeros((len(idx), s.max()), np.int64)
        tgt_in = np.zeros((len(idx), t.max()), np.int64)
        for r, (si, ti) in enumerate(zip(s, t, strict=True)):
            src_t[r, :si] = rng.integers(4, VOCAB, si)
            tgt_in[r, :ti] = rng.integers(4, VOCAB, ti)
        tgt_out = np.where(tgt_in != 0, (tgt_in + 1) % VOCAB + (tgt_in == VOCAB - 1) * 4, 0)
        batch = Batch(torch.from_numpy(src_t), torch.from_numpy(tgt_in),
                      torch.from_numpy(tgt_out), torch.from_numpy(idx), int(s.sum()),
                      int(t.sum()), tgt_positions=torch.from_numpy(np.flatnonzero(tgt_out)))
        if device.type == "cuda":
            batch = batch.pin_memory()
        out.append(batch)
    return out


class Timer:
    """CUDA events on a GPU (no host sync until read), perf_counter elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, a, b) -> float:
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b) / 1000
        return b - a


def measure(name: str, args, device: torch.device) -> dict:
    cfg = config(name)
    torch.manual_seed(0)
    model = fast.apply(Transformer(cfg).to(device)).train()
    optimizer, scheduler = make_optimizer(model, (0.9, 0.98), 1e-9, cfg.d_model, 4000, 1.0,
                                          fused=True)
    net: torch.nn.Module = model
    if args.ddp:  # as the trainer wraps it: DDP first, then compile (graphs split at buckets)
        net = torch.nn.parallel.DistributedDataParallel(
            net, device_ids=[device.index] if device.type == "cuda" else None)
    if args.compile:
        torch._dynamo.utils.counters.clear()
        net = torch.compile(net)
    amp = autocast_dtype(args.precision, device)
    # fp16: dynamic loss scaling as the trainer does it (a no-op in other precisions)
    scaler = torch.amp.GradScaler(device.type, enabled=amp == torch.float16)
    plan = plan_step(args.tokens_per_step, 1, args.max_tokens)  # as the trainer plans a step
    accum = plan.accumulation
    # --reuse: the measured steps cycle through the warm-up's batches, whose shapes were met.
    fresh = args.warmup + (0 if args.reuse else args.steps)
    criterion = make_criterion(kernels="fast", label_smoothing=0.1, rdrop=0.0, pad_id=0,
                               embedding=model.embedding.weight, amp_dtype=amp)
    batches = make_batches(fresh * accum, plan.batch_tokens, 1, device)
    timer = Timer(device)
    parts = {"forward+loss": [], "backward": [], "optimizer": [], "step": []}
    tokens, flops = [], []

    def run_step(group: list[Batch]) -> tuple:
        t0 = timer.mark()
        marks = []  # (before forward, after forward + loss, after backward) per micro-batch
        total = sum(b.tgt_tokens for b in group)
        with step_casts(device.type, amp):  # as the trainer: bf16 weights cast once per step
            for b in group:
                b = b.to(device, non_blocking=True)
                a = timer.mark()
                loss, _, _ = criterion(net, b)
                m = timer.mark()
                with no_autocast(device.type):
                    scaler.scale(loss / total).backward()
                marks.append((a, m, timer.mark()))
        o = timer.mark()
        if scaler.is_enabled():
            scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return t0, marks, o, timer.mark()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(args.warmup + args.steps):
        at = step if step < fresh else step % args.warmup
        group = batches[at * accum:(at + 1) * accum]
        if args.profile and step in (0, args.warmup + args.steps - 1):
            profile(run_step, group, device, "first step, shapes new" if step == 0
                    else f"last step, shapes {'met before' if args.reuse else 'new'}")
            continue
        t0, marks, o, t1 = run_step(group)
        if step >= args.warmup:  # read the events once per step, after it was queued
            parts["step"].append(timer.seconds(t0, t1))
            parts["forward+loss"].append(sum(timer.seconds(a, m) for a, m, _ in marks))
            parts["backward"].append(sum(timer.seconds(m, e) for _, m, e in marks))
            parts["optimizer"].append(timer.seconds(o, t1))
            tokens.append(sum(b.tgt_tokens for b in group))
            flops.append(sum(train_flops(cfg, (b.src != 0).sum(1).numpy(),
                                         (b.tgt_out != 0).sum(1).numpy()) for b in group))
    shapes = {tuple(b.src.shape) + tuple(b.tgt_in.shape) for b in batches}
    launches = (count_launches(run_step, batches[:accum], device) if args.count_kernels
                else None)
    step_s = statistics.median(parts["step"])
    achieved = statistics.fmean(f / s for f, s in zip(flops, parts["step"], strict=True))
    result = {"config": name, "accumulation": accum, "precision": precision_name(amp),
              "compile": args.compile, "ddp": args.ddp, "reuse": args.reuse,
              "cudnn_attention": torch.backends.cuda.cudnn_sdp_enabled(),
              "loss_blocks": fast.loss_blocks(device, cfg.vocab_size),
              "batch_shapes": len(shapes),
              "max_tokens": args.max_tokens,
              "launches_per_step": launches,
              "step_s": step_s,
              "tokens_per_s": statistics.fmean(t / s for t, s in zip(tokens, parts["step"],
                                                                      strict=True)),
              "tflops": achieved / 1e12,
              "split_s": {k: statistics.median(v) for k, v in parts.items()}}
    if args.compile:
        counters = torch._dynamo.utils.counters
        result["graphs"] = int(counters["stats"].get("unique_graphs", 0))
        result["graph_breaks"] = int(sum(counters["graph_break"].values()))
    if device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
        peak = args.peak_tflops or peak_tflops(torch.cuda.get_device_name(device))
        result["mfu"] = achieved / (peak * 1e12) if peak else None
        result["hours_for_paper_steps"] = PAPER_STEPS[name] * step_s / 3600
    return result


def profiled(run_step, group: list[Batch], device: torch.device):
    """One step under torch.profiler (host, and the GPU where there is one)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    cuda = device.type == "cuda"
    with torch_profile(activities=[ProfilerActivity.CPU]
                       + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        run_step(group)
        if cuda:
            torch.cuda.synchronize(device)
    return prof


def profile(run_step, group: list[Batch], device: torch.device, title: str) -> None:
    """One step's top operators: where host and device time go."""
    table = profiled(run_step, group, device).key_averages()
    print(f"\nprofile of one step ({title}):")
    print(table.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=50))
    if device.type == "cuda":
        print(table.table(sort_by="self_cuda_time_total", row_limit=8,
                          max_name_column_width=50))


def count_launches(run_step, group: list[Batch], device: torch.device) -> dict:
    """One step under torch.profiler: {"kernels": CUDA kernels launched, "copies": CUDA memory
    copies and sets} on a GPU; {"ops": the aten operators called from Python} on a CPU."""
    events = profiled(run_step, group, device).events()
    if device.type == "cuda":
        from torch.autograd import DeviceType
        on_gpu = [e for e in events if e.device_type == DeviceType.CUDA]
        copies = sum(1 for e in on_gpu if e.name.startswith(("Memcpy", "Memset")))
        return {"kernels": len(on_gpu) - copies, "copies": copies}

    def from_python(e) -> bool:
        parent = e.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::"):
                return False
            parent = parent.cpu_parent
        return True
    return {"ops": sum(1 for e in events if e.name.startswith("aten::") and from_python(e))}


def _words(name: str) -> list[str]:
    return re.split(r"[\s_-]+", name.strip().upper())


def peak_tflops(device_name: str) -> float | None:
    """The table's peak for a device name, matched by whole words ("NVIDIA A100-SXM4-80GB"
    is an A100, "NVIDIA L40" not an L4, "NVIDIA RTX A1000" nothing), the longest key
    first ("H100 PCIe" before "H100"); None for a GPU the table does not hold."""
    words = _words(device_name)
    for key in sorted(PEAK_BF16_TFLOPS, key=lambda k: len(_words(k)), reverse=True):
        k = _words(key)
        if any(words[i:i + len(k)] == k for i in range(len(words) - len(k) + 1)):
            return PEAK_BF16_TFLOPS[key]
    return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = harness.parser(__doc__)
    ap.add_argument("--configs", default="base,big", help="base, big and/or tiny")
    ap.add_argument("--device", default=None, help="cuda (default when there is one) or cpu")
    ap.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp16", "fp32"),
                    help="auto: bf16 where the GPU has it; fp16: float16 with dynamic loss "
                         "scaling, as train.precision fp16")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--cudnn-attention", action="store_true",
                    help="leave cuDNN attention in SDPA's choice (the trainer takes it out)")
    ap.add_argument("--reuse", action="store_true",
                    help="measured steps reuse the warm-up's batches (shapes met before)")
    ap.add_argument("--profile", action="store_true",
                    help="profile the first and the last step (not measured)")
    ap.add_argument("--count-kernels", action="store_true",
                    help="profile one more step and record its kernel launches (GPU) or the "
                         "operators called from Python (CPU)")
    ap.add_argument("--ddp", action="store_true",
                    help="wrap the model in DistributedDataParallel (run under torchrun)")
    ap.add_argument("--steps", type=int, default=20, help="measured optimizer steps")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--tokens-per-step", type=int, default=25_000)
    ap.add_argument("--max-tokens", type=int, default=6250, help="tokens per batch and side")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="the GPU's dense bf16 peak, if not in the built-in table")
    ap.add_argument("--estimate", action="store_true", help="only print the estimate table")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    harness.require_positive(ap, args, "steps", "tokens_per_step", "max_tokens")
    unknown = [c for c in args.configs.split(",") if c not in CONFIGS]
    if unknown:
        ap.error(f"--configs: unknown {', '.join(map(repr, unknown))}; "
                 f"choose among {', '.join(CONFIGS)}")
    if args.profile and args.steps < 2 + (args.warmup == 0):
        ap.error("--profile takes the first and the last step out of the measured ones: give "
                 + ("--steps 2 or more" if args.warmup else "--steps 3 or more with --warmup 0"))
    if args.reuse and args.warmup < 1:
        ap.error("--reuse cycles through the warm-up's batches: give --warmup 1 or more")
    plan = plan_step(args.tokens_per_step, 1, args.max_tokens)  # as the trainer plans a step
    accum = plan.accumulation
    needed = (args.warmup + (0 if args.reuse else args.steps)) * accum
    if not args.estimate and needed > (have := available_batches(plan.batch_tokens)):
        ap.error(f"{args.warmup} warm-up + {args.steps} measured steps of {accum} batch(es) need "
                 f"{needed} distinct batches; the synthetic corpus holds {have} of "
                 f"<= {args.max_tokens} tokens: give fewer --steps/--warmup, --reuse, or a "
                 "smaller --max-tokens")
    if args.ddp and "LOCAL_RANK" not in os.environ:
        ap.error("--ddp needs torchrun: torchrun --standalone --nproc-per-node N "
                 "-m bench.gpu_step --ddp ...")
    return args


def start_device(args) -> torch.device:
    """The device to measure on; under --ddp this rank's, with its process group."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.ddp:
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if not args.cudnn_attention:
        fast.avoid_cudnn_attention(device)  # as the trainer and the translator do
    return device


def measure_configs(args, device: torch.device) -> list[dict]:
    """Each of --configs measured and printed in turn."""
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"measuring on {where}; torch {torch.__version__}; "
          f"{args.tokens_per_step:,} target tokens per step in batches of "
          f"<= {args.max_tokens} tokens; kernels fast; fused Adam"
          + ("; torch.compile" if args.compile else "")
          + ("; cuDNN attention allowed" if args.cudnn_attention else "")
          + (f"; DDP over {dist.get_world_size()} process(es), "
             f"{dist.get_backend()}" if args.ddp else ""))
    measured = []
    for name in args.configs.split(","):
        r = measure(name, args, device)
        measured.append(r)
        split = ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in r["split_s"].items())
        line = (f"{name}: {r['precision']}, accumulation {r['accumulation']}, "
                f"{r['tokens_per_s']:,.0f} target tokens/s, {r['tflops']:.1f} TFLOP/s; "
                f"{split}")
        if r["launches_per_step"]:
            line += "; per step " + ", ".join(f"{v:,} {k}"
                                              for k, v in r["launches_per_step"].items())
        if "graphs" in r:
            line += (f"; {r['graphs']} graph(s), {r['graph_breaks']} graph break(s) over "
                     f"{r['batch_shapes']} batch shapes")
        if "peak_memory_gib" in r:
            mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "unknown peak"
            line += (f"; peak memory {r['peak_memory_gib']:.1f} GiB; MFU {mfu}; "
                     f"{PAPER_STEPS[name]:,} steps in {r['hours_for_paper_steps']:.1f} h")
        print(line, flush=True)
    return measured


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = start_device(args)
    out: dict = {"estimate": None, "measured": [], "torch": torch.__version__,
                 "device": (torch.cuda.get_device_name(device) if device.type == "cuda"
                            else "CPU"),
                 "world_size": dist.get_world_size() if args.ddp else 1}
    print(harness.machine_line())
    if args.estimate or (device.type != "cuda" and args.device is None):
        print("No GPU here (torch.cuda.is_available() is False): nothing was measured on a GPU."
              if device.type != "cuda" else "--estimate: nothing was measured.")
        out["estimate"] = print_estimate(args.tokens_per_step)
    else:
        out["measured"] = measure_configs(args, device)
        if device.type == "cuda":
            out["estimate"] = print_estimate(args.tokens_per_step)
    write = args.json if not args.ddp or dist.get_rank() == 0 else None
    out = harness.save(out, write, argv)
    if args.ddp:
        dist.destroy_process_group()
    return out


if __name__ == "__main__":
    main()

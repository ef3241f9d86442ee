"""The attention pass of one revision against this tree's, side by side in one process
(forward + backward, 4 heads of 64, ~4000 tokens per batch, key-padding or causal masks),
and in fp32 PyTorch's flash kernel beside them. Inputs are unit normal times --scale: at
--scale 4 the scores reach the hundreds and the softmax saturates, as on large projections.

    .venv/bin/python docs/results/multi30k/fp32-avx512/attention/kernel_ab.py --rev 2d5ce1d
"""
import argparse
import statistics
import subprocess
import time
from functools import partial

import torch
import torch.nn.functional as F
from torch.utils import cpp_extension

from aiayn import kernels

ap = argparse.ArgumentParser()
ap.add_argument("--rev", default="2d5ce1d")
ap.add_argument("--dtypes", default="float32,bfloat16")
ap.add_argument("--lengths", default="10,16,23,32,64,128")
ap.add_argument("--scale", type=float, default=1.0)
ap.add_argument("--rounds", type=int, default=7)
args = ap.parse_args()
torch.manual_seed(0)
torch.set_num_threads(2)
new = kernels.cpu_extension()
isa = torch.backends.cpu.get_cpu_capability()
flags = kernels._CFLAGS + kernels._ISA_FLAGS.get(isa, [])
source = subprocess.run(["git", "show", f"{args.rev}:aiayn/csrc/cpu_kernels.cpp"],
                        capture_output=True, text=True, check=True).stdout
old = cpp_extension.load_inline(f"aiayn_attention_{args.rev}_{isa.lower()}", [source],
                                extra_cflags=flags)
H, d = 4, 64
print(f"capability {isa}; {args.rev} against this tree; inputs x {args.scale}")


def run(ext, qkv, mask, causal, g):
    kernels._extension = ext
    out = kernels.attention(qkv, None, H, d, d, None if causal else mask, causal)
    out.backward(g)


def sdpa(qkv, mask, causal, g):
    B, T, _ = qkv.shape
    q, k, v = qkv.view(B, T, 3, H, d).permute(2, 0, 3, 1, 4).unbind(0)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=None if causal else mask,
                                       is_causal=causal)
    o.transpose(1, 2).reshape(B, T, H * d).backward(g)


for dt in (getattr(torch, n) for n in args.dtypes.split(",")):
    for T in map(int, args.lengths.split(",")):
        B = 4000 // T
        for causal in (False, True):
            qkv = (torch.randn(B, T, 3 * H * d) * args.scale).to(dt).requires_grad_()
            lens = torch.randint(T // 2, T + 1, (B,))
            mask = (torch.arange(T)[None] < lens[:, None])[:, None, None, :]
            g = torch.randn(B, T, H * d, dtype=dt)
            fs = {"old": partial(run, old, qkv, mask, causal, g),
                  "new": partial(run, new, qkv, mask, causal, g)}
            if dt == torch.float32:
                fs["flash"] = partial(sdpa, qkv, mask, causal, g)
            ts = {n: [] for n in fs}
            for _ in range(args.rounds):
                for n, f in fs.items():
                    t = time.perf_counter()
                    f()
                    ts[n].append(time.perf_counter() - t)
                    qkv.grad = None
            med = {n: statistics.median(v) * 1e3 for n, v in ts.items()}
            line = " ".join(f"{n} {m:6.1f}" for n, m in med.items())
            extra = f"  flash/new {med['flash'] / med['new']:.2f}x" if "flash" in med else ""
            print(f"{str(dt)[6:]:8} T {T:3} {'causal' if causal else 'padded'}: {line} ms"
                  f"  old/new {med['old'] / med['new']:.2f}x{extra}", flush=True)
kernels._extension = new

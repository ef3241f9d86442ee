"""The residual block's C++ kernel alone on one thread and two: 3,900 x 256 rows, out bf16,
dropout 0.2; ms a call, median of 40 (residual_threads_micro.txt). Run from the repository
root: python docs/results/multi30k/bf16-amx/row-threads/residual_threads_micro.py"""

import statistics
import time

import torch

from aiayn.kernels import cpu_extension, keep_threshold

ext = cpu_extension()
junk = torch.empty(64 * 1024 * 1024 // 4)  # touched before a call: caches flushed


def timed(fn, n=40, before=None):
    for _ in range(3):
        fn()
    times = []
    for _ in range(n):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


m, d = 3900, 256
x, out = torch.randn(m, d), torch.randn(m, d).to(torch.bfloat16)
gamma, beta = torch.ones(d), torch.zeros(d)
threshold, scale = keep_threshold(0.2)
seed = torch.tensor(5)
a, w = torch.randn(m, 1024).to(torch.bfloat16), torch.randn(256, 1024).to(torch.bfloat16)
_, xhat, mask, rstd = ext.forward(x, out, gamma, beta, threshold, scale, 1e-5, seed)
dy = torch.randn(m, d)


def forward():
    return ext.forward(x, out, gamma, beta, threshold, scale, 1e-5, seed)


def backward():
    return ext.backward(dy, xhat, mask, rstd, gamma, scale, torch.bfloat16)


def flush():
    junk.add_(1)


def product():  # a 4,096 x 1,024 x 256 product first, as in the step
    torch.mm(a, w.t(), out=out)


print("threads  fwd hot  flushed  after-mm | bwd hot  flushed")
for threads in (1, 2, 1, 2):
    torch.set_num_threads(threads)
    print(f"{threads:<8} {timed(forward):<8.3f} {timed(forward, before=flush):<8.3f} "
          f"{timed(forward, before=product):<8.3f} | {timed(backward):<8.3f} "
          f"{timed(backward, before=flush):.3f}")

"""The residual block's twin alone, on one multi30k-sized block (4,048 x 256, padded to 4,096):
ms per call of the kernel with and without the twin, beside the casts the twin replaced.

Runs against commit 77c3217's kernel (the twin was reverted after it), from a checkout of it,
with tcmalloc preloaded (``LD_PRELOAD=libtcmalloc_minimal.so.4 .venv/bin/python`` and this
file's path; the output of 2026-12-03 on 2 AMX cores is twin_micro.txt beside it).
"""

import time

import torch

from aiayn import kernels

ext = kernels.cpu_extension()
torch.manual_seed(0)
m, d, rows = 4048, 256, 4096
x, out = torch.randn(m, d), torch.randn(m, d).bfloat16()
w, b = torch.ones(d), torch.zeros(d)
seed = torch.tensor(5)
dy, tg = torch.randn(m, d), torch.randn(rows, d).bfloat16()


def forward(twin_rows):
    return ext.forward(x, out, w, b, 6554, 1 / 0.8, 1e-5, seed, twin_rows)


def backward(twin_grad):
    _, xhat, mask, rstd, _ = forward(0)
    return lambda: ext.backward(dy, twin_grad, xhat, mask, rstd, w, 1 / 0.8, torch.bfloat16)


def pad_cast():  # what the product did without a twin: the fp32 rows cast into padded bf16
    return kernels._pad_rows_into(x, rows, torch.bfloat16)


def cast_back_and_add():  # and its input gradient cast back and summed by autograd
    return dy.add_(tg[:m].float())


cases = {"fwd": lambda: forward(0), "fwd+twin": lambda: forward(rows), "pad cast": pad_cast,
         "bwd": backward(torch.empty(0, dtype=torch.bfloat16)), "bwd+twin": backward(tg),
         "cast back+add": cast_back_and_add}
for _ in range(3):
    ms = {}
    for name, call in cases.items():
        for _ in range(3):
            call()
        start = time.perf_counter()
        for _ in range(30):
            call()
        ms[name] = (time.perf_counter() - start) / 30 * 1e3
    print("  ".join(f"{name} {v:.3f}" for name, v in ms.items()))

import time, torch
from aiayn import kernels
ext = kernels.cpu_extension()
torch.manual_seed(0)
m, d, rows = 4048, 256, 4096
x = torch.randn(m, d); out = torch.randn(m, d).bfloat16(); w = torch.ones(d); b = torch.zeros(d)
seed = torch.tensor(5)
dy = torch.randn(m, d); tg = torch.randn(rows, d).bfloat16()
def fw(tr):
    return ext.forward(x, out, w, b, 6554, 1/0.8, 1e-5, seed, tr)
def bw(t):
    y, xhat, mask, rstd, _ = fw(0)
    return lambda: ext.backward(dy, t, xhat, mask, rstd, w, 1/0.8, torch.bfloat16)
cast = lambda: kernels._pad_rows_into(x, rows, torch.bfloat16)
back_cast = lambda: dy.add_(tg[:m].float())
cases = {"fwd": lambda: fw(0), "fwd+twin": lambda: fw(rows), "pad cast": cast,
         "bwd": bw(torch.empty(0, dtype=torch.bfloat16)), "bwd+twin": bw(tg), "cast back+add": back_cast}
for rnd in range(3):
    res = {}
    for k, f in cases.items():
        for _ in range(3): f()
        t = time.perf_counter()
        for _ in range(30): f()
        res[k] = (time.perf_counter() - t) / 30 * 1e3
    print("  ".join(f"{k} {v:.3f}" for k, v in res.items()))

import torch, time, statistics as st, sys
sys.path.insert(0,'/work/main')
from aiayn.kernels import cpu_extension, keep_threshold
ext=cpu_extension()
junk=torch.empty(64*1024*1024//4)
def t(f, n=40, pre=None):
    for _ in range(3): f()
    ts=[]
    for _ in range(n):
        if pre: pre()
        a=time.perf_counter(); f(); ts.append(time.perf_counter()-a)
    return st.median(ts)*1e3
m,d=3900,256
x=torch.randn(m,d); out=torch.randn(m,d).to(torch.bfloat16); g=torch.ones(d); b=torch.zeros(d)
th,sc=keep_threshold(0.2); seed=torch.tensor(5)
a=torch.randn(m,1024).to(torch.bfloat16); w=torch.randn(256,1024).to(torch.bfloat16)
y,xh,mask,rs=ext.forward(x,out,g,b,th,sc,1e-5,seed)
dy=torch.randn(m,d)
for nt in (1,2,1,2):
    torch.set_num_threads(nt)
    f=lambda: ext.forward(x,out,g,b,th,sc,1e-5,seed)
    bw=lambda: ext.backward(dy,xh,mask,rs,g,sc,torch.bfloat16)
    print(nt, "fwd hot %.3f flushed %.3f after-mm %.3f | bwd hot %.3f flushed %.3f" % (t(f), t(f,pre=lambda: junk.add_(1)), t(f, pre=lambda: torch.mm(a,w.t(),out=out)), t(bw), t(bw,pre=lambda: junk.add_(1))))

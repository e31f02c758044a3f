import torch
from core.kernels import int8_linear as m
g=torch.Generator().manual_seed(1)
def check(kernel, qa, qw):
    ok=True
    for mode in ("rand","extreme"):
        if mode=="rand":
            w=torch.randint(-qw,qw+1,(160,4864),generator=g,dtype=torch.int8); x=torch.randint(-qa,qa+1,(64,4864),generator=g,dtype=torch.int8)
        else:
            w=(torch.randint(0,2,(160,4864),generator=g)*2-1).to(torch.int8)*qw; x=(torch.randint(0,2,(64,4864),generator=g)*2-1).to(torch.int8)*qa
            w[:80]=qw; x[:32]=qa; x[32:40]=-qa
        wt=m._packed(w, torch.ones(160), kernel)
        exact=(x.double()@w.double().T).float()
        for r in (1,2,4,17,64):
            if not torch.equal(m._int8_call(x[:r],wt), exact[:r]): ok=False
    return ok
for k in m.KERNELS:
    for qa,qw in ((127,127),(63,127),(127,63),(63,63),(127,64),(64,127)):
        print(k,qa,qw,check(k,qa,qw))

"""Which int8 matmuls sum exactly, and how fast, when oneDNN and ATen are held to AVX2 (docs/benchmarks.md,
"int8 on AVX2-only CPUs"). Run it as is and with `ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`."""
import os
import time

import torch


def timed(call, reps=30):
    for _ in range(3):
        call()
    start = time.perf_counter()
    for _ in range(reps):
        call()
    return (time.perf_counter() - start) / reps * 1e3


def onednn(x, zero, packed, out):
    """oneDNN's int8 linear: the exact int32 sums of (x - zero) and the int8 weight, as fp32."""
    ones, zeros = torch.ones(out), torch.zeros(out, dtype=torch.long)
    if x.shape[0] < 4:  # as core/kernels/int8_linear.py: short calls zero-padded
        x = torch.cat([x, x.new_full((4 - x.shape[0], x.shape[1]), zero)])
    return torch.ops.onednn.qlinear_pointwise(x, 1.0, zero, packed, ones, zeros, None, 1.0, 0, torch.float32,
                                              "none", [], "")


print(f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA')}, ATen {torch.backends.cpu.get_cpu_capability()}")
gen = torch.Generator().manual_seed(0)
out, inp = 160, 4864
w = torch.randint(-127, 128, (out, inp), generator=gen, dtype=torch.int8)
packed = torch.ops.onednn.qlinear_prepack(w, None)
for lo, hi, zero, name in [(-127, 128, 0, "s8 activations (today's int8 backend)"),
                           (0, 128, 64, "u8 activations of 7 bits, zero point 64"),
                           (0, 256, 128, "u8 activations of 8 bits, zero point 128")]:
    x = torch.randint(lo, hi, (300, inp), generator=gen, dtype=torch.int16)
    q = x.to(torch.uint8 if lo >= 0 else torch.int8)
    exact = ((x.double() - zero) @ w.double().T).float()
    ok = sum(torch.equal(onednn(q[:m], zero, packed, out)[:m], exact[:m]) for m in (*range(1, 41), 300))
    print(f"oneDNN, {name}: exact integer sums at {ok} of 41 row counts")

# One Qwen2.5-1.5B MLP weight (8960 x 1536): ms a call by rows.
W = torch.randn(8960, 1536)
scale = W.abs().amax(1) / 127
Wq = (W / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
P = torch.ops.onednn.qlinear_prepack(Wq, None)
for m in (1, 4, 16):
    x = torch.randn(m, 1536)
    s8 = torch.randint(-127, 128, (m, 1536), dtype=torch.int8)
    u8 = torch.randint(0, 128, (m, 1536), dtype=torch.uint8)
    xb, sb, Wb = x.bfloat16(), scale.bfloat16(), W.bfloat16()
    print(f"{m:2d} rows: fp32 F.linear {timed(lambda: torch.nn.functional.linear(x, W)):.2f} ms, "
          f"bf16 F.linear {timed(lambda: torch.nn.functional.linear(xb, Wb)):.2f}, "
          f"oneDNN s8 {timed(lambda: onednn(s8, 0, P, 8960)):.2f}, u8 {timed(lambda: onednn(u8, 64, P, 8960)):.2f}, "
          f"weight-only int8 fp32 {timed(lambda: torch.ops.aten._weight_int8pack_mm(x, Wq, scale)):.2f}, "
          f"bf16 {timed(lambda: torch.ops.aten._weight_int8pack_mm(xb, Wq, sb)):.2f}")
xb = torch.randn(40, 1536).bfloat16()
one = torch.cat([torch.ops.aten._weight_int8pack_mm(xb[i:i + 1], Wq, scale.bfloat16()) for i in range(40)])
ok = sum(torch.equal(torch.ops.aten._weight_int8pack_mm(xb[:m], Wq, scale.bfloat16()), one[:m]) for m in range(1, 41))
print(f"weight-only int8 (bf16 activations): rows equal their one-row calls at {ok} of 40 row counts")

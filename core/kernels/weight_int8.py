"""Linear layers with int8 weights and fp32 activations, for the `weight-int8` backend (the `fast`
default where it is the fastest exact backend: AVX2-only CPUs; docs/exactness.md, weight-only int8).

Each weight is quantized once, on first use, by symmetric per-channel scales (absmax / 127, fp32)
and packed as the kernel reads it (panels of 16 channels, k-major); a call's rows go in as fp32
and come out in fp32, each output one chain of FMAs over the input in order (weight_int8.c, AVX2
+ FMA: a GEMM micro-kernel, tiles of up to 6 rows x 16 channels in registers; calls of many rows
convert each panel to fp32 once, which changes no sum). A decode step then streams a quarter
of an fp32 weight's bytes. What a drafting backend needs is that a row of a call of any row count
comes out bit for bit as its one-row call: the kernel computes every output in one fixed order,
whatever the other rows of its call or the thread that takes it; `weight_int8_runs` checks that
once per process, at 1..40 rows and at a prefill's row count, and the backend is refused where
it fails or the kernel cannot be built. Greedy output is then identical to this backend's own
one-token greedy decoding (not to fp32 greedy: the weights are rounded; docs/exactness.md).

The kernel is C, built once per machine with the system's C compiler (`cc`, else gcc) into
specsuite's cache and called through ctypes (which lets go of the GIL for the call): ATen has no
int8-weight kernel with fp32 activations that is fast on AVX2 (`_weight_int8pack_mm` takes bf16
rows and ran slower than fp32 from 4 rows on; docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch

from ..speculation.draft_budget import cache_root
from .int8_linear import Int8Weights, quantize_channels

SOURCE = Path(__file__).with_name("weight_int8.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]  # no -ffast-math: the order is the C's
# The kernel's version: what its measured step costs are kept under (backend.py, `Backend.cost_key`).
KERNEL_VERSION = hashlib.sha1(SOURCE.read_bytes()).hexdigest()[:12]


class WeightInt8(NamedTuple):
    """A weight's int8 values packed as the kernel reads them (`kernel_layout`), (panels, in, a
    panel's channels) with the channels padded with zeros to whole groups of panels, and its fp32
    channel scales (out,)."""

    q: torch.Tensor
    scale: torch.Tensor


class WeightInt8Store(Int8Weights):
    """The int8 form of each weight a backend's forwards use (`quantized_weight`), and the last
    input as contiguous fp32 rows (`Int8Weights`' cache: q, k and v read one input). A backend owns one."""

    def __init__(self) -> None:
        super().__init__(quantized_weight, lambda rows: rows.to(torch.float32).contiguous())


@functools.cache
def kernel_layout() -> tuple[int, int]:
    """The weight layout the kernel reads (weight_int8.c): panels of `panel` channels, k-major, in
    groups of `group` panels."""
    library = kernel_library()
    return ctypes.c_long.in_dll(library, "weight_int8_panel").value, ctypes.c_long.in_dll(library, "weight_int8_group").value


def quantized_weight(weight: torch.Tensor) -> WeightInt8:
    q, scale = quantize_channels(weight, scale_dtype=torch.float32)
    (panel, group), (out, k) = kernel_layout(), q.shape
    width = panel * group
    padded = torch.zeros(-(-out // width) * width, k, dtype=torch.int8)
    padded[:out] = q
    return WeightInt8(padded.view(-1, panel, k).transpose(1, 2).contiguous(), scale)


def compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


@functools.cache
def kernel_library() -> ctypes.CDLL:
    """The built kernel, loaded: built once per source, compiler and flags into the cache (a
    finished file renamed into place, so a crash never leaves half a library)."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) to build the weight-int8 kernel")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha1("\n".join([KERNEL_VERSION, cc, version, *FLAGS]).encode()).hexdigest()[:16]
    path = cache_root() / "kernels" / f"weight_int8-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            built = Path(tmp) / path.name
            done = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(built)], capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"building the weight-int8 kernel failed: {done.stderr.strip()[-2000:]}")
            os.replace(built, path)
    library = ctypes.CDLL(str(path))
    pointer, size = ctypes.c_void_p, ctypes.c_long
    library.weight_int8_mm.argtypes = [pointer, size, size, pointer, pointer, pointer, size, pointer, ctypes.c_int]
    library.weight_int8_mm.restype = None
    return library


def weight_int8_call(x: torch.Tensor, weight: WeightInt8, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (m, in) contiguous fp32 -> (m, out) fp32: each output its row's sum over the int8 weight,
    times its channel's scale, plus the bias (fp32, or None)."""
    (m, k), n = x.shape, weight.scale.shape[0]
    if x.dtype != torch.float32 or not x.is_contiguous() or k != weight.q.shape[1]:
        raise ValueError(f"weight-int8 takes contiguous fp32 rows of {weight.q.shape[1]}, not {x.dtype} {tuple(x.shape)}")
    y = torch.empty(m, n, dtype=torch.float32)
    kernel_library().weight_int8_mm(x.data_ptr(), m, k, weight.q.data_ptr(), weight.scale.data_ptr(),
                                    None if bias is None else bias.data_ptr(), n, y.data_ptr(),
                                    torch.get_num_threads())
    return y


def weight_int8_rows(layer: torch.nn.Linear, x: torch.Tensor, block: int, store: WeightInt8Store) -> torch.Tensor:
    """x (1, rows, in) -> (1, rows, out) in x's dtype, every row as its one-row call, in one call
    whatever `block` is (a prefill's rows compute as any other row here)."""
    bias = None if layer.bias is None else layer.bias.detach().to(torch.float32).contiguous()
    return weight_int8_call(store.rows(x), store(layer.weight), bias).to(x.dtype)[None]


@functools.cache
def weight_int8_runs() -> bool:
    """Whether the kernel builds and runs here and computes every row of a call of 1..40 rows and
    of a prefill's row count bit for bit as its one-row call (random rows, a wide input, in any
    place of the call, with a bias). Checked once per process."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):  # x86 with AVX2 and FMA
        return False
    gen = torch.Generator().manual_seed(0)
    try:
        weight = quantized_weight(torch.randn(160, 4864, generator=gen))
        bias = torch.randn(160, generator=gen)
        x = torch.randn(300, 4864, generator=gen)
        alone = torch.cat([weight_int8_call(x[i: i + 1], weight, bias) for i in range(x.shape[0])])
        calls = [(0, m) for m in range(1, 41)] + [(0, 300), (5, 37), (101, 300)]
        return all(torch.equal(weight_int8_call(x[a:b], weight, bias), alone[a:b]) for a, b in calls)
    except (RuntimeError, OSError):  # no compiler, a failed build, or a library that does not load
        return False

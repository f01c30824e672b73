"""Backend choice and the row view every entry point works on: `[R, K]` rows, one float32 amax per row.

Below both the public entry points (api.py) and the tensor types (tensor.py): `NVFP4Tensor.dequantize`
runs `dequantize` from here, so the tensor type never imports the dispatcher that imports it.
"""

from typing import Literal

import torch

from . import reference
from .format import BLOCK_SIZE

Backend = Literal["auto", "torch", "triton", "compiled", "native"]


def check_amax_sign(global_amax: torch.Tensor) -> None:
    """A global amax is a magnitude: a negative one (or -0.0) would flip every scale's sign, and the
    kernels do not define that. NaN / +inf are allowed (they mark the row NaN, documented)."""
    negative = torch.signbit(global_amax) & ~torch.isnan(global_amax)
    if global_amax.device.type == "cpu":
        if bool(negative.any()):
            bad = global_amax[negative][:4].tolist()
            raise ValueError(f"global_amax must be >= +0 (it is a magnitude), got {bad}")
    else:
        # No host sync on the device path: a device-side assert stops the stream with this message.
        torch._assert_async(~negative.any(), "trace_kernels: global_amax must be >= +0 (it is a magnitude)")


def rows_amax(global_amax: torch.Tensor, lead_shape: torch.Size, device) -> torch.Tensor:
    """Expand a per-tensor amax to one value per row, or check a per-row one; returns float32 [R]."""
    if not isinstance(global_amax, torch.Tensor):
        raise TypeError(f"global_amax must be a float32 torch.Tensor, got {type(global_amax).__name__}")
    if global_amax.dtype != torch.float32:
        raise ValueError(f"global_amax must be float32, got {global_amax.dtype}")
    if global_amax.device != torch.device(device):
        raise ValueError(f"global_amax is on {global_amax.device}, the data on {device}")
    check_amax_sign(global_amax)
    rows = 1
    for d in lead_shape:
        rows *= d
    if global_amax.numel() == 1:
        return global_amax.reshape(1).expand(rows).contiguous()
    if tuple(global_amax.shape) != tuple(lead_shape):
        raise ValueError(
            f"global_amax has shape {tuple(global_amax.shape)}: expected one element (per tensor) "
            f"or {tuple(lead_shape)} (one per row)"
        )
    return global_amax.reshape(rows).contiguous()


def resolve_backend(backend: Backend, device: torch.device, block_scale: str = "6") -> str:
    """`"auto"` picks Triton for CUDA tensors and, elsewhere, the torch reference or (with
    `TRACE_FP4_CPU_BACKEND=compiled`) its compiled pieces (cpu_compiled.py), or (`=native`) the numba
    kernels (cpu_native/); all agree bit for bit. A piece with no native kernel runs "torch" when its
    caller gets "native" back and counts it (cpu_native.count_eager).
    The compiled pieces implement the default block scale: under 4over6 a "compiled" choice runs the
    torch reference instead, counted (cpu_compiled.fallbacks(), kept_eager:block_scale_4over6)."""
    device = torch.device(device)
    if backend == "auto":
        if device.type == "cuda":
            return "triton"
        from . import envs

        backend = {"compiled": "compiled", "native": "native"}.get(envs.TRACE_FP4_CPU_BACKEND, "torch")
    elif backend not in ("torch", "triton", "compiled", "native"):
        raise ValueError(f"backend must be 'auto', 'torch', 'triton', 'compiled' or 'native', got {backend!r}")
    elif backend in ("compiled", "native") and device.type != "cpu":
        raise ValueError(f"backend {backend!r} is a CPU path; the data is on {device}")
    if backend == "compiled" and block_scale != "6":
        from . import cpu_compiled

        cpu_compiled.count_eager("block_scale_4over6")
        return "torch"
    return backend


def dequantize(q, dtype: torch.dtype = torch.float32, *, backend: Backend = "auto", block_scale: str = "6") -> torch.Tensor:
    """The values an NVFP4Tensor `q` stands for, in `dtype` (`block_scale`: the rule it was quantized
    with, which sets its global scale: 448 * 6 / amax, or 256 * 6 / amax for 4over6)."""
    lead, K = q.shape[:-1], q.shape[-1]
    amax = rows_amax(q.global_amax, lead, q.codes.device)
    codes, scales = q.codes.reshape(-1, K // 2), q.scales.reshape(-1, K // BLOCK_SIZE)
    chosen = resolve_backend(backend, q.codes.device, block_scale)
    if chosen == "native":
        from .cpu_native import quantize as native

        out = native.dequantize(codes, scales, amax, block_scale)
    elif chosen == "triton":
        from . import triton_kernels

        out = triton_kernels.dequantize(codes, scales, amax, block_scale)
    elif chosen == "compiled":
        from . import cpu_compiled

        out = cpu_compiled.dequantize(codes, scales, amax)
    else:
        out = dequantize_torch(codes, scales, amax, block_scale)
    return out.reshape(*lead, K).to(dtype)


def dequantize_torch(codes, scales, amax, block_scale: str = "6") -> torch.Tensor:
    """The reference's dequantized values: the default rule in fewer ops (grouped_mm.reference's tables,
    bit-identical, tested), 4over6 through the reference itself."""
    if block_scale == "6":
        from .grouped_mm.reference import dequantize_rows  # (imported here: grouped_mm imports this package)

        return dequantize_rows(codes, scales, amax)
    return reference.dequantize(codes, scales, amax, block_scale)

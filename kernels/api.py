"""Public entry points: validation, shape handling and backend dispatch.

Everything here reshapes to `[R, K]` rows with one float32 global amax per row, calls the torch reference
or the Triton kernels, and reshapes back. Backends agree bit for bit; `"auto"` picks Triton for CUDA
tensors and the torch reference elsewhere.
"""

from typing import Literal

import torch

from . import reference
from .format import BLOCK_SIZE
from .tensor import CompactGuide, NVFP4Tensor

Backend = Literal["auto", "torch", "triton"]
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_input(x: torch.Tensor, what: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{what} must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() > 0 and x.shape[-1] == 0:
        raise ValueError(f"{what} has shape {tuple(x.shape)}: its last dimension is empty (NVFP4 quantizes rows of it)")
    if x.dim() == 0 or x.shape[-1] % BLOCK_SIZE != 0:
        raise ValueError(
            f"{what} has shape {tuple(x.shape)}: NVFP4 needs a last dimension divisible by "
            f"{BLOCK_SIZE} (one E4M3 scale per {BLOCK_SIZE} consecutive elements)"
        )


def _check_amax_sign(global_amax: torch.Tensor) -> None:
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


def _rows_amax(global_amax: torch.Tensor, lead_shape: torch.Size, device) -> torch.Tensor:
    """Expand a per-tensor amax to one value per row, or check a per-row one; returns float32 [R]."""
    if not isinstance(global_amax, torch.Tensor):
        raise TypeError(f"global_amax must be a float32 torch.Tensor, got {type(global_amax).__name__}")
    if global_amax.dtype != torch.float32:
        raise ValueError(f"global_amax must be float32, got {global_amax.dtype}")
    if global_amax.device != torch.device(device):
        raise ValueError(f"global_amax is on {global_amax.device}, the data on {device}")
    _check_amax_sign(global_amax)
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


def _resolve(backend: Backend, device: torch.device) -> str:
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend not in ("torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    return backend


def row_amax(x: torch.Tensor) -> torch.Tensor:
    """Per-row (per-token) global amax, float32 `x.shape[:-1]`. Batch invariant: a max is exact."""
    return x.abs().amax(dim=-1).to(torch.float32)


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """Per-tensor global amax, float32 with one element."""
    return x.abs().amax().to(torch.float32).reshape(1)


def _check_guide(x: torch.Tensor, guide) -> None:
    if not isinstance(guide, (NVFP4Tensor, CompactGuide)):
        raise TypeError(f"guide must be an NVFP4Tensor or a CompactGuide, got {type(guide).__name__}")
    if tuple(guide.shape) != tuple(x.shape):
        raise ValueError(f"guide covers shape {tuple(guide.shape)} but x has shape {tuple(x.shape)}")


def _run(x, global_amax, guide, *, capture: bool, out_dtype, backend: Backend):
    """The one dispatch point: RTN (guide is None, with `global_amax`) or guided rounding, on rows.

    Returns (NVFP4Tensor or None, dequantized tensor or None)."""
    _check_input(x)
    lead, K = x.shape[:-1], x.shape[-1]
    if guide is not None:
        _check_guide(x, guide)
        global_amax = guide.global_amax
    amax = _rows_amax(global_amax, lead, x.device)
    x2 = x.reshape(-1, K)
    use_triton = _resolve(backend, x.device) == "triton"
    if guide is None:
        if use_triton:
            from . import triton_kernels

            codes, scales, out = triton_kernels.quantize(x2, amax, out_dtype=out_dtype, capture=capture)
        else:
            codes, scales = reference.quantize(x2, amax)
    else:
        g_scales = guide.scales.reshape(-1, K // BLOCK_SIZE)
        full = isinstance(guide, NVFP4Tensor)
        if use_triton:
            from . import triton_kernels

            target = guide.codes.reshape(-1, K // 2) if full else guide.mbits.reshape(-1, K // 8)
            codes, scales, out = triton_kernels.quantize_guided(
                x2, g_scales, amax, target, full=full, out_dtype=out_dtype, capture=capture
            )
        elif full:
            codes, scales = reference.quantize_guided(x2, g_scales, amax, codes=guide.codes.reshape(-1, K // 2))
        else:
            bits = guide.unpacked_bits().reshape(-1, K)
            codes, scales = reference.quantize_guided(x2, g_scales, amax, mbits=bits)
    if not use_triton and out_dtype is not None:
        out = reference.dequantize(codes, scales, amax).to(out_dtype)
    q = None
    if capture:
        q = NVFP4Tensor(codes.reshape(*lead, K // 2), scales.reshape(*lead, K // BLOCK_SIZE), global_amax)
    if out_dtype is None:
        out = None
    else:
        out = out.reshape(x.shape)
    return q, out


def quantize(x: torch.Tensor, global_amax: torch.Tensor, *, backend: Backend = "auto") -> NVFP4Tensor:
    """Round-to-nearest NVFP4 (DESIGN.md section 3)."""
    return _run(x, global_amax, None, capture=True, out_dtype=None, backend=backend)[0]


def quantize_guided(
    x: torch.Tensor,
    guide: NVFP4Tensor | CompactGuide | None,
    *,
    global_amax: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> NVFP4Tensor:
    """Round `x` with the guide's scales toward the guide's codewords (DESIGN.md section 4).

    `guide=None` is plain round-to-nearest with the caller's own `global_amax` (required then).
    The result carries the guide's scales and global amax.
    """
    if guide is None and global_amax is None:
        raise ValueError("quantize_guided without a guide needs the trainer's own global_amax")
    return _run(x, global_amax, guide, capture=True, out_dtype=None, backend=backend)[0]


def quantize_dequantize(
    x: torch.Tensor,
    *,
    global_amax: torch.Tensor | None = None,
    guide: NVFP4Tensor | CompactGuide | None = None,
    capture: bool = True,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, NVFP4Tensor | None]:
    """Fake quantization in one pass: returns (dequantized values in x's dtype, captured NVFP4Tensor or
    None). This is what an engine without FP4 GEMMs runs on an activation. Without a guide,
    `global_amax` defaults to the per-row amax of `x` (batch invariant)."""
    if guide is None and global_amax is None:
        global_amax = row_amax(x)
    q, out = _run(x, global_amax, guide, capture=capture, out_dtype=x.dtype, backend=backend)
    return out, q


def dequantize(q: NVFP4Tensor, dtype: torch.dtype = torch.float32, *, backend: Backend = "auto") -> torch.Tensor:
    lead, K = q.shape[:-1], q.shape[-1]
    amax = _rows_amax(q.global_amax, lead, q.codes.device)
    codes, scales = q.codes.reshape(-1, K // 2), q.scales.reshape(-1, K // BLOCK_SIZE)
    if _resolve(backend, q.codes.device) == "triton":
        from . import triton_kernels

        out = triton_kernels.dequantize(codes, scales, amax)
    else:
        out = reference.dequantize(codes, scales, amax)
    return out.reshape(*lead, K).to(dtype)

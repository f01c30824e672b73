"""Public entry points: validation, shape handling and backend dispatch.

Everything here reshapes to `[R, K]` rows with one float32 global amax per row, calls the torch reference
or the Triton kernels, and reshapes back. Backends agree bit for bit; `"auto"` picks Triton for CUDA
tensors and the torch reference elsewhere.
"""

import torch

from .backend import Backend, dequantize, dequantize_torch, resolve_backend
from .backend import rows_amax as _rows_amax
from .format import BLOCK_SIZE, check_block_scale
from .guides.base import Guide
from .tensor import NVFP4Tensor

__all__ = ["Backend", "dequantize", "quantize", "quantize_dequantize", "quantize_guided", "row_amax", "tensor_amax"]
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


def row_amax(x: torch.Tensor) -> torch.Tensor:
    """Per-row (per-token) global amax, float32 `x.shape[:-1]`. Batch invariant: a max is exact."""
    return x.abs().amax(dim=-1).to(torch.float32)


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """Per-tensor global amax, float32 with one element."""
    return x.abs().amax().to(torch.float32).reshape(1)


def _check_guide(x: torch.Tensor, guide) -> None:
    if not isinstance(guide, Guide):
        raise TypeError(f"guide must be a trace_kernels Guide (NVFP4Tensor, CompactGuide, SparseGuide), got {type(guide).__name__}")
    if tuple(guide.shape) != tuple(x.shape):
        raise ValueError(f"guide covers shape {tuple(guide.shape)} but x has shape {tuple(x.shape)}")


def _run(x, global_amax, guide, *, capture: bool, out_dtype, backend: Backend, block_scale: str = "6"):
    """The one dispatch point: RTN (guide is None, with `global_amax`) or guided rounding, on rows.

    Returns (NVFP4Tensor or None, dequantized tensor or None)."""
    _check_input(x)
    check_block_scale(block_scale)
    lead, K = x.shape[:-1], x.shape[-1]
    if guide is not None:
        _check_guide(x, guide)
        guide, _ = guide.rounding_target(x, block_scale=block_scale)  # a sparse guide decodes against x first
        global_amax = guide.global_amax
    amax = _rows_amax(global_amax, lead, x.device)
    x2 = x.reshape(-1, K)
    chosen = resolve_backend(backend, x.device, block_scale)
    use_triton = chosen == "triton"
    if chosen == "native" and guide is not None:
        from .cpu_native import guided  # a full or compact guide: what `rounding_target` hands over

        codes, scales, out = guided.quantize_guided(x2, amax, guide, block_scale, out_dtype)
    elif chosen == "native":
        from .cpu_native import quantize as native

        codes, scales, out = native.quantize(x2, amax, out_dtype, block_scale)
    elif chosen == "compiled":
        codes, scales, out = _run_compiled(x2, amax, guide, out_dtype)
    elif guide is None:
        if use_triton:
            from . import triton_kernels

            codes, scales, out = triton_kernels.quantize(x2, amax, out_dtype=out_dtype, capture=capture,
                                                         block_scale=block_scale)
        else:
            from .grouped_mm.reference import quantize_rows  # the contract's bits in fewer ops (tested)

            codes, scales = quantize_rows(x2, amax, block_scale)
    else:
        codes, scales, out = guide.round_rows(x2, amax, use_triton=use_triton, out_dtype=out_dtype, capture=capture,
                                              block_scale=block_scale)
    if chosen == "torch" and out_dtype is not None:
        out = dequantize_torch(codes, scales, amax, block_scale).to(out_dtype)
    q = None
    if capture:
        q = NVFP4Tensor(codes.reshape(*lead, K // 2), scales.reshape(*lead, K // BLOCK_SIZE), global_amax)
    if out_dtype is None:
        out = None
    else:
        out = out.reshape(x.shape)
    return q, out


def _run_compiled(x2, amax, guide, out_dtype):
    """The CPU compiled path (cpu_compiled.py): RTN or guided rounding (a full or compact guide: what
    `rounding_target` hands over), the dequantized output fused in the same compiled piece."""
    from . import cpu_compiled
    from .guides.compact import CompactGuide

    if guide is None:
        return cpu_compiled.quantize(x2, amax, out_dtype)
    K = x2.shape[-1]
    scales = guide.scales.reshape(-1, K // BLOCK_SIZE)
    if isinstance(guide, CompactGuide):
        mbits = guide.unpacked_bits().reshape(-1, K)
        return cpu_compiled.quantize_guided(x2, scales, amax, mbits=mbits, out_dtype=out_dtype)
    if isinstance(guide, NVFP4Tensor):
        codes = guide.codes.reshape(-1, K // 2)
        return cpu_compiled.quantize_guided(x2, scales, amax, codes=codes, out_dtype=out_dtype)
    raise TypeError(f"{type(guide).__name__} has no compiled guided rounding")


def quantize(x: torch.Tensor, global_amax: torch.Tensor, *, backend: Backend = "auto", block_scale: str = "6") -> NVFP4Tensor:
    """Round-to-nearest NVFP4 (docs/architecture.md: the numerics). `block_scale`: "6" (the contract) or
    "4over6" (docs/four_over_six.md)."""
    return _run(x, global_amax, None, capture=True, out_dtype=None, backend=backend, block_scale=block_scale)[0]


def quantize_guided(
    x: torch.Tensor,
    guide: Guide | None,
    *,
    global_amax: torch.Tensor | None = None,
    backend: Backend = "auto",
    block_scale: str = "6",
) -> NVFP4Tensor:
    """Round `x` with the guide's scales toward the guide's codewords (guided rounding).

    `guide=None` is plain round-to-nearest with the caller's own `global_amax` (required then).
    The result carries the guide's scales and global amax.
    """
    if guide is None and global_amax is None:
        raise ValueError("quantize_guided without a guide needs the trainer's own global_amax")
    return _run(x, global_amax, guide, capture=True, out_dtype=None, backend=backend, block_scale=block_scale)[0]


def quantize_dequantize(
    x: torch.Tensor,
    *,
    global_amax: torch.Tensor | None = None,
    guide: Guide | None = None,
    capture: bool = True,
    backend: Backend = "auto",
    block_scale: str = "6",
) -> tuple[torch.Tensor, NVFP4Tensor | None]:
    """Fake quantization in one pass: returns (dequantized values in x's dtype, captured NVFP4Tensor or
    None). This is what an engine without FP4 GEMMs runs on an activation. Without a guide,
    `global_amax` defaults to the per-row amax of `x` (batch invariant)."""
    if guide is None and global_amax is None:
        global_amax = row_amax(x)
    q, out = _run(x, global_amax, guide, capture=capture, out_dtype=x.dtype, backend=backend, block_scale=block_scale)
    return out, q

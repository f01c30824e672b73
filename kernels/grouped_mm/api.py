"""`grouped_mm`: the NVFP4 MoE GEMM over expert-sorted rows (modelled on torchao's
`prototype/mx_formats/grouped_mm`): one entry point, `offs` in the `torch._grouped_mm` convention
(cumulative rows per expert), an explicit backend.

    out[m, :] = dequant(quantize(a[a_rows[m]])) @ dequant(W[e(m)])^T  (+ bias[e(m)])  (numerics: reference.py)

A is quantized on load with the contract (global amax per source row: per token by default, or one
static value), so the GEMM consumes exactly the codes it can capture; `capture` receives them.
"""

from typing import Literal

import torch

from ..api import row_amax
from ..backend import resolve_backend
from ..format import BLOCK_SIZE
from ..tensor import NVFP4Tensor
from . import reference
from .weights import PackedExperts

Backend = Literal["auto", "torch", "triton", "compiled", "native"]


def _check(a, a_amax, a_rows, w: PackedExperts, offs, capture, bias) -> None:
    if a.dim() != 2 or a.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"a must be a 2-D float32/bfloat16/float16 tensor [rows, K], got {tuple(a.shape)} {a.dtype}")
    E, N, K = w.shape
    if a.shape[1] != K:
        raise ValueError(f"a has K={a.shape[1]} but the expert weights {tuple(w.shape)} have K={K}")
    if K % BLOCK_SIZE:
        raise ValueError(f"K={K} is not divisible by {BLOCK_SIZE}")
    if a_amax.dtype != torch.float32 or tuple(a_amax.shape) != (a.shape[0],):
        raise ValueError(f"a_amax must be float32 [{a.shape[0]}] (one per row of a), got {tuple(a_amax.shape)} {a_amax.dtype}")
    if a_rows is not None and (a_rows.dtype != torch.int64 or a_rows.dim() != 1):
        raise ValueError(f"a_rows must be a 1-D int64 tensor, got {a_rows.dtype} {tuple(a_rows.shape)}")
    if offs.dtype != torch.int32 or tuple(offs.shape) != (E,):
        raise ValueError(f"offs must be int32 [{E}] (cumulative rows per expert), got {offs.dtype} {tuple(offs.shape)}")
    for t, what in ((a_amax, "a_amax"), (offs, "offs"), (w.codes, "weights")) + (((a_rows, "a_rows"),) if a_rows is not None else ()):
        if t.device != a.device:
            raise ValueError(f"{what} is on {t.device}, a on {a.device}")
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (E, N) or bias.device != a.device):
        raise ValueError(
            f"bias must be float32 [{E}, {N}] (one row per expert) on {a.device}, got {bias.dtype} {tuple(bias.shape)} on {bias.device}"
        )
    if capture is not None:
        dest, codes, scales = capture
        M = a_rows.shape[0] if a_rows is not None else a.shape[0]
        if dest.dtype != torch.int64 or tuple(dest.shape) != (M,):
            raise ValueError(f"capture rows must be int64 [{M}], got {dest.dtype} {tuple(dest.shape)}")
        if codes.dtype != torch.uint8 or codes.shape[-1] != K // 2 or scales.dtype != torch.uint8 or scales.shape[-1] != K // BLOCK_SIZE:
            raise ValueError("capture codes/scales must be uint8 [rows, K/2] and [rows, K/16]")
        if not (codes.is_contiguous() and scales.is_contiguous()):
            raise ValueError("capture codes/scales must be contiguous")


def grouped_mm(
    a: torch.Tensor,
    w: PackedExperts,
    offs: torch.Tensor,
    *,
    a_amax: torch.Tensor | None = None,
    a_rows: torch.Tensor | None = None,
    capture: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    bias: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """NVFP4 grouped GEMM; returns fp32 [M, N].

    a       [Ra, K] source rows (model dtype)
    w       PackedExperts of W [E, N, K]
    offs    int32 [E]: rows offs[e-1]:offs[e] of the sorted rows belong to expert e
    a_amax  fp32 [Ra] global amax per source row, or one element (a static amax); default: row amax
    a_rows  int64 [M]: source row of each sorted row (None: the sorted rows are a itself)
    capture (dest int64 [M], codes uint8 [Rc, K/2], scales uint8 [Rc, K/16]): sorted row m's A codes
            go to row dest[m] (-1: not captured)
    bias    fp32 [E, N] or None: a per-expert bias added in fp32 after the global scales (gpt-oss's
            expert biases; not quantized, it never enters the FP4 dot)
    backend "torch" (reference), "compiled" (the reference's pieces compiled by inductor, CPU),
            "triton" (compiled on CUDA, interpreted on CPU), "auto" (Triton on CUDA tensors, elsewhere
            torch or, with TRACE_FP4_CPU_BACKEND=compiled, compiled)
    """
    if a_amax is None:
        a_amax = row_amax(a)
    elif a_amax.numel() == 1:
        a_amax = a_amax.reshape(1).expand(a.shape[0]).contiguous()
    _check(a, a_amax, a_rows, w, offs, capture, bias)
    backend = resolve_backend(backend, a.device, w.block_scale)  # "auto": Triton on CUDA
    if backend == "native":
        from .. import cpu_native

        if w.block_scale != "6":
            backend = cpu_native.torch_for("grouped_mm_4over6", "the native grouped GEMM implements the default block scale")
        else:
            from ..cpu_native import grouped_mm as native

            return native.grouped_mm(a, a_amax, a_rows, w.codes, w.scales, w.amax, offs, capture, bias)
    if backend in ("torch", "compiled"):
        return reference.grouped_mm(a, a_amax, a_rows, w.codes, w.scales, w.amax, offs, capture, bias, w.block_scale,
                                    compiled=backend == "compiled")
    from . import launch

    return launch.grouped_mm(a, a_amax, a_rows, w.codes, w.scales, w.amax, offs, capture, bias, w.block_scale)


def quantized_mm(a: NVFP4Tensor, w: NVFP4Tensor, *, block_scale: str = "6") -> torch.Tensor:
    """fp32 [..., N] = a @ w^T with the grouped GEMM's arithmetic (exact block products, the fixed K
    order, both global scales in the epilogue) on operands that are already quantized: one expert's
    GEMM as the engine computes it, for a caller whose A codes are not its own round-to-nearest (the
    trainer, whose guided codes are the rollout's). Bit-identical to the row of `grouped_mm` that the
    same codes, scales and amaxes produce.

    a  NVFP4Tensor [..., K], global amax per row (or one)
    w  NVFP4Tensor [N, K], one global amax (an expert weight)
    """
    if not isinstance(a, NVFP4Tensor) or not isinstance(w, NVFP4Tensor):
        raise TypeError(f"quantized_mm takes two NVFP4Tensors, got {type(a).__name__} and {type(w).__name__}")
    K = a.shape[-1]
    if len(w.shape) != 2 or w.shape[-1] != K:
        raise ValueError(f"w must be an NVFP4Tensor [N, K={K}], got shape {tuple(w.shape)}")
    if w.global_amax.numel() != 1:
        raise ValueError(f"w must have one global amax (an expert weight), got {w.global_amax.numel()}")
    lead = a.shape[:-1]
    M, N = int(torch.Size(lead).numel()), w.shape[0]
    a_amax = a.global_amax.to(torch.float32).reshape(-1)
    a_amax = a_amax.expand(M) if a_amax.numel() == 1 else a_amax
    if a_amax.numel() != M:
        raise ValueError(f"a has {M} rows but {a_amax.numel()} global amaxes")
    a_val = reference.decode_operand(a.codes.reshape(M, K // 2), a.scales.reshape(M, K // BLOCK_SIZE))
    _, g_dec_a = reference.contract.global_scales(a_amax, block_scale)
    _, g_dec_w = reference.contract.global_scales(w.global_amax.to(torch.float32).reshape(1), block_scale)
    out = reference._per_expert(a_val, g_dec_a, w.codes[None], w.scales[None], g_dec_w, [M])
    return out.reshape(*lead, N)

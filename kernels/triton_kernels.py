"""Launchers for the Triton NVFP4 kernels (source in `triton_jit.py`).

CUDA tensors run the compiled kernels; CPU tensors run the same source under the Triton interpreter,
so CI on a CPU machine checks the very kernels a GPU compiles. The interpreted copy is made by importing
`triton_jit.py` a second time with TRITON_INTERPRET=1 set for the duration of that import only (the
decorator reads it then), so nobody has to set it before importing triton, and the process environment
is left as it was.
"""

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import torch
import triton

from . import triton_jit as _compiled
from .format import check_block_scale
from .triton_jit import MODE_COMPACT, MODE_FULL, MODE_RTN

_interpreted: ModuleType | None = None


def import_interpreted(name: str, path: Path, substitutes: dict[str, ModuleType] | None = None) -> ModuleType:
    """Import the Triton source file `path` a second time as module `name`, with TRITON_INTERPRET=1 set
    only while the import runs (the decorator reads it then) and `substitutes` standing in for other
    modules meanwhile (an interpreted kernel must call interpreted helpers, not compiled ones)."""
    previous = os.environ.get("TRITON_INTERPRET")
    saved = {mod: sys.modules.get(mod) for mod in substitutes or {}}
    os.environ["TRITON_INTERPRET"] = "1"
    sys.modules.update(substitutes or {})
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for mod, original in saved.items():
            if original is None:
                sys.modules.pop(mod, None)
            else:
                sys.modules[mod] = original
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    return module


def kernel_source(package: str, source: Path, uses_helpers: bool = True):
    """`kernels(t)`: the module of `package`'s Triton source `source` (its `triton_jit.py`) for tensor
    `t`: the compiled import on CUDA, else one interpreted copy, imported on first use. `uses_helpers`:
    the source calls `trace_kernels.triton_jit`'s jit helpers, whose interpreted copy stands in while
    it is imported (an interpreted kernel cannot call compiled-mode jit functions)."""
    cache: list[ModuleType] = []

    def kernels(t: torch.Tensor) -> ModuleType:
        if t.device.type == "cuda":
            return importlib.import_module(f"{package}.triton_jit")
        if not cache:
            subs = {"trace_kernels.triton_jit": _interpreted_module()} if uses_helpers else None
            cache.append(import_interpreted(f"{package}._triton_jit_interpreted", source, substitutes=subs))
        return cache[0]

    return kernels


def _interpreted_module() -> ModuleType:
    global _interpreted
    if _interpreted is None:
        _interpreted = import_interpreted("trace_kernels._triton_jit_interpreted", Path(__file__).with_name("triton_jit.py"))
    return _interpreted


def _kernels(t: torch.Tensor) -> ModuleType:
    return _compiled if t.device.type == "cuda" else _interpreted_module()


def _tiles(R: int, K: int) -> tuple[int, int, tuple[int, int]]:
    # Interpreted launches cost per program, so CPU tiles are as large as the data allows.
    block_k = min(triton.next_power_of_2(K), 256 if torch.cuda.is_available() else 1024)
    block_k = max(block_k, 16)
    block_r = max(1, min(triton.next_power_of_2(R), 4096 // block_k))
    return block_r, block_k, (triton.cdiv(R, block_r), triton.cdiv(K, block_k))


def quantize(x: torch.Tensor, amax: torch.Tensor, **outputs):
    """x [R, K], amax float32 [R] -> (codes [R, K/2], scales [R, K/16], dequantized or None).
    `block_scale="4over6"` selects each block's scale by the 4-over-6 rule (reference.select_4over6)."""
    return _launch(x, amax, MODE_RTN, None, None, **outputs)


def quantize_guided(x, scales, amax, target, *, full: bool, **outputs):
    """Guided rounding; `target` is the packed codes (full) or packed mantissa bits (compact)."""
    return _launch(x, amax, MODE_FULL if full else MODE_COMPACT, target, scales, **outputs)


def _launch(x, amax, mode, target, scales, *, out_dtype=None, capture=True, block_scale="6"):
    """One pass over x. `capture` writes codes and scales; `out_dtype` writes the dequantized values
    (fake quantization). Returns (codes, scales, out), with None for what was not written."""
    x = x.contiguous()
    R, K = x.shape
    dev = x.device
    codes = torch.empty((R, K // 2), dtype=torch.uint8, device=dev) if capture else None
    out_scales = torch.empty((R, K // 16), dtype=torch.uint8, device=dev) if capture else None
    out_bf16 = out_dtype == torch.bfloat16
    out = None
    if out_dtype is not None:
        out = torch.empty((R, K), dtype=out_dtype if out_bf16 else torch.float32, device=dev)
    dummy = torch.empty(1, dtype=torch.uint8, device=dev)
    if R == 0:  # an expert that received no tokens: nothing to launch
        return codes, out_scales, out.to(out_dtype) if out is not None else None
    block_r, block_k, grid = _tiles(R, K)
    _kernels(x)._quantize_kernel[grid](
        x, amax.contiguous(),
        target.contiguous() if target is not None else dummy,
        scales.contiguous() if scales is not None else dummy,
        codes if capture else dummy, out_scales if capture else dummy,
        (out.view(torch.int16) if out_bf16 else out) if out is not None else dummy,
        R, K,
        MODE=mode, WRITE_CODES=capture, WRITE_OUT=out is not None, OUT_BF16=out_bf16,
        BLOCK_R=block_r, BLOCK_K=block_k, FOUR6=check_block_scale(block_scale), PTX_ADD=dev.type == "cuda",
    )
    if out is not None and out.dtype != out_dtype:
        out = out.to(out_dtype)  # float16: converted by torch (round-to-nearest-even)
    return codes, out_scales, out


def dequantize(codes: torch.Tensor, scales: torch.Tensor, amax: torch.Tensor, block_scale: str = "6") -> torch.Tensor:
    R, K = codes.shape[0], codes.shape[1] * 2
    out = torch.empty((R, K), dtype=torch.float32, device=codes.device)
    if R == 0:
        return out
    block_r, block_k, grid = _tiles(R, K)
    _kernels(codes)._dequantize_kernel[grid](codes.contiguous(), scales.contiguous(), amax.contiguous(), out, R, K,
                             BLOCK_R=block_r, BLOCK_K=block_k, FOUR6=check_block_scale(block_scale))
    return out

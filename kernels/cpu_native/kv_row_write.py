"""The vLLM plugin's native KV write for bf16 K / V with per-row amaxes (activation_scale != "static"):
`kv.quantize_write(..., compute_amax=True)` in one kernel call and a handful of Python operations.

Why: the write runs once per layer per step on ~16 new rows, where the work itself is a few microseconds
and the glue around it cost several times that inside the engine (two torch casts of K and V to float32,
their numpy views, six output allocations, a slot-mapping cast; each Python-level tensor operation costs
2-3x its warm-loop time there, the caches being cold between layer calls). Here:
- K and V are passed as their bf16 bits (an int16 view, any strides: no copy) and widened to float32
  inside the kernel, which is exactly torch's cast (bf16 -> float32 shifts the bits into the high half,
  NaN payloads included); the float32 rows then go through `kv.quantize_write_kernel`, the same code
  as before, so the amaxes, codes, scales and page bytes are the same bits;
- without capture (`keep=False`) the codes, scales and amaxes land in scratch arrays reused from call
  to call (one set per thread, remade when the shape changes): only the page bytes are kept;
- with capture (`keep=True`) they are fresh arrays wrapped by torch.from_numpy, as the capture store's
  put_owned needs (it keeps them without a copy).
"""

import threading

import numpy as np
import torch

from . import count_eager, njit
from .kv import quantize_write_kernel
from .quantize import CALLS, NUMERATOR, tables

_SCRATCH = threading.local()


@njit
def widen_bf16(bits):
    """bf16 bits (int16 [T, H, D], any strides) -> a fresh C-contiguous float32 [T, H, D]: each value's bits
    in the high half, torch's exact bf16 -> float32 cast (NaNs keep their payloads)."""
    T, H, D = bits.shape
    wide = np.empty((T, H, D), dtype=np.uint32)
    for t in range(T):
        for h in range(H):
            for i in range(D):
                wide[t, h, i] = np.uint32((np.int64(bits[t, h, i]) & 0xFFFF) << 16)
    return wide.view(np.float32)


@njit
def quantize_write_bf16_kernel(page, slots, kb, vb, ka, va, amax_native, numerator, nib, sv, kc, ks, vc, vs):
    """kv.quantize_write_kernel on bf16 K / V bits (widen_bf16 first); same outputs, same NaN contract."""
    return quantize_write_kernel(page, slots, widen_bf16(kb), ka, widen_bf16(vb), va, amax_native, numerator, nib,
                                 sv, kc, ks, vc, vs)


def _outputs(T: int, H: int, D: int, DV: int):
    """(K amax, V amax, K codes, K scales, V codes, V scales) numpy arrays for T tokens."""
    return (np.empty((T, H), dtype=np.float32), np.empty((T, H), dtype=np.float32),
            np.empty((T, H, D // 2), dtype=np.uint8), np.empty((T, H, D // 16), dtype=np.uint8),
            np.empty((T, H, DV // 2), dtype=np.uint8), np.empty((T, H, DV // 16), dtype=np.uint8))


def _scratch(T: int, H: int, D: int, DV: int):
    """This thread's reused `_outputs` for the shape (a decode step's shape repeats step after step)."""
    held = getattr(_SCRATCH, "held", None)
    if held is None or held[0] != (T, H, D, DV):
        held = ((T, H, D, DV), _outputs(T, H, D, DV))
        _SCRATCH.held = held
    return held[1]


def quantize_write_per_row(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, keep: bool):
    """kv.quantize_write(kv_cache, slot_mapping, key, value, k_amax, v_amax, compute_amax=True) for bf16 K / V
    `[T, H, D]` (D % 16 == 0, checked once by the plugin with the cache's device and contiguity): the packed
    rows of the first len(slot_mapping) tokens stored at their slots. keep: returns ((K codes, K scales,
    K amax), (V codes, V scales, V amax)) as fresh tensors (the capture's); else None (nothing but the
    page is kept)."""
    CALLS["kv_quantize_write"] += 1
    T, H, D = key.shape
    DV = value.shape[2]
    out = _outputs(T, H, D, DV) if keep else _scratch(T, H, D, DV)
    ka, va, kc, ks, vc, vs = out
    slots = (slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.to(torch.int64)).numpy()
    page, kb, vb = kv_cache.numpy(), key.view(torch.int16).numpy(), value.view(torch.int16).numpy()
    nib, sv = tables()
    if not quantize_write_bf16_kernel(page, slots, kb, vb, ka, va, True, NUMERATOR["6"], nib, sv, kc, ks, vc, vs):
        # A NaN: nothing was written yet; torch's amax decides the NaN's bits (as kv.quantize_write).
        from ..api import row_amax

        count_eager("kv_write_amax_nan", "a NaN in K or V: torch's amax decides the NaN's bits")
        torch.from_numpy(ka).copy_(row_amax(key)), torch.from_numpy(va).copy_(row_amax(value))
        quantize_write_bf16_kernel(page, slots, kb, vb, ka, va, False, NUMERATOR["6"], nib, sv, kc, ks, vc, vs)
    if not keep:
        return None
    ka, va, kc, ks, vc, vs = (torch.from_numpy(a) for a in out)
    return (kc, ks, ka), (vc, vs, va)

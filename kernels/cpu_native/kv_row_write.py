"""The vLLM plugin's native KV write for bf16 K / V with per-row amaxes (activation_scale != "static"):
`kv.quantize_write(..., compute_amax=True)` in one kernel call and a handful of Python operations.

Why: the write runs once per layer per step on ~16 new rows, where the work itself is a few microseconds
and the glue around it cost several times that inside the engine (two torch casts of K and V to float32,
their numpy views, six output allocations, a slot-mapping cast; each Python-level tensor operation costs
2-3x its warm-loop time there, the caches being cold between layer calls). Here:
- K and V are passed as their bf16 bits (an int16 view, any strides: no copy) and widened to float32
  inside the kernel, which is exactly torch's cast (bf16 -> float32 shifts the bits into the high half);
  the row and block amaxes, and whether a value is not finite, come from the magnitude bits (integers),
  the rest is quantize_kernel's float32 arithmetic step for step, so the amaxes, codes, scales and page
  bytes are kv.quantize_write's bits (tests/kernels/test_cpu_native_kv_row_write.py, random bf16 bit
  patterns included);
- without capture (`keep=False`) the codes, scales and amaxes land in scratch arrays reused from call
  to call (one set per thread, remade when the shape changes): only the page bytes are kept;
- with capture (`keep=True`) they are fresh arrays wrapped by torch.from_numpy, as the capture store's
  put_owned needs (it keeps them without a copy);
- K and V reach the kernel as their data address and strides (`quantize_write_bf16_at_kernel`), the kernel
  making the [T, H, D] int16 views itself: two `.view(torch.int16).numpy()` pairs cost ~3-4 us a layer call
  in the engine. The callers hold K and V for the call, so the addresses stay valid.
"""

import threading

import numpy as np
import torch

from numba import carray

from . import count_eager, njit
from .kv import write_rows_kernel
from .pointers import int16_pointer
from .quantize import CALLS, F32, NUMERATOR, SIXTH, block_scale_enc, global_dec, tables

_SCRATCH = threading.local()


@njit
def row_amax_bits_kernel(bits, out):
    """out[t, h] = max |value| of row (t, h) of bf16 bits (int16 [T, H, D], any strides): row_amax_kernel's
    bits, from integers. For values that are not NaN, |x| orders as its magnitude bits (bits & 0x7FFF: a
    sign-magnitude format), and the largest of them widened is the largest |x| (+0 for a row of zeros and
    -0s, as abs makes every zero +0; Inf as Inf); a NaN is a magnitude above 0x7F80, so the row's largest
    magnitude says whether it holds one. Returns False at the first row with a NaN (out then incomplete)."""
    T, H, D = bits.shape
    wide = np.empty(1, dtype=np.uint32)
    wide_f = wide.view(np.float32)
    for t in range(T):
        for h in range(H):
            m = np.int32(0)
            for i in range(D):
                a = np.int32(bits[t, h, i]) & 0x7FFF
                if a > m:
                    m = a
            if m > 0x7F80:
                return False
            wide[0] = np.uint32(m) << 16
            out[t, h] = wide_f[0]
    return True


@njit
def quantize_bits_kernel(bits, amax, numerator, codes, scales, sv):
    """quantize_kernel (want_out False) on bf16 bits int16 [T, H, D] (any strides), amax f32 [T, H] -> codes u8
    [T, H, D/2], scales u8 [T, H, D/16]: the same steps in the same float32 arithmetic, each value widened
    exactly (its bits in the high half: torch's bf16 -> float32 cast). A block's amax and whether it holds a
    non-finite value come from its largest magnitude bits (row_amax_bits_kernel: why)."""
    T, H, D = bits.shape
    NB = D // 16
    fbuf = np.empty(1, dtype=np.float32)
    ibuf = fbuf.view(np.int32)
    row = np.empty(D, dtype=np.uint32)
    row_f = row.view(np.float32)
    ys = np.empty(16, dtype=np.float32)
    ys_bits = ys.view(np.int32)
    cs = np.empty(16, dtype=np.int32)
    for t in range(T):
        for h in range(H):
            g_enc, g_dec = global_dec(amax[t, h], numerator)
            row_bad = not np.isfinite(amax[t, h])
            g6 = g_enc * SIXTH
            for i in range(D):
                row[i] = np.uint32(np.int32(bits[t, h, i]) & 0xFFFF) << 16
            for b in range(NB):
                base = b * 16
                m = np.int32(0)
                for j in range(16):
                    a = np.int32(row[base + j] >> 16) & 0x7FFF
                    if a > m:
                        m = a
                if m >= 0x7F80 or row_bad:  # an Inf or NaN in the block, or a non-finite row amax
                    for j in range(8):
                        codes[t, h, base // 2 + j] = 0
                    scales[t, h, b] = 0x7F
                    continue
                ibuf[0] = np.int32(m) << 16
                amax_b = fbuf[0]
                byte, enc = block_scale_enc(amax_b, g6, g_dec, fbuf, ibuf, sv)  # steps 2 and 3
                scales[t, h, b] = byte
                # step 4 in three short loops the compiler runs branch-free (one loop of quantize.e2m1_code per
                # pair took 2x as long): the clamped values; their codes, |y| compared with the thresholds
                # 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0 as integers (non-negative floats order as their bits;
                # y is never NaN: x is finite, enc at most FLT_MAX), the sign only when y < 0 (-0 has code 0,
                # as in e2m1_code); the bytes.
                for j in range(16):
                    y = row_f[base + j] * enc
                    if y < F32(-6.0):
                        y = F32(-6.0)
                    elif y > F32(6.0):
                        y = F32(6.0)
                    ys[j] = y
                for j in range(16):
                    a = ys_bits[j] & 0x7FFFFFFF
                    c = ((a > 0x3E800000) + (a >= 0x3F400000) + (a > 0x3FA00000) + (a >= 0x3FE00000)
                         + (a > 0x40200000) + (a >= 0x40600000) + (a > 0x40A00000))
                    cs[j] = c | ((ys[j] < F32(0.0)) << 3)
                for j in range(8):
                    codes[t, h, base // 2 + j] = cs[2 * j] | (cs[2 * j + 1] << 4)


@njit
def quantize_write_bf16_kernel(page, slots, kb, vb, ka, va, amax_native, numerator, sv, kc, ks, vc, vs):
    """kv.quantize_write_kernel on bf16 K / V bits (int16 [T, H, D], any strides): the same amaxes, codes,
    scales and page bytes. With amax_native, ka / va are written first (row_amax_bits_kernel); a NaN stops it
    before anything else is written (returns False: torch decides a NaN's bits)."""
    if amax_native:
        if not row_amax_bits_kernel(kb, ka):
            return False
        if not row_amax_bits_kernel(vb, va):
            return False
    quantize_bits_kernel(kb, ka, numerator, kc, ks, sv)
    quantize_bits_kernel(vb, va, numerator, vc, vs, sv)
    write_rows_kernel(page, slots, kc, ks, ka, vc, vs, va)
    return True


@njit
def bf16_rows_at(address, T, H, D, s0, s1, s2):
    """The int16 [T, H, D] view of the bf16 tensor at `address` with element strides (s0, s1, s2) (T, H, D > 0):
    a 1-D array over exactly the span those strides reach, strided as the tensor (what `.view(torch.int16)
    .numpy()` gives, without its two Python objects)."""
    n = (T - 1) * s0 + (H - 1) * s1 + (D - 1) * s2 + 1
    return np.lib.stride_tricks.as_strided(carray(int16_pointer(address), (n,)), shape=(T, H, D),
                                           strides=(2 * s0, 2 * s1, 2 * s2))


@njit
def quantize_write_bf16_at_kernel(page, slots, k_address, k_strides, v_address, v_strides, T, H, D, DV, ka, va,
                                  numerator, sv, kc, ks, vc, vs):
    """quantize_write_bf16_kernel (amax_native True) on K / V given as addresses and element strides (bf16_rows_at)."""
    kb = bf16_rows_at(k_address, T, H, D, k_strides[0], k_strides[1], k_strides[2])
    vb = bf16_rows_at(v_address, T, H, DV, v_strides[0], v_strides[1], v_strides[2])
    return quantize_write_bf16_kernel(page, slots, kb, vb, ka, va, True, numerator, sv, kc, ks, vc, vs)


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
    slots = (slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.to(torch.int64)).numpy()
    return quantize_write_rows(kv_cache.numpy(), slots, key, value, keep)


def quantize_write_rows(page: np.ndarray, slots: np.ndarray, key: torch.Tensor, value: torch.Tensor, keep: bool,
                        into=None):
    """quantize_write_per_row on the cache's and the slot mapping's numpy views (uint8 pages, int64 slots):
    the plugin holds the page view per cache tensor and the slots per step (kv_packed: why), as those two
    `.numpy()` calls cost ~1 and ~2.5 us a layer call in the engine. `into`: the capture's rows to write
    (`_outputs`' six arrays for these T rows: the capture store's host arena scratch, copied into its chunk at end_step), then returns None."""
    CALLS["kv_quantize_write"] += 1
    T, H, D = key.shape
    DV = value.shape[2]
    out = into if into is not None else _outputs(T, H, D, DV) if keep else _scratch(T, H, D, DV)
    ka, va, kc, ks, vc, vs = out
    sv = tables()[1]
    if T and H:
        ok = quantize_write_bf16_at_kernel(page, slots, key.data_ptr(), key.stride(), value.data_ptr(), value.stride(), T,
                                           H, D, DV, ka, va, NUMERATOR["6"], sv, kc, ks, vc, vs)
    else:  # no rows: no address to view
        ok = quantize_write_bf16_kernel(page, slots, key.view(torch.int16).numpy(), value.view(torch.int16).numpy(),
                                        ka, va, True, NUMERATOR["6"], sv, kc, ks, vc, vs)
    if not ok:
        # A NaN: nothing was written yet; torch's amax decides the NaN's bits (as kv.quantize_write).
        from ..api import row_amax

        kb, vb = key.view(torch.int16).numpy(), value.view(torch.int16).numpy()
        count_eager("kv_write_amax_nan", "a NaN in K or V: torch's amax decides the NaN's bits")
        torch.from_numpy(ka).copy_(row_amax(key)), torch.from_numpy(va).copy_(row_amax(value))
        quantize_write_bf16_kernel(page, slots, kb, vb, ka, va, False, NUMERATOR["6"], sv, kc, ks, vc, vs)
    if not keep or into is not None:
        return None
    ka, va, kc, ks, vc, vs = (torch.from_numpy(a) for a in out)
    return (kc, ks, ka), (vc, vs, va)

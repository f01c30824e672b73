"""Guided rounding on the native path, and comparing rows with a guide.

`quantize_guided`: `reference.quantize_guided` (the trainer's rounding of its own values toward the
rollout's codewords, with the rollout's scales and amax) as one loop nest, for both guides a rounding
target can be: full (the packed codes) and compact (one mantissa bit per element). The reference's
steps, float32, the same IEEE operations in the same order:
  1. g_dec from the row's amax (the block scale rule sets only the numerator: "6" or "4over6")
  2. s = e4m3(guide's scale byte); y = clamp(x * min(1 / (s * g_dec), FLT_MAX), -6, 6)
  3. k = the largest grid index with G[k] <= |y|, k_up = k on the grid, else k + 1 (at most 7)
     compact: k where its mantissa bit (k & 1) is the guide's bit, else k_up
     full: k where |(+-G[k]) - target| <= |(+-G[k_up]) - target| (exact: grid values), else k_up
  4. sign bit where y < 0; a block with a NaN / Inf value, a row with a non-finite amax or a NaN scale
     byte (0x7F / 0xFF) gets codes 0 and scale byte 0x7F; other blocks keep the guide's scale byte
Dequantized values (when asked): e2m1(code) * (e4m3(scale) * g_dec), as `quantize.py` computes them
(equal to the reference's dequantize under either block scale: only g_dec's numerator differs).
The comparisons are written so a NaN takes the branch torch's comparisons give it (every `>=` false),
though in a block that is not bad y cannot be NaN (g_dec is finite and positive for a finite amax).

`codeword_mismatches`: the count of codewords that differ (FullGuide.mismatches), which the trainer
takes at every guided site and step. Bit-identical by construction (integer compares): a codeword is the
code nibble with -0 folded into +0, as guides/full.py `codewords` defines it.
"""

from collections import Counter

import numpy as np
import torch

from . import njit
from .quantize import FLT_MAX, NUMERATOR, global_dec, np_view, tables, write_bad_block

F32 = np.float32
CALLS: Counter = Counter()  # "full" / "compact" -> calls of the native guided rounding (tests read it)


@njit
def _guided_index(t, target, full, nib):
    """Step 3 for one scaled value t: the magnitude index guided rounding picks. `target` is the guide's
    code nibble (full) or its mantissa bit (compact); nib[0:8] are the grid magnitudes G.

    Full: the reference compares |v_toward - target| <= |v_away - target| on exact grid values. The target
    is a signed grid point and v_toward, v_away are adjacent signed grid points (k and k + 1 on t's side
    of zero), so it never lies strictly between them: it is at or beyond v_away (k_up chosen) exactly when
    it is on t's side (same sign bit) with an index >= k_up, else at or beyond v_toward (k chosen). The
    same choice as integer compares (a -0 target has index 0 < k_up; a NaN t has neg False, k 0, k_up 1,
    as in torch); tested against the reference on every value beside every code."""
    a = abs(t)
    k = ((a >= F32(0.5)) + (a >= F32(1.0)) + (a >= F32(1.5)) + (a >= F32(2.0)) + (a >= F32(3.0))
         + (a >= F32(4.0)) + (a >= F32(6.0)))
    k_up = k if nib[k] == a else min(k + 1, 7)
    if not full:
        return k if (k & 1) == target else k_up
    same_side = ((target & 8) != 0) == (t < F32(0.0))
    return k_up if same_side and (target & 7) >= k_up else k


@njit
def guided_kernel(x, scales, amax, numerator, target, full, codes, scales_out, out, want_out, nib, sv):
    """x f32 [R, K], guide scale bytes u8 [R, K/16], amax f32 [R], target u8: packed codes [R, K/2] (full)
    or packed mantissa bits [R, K/8] (compact, element 8i + j in bit j) -> codes u8 [R, K/2], scale bytes
    u8 [R, K/16]; with `want_out` also the dequantized values into out f32 [R, K]."""
    R, K = x.shape
    NB = K // 16
    for r in range(R):
        g_dec = global_dec(amax[r], numerator)[1]
        row_bad = not np.isfinite(amax[r])
        for b in range(NB):
            base = b * 16
            byte = scales[r, b]
            bad = row_bad or (byte & 0x7F) == 0x7F
            if not bad:
                for j in range(16):
                    if not np.isfinite(x[r, base + j]):
                        bad = True
                        break
            if bad:
                write_bad_block(codes, scales_out, out, r, b, want_out, sv[0x7F] * g_dec, nib)
                continue
            scales_out[r, b] = byte
            s_value = sv[byte]
            enc = F32(1.0) / (s_value * g_dec)
            if enc > FLT_MAX:
                enc = FLT_MAX
            m = s_value * g_dec
            for j in range(0, 16, 2):
                pair = 0
                for h in range(2):
                    e = base + j + h
                    t = x[r, e] * enc
                    if t < F32(-6.0):
                        t = F32(-6.0)
                    elif t > F32(6.0):
                        t = F32(6.0)
                    if full:
                        tgt = (target[r, e // 2] >> (4 * h)) & 0xF
                    else:
                        tgt = (target[r, e // 8] >> (e % 8)) & 1
                    c = _guided_index(t, tgt, full, nib)
                    if t < F32(0.0):
                        c |= 8
                    pair |= c << (4 * h)
                    if want_out:
                        out[r, e] = nib[c] * m
                codes[r, (base + j) // 2] = pair


def quantize_guided(x2: torch.Tensor, amax: torch.Tensor, guide, block_scale: str = "6", out_dtype=None):
    """Guided rows: x2 [R, K] (float32 / bf16 / fp16), amax f32 [R] (the guide's, per row), `guide` an
    NVFP4Tensor (full) or CompactGuide covering x2's rows -> (codes u8 [R, K/2], scale bytes u8 [R, K/16],
    dequantized values in out_dtype or None), the reference's bits."""
    from ..guides.compact import CompactGuide
    from ..tensor import NVFP4Tensor

    if not isinstance(guide, (NVFP4Tensor, CompactGuide)):
        raise TypeError(f"native guided rounding takes a full or compact guide, got {type(guide).__name__}")
    R, K = x2.shape
    full = isinstance(guide, NVFP4Tensor)
    CALLS["full" if full else "compact"] += 1
    target = guide.codes.reshape(R, K // 2) if full else guide.mbits.reshape(R, K // 8)
    xf = x2.to(torch.float32).contiguous()  # exact for bf16 / fp16
    codes = np.empty((R, K // 2), dtype=np.uint8)
    scales = np.empty((R, K // 16), dtype=np.uint8)
    out = np.empty((R, K) if out_dtype is not None else (0, 0), dtype=np.float32)
    nib, sv = tables()
    guided_kernel(xf.numpy(), np_view(guide.scales.reshape(R, K // 16)), np_view(amax), NUMERATOR[block_scale],
                  np_view(target), full, codes, scales, out, out_dtype is not None, nib, sv)
    codes, scales = torch.from_numpy(codes), torch.from_numpy(scales)
    if out_dtype is None:
        return codes, scales, None
    return codes, scales, torch.from_numpy(out).to(out_dtype)


@njit
def _mismatches(a, b):
    n = 0
    for i in range(a.shape[0]):
        x = a[i]
        y = b[i]
        if x == y:
            continue
        lo_x, lo_y = x & 0xF, y & 0xF
        hi_x, hi_y = x >> 4, y >> 4
        if (lo_x & 7) == 0:
            lo_x = 0
        if (lo_y & 7) == 0:
            lo_y = 0
        if (hi_x & 7) == 0:
            hi_x = 0
        if (hi_y & 7) == 0:
            hi_y = 0
        n += (lo_x != lo_y) + (hi_x != hi_y)
    return n


def codeword_mismatches(codes_a: torch.Tensor, codes_b: torch.Tensor) -> int:
    """Elements whose codewords differ between two packed code tensors of one shape (uint8, CPU)."""
    if codes_a.shape != codes_b.shape:
        raise ValueError(f"packed codes of shapes {tuple(codes_a.shape)} and {tuple(codes_b.shape)} do not line up")
    a = codes_a.contiguous().reshape(-1).numpy()
    b = codes_b.contiguous().reshape(-1).numpy()
    return int(_mismatches(a, b)) if a.size else 0


__all__ = ["codeword_mismatches", "quantize_guided"]

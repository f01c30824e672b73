"""Triton source of the NVFP4 grouped GEMM over expert-sorted rows (bit-identical with reference.py).

One program owns BLOCK_M sorted rows of one expert and BLOCK_N output columns. It
  - finds its expert by walking `offs` (no host-side tile map: the grid depends only on M and E, so
    the launch is CUDA-graph safe),
  - per 16-element K block: loads A [BLOCK_M, 16], quantizes it with the contract (global amax per
    row), writes the captured codes and scale byte (programs of column tile 0 only), decodes W codes
    [BLOCK_N, 16] in registers, and adds the exact fp16 x fp16 -> fp32 block dot to the fp32
    accumulator with a separate round-to-nearest add (steps 3-4 of reference.py: blocks in
    increasing order). On CUDA the add is inline PTX `add.rn.f32` so the compiler cannot fold it into
    the MMA accumulator (tensor-core accumulation does not round like IEEE),
  - applies g_dec_a[row] * g_dec_w[expert] in the epilogue, then adds the expert's fp32 bias row
    (BIAS: gpt-oss) with a separate round-to-nearest add (`_add_rn`: on CUDA the compiler would
    otherwise contract the multiply and the add into one FMA, which rounds once, not twice like the
    torch backend).

The contract's roundings are the helpers of `trace_kernels.triton_jit` (integer / comparison
arithmetic only). This module is only source: `launch.py` imports it compiled (CUDA) and, with the
helpers' interpreted copy in place, under the Triton interpreter (CPU).
"""

import triton
import triton.language as tl

from trace_kernels.triton_jit import (FLT_MAX, _add_rn, _decode_e4m3, _e2m1_index, _global_scales, _grid_value,
                                     _max_combine, _round_to_e4m3, _sq_err_pairs)


@triton.jit
def _rtn_block(x, s_value, g_dec):
    """Steps 3-4 on a [BM, 16] tile with block scale values [BM]: (magnitude index, y)."""
    enc = tl.math.div_rn(tl.full(s_value.shape, 1.0, tl.float32), s_value * g_dec)
    enc = tl.minimum(enc, FLT_MAX)
    y = tl.minimum(tl.maximum(x * enc[:, None], -6.0), 6.0)
    return _e2m1_index(tl.abs(y)), y


@triton.jit
def _block_err(x, idx, y, s_value, g_dec, BLOCK_M: tl.constexpr, PTX_ADD: tl.constexpr):
    """4over6's squared error of each [16] row block (reference.block_sq_error's order), [BM]."""
    xe, xo = tl.split(tl.reshape(x, [BLOCK_M, 8, 2]))
    ye, yo = tl.split(tl.reshape(y, [BLOCK_M, 8, 2]))
    ie, io = tl.split(tl.reshape(idx, [BLOCK_M, 8, 2]))
    mult = (s_value * g_dec)[:, None, None]
    err = _sq_err_pairs(xe[:, None, :], xo[:, None, :], ye[:, None, :], yo[:, None, :], ie[:, None, :], io[:, None, :],
                        mult, PTX_ADD)
    return tl.reshape(err, [BLOCK_M])


@triton.jit
def _signed_grid(code):
    mag = _grid_value(code & 7)
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def _grouped_mm_kernel(
    a_ptr, a_rows_ptr, a_amax_ptr,  # A source rows [Ra, K] (any float dtype), gather [M] int64, amax fp32 [Ra]
    w_codes_ptr, w_scales_ptr, w_amax_ptr,  # W [E, N, K/2] u8, [E, N, K/16] u8, fp32 [E]
    offs_ptr,  # int32 [E], cumulative rows per expert
    out_ptr,  # fp32 [M, N]
    cap_rows_ptr, cap_codes_ptr, cap_scales_ptr,  # int64 [M] (dest row or -1), u8 [Rc, K/2], u8 [Rc, K/16]
    bias_ptr,  # fp32 [E, N] (BIAS only)
    N, K, E,
    GATHER: tl.constexpr, CAPTURE: tl.constexpr, BIAS: tl.constexpr, PTX_ADD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FOUR6: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)

    # ---- which expert, which rows: tile t of expert e covers rows start_e + t * BLOCK_M ... --------
    zero = pid_m * 0  # int32 scalars (loop-carried values keep one type in compiled Triton)
    e_sel = zero - 1
    row0 = zero
    row_end = zero
    start = zero
    tile_base = zero
    for e in range(E):
        end = tl.load(offs_ptr + e)
        nt = (end - start + BLOCK_M - 1) // BLOCK_M
        hit = (pid_m >= tile_base) & (pid_m < tile_base + nt)
        e_sel = tl.where(hit, e, e_sel)
        row0 = tl.where(hit, start + (pid_m - tile_base) * BLOCK_M, row0)
        row_end = tl.where(hit, end, row_end)
        tile_base += nt
        start = end

    if e_sel >= 0:
        e64 = e_sel.to(tl.int64)
        m = row0 + tl.arange(0, BLOCK_M)  # [BM] sorted rows
        m_ok = m < row_end
        if GATHER:
            src = tl.load(a_rows_ptr + m, mask=m_ok, other=0)  # [BM] int64 source rows
        else:
            src = m.to(tl.int64)
        amax = tl.load(a_amax_ptr + src, mask=m_ok, other=1.0)  # [BM]
        g_enc, g_dec_a = _global_scales(amax, FOUR6)
        row_bad = (amax != amax) | (tl.abs(amax) == float("inf"))
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        n_ok = n < N
        w_amax = tl.load(w_amax_ptr + e64 + n * 0)  # [BN], the expert's one value
        _, g_dec_w = _global_scales(w_amax, FOUR6)
        if CAPTURE:
            dest = tl.load(cap_rows_ptr + m, mask=m_ok, other=-1)  # [BM]
            cap_ok = m_ok & (dest >= 0) & ((m * 0 + pid_n) == 0)  # column tile 0 writes the capture
        j = tl.arange(0, 16)
        jp = tl.arange(0, 8)
        w_row = (e64 * N + n.to(tl.int64))  # [BN] row of W in [E * N]
        acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)  # (tl.zeros is a jit function: not callable interpreted)
        for kb in range(0, K // 16):
            # ---- A block: quantize on load (contract steps 2-4) ------------------------------------
            x = tl.load(a_ptr + src[:, None] * K + kb * 16 + j[None, :], mask=m_ok[:, None], other=0.0)
            x = x.to(tl.float32)  # [BM, 16]
            nonfinite = (x != x) | (tl.abs(x) == float("inf"))
            bad = (tl.reduce(nonfinite.to(tl.int32), 1, _max_combine) != 0) | row_bad  # [BM]
            amax_b = tl.reduce(tl.abs(x), 1, _max_combine)
            s = amax_b * (g_enc * (1.0 / 6.0))
            s = tl.minimum(s, FLT_MAX)
            s = tl.minimum(tl.maximum(s, -448.0), 448.0)
            s = tl.where(bad, 0.0, s)
            scale_byte, s_value = _round_to_e4m3(s)  # [BM]
            idx, y = _rtn_block(x, s_value, g_dec_a)
            if FOUR6:  # 4over6: the 4-candidate (scale x 1.5) where its squared error is strictly lower
                s4 = tl.minimum(tl.maximum(tl.minimum(s * 1.5, FLT_MAX), -448.0), 448.0)
                byte4, value4 = _round_to_e4m3(s4)
                idx4, y4 = _rtn_block(x, value4, g_dec_a)
                four = _block_err(x, idx4, y4, value4, g_dec_a, BLOCK_M, PTX_ADD) < _block_err(
                    x, idx, y, s_value, g_dec_a, BLOCK_M, PTX_ADD)
                four = four & (bad == 0)
                scale_byte = tl.where(four, byte4, scale_byte)
                s_value = tl.where(four, value4, s_value)
                idx = tl.where(four[:, None], idx4, idx)
                y = tl.where(four[:, None], y4, y)
            code = tl.where(bad[:, None], 0, idx | tl.where(y < 0, 8, 0))  # [BM, 16]
            if CAPTURE:
                ce, co = tl.split(tl.reshape(code, [BLOCK_M, 8, 2]))
                tl.store(cap_codes_ptr + dest[:, None] * (K // 2) + kb * 8 + jp[None, :],
                         (ce | (co << 4)).to(tl.uint8), mask=cap_ok[:, None])
                tl.store(cap_scales_ptr + dest * (K // 16) + kb,
                         tl.where(bad, 0x7F, scale_byte).to(tl.uint8), mask=cap_ok)
            a_val = _signed_grid(code) * tl.where(bad, float("nan"), s_value)[:, None]  # exact in fp16
            # ---- W block: decode in registers -------------------------------------------------------
            # Element j is the low (even j) or high (odd j) nibble of byte j // 2, read as [BN, 16] directly:
            # tl.reshape(tl.join(low, high)) feeding the fp16 tl.dot compiled wrong on an H200 (Triton 3.6:
            # every output differed; the same join with an fp32 dot, or this form with the fp16 dot, was exact).
            wc = tl.load(w_codes_ptr + w_row[:, None] * (K // 2) + kb * 8 + (j // 2)[None, :], mask=n_ok[:, None], other=0)
            w_code = (wc.to(tl.int32) >> ((j % 2) * 4)[None, :]) & 0xF  # [BN, 16]
            wb = tl.load(w_scales_ptr + w_row * (K // 16) + kb, mask=n_ok, other=0).to(tl.int32)  # [BN]
            w_s = tl.where((wb & 0x7F) == 0x7F, float("nan"), _decode_e4m3(wb))
            w_val = _signed_grid(w_code) * w_s[:, None]  # [BN, 16]
            # ---- exact block dot, then one round-to-nearest add in kb order ---------------------------
            partial = tl.dot(a_val.to(tl.float16), tl.trans(w_val.to(tl.float16)), out_dtype=tl.float32)
            acc = _add_rn(acc, partial, PTX_ADD)
        out = acc * (g_dec_a[:, None] * g_dec_w[None, :])
        if BIAS:
            b = tl.load(bias_ptr + e64 * N + n, mask=n_ok, other=0.0)  # [BN] fp32
            out = _add_rn(out, tl.broadcast_to(b[None, :], [BLOCK_M, BLOCK_N]), PTX_ADD)
        tl.store(out_ptr + m[:, None].to(tl.int64) * N + n[None, :], out, mask=m_ok[:, None] & n_ok[None, :])

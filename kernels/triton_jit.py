"""Triton source of the NVFP4 kernels: quantize (with capture), guided quantize, dequantize.

Bit-identical with `reference.py`: the same float32 steps in the same order, E4M3 and E2M1 rounding by
integer and comparison arithmetic (the Triton 3.7-3.9 interpreter miscasts fp32 -> float8e4nv and
fp32 -> bf16, so no compiler float8 / bf16 conversion is used), and divisions through `div_rn`
(plain `/` on a GPU is an approximate division).

Tiles are 3-D: [BLOCK_R rows, BLOCK_K // 16 scale blocks, 8 element pairs]; each pair (2i, 2i + 1)
shares one output byte, so even and odd elements are loaded as two tensors and packed without a
reshape.

This module is only source: `triton_kernels` imports it twice, once compiled (CUDA tensors) and once
under the Triton interpreter (CPU tensors), because `triton.jit` picks the mode when it decorates.
"""

import triton
import triton.language as tl

from . import format as _format

# Globals a @triton.jit body reads must be tl.constexpr: the CUDA compiler refuses plain Python floats
# ("Cannot access global variable ... from within @jit'ed function"), the interpreter does not check.
FLT_MAX = tl.constexpr(_format.FLT_MAX)
GLOBAL_ENC_NUMERATOR = tl.constexpr(_format.GLOBAL_ENC_NUMERATOR)
GLOBAL_ENC_NUMERATOR_4OVER6 = tl.constexpr(_format.GLOBAL_ENC_NUMERATOR_4OVER6)

MODE_RTN = 0
MODE_FULL = 1
MODE_COMPACT = 2


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _row_max(v, axis: tl.constexpr):
    # tl.reduce with our own combine function instead of tl.max: tl.max is itself a @triton.jit
    # function, decorated in whichever mode was active when triton was first imported, so the
    # interpreted copy of this module could not call it.
    return tl.reduce(v, axis, _max_combine)


@triton.jit
def _add_rn(a, b, PTX_ADD: tl.constexpr):
    """a + b rounded once. On CUDA inline PTX `add.rn.f32`, so the compiler cannot contract a preceding
    multiply into an FMA (which rounds once where the torch reference rounds twice)."""
    if PTX_ADD:
        bits = tl.inline_asm_elementwise(
            "add.rn.f32 $0, $1, $2;", "=r,r,r",
            [a.to(tl.int32, bitcast=True), b.to(tl.int32, bitcast=True)],
            dtype=tl.int32, is_pure=True, pack=1,
        )
        return bits.to(tl.float32, bitcast=True)
    else:
        return a + b


@triton.jit
def _global_scales(amax, FOUR6: tl.constexpr):
    if FOUR6:
        g_enc = tl.math.div_rn(tl.full(amax.shape, GLOBAL_ENC_NUMERATOR_4OVER6, tl.float32), amax)
    else:
        g_enc = tl.math.div_rn(tl.full(amax.shape, GLOBAL_ENC_NUMERATOR, tl.float32), amax)
    g_enc = tl.minimum(g_enc, FLT_MAX)
    g_enc = tl.where(g_enc == 0.0, 1.0, g_enc)
    g_dec = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), g_enc)
    return g_enc, g_dec


@triton.jit
def _round_half_even(v):
    f = tl.floor(v)
    d = v - f
    odd = (f.to(tl.int32) & 1) == 1
    up = (d > 0.5) | ((d == 0.5) & odd)
    return f + up.to(tl.float32)


@triton.jit
def _round_to_e4m3(s):
    """Non-negative finite s <= 448 -> (E4M3 byte as int32, its float32 value)."""
    bits = s.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1
    rounded = (bits + 0x7FFFF + lsb) & ~0xFFFFF
    normal_value = rounded.to(tl.float32, bitcast=True)
    normal_byte = ((((rounded >> 23) & 0xFF) - 120) << 3) | ((rounded >> 20) & 0x7)
    q = _round_half_even(s * 512.0)
    sub_value = q * 0.001953125
    is_normal = s >= 0.015625
    byte = tl.where(is_normal, normal_byte, q.to(tl.int32))
    value = tl.where(is_normal, normal_value, sub_value)
    return byte, value


@triton.jit
def _decode_e4m3(byte):
    exp_field = (byte >> 3) & 0xF
    mant = byte & 0x7
    normal = (((exp_field + 120) << 23) | (mant << 20)).to(tl.float32, bitcast=True)
    sub = mant.to(tl.float32) * 0.001953125
    return tl.where(exp_field == 0, sub, normal)


@triton.jit
def _bf16_bits(v):
    """float32 -> bfloat16 bit pattern (int16), round-to-nearest-even on the integer. A NaN keeps its
    sign and top mantissa bits, with the quiet bit set, and is never rounded: a GPU's NaN is 0x7FFFFFFF,
    which the rounding add would carry into the sign bit (-0.0, seen on an H200); the CPU's 0x7FC00000
    and 0xFFC00000 give 0x7FC0 / 0xFFC0 either way."""
    bits = v.to(tl.int32, bitcast=True)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return tl.where(nan, (bits >> 16) | 0x40, rounded >> 16).to(tl.int16)


@triton.jit
def _e2m1_index(a):
    idx = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
    idx += (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
    idx += (a > 5.0).to(tl.int32)
    return idx


@triton.jit
def _grid_floor_index(a):
    idx = (a >= 0.5).to(tl.int32) + (a >= 1.0).to(tl.int32) + (a >= 1.5).to(tl.int32)
    idx += (a >= 2.0).to(tl.int32) + (a >= 3.0).to(tl.int32) + (a >= 4.0).to(tl.int32)
    idx += (a >= 6.0).to(tl.int32)
    return idx


@triton.jit
def _grid_value(idx):
    return tl.where(idx <= 4, idx.to(tl.float32) * 0.5, tl.where(idx == 5, 3.0, tl.where(idx == 6, 4.0, 6.0)))


@triton.jit
def _pair_tree_sum(p, PTX_ADD: tl.constexpr):
    """[A, B, 8] -> [A, B]: p[0] + p[1], p[2] + p[3], ... then pairs of those (reference.block_sq_error's
    order; p holds the sums of element pairs (2i, 2i + 1))."""
    A: tl.constexpr = p.shape[0]
    B: tl.constexpr = p.shape[1]
    a, b = tl.split(tl.reshape(p, [A, B, 4, 2]))
    q = _add_rn(a, b, PTX_ADD)
    a, b = tl.split(tl.reshape(q, [A, B, 2, 2]))
    r = _add_rn(a, b, PTX_ADD)
    a, b = tl.split(r)
    return _add_rn(a, b, PTX_ADD)


@triton.jit
def _sq_err_pairs(xe, xo, ye, yo, ie, io, mult, PTX_ADD: tl.constexpr):
    """Summed squared error of each block (reference.block_sq_error), from even / odd element tiles
    [A, B, 8] and the block multiplier s * g_dec [A, B, 1]."""
    ve = _grid_value(ie)
    vo = _grid_value(io)
    de = _add_rn(tl.where(ye < 0, -ve, ve) * mult, -xe, PTX_ADD)
    do = _add_rn(tl.where(yo < 0, -vo, vo) * mult, -xo, PTX_ADD)
    return _pair_tree_sum(_add_rn(de * de, do * do, PTX_ADD), PTX_ADD)


@triton.jit
def _guided_index(y, target_code, target_mbit, MODE: tl.constexpr):
    """Guided rounding's choice of codeword on scaled values y; see reference.guided_indices."""
    a = tl.abs(y)
    k = _grid_floor_index(a)
    on_grid = _grid_value(k) == a
    k_up = tl.where(on_grid, k, tl.minimum(k + 1, 7))
    if MODE == 2:
        idx = tl.where((k & 1) == target_mbit, k, k_up)
    else:
        neg = y < 0
        v_toward = tl.where(neg, -_grid_value(k), _grid_value(k))
        v_away = tl.where(neg, -_grid_value(k_up), _grid_value(k_up))
        t_mag = _grid_value(target_code & 7)
        target = tl.where((target_code & 8) != 0, -t_mag, t_mag)
        idx = tl.where(tl.abs(v_toward - target) <= tl.abs(v_away - target), k, k_up)
    return idx


@triton.jit
def _rtn_pairs(xe, xo, s_value, g_dec):
    """Steps 3-4 for even / odd tiles with block scale values s_value [A, B]: (ie, io, ye, yo)."""
    enc = tl.math.div_rn(tl.full(s_value.shape, 1.0, tl.float32), s_value * g_dec[:, None])
    enc = tl.minimum(enc, FLT_MAX)[:, :, None]
    ye = tl.minimum(tl.maximum(xe * enc, -6.0), 6.0)
    yo = tl.minimum(tl.maximum(xo * enc, -6.0), 6.0)
    return _e2m1_index(tl.abs(ye)), _e2m1_index(tl.abs(yo)), ye, yo


@triton.jit
def _quantize_kernel(
    x_ptr, amax_ptr, gcode_ptr, gscale_ptr,  # inputs (guide pointers unused for MODE_RTN)
    code_ptr, scale_ptr, out_ptr,  # outputs
    R, K,
    MODE: tl.constexpr, WRITE_CODES: tl.constexpr, WRITE_OUT: tl.constexpr, OUT_BF16: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, FOUR6: tl.constexpr, PTX_ADD: tl.constexpr,
):
    NB: tl.constexpr = BLOCK_K // 16
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    b = tl.program_id(1) * NB + tl.arange(0, NB)
    j = tl.arange(0, 8)
    r3 = r[:, None, None]
    pair = b[None, :, None] * 8 + j[None, None, :]  # packed-byte column
    mask = (r3 < R) & (pair * 2 < K)
    row_off = r3.to(tl.int64) * K
    xe = tl.load(x_ptr + row_off + pair * 2, mask=mask, other=0.0).to(tl.float32)
    xo = tl.load(x_ptr + row_off + pair * 2 + 1, mask=mask, other=0.0).to(tl.float32)

    amax = tl.load(amax_ptr + r, mask=r < R, other=1.0)
    g_enc, g_dec = _global_scales(amax, FOUR6)
    nonfinite = (xe != xe) | (tl.abs(xe) == float("inf")) | (xo != xo) | (tl.abs(xo) == float("inf"))
    bad = _row_max(nonfinite.to(tl.int32), 2) != 0
    bad = bad | ((amax != amax) | (tl.abs(amax) == float("inf")))[:, None]
    bmask = (r[:, None] < R) & (b[None, :] * 16 < K)
    scale_off = r[:, None].to(tl.int64) * (K // 16) + b[None, :]

    if MODE == 0:
        amax_b = tl.maximum(_row_max(tl.abs(xe), 2), _row_max(tl.abs(xo), 2))
        s = amax_b * (g_enc * (1.0 / 6.0))[:, None]
        s = tl.minimum(s, FLT_MAX)
        s = tl.minimum(tl.maximum(s, -448.0), 448.0)
        s = tl.where(bad, 0.0, s)
        scale_byte, s_value = _round_to_e4m3(s)
        if FOUR6:
            # 4over6: the 4-candidate (scale x 1.5), taken where its squared error is strictly lower
            s4 = tl.minimum(s * 1.5, FLT_MAX)
            s4 = tl.minimum(tl.maximum(s4, -448.0), 448.0)
            byte4, value4 = _round_to_e4m3(s4)
            ie6, io6, ye6, yo6 = _rtn_pairs(xe, xo, s_value, g_dec)
            ie4, io4, ye4, yo4 = _rtn_pairs(xe, xo, value4, g_dec)
            err6 = _sq_err_pairs(xe, xo, ye6, yo6, ie6, io6, (s_value * g_dec[:, None])[:, :, None], PTX_ADD)
            err4 = _sq_err_pairs(xe, xo, ye4, yo4, ie4, io4, (value4 * g_dec[:, None])[:, :, None], PTX_ADD)
            four = (err4 < err6) & (bad == 0)
            scale_byte = tl.where(four, byte4, scale_byte)
            s_value = tl.where(four, value4, s_value)
    else:
        scale_byte = tl.load(gscale_ptr + scale_off, mask=bmask, other=0).to(tl.int32)
        bad = bad | ((scale_byte & 0x7F) == 0x7F)
        s_value = tl.where(bad, 1.0, _decode_e4m3(scale_byte))

    enc = tl.math.div_rn(tl.full(s_value.shape, 1.0, tl.float32), s_value * g_dec[:, None])
    enc = tl.minimum(enc, FLT_MAX)[:, :, None]
    ye = tl.minimum(tl.maximum(xe * enc, -6.0), 6.0)
    yo = tl.minimum(tl.maximum(xo * enc, -6.0), 6.0)

    if MODE == 0:
        ie = _e2m1_index(tl.abs(ye))
        io = _e2m1_index(tl.abs(yo))
    else:
        if MODE == 1:
            gc = tl.load(gcode_ptr + r3.to(tl.int64) * (K // 2) + pair, mask=mask, other=0).to(tl.int32)
            te = gc & 0xF
            to = gc >> 4
            me = te
            mo = to
        else:
            gb = tl.load(gcode_ptr + r3.to(tl.int64) * (K // 8) + pair // 4, mask=mask, other=0).to(tl.int32)
            shift = (pair % 4) * 2
            me = (gb >> shift) & 1
            mo = (gb >> (shift + 1)) & 1
            te = me
            to = mo
        ie = _guided_index(ye, te, me, MODE)
        io = _guided_index(yo, to, mo, MODE)

    ce = tl.where(bad[:, :, None], 0, ie | tl.where(ye < 0, 8, 0))
    co = tl.where(bad[:, :, None], 0, io | tl.where(yo < 0, 8, 0))
    if WRITE_CODES:
        tl.store(code_ptr + r3.to(tl.int64) * (K // 2) + pair, (ce | (co << 4)).to(tl.uint8), mask=mask)
        scale_byte = tl.where(bad, 0x7F, scale_byte)
        tl.store(scale_ptr + scale_off, scale_byte.to(tl.uint8), mask=bmask)

    if WRITE_OUT:
        mult = (tl.where(bad, float("nan"), s_value) * g_dec[:, None])[:, :, None]
        ve = _grid_value(ce & 7)
        vo = _grid_value(co & 7)
        ve = tl.where((ce & 8) != 0, -ve, ve) * mult
        vo = tl.where((co & 8) != 0, -vo, vo) * mult
        if OUT_BF16:
            ve = _bf16_bits(ve)
            vo = _bf16_bits(vo)
        tl.store(out_ptr + row_off + pair * 2, ve, mask=mask)
        tl.store(out_ptr + row_off + pair * 2 + 1, vo, mask=mask)


@triton.jit
def _dequantize_kernel(code_ptr, scale_ptr, amax_ptr, out_ptr, R, K, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                       FOUR6: tl.constexpr):
    NB: tl.constexpr = BLOCK_K // 16
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    b = tl.program_id(1) * NB + tl.arange(0, NB)
    j = tl.arange(0, 8)
    r3 = r[:, None, None]
    pair = b[None, :, None] * 8 + j[None, None, :]
    mask = (r3 < R) & (pair * 2 < K)
    bmask = (r[:, None] < R) & (b[None, :] * 16 < K)
    c = tl.load(code_ptr + r3.to(tl.int64) * (K // 2) + pair, mask=mask, other=0).to(tl.int32)
    byte = tl.load(scale_ptr + r[:, None].to(tl.int64) * (K // 16) + b[None, :], mask=bmask, other=0).to(tl.int32)
    amax = tl.load(amax_ptr + r, mask=r < R, other=1.0)
    _, g_dec = _global_scales(amax, FOUR6)
    s_value = tl.where((byte & 0x7F) == 0x7F, float("nan"), _decode_e4m3(byte))
    mult = (s_value * g_dec[:, None])[:, :, None]
    ce = c & 0xF
    co = c >> 4
    ve = _grid_value(ce & 7)
    vo = _grid_value(co & 7)
    ve = tl.where((ce & 8) != 0, -ve, ve) * mult
    vo = tl.where((co & 8) != 0, -vo, vo) * mult
    row_off = r3.to(tl.int64) * K
    tl.store(out_ptr + row_off + pair * 2, ve, mask=mask)
    tl.store(out_ptr + row_off + pair * 2 + 1, vo, mask=mask)

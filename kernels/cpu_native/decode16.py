"""The NVFP4 block decode (8 code bytes + an E4M3 scale -> 16 float32 values) in 16-lane registers, LLVM IR.

Why: the grouped GEMM decodes each used expert's W per call (no resident dequantized weight), and numba's
loop over `nib[code] * sv[scale]` ran one value at a time (a table load, a multiply and a strided store per
value: ~20 us of a ~39 us decode MoE call, lane moe7), because LLVM's vectoriser does not turn a 16-entry
table load into a vector operation. Here the E2M1 value is built from the nibble's bits with integer
vector operations, and one IEEE multiply by the block's scale value gives each element.

The same bits as the scalar decode `nib[c] * sv[s]` (quantize.tables()): the E2M1 values 0, 0.5, 1, 1.5, 2,
3, 4, 6 (sign: the nibble's bit 3, so nibble 8 is -0.0 as nib[8]) are exact float32 numbers, so the integer
construction gives nib's own bits, and the product is the same single IEEE multiply (no fast-math flag; the
operands' order does not change an IEEE product, nor which NaN comes out when only the scale is NaN, as
nib holds no NaN). tests/kernels/test_cpu_native_decode16.py checks all 256 code bytes at every byte
position against all 256 scale bytes, bit for bit.

Arrays are read through their data pointers with element offsets: they must be C-contiguous (the typing
refuses any other layout, so a caller with a strided array fails to compile instead of reading wrong bytes).
"""

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from .vec16 import _data, _i64, _nibbles16, _splat, _vec_ptr

_F32 = ir.FloatType()
_I8 = ir.IntType(8)
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_V16 = ir.VectorType(_F32, 16)
_I16 = ir.VectorType(_I32, 16)


def _k16(x):
    return ir.Constant(_I16, [x] * 16)


def _e2m1_times(builder, nib, scale):
    """nib <16 x i32> (nibbles 0..15) -> e2m1(nib) * scale (<16 x float>). The magnitude a = nib & 7 as float32
    bits: 0 for a = 0, 0.5 (0x3F000000) for a = 1, else exponent 126 + a >> 1 and mantissa bit 22 = a & 1
    (1, 1.5, 2, 3, 4, 6); the sign is the nibble's bit 3."""
    a = builder.and_(nib, _k16(7))
    mag = builder.or_(builder.shl(builder.add(builder.lshr(a, _k16(1)), _k16(126)), _k16(23)),
                      builder.shl(builder.and_(a, _k16(1)), _k16(22)))
    mag = builder.select(builder.icmp_unsigned("==", a, _k16(1)), _k16(0x3F000000), mag)
    mag = builder.select(builder.icmp_unsigned("==", a, _k16(0)), _k16(0), mag)
    bits = builder.or_(mag, builder.shl(builder.and_(nib, _k16(8)), _k16(28)))
    return builder.fmul(builder.bitcast(bits, _V16), scale)


def _c_arrays(*arrays):
    return all(isinstance(a, types.Array) and a.layout == "C" for a in arrays)


@intrinsic
def decode16_cols(typingctx, dst, do, dstride, codes, co, cstride, scales, so, sstride, sv):
    """One 16 x 16 tile of a transposed decode, in registers: for lanes l < 16 (16 rows of W) and j < 16 (the
    block's elements), dst_flat[do + j dstride + l] = e2m1(nibble j of the 8 code bytes at codes_flat[co +
    l cstride ..]) * sv[scales_flat[so + l sstride]] (nibble 2 k the low one of byte k, 2 k + 1 the high one).
    dst float32, codes / scales uint8, sv float32 [256]; all C-contiguous, offsets in elements. Each of the
    16 stores is one contiguous row of 16 floats: the [K, N] layout the grouped GEMM's product loop reads."""
    if not _c_arrays(dst, codes, scales, sv):
        return None
    sig = types.void(dst, do, dstride, codes, co, cstride, scales, so, sstride, sv)

    def codegen(context, builder, signature, args):
        d_, do_, ds_, c_, co_, cs_, s_, so_, ss_, sv_ = args
        dty, doty, dsty, cty, coty, csty, sty, soty, ssty, svty = signature.args
        dp, cp = _data(context, builder, dty, d_), _data(context, builder, cty, c_)
        sp, vp = _data(context, builder, sty, s_), _data(context, builder, svty, sv_)
        do_, ds_, co_, cs_, so_, ss_ = (_i64(context, builder, t, v) for t, v in
                                        ((doty, do_), (dsty, ds_), (coty, co_), (csty, cs_), (soty, so_), (ssty, ss_)))
        lo = hi = ir.Constant(_I16, ir.Undefined)  # code bytes 0-3 / 4-7 of each lane, little-endian
        scale = ir.Constant(_V16, ir.Undefined)
        i32p = _I32.as_pointer()
        for lane in range(16):
            li = ir.Constant(_I32, lane)
            row = builder.add(co_, builder.mul(cs_, ir.Constant(_I64, lane)))
            lo = builder.insert_element(lo, builder.load(builder.bitcast(builder.gep(cp, [row]), i32p), align=1), li)
            hi = builder.insert_element(hi, builder.load(builder.bitcast(builder.gep(cp, [builder.add(row, ir.Constant(_I64, 4))]), i32p), align=1), li)
            sbyte = builder.load(builder.gep(sp, [builder.add(so_, builder.mul(ss_, ir.Constant(_I64, lane)))]))
            scale = builder.insert_element(scale, builder.load(builder.gep(vp, [builder.zext(sbyte, _I64)])), li)
        for j in range(16):
            word = lo if j < 8 else hi
            nib = builder.and_(builder.lshr(word, _k16(4 * (j % 8))), _k16(15))
            dst = _vec_ptr(builder, dp, builder.add(do_, builder.mul(ds_, ir.Constant(_I64, j))), _V16)
            builder.store(_e2m1_times(builder, nib, scale), dst, align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def decode16_row(typingctx, dst, do, codes, co, scale):
    """One block along its row: dst_flat[do + j] = e2m1(nibble j of the 8 code bytes codes_flat[co ..]) * scale
    for j < 16 (nibble 2 k the low one of byte k). dst float32, codes uint8, C-contiguous; scale float32 (the
    block's sv value)."""
    if not _c_arrays(dst, codes) or scale != types.float32:
        return None
    sig = types.void(dst, do, codes, co, scale)

    def codegen(context, builder, signature, args):
        d_, do_, c_, co_, s_ = args
        dty, doty, cty, coty, sty = signature.args
        dp, cp = _data(context, builder, dty, d_), _data(context, builder, cty, c_)
        do_, co_ = _i64(context, builder, doty, do_), _i64(context, builder, coty, co_)
        i8x8 = ir.VectorType(_I8, 8)
        nib = _nibbles16(builder, builder.load(_vec_ptr(builder, cp, co_, i8x8), align=1))
        scale = _splat(builder, context.cast(builder, s_, sty, types.float32), _V16)
        builder.store(_e2m1_times(builder, nib, scale), _vec_ptr(builder, dp, do_, _V16), align=4)
        return context.get_dummy_value()

    return sig, codegen

"""The round-to-nearest of one 16-value block in 16-lane registers, LLVM IR (the sparse decode's RTN rows).

Why: the sparse decode computes the trainer's own round-to-nearest of each row in the same pass
(sparse_decode._rtn_row). Written as numba scalar loops it ran one value at a time: the block's largest
|value| as a serial max chain, then per value a multiply, two clamps (branches) and seven compares for
the E2M1 index, and a byte packed from each pair; LLVM's vectoriser took none of it (the float max chain
is a reduction it does not reorder without fast-math flags, the pair packing a strided loop). It was ~40 %
of the decode kernel's time (5.3 ns a value; lane decode10). Here both are 16-lane vector operations.

The same bits as the scalar code (quantize.block_amax's loop, quantize.e2m1_code):
- the block's largest |value|: every lane is |x| (the sign bit cleared: +0 for +-0), the scalar loop keeps
  the largest starting from +0.0; for values that are not NaN the maximum of a set is one float whatever
  the order it is taken in (equal floats of different bits do not occur among |x|: only +0 and -0 compare
  equal and abs made both +0), so a tree of ordered `>` selects gives the same float. The rows reach here
  finite (the decode checks that first), so no NaN enters.
- the codes: t = x * enc (one IEEE multiply, no fast-math flag, no contraction), clamped to [-6, 6] by the
  scalar code's two compares as selects (t < -6 -> -6, else t > 6 -> 6), the E2M1 index as the sum of the
  same seven ordered compares on |t| (> 0.25, >= 0.75, > 1.25, >= 1.75, > 2.5, >= 3.5, > 5: ties to the
  even mantissa), plus 8 where t < 0; value 2 k the low nibble of byte k, 2 k + 1 the high one.
tests/kernels/test_sparse_rtn16.py checks both against the scalar helpers on ties, signed zeros,
subnormals, saturation and random rows.

Arrays are read through their data pointers with element offsets: they must be C-contiguous (the typing
refuses any other layout, so a caller with a strided array fails to compile instead of reading wrong bytes).
"""

from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from .vec16 import _data, _i64, _splat, _vec_ptr

_F32 = ir.FloatType()
_I1 = ir.IntType(1)
_I8 = ir.IntType(8)
_I32 = ir.IntType(32)
_V16 = ir.VectorType(_F32, 16)
_I16 = ir.VectorType(_I32, 16)
_B16 = ir.VectorType(_I8, 16)
_B8 = ir.VectorType(_I8, 8)


def _f16(x):
    return ir.Constant(_V16, [x] * 16)


def _abs16(builder, v):
    """|v| in 16 lanes: the sign bit cleared (abs on float32 bits, as numba's abs of a float32)."""
    bits = builder.bitcast(v, _I16)
    return builder.bitcast(builder.and_(bits, ir.Constant(_I16, [0x7FFFFFFF] * 16)), _V16)


def _f32_array(a):
    return isinstance(a, types.Array) and a.layout == "C" and a.dtype == types.float32


@intrinsic
def absmax16(typingctx, src, so):
    """float32: the largest |src[so + j]| for j < 16, from +0.0 (quantize.block_amax's loop `m = 0; if |x| > m:
    m = |x|`, for values that are not NaN). src float32, C-contiguous."""
    if not _f32_array(src):
        return None
    sig = types.float32(src, so)

    def codegen(context, builder, signature, args):
        s_, so_ = args
        sty, soty = signature.args
        sp = _data(context, builder, sty, s_)
        v = _abs16(builder, builder.load(_vec_ptr(builder, sp, _i64(context, builder, soty, so_), _V16), align=4))
        width = 16
        while width > 1:  # halves compared lane by lane: an ordered `>` select, as the scalar loop's test
            width //= 2
            lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, width), list(range(width))))
            hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, width), list(range(width, 2 * width))))
            v = builder.select(builder.fcmp_ordered(">", hi, lo), hi, lo)
        m = builder.extract_element(v, ir.Constant(_I32, 0))
        zero = ir.Constant(_F32, 0.0)
        return builder.select(builder.fcmp_ordered(">", m, zero), m, zero)

    return sig, codegen


# the E2M1 index's thresholds on |t| with their compare: `>` where a tie rounds down, `>=` where it rounds up
_THRESHOLDS = ((">", 0.25), (">=", 0.75), (">", 1.25), (">=", 1.75), (">", 2.5), (">=", 3.5), (">", 5.0))


@intrinsic
def rtn_codes16(typingctx, dst, do, src, so, enc):
    """dst[do + k] (uint8) for k < 8: the E2M1 codes of t_j = src[so + j] * enc clamped to [-6, 6] (j = 2 k the low
    nibble, 2 k + 1 the high one), as quantize.e2m1_code computes each. dst uint8, src float32, C-contiguous."""
    if not (_f32_array(src) and isinstance(dst, types.Array) and dst.layout == "C" and dst.dtype == types.uint8):
        return None
    sig = types.void(dst, do, src, so, enc)

    def codegen(context, builder, signature, args):
        d_, do_, s_, so_, e_ = args
        dty, doty, sty, soty, ety = signature.args
        dp, sp = _data(context, builder, dty, d_), _data(context, builder, sty, s_)
        x = builder.load(_vec_ptr(builder, sp, _i64(context, builder, soty, so_), _V16), align=4)
        t = builder.fmul(x, _splat(builder, context.cast(builder, e_, ety, types.float32), _V16))
        t = builder.select(builder.fcmp_ordered("<", t, _f16(-6.0)), _f16(-6.0), t)
        t = builder.select(builder.fcmp_ordered(">", t, _f16(6.0)), _f16(6.0), t)
        a = _abs16(builder, t)
        code = ir.Constant(_B16, [0] * 16)
        for op, th in _THRESHOLDS:
            code = builder.add(code, builder.zext(builder.fcmp_ordered(op, a, _f16(th)), _B16))
        code = builder.or_(code, builder.select(builder.fcmp_ordered("<", t, _f16(0.0)),
                                                ir.Constant(_B16, [8] * 16), ir.Constant(_B16, [0] * 16)))
        lo = builder.shuffle_vector(code, code, ir.Constant(ir.VectorType(_I32, 8), list(range(0, 16, 2))))
        hi = builder.shuffle_vector(code, code, ir.Constant(ir.VectorType(_I32, 8), list(range(1, 16, 2))))
        packed = builder.or_(lo, builder.shl(hi, ir.Constant(_B8, [4] * 8)))
        builder.store(packed, _vec_ptr(builder, dp, _i64(context, builder, doty, do_), _B8), align=1)
        return context.get_dummy_value()

    return sig, codegen

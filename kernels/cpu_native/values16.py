"""The sparse decode's values (backend.dequantize of the guided codes) for one 16-value block in 16-lane
registers, rounded to bf16 bits, LLVM IR.

Why: sparse_decode's `with_values` pass built each value from a table load, a sign select and a multiply,
then rounded it to bf16 on its integer bits, one value at a time (~0.7 ms of a step's 7.5 ms decode on one
thread, lane decode10). The float32 values are decode16.decode16_row's (the grouped GEMM's block decode:
the signed E2M1 value built from the nibble's bits, times the block's multiplier); here the same vector of
products is also rounded to bf16.

The same bits as the scalar loop: the product is decode16_row's, which equals `(-mag if c & 8 else mag) *
mult` (decode16.py: why; the sign is exact on the table value, and -0.0 for code 8 as the scalar's -0.0);
the rounding is torch's float -> bf16 round to nearest even on the float32 bits u, `(u + 0x7FFF + ((u >> 16)
& 1)) >> 16` kept to 16 bits: the scalar computes it in int64, here in 32-bit lanes that wrap, and bits 16-31
of the sum are the same either way (only a carry out of bit 31 differs, which both drop).
tests/kernels/test_sparse_values16.py checks every code byte under scales of every exponent range.
"""

from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from .decode16 import _e2m1_times
from .vec16 import _data, _i64, _k16, _nibbles16, _splat, _vec_ptr

_F32 = ir.FloatType()
_I8 = ir.IntType(8)
_I16T = ir.IntType(16)
_I32 = ir.IntType(32)
_V16 = ir.VectorType(_F32, 16)
_I16 = ir.VectorType(_I32, 16)



@intrinsic
def values16_bf16(typingctx, dst, do, codes, co, mult):
    """dst[do + j] (uint16, bf16 bits) for j < 16: e2m1(nibble j of the 8 code bytes codes[co ..]) * mult (nibble
    2 k the low one of byte k), rounded to bf16 to nearest even. dst uint16, codes uint8, both C-contiguous;
    mult float32 (the block's scale value times g_dec)."""
    if not (isinstance(dst, types.Array) and dst.layout == "C" and dst.dtype == types.uint16
            and isinstance(codes, types.Array) and codes.layout == "C" and codes.dtype == types.uint8
            and mult == types.float32):
        return None
    sig = types.void(dst, do, codes, co, mult)

    def codegen(context, builder, signature, args):
        d_, do_, c_, co_, m_ = args
        dty, doty, cty, coty, mty = signature.args
        dp, cp = _data(context, builder, dty, d_), _data(context, builder, cty, c_)
        do_, co_ = _i64(context, builder, doty, do_), _i64(context, builder, coty, co_)
        i8x8 = ir.VectorType(_I8, 8)
        nib = _nibbles16(builder, builder.load(_vec_ptr(builder, cp, co_, i8x8), align=1))
        u = builder.bitcast(_e2m1_times(builder, nib, _splat(builder, m_, _V16)), _I16)
        odd = builder.and_(builder.lshr(u, _k16(16)), _k16(1))
        r = builder.lshr(builder.add(builder.add(u, _k16(0x7FFF)), odd), _k16(16))
        builder.store(builder.trunc(r, ir.VectorType(_I16T, 16)), _vec_ptr(builder, dp, do_, ir.VectorType(_I16T, 16)),
                      align=2)
        return context.get_dummy_value()

    return sig, codegen

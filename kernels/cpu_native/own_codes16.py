"""The sparse decode's code stage for one 16-value block in 16-lane registers, LLVM IR: the trainer's own
mantissa bits under a hypothesis's block scale, each value's grid neighbours and sign, and what its flip
cost starts from (sparse_decode._hypothesis).

Why: per value the scalar loop did a multiply, two clamps, the seven compares of the E2M1 index, seven
more for the grid floor, a table load and a branch on "on the grid", one value at a time (~0.8 ms of a
step's 7.5 ms decode on one thread, lane decode10). Every value's work is independent: 16 lanes at once.

The same bits as the scalar loop (the float work is one IEEE multiply and ordered compares, no fast-math
flag): y = x * enc clamped to [-6, 6] by the same two compares as selects; a = |y| (sign bit cleared);
bit = the E2M1 index's parity (quantize.e2m1_code's seven compares, ties to even; the sign's 8 does not
touch bit 0); k = the grid floor (seven `>=` compares against 0.5 .. 6); the grid value E2M1_GRID[k] built
from k's bits as decode16._e2m1_times builds it (exact float32 numbers); neg = 64 where y < 0; on the grid
(E2M1_GRID[k] == a): cost inf and nbr = k | k << 3 | neg, else cost a and nbr = k | min(k + 1, 7) << 3 | neg.
tests/kernels/test_sparse_own_codes16.py checks it against the scalar loop on ties, grid points, one-ulp
neighbours, signed zeros, saturation and random blocks.
"""

from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from .vec16 import _data, _i64, _k16, _splat, _vec_ptr

_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_V16 = ir.VectorType(_F32, 16)
_I16 = ir.VectorType(_I32, 16)
_L16 = ir.VectorType(_I64, 16)


def _f16(x):
    return ir.Constant(_V16, [x] * 16)



def _count(builder, a, thresholds):
    """The number of (op, threshold) compares of a that hold, in each lane (<16 x i32>)."""
    n = _k16(0)
    for op, th in thresholds:
        n = builder.add(n, builder.zext(builder.fcmp_ordered(op, a, _f16(th)), _I16))
    return n


_INDEX = ((">", 0.25), (">=", 0.75), (">", 1.25), (">=", 1.75), (">", 2.5), (">=", 3.5), (">", 5.0))
_FLOOR = tuple((">=", g) for g in (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0))


def _grid16(builder, k):
    """E2M1_GRID[k] (k <16 x i32> in 0..7) as float32: 0, 0.5, then exponent 126 + k >> 1 with mantissa bit 22
    = k & 1 (1, 1.5, 2, 3, 4, 6), as decode16._e2m1_times builds the magnitude."""
    mag = builder.or_(builder.shl(builder.add(builder.lshr(k, _k16(1)), _k16(126)), _k16(23)),
                      builder.shl(builder.and_(k, _k16(1)), _k16(22)))
    mag = builder.select(builder.icmp_unsigned("==", k, _k16(1)), _k16(0x3F000000), mag)
    mag = builder.select(builder.icmp_unsigned("==", k, _k16(0)), _k16(0), mag)
    return builder.bitcast(mag, _V16)


def _ok(bits, nbr, cost, x):
    def c(a, dt):
        return isinstance(a, types.Array) and a.layout == "C" and a.dtype == dt
    return c(bits, types.int64) and c(nbr, types.int64) and c(cost, types.float32) and c(x, types.float32)


@intrinsic
def own_codes16(typingctx, bits, nbr, cost, off, x, enc):
    """For t = off + j, j < 16: y = x[t] * enc clamped to [-6, 6]; bits[t] = the E2M1 index of y & 1; nbr[t] = k |
    k_up << 3 | (64 if y < 0) with k the grid floor of |y| and k_up = k on the grid, else min(k + 1, 7); cost[t] =
    inf on the grid, else |y|. bits / nbr int64, cost / x float32, all C-contiguous; enc float32."""
    if not _ok(bits, nbr, cost, x):
        return None
    sig = types.void(bits, nbr, cost, off, x, enc)

    def codegen(context, builder, signature, args):
        b_, n_, c_, o_, x_, e_ = args
        bty, nty, cty, oty, xty, ety = signature.args
        bp, np_, cp, xp = (_data(context, builder, t, v) for t, v in ((bty, b_), (nty, n_), (cty, c_), (xty, x_)))
        o = _i64(context, builder, oty, o_)
        y = builder.fmul(builder.load(_vec_ptr(builder, xp, o, _V16), align=4),
                         _splat(builder, context.cast(builder, e_, ety, types.float32), _V16))
        y = builder.select(builder.fcmp_ordered("<", y, _f16(-6.0)), _f16(-6.0), y)
        y = builder.select(builder.fcmp_ordered(">", y, _f16(6.0)), _f16(6.0), y)
        a = builder.bitcast(builder.and_(builder.bitcast(y, _I16), _k16(0x7FFFFFFF)), _V16)
        bit = builder.and_(_count(builder, a, _INDEX), _k16(1))
        k = _count(builder, a, _FLOOR)
        neg = builder.select(builder.fcmp_ordered("<", y, _f16(0.0)), _k16(64), _k16(0))
        on = builder.fcmp_ordered("==", _grid16(builder, k), a)
        up = builder.select(on, k, builder.select(builder.icmp_unsigned("<", k, _k16(7)), builder.add(k, _k16(1)), _k16(7)))
        nb = builder.or_(builder.or_(k, builder.shl(up, _k16(3))), neg)
        builder.store(builder.zext(bit, _L16), _vec_ptr(builder, bp, o, _L16), align=8)
        builder.store(builder.zext(nb, _L16), _vec_ptr(builder, np_, o, _L16), align=8)
        builder.store(builder.select(on, _f16(float("inf")), a), _vec_ptr(builder, cp, o, _V16), align=4)
        return context.get_dummy_value()

    return sig, codegen

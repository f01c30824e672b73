"""expf in 16 lanes, written as LLVM IR: the softmax's exponentials of the native attention (attention.py).

Why: the attention's `np.exp(s[t] - mx)` on a float32 is one call of libm's scalar `expf` per key and query
head (~6,400 a decode call of the bench's engine, ~4 ns each). LLVM cannot vectorise a libm call without a
vector library, and numba's SVML one is not bit-identical. This is glibc's own expf (`__expf_fma`: sysdeps/
ieee754/flt-32/e_expf.c, the FMA build that glibc's IFUNC picks on an x86-64 CPU with FMA, as on this host)
run in 16 lanes: the same 32-entry table of 2^(i/32), the same degree-3 polynomial, the same double-precision
steps with the same fused multiply-adds where GCC fused them in that build (read off its machine code:
k = fma(InvLn2N, x, Shift), r = fma(InvLn2N, x, -kd), z = fma(C0, r, C1), y = fma(C2, r, 1), y = fma(z, r^2, y)),
and the same results on its special inputs (-inf -> 0, inf / NaN -> x + x, overflow -> inf, underflow -> 0
or the smallest subnormal). So every lane gives the bits of the scalar expf it replaces: checked over all
2^32 float32 inputs (tests/kernels/test_cpu_native_attention_exp.py).

The bits are glibc's FMA expf's, not those of any libm: on a host whose `expf` is another implementation
(musl, macOS, glibc's non-FMA build on a CPU without FMA, an older glibc) the scalar kernel's results can
differ from these in the last bit, and the all-floats test skips there, saying why.
"""

import platform
import struct

from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

_F32 = ir.FloatType()
_F64 = ir.DoubleType()
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_VF = ir.VectorType(_F32, 16)
_VD = ir.VectorType(_F64, 16)
_VI = ir.VectorType(_I32, 16)
_VL = ir.VectorType(_I64, 16)

_N = 32  # table entries: EXP2F_TABLE_BITS 5
_INV_LN2_N = float.fromhex("0x1.71547652b82fep+5")  # N / ln 2
_SHIFT = float.fromhex("0x1.8p+52")  # rounds k to an integer in the low mantissa bits
_C = [float.fromhex(h) for h in ("0x1.c6af84b912394p-20", "0x1.ebfce50fac4f3p-13", "0x1.62e42ff0c52d6p-6")]
# __exp2f_data.tab: the bits of 2^(i/32), less i << 47 (the k << 47 added back below puts k / 32 in the exponent)
_TAB = (0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51, 0x3fef72b83c7d517b,
        0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1, 0x3fef06fe0a31b715, 0x3feef1a7373aa9cb,
        0x3feedea64c123422, 0x3feece086061892d, 0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429,
        0x3feea47eb03a5585, 0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
        0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d, 0x3feee89f995ad3ad,
        0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069, 0x3fef5818dcfba487, 0x3fef7c97337b9b5f,
        0x3fefa4afa2a490da, 0x3fefd0765b6e4540)
_F32_BITS = {  # the special path's thresholds and results (float32 bits)
    "overflow_above": 0x42B17217,  # 0x1.62e42ep6f, log(0x1p128): above it, inf (__math_oflowf)
    "underflow_below": 0xC2CFF1B4,  # -0x1.9fe368p6f, log(0x1p-150): below it, +0 (__math_uflowf: 0x1p-95f squared)
    "may_underflow_below": 0xC2CE8ECF,  # -0x1.9d1d9ep6f, log(0x1p-149): below it, 0x1.4p-75f squared = 2^-149
}
_TOP12_88 = 0x42B  # top12(88.0f): |x| >= 88 (or NaN / inf) takes the special checks


def _bits_f32(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b))[0]


def glibc_fma_expf_host() -> str | None:
    """Why this host's `expf` may not be the one exp16 copies (glibc's FMA build), or None when it is."""
    libc, version = platform.libc_ver()
    if libc != "glibc":
        return f"the C library is {libc or 'not glibc'!r}, not glibc: its expf is another implementation"
    if tuple(int(p) for p in version.split(".")[:2]) < (2, 28):
        return f"glibc {version} predates the table-driven expf of 2.28"
    if platform.machine() != "x86_64":
        return f"{platform.machine()}: glibc's expf there is not the x86-64 FMA build"
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "no /proc/cpuinfo to tell whether the CPU has FMA (glibc picks the FMA expf by it)"
    if "fma" not in flags or "avx2" not in flags:
        return "the CPU has no FMA / AVX2: glibc's IFUNC picks its non-FMA expf"
    return None


def _splat(builder, x, vty):
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined), ir.Constant(_VI, [0] * 16))


def _dconst(x):
    return ir.Constant(_VD, [x] * 16)


def _table(module):
    """The [32 x i64] table as a module-internal constant (one per module that inlines exp16)."""
    name = "trace_fp4_expf_tab"
    if name in module.globals:
        return module.globals[name]
    arr = ir.ArrayType(_I64, _N)
    g = ir.GlobalVariable(module, arr, name=name)
    g.linkage = "internal"
    g.global_constant = True
    g.initializer = ir.Constant(arr, list(_TAB))
    return g


def expf16(builder, x):
    """<16 x float> x -> expf of each lane (glibc's __expf_fma, bit for bit)."""
    mod = builder.module
    name = "llvm.fma.v16f64"  # llvmlite's declare_intrinsic cannot name a vector overload
    fma = mod.globals.get(name) or ir.Function(mod, ir.FunctionType(_VD, [_VD, _VD, _VD]), name=name)
    xd = builder.fpext(x, _VD)
    kdr = builder.call(fma, [_dconst(_INV_LN2_N), xd, _dconst(_SHIFT)])  # k + Shift, k = round(x N / ln 2)
    ki = builder.bitcast(kdr, _VL)
    kd = builder.fsub(kdr, _dconst(_SHIFT))
    r = builder.call(fma, [_dconst(_INV_LN2_N), xd, builder.fneg(kd)])  # x N / ln 2 - k, in [-1/2, 1/2]
    idx = builder.and_(ki, ir.Constant(_VL, [_N - 1] * 16))
    tab = _table(mod)
    t = ir.Constant(_VL, ir.Undefined)
    for j in range(16):
        e = builder.extract_element(idx, ir.Constant(_I32, j))
        t = builder.insert_element(t, builder.load(builder.gep(tab, [ir.Constant(_I32, 0), e])), ir.Constant(_I32, j))
    t = builder.add(t, builder.shl(ki, ir.Constant(_VL, [52 - 5] * 16)))
    s = builder.bitcast(t, _VD)  # 2^(k / N)
    z = builder.call(fma, [_dconst(_C[0]), r, _dconst(_C[1])])
    r2 = builder.fmul(r, r)
    y = builder.call(fma, [_dconst(_C[2]), r, _dconst(1.0)])
    y = builder.call(fma, [z, r2, y])
    y = builder.fptrunc(builder.fmul(y, s), _VF)
    # The special inputs (|x| >= 88, inf, NaN), as the scalar code's branches return them.
    xb = builder.bitcast(x, _VI)

    def i32(v):
        return ir.Constant(_VI, [v] * 16)

    def f32(b):
        return ir.Constant(_VF, [_bits_f32(b)] * 16)

    abstop = builder.and_(builder.lshr(xb, i32(20)), i32(0x7FF))
    special = builder.icmp_unsigned(">=", abstop, i32(_TOP12_88))
    alt = y  # 88 <= |x| but within range: the main path's value
    alt = builder.select(builder.fcmp_ordered("<", x, f32(_F32_BITS["may_underflow_below"])), f32(1), alt)
    alt = builder.select(builder.fcmp_ordered("<", x, f32(_F32_BITS["underflow_below"])), f32(0), alt)
    alt = builder.select(builder.fcmp_ordered(">", x, f32(_F32_BITS["overflow_above"])), f32(0x7F800000), alt)
    alt = builder.select(builder.icmp_unsigned(">=", abstop, i32(0x7F8)), builder.fadd(x, x), alt)  # inf, NaN
    alt = builder.select(builder.icmp_unsigned("==", xb, i32(0xFF800000)), f32(0), alt)  # -inf
    return builder.select(special, alt, y)


@intrinsic
def exp16_shifted(typingctx, s, o, mx):
    """s[o + j] = expf(s[o + j] - mx) for j < 16 (float32 s, the subtraction in float32 as the scalar code's):
    the softmax's exponentials of 16 keys (unaligned load and store: align 4)."""
    sig = types.void(s, o, mx)

    def codegen(context, builder, signature, args):
        s_, o_, mx_ = args
        sty, oty, _ = signature.args
        data = context.make_array(sty)(context, builder, s_).data
        ptr = builder.bitcast(builder.gep(data, [context.cast(builder, o_, oty, types.int64)]), _VF.as_pointer())
        x = builder.fsub(builder.load(ptr, align=4), _splat(builder, mx_, _VF))
        builder.store(expf16(builder, x), ptr, align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def exp16_array(typingctx, x, o, y):
    """y[o + j] = expf(x[o + j]) for j < 16 (float32 arrays): for the all-floats check against the scalar expf."""
    sig = types.void(x, o, y)

    def codegen(context, builder, signature, args):
        x_, o_, y_ = args
        xty, oty, yty = signature.args
        o64 = context.cast(builder, o_, oty, types.int64)
        xp = builder.bitcast(builder.gep(context.make_array(xty)(context, builder, x_).data, [o64]), _VF.as_pointer())
        yp = builder.bitcast(builder.gep(context.make_array(yty)(context, builder, y_).data, [o64]), _VF.as_pointer())
        builder.store(expf16(builder, builder.load(xp, align=4)), yp, align=4)
        return context.get_dummy_value()

    return sig, codegen


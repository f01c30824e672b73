"""16-lane float32 vector loops for the native attention (attention.py), written as LLVM IR.

Why: numba hands its loops to LLVM's loop vectoriser, which for the attention's short loops (~30-160 keys,
head dims of 32) picks 64-wide bodies (16 lanes x 4) plus a runtime alias check and a scalar remainder, so at
L ~100 keys most of the work ran one value at a time, and a sum kept in memory (s[t] += ...) went through a
load and store per step. Here each loop is written with explicit 16-lane vectors whose sums stay in
registers, and every lane does the scalar code's arithmetic: an IEEE multiply then an IEEE add, in the same
order, no fused multiply-add, no reassociation (no fast-math flags on any instruction), so each value has the
bits of the scalar loop it replaces. The K/V decode's integer builds (_build16: a block's 16 values from its 8
code bytes) run the same way: one row's block along the row (V), or 16 rows' blocks transposed in registers
into K's [d, row] layout (build_cols16).
"""

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_V16 = ir.VectorType(_F32, 16)
_I16 = ir.VectorType(_I32, 16)


def _data(context, builder, aryty, ary):
    """The array's data pointer (elements of its dtype)."""
    return context.make_array(aryty)(context, builder, ary).data


def _vec_ptr(builder, data, index, vty):
    """Pointer to the 16 elements at data[index] as one vector (unaligned loads and stores: align 4)."""
    return builder.bitcast(builder.gep(data, [index]), vty.as_pointer())


def _splat(builder, x, vty):
    """x in all 16 lanes."""
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined), ir.Constant(_I16, [0] * 16))


def _i64(context, builder, ty, v):
    return context.cast(builder, v, ty, types.int64)


def _mac_loop(builder, accs, n, a, b, base, stride, total=None):
    """For i < n in order: accs[u] += a[i] * b[base + i stride + 16 u .. + 16] (all 16 lanes of each of the U
    register sums; an IEEE multiply then an IEEE add). The scores' loop over d and the output's over keys.
    `total` (a float32 slot): also total += a[i], in order (the softmax's denominator, summed beside the output's
    first 16 values: the same additions in the same order as a loop of its own, without a second pass over p)."""
    with cgutils.for_range(builder, n) as loop:
        i = loop.index
        ai_s = builder.load(builder.gep(a, [i]))
        if total is not None:
            builder.store(builder.fadd(builder.load(total), ai_s), total)
        ai = _splat(builder, ai_s, _V16)
        row = builder.add(base, builder.mul(i, stride))
        for u, acc in enumerate(accs):
            x = builder.load(_vec_ptr(builder, b, builder.add(row, ir.Constant(_I64, 16 * u)), _V16), align=4)
            builder.store(builder.fadd(builder.load(acc), builder.fmul(ai, x)), acc)


def _scores_factory(U):
    @intrinsic
    def scores(typingctx, s, so, qf, kt, ko, kstride, D, scale):
        """s[so + j] for j < 16 U: sum over d < D, in order from 0.0, of qf[d] * kt_flat[ko + d kstride + j], then
        times scale (attention.py's score loop; kt_flat the C-contiguous float32 kt as one row). The U x 16 sums
        are independent chains held in registers."""
        sig = types.void(s, so, qf, kt, ko, kstride, D, scale)

        def codegen(context, builder, signature, args):
            s_, so_, qf_, kt_, ko_, ks_, D_, sc_ = args
            sty, soty, qfty, ktty, koty, ksty, Dty, scty = signature.args
            sp, qp, kp = _data(context, builder, sty, s_), _data(context, builder, qfty, qf_), _data(context, builder, ktty, kt_)
            so_, ko_, ks_, D_ = (_i64(context, builder, t, v) for t, v in ((soty, so_), (koty, ko_), (ksty, ks_), (Dty, D_)))
            accs = [cgutils.alloca_once_value(builder, ir.Constant(_V16, [0.0] * 16)) for _ in range(U)]
            _mac_loop(builder, accs, D_, qp, kp, ko_, ks_)
            scv = _splat(builder, sc_, _V16)
            for u in range(U):
                dst = _vec_ptr(builder, sp, builder.add(so_, ir.Constant(_I64, 16 * u)), _V16)
                builder.store(builder.fmul(builder.load(accs[u]), scv), dst, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return scores


scores16x4 = _scores_factory(4)
scores16x1 = _scores_factory(1)


def _wsum_factory(U, with_total=False):
    @intrinsic
    def wsum(typingctx, acc, p, L, v, vo, vstride):
        """acc[j] for j < 16 U: sum over t < L, in order from 0.0, of p[t] * v_flat[vo + t vstride + j] (attention.py's
        output loop; v_flat the C-contiguous float32 V rows as one row). The U x 16 sums held in registers. The
        `_total` variant returns sum over t < L, in order from 0.0, of p[t] (float32) as well."""
        sig = (types.float32 if with_total else types.void)(acc, p, L, v, vo, vstride)

        def codegen(context, builder, signature, args):
            a_, p_, L_, v_, vo_, vs_ = args
            aty, pty, Lty, vty, voty, vsty = signature.args
            ap, pp, vp = _data(context, builder, aty, a_), _data(context, builder, pty, p_), _data(context, builder, vty, v_)
            L_, vo_, vs_ = (_i64(context, builder, t, x) for t, x in ((Lty, L_), (voty, vo_), (vsty, vs_)))
            accs = [cgutils.alloca_once_value(builder, ir.Constant(_V16, [0.0] * 16)) for _ in range(U)]
            total = cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0)) if with_total else None
            _mac_loop(builder, accs, L_, pp, vp, vo_, vs_, total)
            for u in range(U):
                builder.store(builder.load(accs[u]), _vec_ptr(builder, ap, ir.Constant(_I64, 16 * u), _V16), align=4)
            return builder.load(total) if with_total else context.get_dummy_value()

        return sig, codegen

    return wsum


wsum16x1 = _wsum_factory(1)
wsum16x2 = _wsum_factory(2)
wsum16x4 = _wsum_factory(4)
wsum16x1_total = _wsum_factory(1, True)
wsum16x2_total = _wsum_factory(2, True)
wsum16x4_total = _wsum_factory(4, True)


def _k16(x):
    return ir.Constant(_I16, [x] * 16)


def _nibbles16(builder, codes):
    """<8 x i8> code bytes -> <16 x i32>: nibble j of them in lane j (nibble 2 k the low one of byte k, 2 k + 1
    the high one). The block unpack of the attention's build, the grouped GEMM's decode16_row and the sparse
    decode's values16."""
    i32x8 = ir.VectorType(_I32, 8)
    c = builder.zext(codes, i32x8)
    lo = builder.and_(c, ir.Constant(i32x8, [15] * 8))
    hi = builder.lshr(c, ir.Constant(i32x8, [4] * 8))
    return builder.shuffle_vector(lo, hi, ir.Constant(_I16, [k // 2 + 8 * (k % 2) for k in range(16)]))


def _build16(builder, codes, b1v, b15v):
    """<8 x i8> code bytes (value 2 k the low nibble of byte k, 2 k + 1 the high one) and the block's r1 / r15 bits
    (<16 x i32> splats, attention._block_bits) -> <16 x i32>: the bits of _decode_row's fast-path table entry for
    each code nibble n. r1, r15 are positive normal numbers: |entry| is 0 (n & 7 == 0) or r1 or r15 times 2^k,
    k = (n & 7) // 2 - 1 (codes 1, 2|3, 4|5, 6|7: 0.5, 1, 2, 4; r15 for the odd codes 3, 5, 7), so its bits are
    r's bits plus k in the exponent field (exact: every entry is normal, see attention._M_LO), and the sign bit
    n & 8 (tab[8 + i] = -tab[i]: -0.0 for n = 8). Integer selects and adds, all 16 values at once; on a host with
    AVX-512 the eight magnitudes are built once in one register and each nibble picks its own by a lane permute
    (_magnitudes16), the same bits in about half the instructions."""
    n = _nibbles16(builder, codes)
    a = builder.and_(n, _k16(7))
    if _PERMUTE:
        v = builder.call(_permvar(builder), [_magnitudes16(builder, b1v, b15v), a])
    else:
        odd = builder.and_(builder.icmp_unsigned("==", builder.and_(a, _k16(1)), _k16(1)),
                           builder.icmp_unsigned(">", a, _k16(1)))
        base = builder.select(odd, b15v, b1v)
        v = builder.sub(builder.add(base, builder.shl(builder.lshr(a, _k16(1)), _k16(23))), _k16(1 << 23))
        v = builder.select(builder.icmp_unsigned("==", a, _k16(0)), _k16(0), v)
    return builder.or_(v, builder.shl(builder.and_(n, _k16(8)), _k16(28)))


def _host_has_avx512f():
    """Whether the CPU numba compiles for has AVX-512F's vpermd on 16 lanes: the host's features, unless numba is
    told another target (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES, e.g. a portable cache): then only features it names
    count, and a named CPU without them gets the select build (LLVM would refuse the intrinsic there)."""
    import llvmlite.binding as llvm
    from numba.core import config

    if config.CPU_FEATURES is not None:
        return "+avx512f" in config.CPU_FEATURES.split(",")
    if config.CPU_NAME is not None and config.CPU_NAME != "host":
        return False
    return bool(llvm.get_host_cpu_features().get("avx512f", False))


# The lane-permute build (_magnitudes16 + vpermd) needs AVX-512F; elsewhere the select build runs. Both give the
# same bits for every code and r1 / r15 (tests/kernels/test_cpu_native_attention.py checks the one this host runs
# against _decode_row; the select build is main's code before this change).
_PERMUTE = _host_has_avx512f()


def _permvar(builder):
    """llvm.x86.avx512.permvar.si.512(table, idx): lane j of the result = table[idx[j] & 15] (vpermd)."""
    fnty = ir.FunctionType(_I16, [_I16, _I16])
    return cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.avx512.permvar.si.512")


def _magnitudes16(builder, b1v, b15v):
    """The eight magnitudes' bits for n & 7 = 0 .. 7, in lanes 0 .. 7 (lanes 8 .. 15 unused: the index is n & 7):
    0, r1 - 1 exponent step (0.5 r1), r1, r15, r1 + 1 step (2 r1), r15 + 1, r1 + 2 steps (4 r1), r15 + 2 steps,
    which is the select build's base + ((a >> 1) << 23) - (1 << 23) per a, and 0 for a = 0."""
    odd = ir.Constant(ir.VectorType(ir.IntType(1), 16), [a % 2 == 1 and a > 1 for a in range(16)])
    base = builder.select(odd, b15v, b1v)
    step = ir.Constant(_I16, [((a % 8) >> 1 << 23) - (1 << 23) for a in range(16)])
    keep = ir.Constant(_I16, [0 if a % 8 == 0 else -1 for a in range(16)])
    return builder.and_(builder.add(base, step), keep)


_I8X8 = ir.VectorType(ir.IntType(8), 8)


@intrinsic
def build_row16(typingctx, dst, do, src, so, b1, b15):
    """dst[do + j] (uint32) for j < 16 = _build16's bits for the j-th code nibble of the 8 code bytes
    src[so ..] (value 2 k the low nibble of byte k, 2 k + 1 the high one), from the bits b1 (r1) and b15 (r15)
    of the block: one row's block laid out along the row."""
    sig = types.void(dst, do, src, so, b1, b15)

    def codegen(context, builder, signature, args):
        d_, do_, s_, so_, b1_, b15_ = args
        dty, doty, sty, soty, b1ty, b15ty = signature.args
        dp, sp = _data(context, builder, dty, d_), _data(context, builder, sty, s_)
        do_, so_ = _i64(context, builder, doty, do_), _i64(context, builder, soty, so_)
        b1v = _splat(builder, context.cast(builder, b1_, b1ty, types.uint32), _I16)
        b15v = _splat(builder, context.cast(builder, b15_, b15ty, types.uint32), _I16)
        v = _build16(builder, builder.load(_vec_ptr(builder, sp, so_, _I8X8), align=1), b1v, b15v)
        builder.store(v, _vec_ptr(builder, dp, do_, _I16), align=4)
        return context.get_dummy_value()

    return sig, codegen


def _transpose16(builder, rows):
    """16 <16 x i32> rows -> the 16 columns (rows[j][d] -> cols[d][j]): four rounds of pairing row i with row
    i + 8 and interleaving their low and high halves (register shuffles, no memory)."""
    lo = ir.Constant(_I16, [k // 2 + 16 * (k % 2) for k in range(16)])
    hi = ir.Constant(_I16, [8 + k // 2 + 16 * (k % 2) for k in range(16)])
    for _ in range(4):
        new = []
        for i in range(8):
            new.append(builder.shuffle_vector(rows[i], rows[i + 8], lo))
            new.append(builder.shuffle_vector(rows[i], rows[i + 8], hi))
        rows = new
    return rows


@intrinsic
def build_cols16(typingctx, dst, kstride, d0, i0, src, off, cpart, b1r, b15r, N):
    """One 16-value block of 16 rows decoded into K's transposed layout: for j < 16 and d < 16,
    dst_flat[(d0 + d) kstride + i0 + j] (uint32) = _build16's bits for value d of the block whose 8 code
    bytes start at src[off[i] + cpart], r1 / r15 bits b1r[i] / b15r[i], row i = min(i0 + j, N - 1) (the group's
    rows past N repeat row N - 1: the caller zeroes those columns). Each row's block is built in 16 lanes from its
    code bytes (_build16), the 16 x 16 block transposed in registers, and stored as 16 columns of 16 rows: no
    per-row code words gathered along the rows, no 16 scalar passes over them per block."""
    sig = types.void(dst, kstride, d0, i0, src, off, cpart, b1r, b15r, N)

    def codegen(context, builder, signature, args):
        tys = signature.args
        dp, sp, op, b1p, b15p = (_data(context, builder, tys[k], args[k]) for k in (0, 4, 5, 7, 8))
        ks, d0_, i0_, cp, n_ = (_i64(context, builder, tys[k], args[k]) for k in (1, 2, 3, 6, 9))
        last = builder.sub(n_, ir.Constant(_I64, 1))
        rows = []
        for j in range(16):
            i = builder.add(i0_, ir.Constant(_I64, j))
            i = builder.select(builder.icmp_signed("<", i, last), i, last)
            o = builder.add(_i64(context, builder, tys[5].dtype, builder.load(builder.gep(op, [i]))), cp)
            b1v = _splat(builder, builder.load(builder.gep(b1p, [i])), _I16)
            b15v = _splat(builder, builder.load(builder.gep(b15p, [i])), _I16)
            rows.append(_build16(builder, builder.load(_vec_ptr(builder, sp, o, _I8X8), align=1), b1v, b15v))
        for d, col in enumerate(_transpose16(builder, rows)):
            at = builder.add(builder.mul(builder.add(d0_, ir.Constant(_I64, d)), ks), i0_)
            builder.store(col, _vec_ptr(builder, dp, at, _I16), align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def max16(typingctx, s, n):
    """The float32 m of attention's scalar loop `m = -inf; for t < n: if s[t] > m: m = s[t]` (the scores' max: NaN
    never taken), with the n // 16 full blocks compared in 16 lanes (one running max a lane), then the lanes and
    the last n % 16 values in order. The same value as the scalar loop; of equal zeros it may keep the other
    sign, which the softmax cannot see (s - (+0) and s - (-0) differ only for s = -0, both exp to 1)."""
    if not isinstance(s, types.Array) or s.dtype != types.float32:
        return None  # float32 scores only: the lanes are <16 x float>
    sig = s.dtype(s, n)

    def codegen(context, builder, signature, args):
        s_, n_ = args
        sty, nty = signature.args
        sp = _data(context, builder, sty, s_)
        n64 = _i64(context, builder, nty, n_)
        ninf = float("-inf")
        acc = cgutils.alloca_once_value(builder, ir.Constant(_V16, [ninf] * 16))
        with cgutils.for_range(builder, builder.sdiv(n64, ir.Constant(_I64, 16))) as loop:
            x = builder.load(_vec_ptr(builder, sp, builder.mul(loop.index, ir.Constant(_I64, 16)), _V16), align=4)
            a = builder.load(acc)
            builder.store(builder.select(builder.fcmp_ordered(">", x, a), x, a), acc)
        m = cgutils.alloca_once_value(builder, ir.Constant(_F32, ninf))
        a = builder.load(acc)
        for j in range(16):
            e, cur = builder.extract_element(a, ir.Constant(_I32, j)), builder.load(m)
            builder.store(builder.select(builder.fcmp_ordered(">", e, cur), e, cur), m)
        t0 = builder.mul(builder.sdiv(n64, ir.Constant(_I64, 16)), ir.Constant(_I64, 16))
        with cgutils.for_range(builder, builder.sub(n64, t0)) as loop:
            e, cur = builder.load(builder.gep(sp, [builder.add(t0, loop.index)])), builder.load(m)
            builder.store(builder.select(builder.fcmp_ordered(">", e, cur), e, cur), m)
        return builder.load(m)

    return sig, codegen

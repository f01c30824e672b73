"""Native attention from the packed NVFP4 KV pages (`trace_kernels.cpu_native.attention`, numba) against the
torch reference (`trace_kernels.attention.reference`), the way the Triton decode kernel is tested.

Tolerance, and why not bit for bit: attention outputs are not part of the FP4 codeword contract (the K/V
codes and scales are, and they come from the write). The kernel attends to the same K/V values the
reference decodes (bit for bit: `dequantize(dtype)` of the same rows), and computes the same float32
formula, but sums in its own fixed order (scores over d in order, the output over keys in order) where
the reference's einsum / softmax use torch's vectorised reductions. Sums can differ in the last float32
bits, which can move a result across a bf16 rounding boundary: so bf16 outputs are compared within one
bf16 ulp of the reference (and nearly all equal). float32 outputs are compared with the float64 result:
the kernel's error at most twice the reference's own (softmax over scores of 30 amplifies float32 noise
to about 1e-5 of the largest V value, in both).
"""

import numpy as np
import pytest
import torch

import trace_kernels as tk
from trace_kernels.attention import reference
from trace_kernels.cpu_native.quantize import CALLS
from trace_kernels.cpu_native.attention import packed_attention
from trace_kernels.kv_layout import pack_rows, unpack_rows

NB, H, BS, D, HQ = 6, 2, 16, 32, 4


def _cache(seed: int, dv: int = D) -> torch.Tensor:
    """uint8 [NB, H, BS, row_k + row_v]: random rows over five decades, an all-zero row, a subnormal scale."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-3, 2, NB)[:, None, None, None]
    k = torch.randn(NB, H, BS, D, generator=g) * scale
    v = torch.randn(NB, H, BS, dv, generator=g) * scale
    k[1, 0, 3] = 0.0
    v[1, 0, 3] = 0.0
    k[2, 1, 5, :16] *= 1e-6
    rk, rv = k.reshape(-1, D), v.reshape(-1, dv)
    qk, qv = tk.quantize(rk, tk.row_amax(rk)), tk.quantize(rv, tk.row_amax(rv))
    return torch.cat((pack_rows(qk), pack_rows(qv)), -1).reshape(NB, H, BS, -1)


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(x.abs().to(torch.bfloat16), torch.tensor(float("inf"), dtype=torch.bfloat16)).float() - x.abs().float()


def _float64_attention(q, cache, table, seq_lens, qsl, scale):
    """The reference's formula in float64 over the same float32 K/V values: the rounding-free result."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(seq_lens.shape[0]):
        n, q0, q1 = int(seq_lens[i]), int(qsl[i]), int(qsl[i + 1])
        k, v = reference.sequence_kv(cache, table[i, : (n + BS - 1) // BS], n, D, D, torch.float32)
        k, v = (t.double().repeat_interleave(HQ // H, dim=1) for t in (k, v))
        s = torch.einsum("qhd,nhd->hqn", q[q0:q1].double(), k) * scale
        pos = n - (q1 - q0) + torch.arange(q1 - q0)
        s = s.masked_fill(torch.arange(n)[None, :] > pos[:, None], float("-inf"))
        out[q0:q1] = torch.einsum("hqn,nhd->qhd", torch.softmax(s, -1), v)
    return out


# A mixed batch as vLLM's chunked prefill makes it: a prefill chunk reading earlier blocks (5 new tokens of
# 40), a decode (1 of 25), a whole one-block prompt (9 of 9), a one-token sequence; blocks out of order.
TABLE = torch.tensor([[4, 1, 3], [2, 0, 5], [5, 4, 4], [3, 3, 3]], dtype=torch.int32)
SEQ_LENS = torch.tensor([40, 25, 9, 1], dtype=torch.int32)
QSL = torch.tensor([0, 5, 6, 15, 16], dtype=torch.int32)


def _garbage_past_lengths(cache):
    # Rows past each sequence's length hold garbage the kernel must not read: NaN-marked K and V rows.
    cache[3, :, 8:, D // 2] = 0x7F  # request 0's third block: tokens 32..39 valid
    cache[5, :, 9:, D // 2] = 0x7F  # request 1's second block 5: tokens 16..24 valid
    return cache


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mixed_batch_matches_the_reference(dtype):
    cache = _garbage_past_lengths(_cache(1))
    cache[3, :, 8:, D // 2] = 0x7F
    g = torch.Generator().manual_seed(2)
    q = torch.randn(17, HQ, D, generator=g).to(dtype)  # one padding token past the last request
    out = torch.full((17, HQ * D), 7.0, dtype=dtype)
    packed_attention(q[:16], cache, TABLE, SEQ_LENS, QSL, D**-0.5, out=out[:16])
    assert (out[16] == 7.0).all()  # rows past the batch's tokens untouched
    got = out[:16].view(16, HQ, D)
    ref = reference.packed_attention(q[:16], cache, TABLE, SEQ_LENS, QSL, D**-0.5)
    assert torch.isfinite(got).all() and got.dtype == dtype
    diff = (got.float() - ref.float()).abs()
    if dtype == torch.bfloat16:
        assert (diff <= _bf16_ulp(ref)).all(), diff.max()
        assert (diff == 0).float().mean() >= 0.98
    else:  # as close to the float64 result as the reference is (the outputs' float32 rounding noise)
        exact = _float64_attention(q[:16], cache, TABLE, SEQ_LENS, QSL, D**-0.5)
        err, ref_err = (got.double() - exact).abs(), (ref.double() - exact).abs()
        assert err.max() <= 2 * ref_err.max() and err.mean() <= 2 * ref_err.mean(), (err.max(), ref_err.max())
    # The one-token sequence attends to its own V row only: exactly that row (bf16 or float32 values).
    own_v = reference.sequence_kv(cache, TABLE[3, :1], 1, D, D, dtype)[1][0].repeat_interleave(HQ // H, 0)
    assert torch.equal(got[15], own_v)


def test_decode_batch_matches_the_triton_kernels_reference_and_is_batch_invariant():
    cache = _garbage_past_lengths(_cache(3))
    g = torch.Generator().manual_seed(4)
    q = torch.randn(3, HQ, D, generator=g).to(torch.bfloat16)
    seq_lens = torch.tensor([40, 25, 1], dtype=torch.int32)
    qsl = torch.arange(4, dtype=torch.int32)
    out = packed_attention(q, cache, TABLE[:3], seq_lens, qsl, D**-0.5)
    ref = reference.packed_decode_attention(q, cache, TABLE[:3], seq_lens, D**-0.5)
    diff = (out.float() - ref.float()).abs()
    assert (diff <= _bf16_ulp(ref)).all() and (diff == 0).float().mean() >= 0.98
    # A request's output does not depend on what else is in the batch (fixed arithmetic order).
    alone = packed_attention(q[1:2], cache, TABLE[1:2], seq_lens[1:2], qsl[:2], D**-0.5)
    assert torch.equal(alone.view(torch.int16), out[1:2].view(torch.int16))


def test_value_head_size_differs_from_key_head_size():
    DV = 64
    cache = _cache(5, dv=DV)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(16, HQ, D, generator=g).to(torch.bfloat16)
    out = packed_attention(q, cache, TABLE, SEQ_LENS, QSL, D**-0.5, head_size_v=DV)
    ref = reference.packed_attention(q, cache, TABLE, SEQ_LENS, QSL, D**-0.5, head_size_v=DV)
    assert out.shape == (16, HQ, DV)
    assert ((out.float() - ref.float()).abs() <= _bf16_ulp(ref)).all()


def test_bad_input_is_refused_by_name():
    cache = _cache(7)
    q = torch.randn(16, HQ, D)
    with pytest.raises(ValueError, match="model dtype torch.float16"):
        packed_attention(q.half(), cache, TABLE, SEQ_LENS, QSL, 1.0)
    with pytest.raises(ValueError, match="do not hold head sizes 64"):
        packed_attention(torch.randn(16, HQ, 64), cache, TABLE, SEQ_LENS, QSL, 1.0)
    with pytest.raises(ValueError, match="query heads over"):
        packed_attention(torch.randn(16, 3, D), cache, TABLE, SEQ_LENS, QSL, 1.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_decode_gives_the_scratch_values_bit_for_bit(dtype):
    """Both decodes, the per-row one (_decode_row: the rows outside the fast range) and the kernel's decode of all
    of a call's rows (_decode_all: per-block table values built as bits along the rows), against the reference's
    per-value dequantize(dtype), bit for bit. Their per-block value table (two products and roundings per block,
    the rest exact power-of-two scalings) is checked on every scale byte (NaN-marked 0x7F / 0xFF included)
    beside every code byte, under global amaxes from 0 and subnormal to FLT_MAX, Inf and NaN."""
    import numpy as np

    from trace_kernels.cpu_native.attention import _decode_row
    from trace_kernels.cpu_native.quantize import NUMERATOR, tables

    g = torch.Generator().manual_seed(8)
    amaxes = torch.tensor([0.0, 1e-45, 1e-40, 1e-30, 1e-6, 0.37, 1.0, 6.0, 448.0, 1e20, 3.4e38,
                           float("inf"), float("nan")])
    rows = []
    for a in amaxes:
        for start in range(0, 256, 2):  # two blocks per row: scale bytes start, start + 1
            codes = torch.randint(0, 256, (D // 2,), generator=g, dtype=torch.uint8)
            codes[: D // 4] = torch.arange(start, start + D // 4) % 256  # every code byte occurs
            scales = torch.tensor([start, start + 1], dtype=torch.uint8)
            rows.append(torch.cat((codes, scales, a.reshape(1).view(torch.uint8))))
    packed = torch.stack(rows)  # [R, row bytes]
    want = unpack_rows(packed, D).dequantize(dtype).float()
    nib, sv = tables()
    _check_decoded(_decode_all_rows(packed, dtype), want)
    got = np.empty((packed.shape[0], D), dtype=np.float32)
    fbuf = np.empty(1, dtype=np.float32)
    for r in range(packed.shape[0]):
        _decode_row(packed[r].numpy(), 0, D, NUMERATOR["6"], nib, sv, dtype == torch.bfloat16, got[r], fbuf,
                    fbuf.view(np.int32), np.empty(16, dtype=np.float32))
    _check_decoded(torch.from_numpy(got), want)


def _check_decoded(got, want):
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0.0).view(torch.int32), want.nan_to_num(0.0).view(torch.int32))
    assert got.isnan().any() and (got == 0).any() and got.isinf().sum() == want.isinf().sum()


def _decode_all_rows(packed, dtype):
    """packed [R, row bytes] as the K and the V rows of one request's R tokens (one KV head, one block of R
    tokens), decoded by the kernel's _decode_all: K and V [R, D] float32 (they must be equal)."""
    from trace_kernels.cpu_native.attention import _decode_all
    from trace_kernels.cpu_native.quantize import NUMERATOR, tables

    R = packed.shape[0]
    page = torch.cat((packed, packed), -1).reshape(1, 1, R, -1).contiguous().numpy()
    nib, sv = tables()
    kt, v, start = _decode_all(page, np.zeros((1, 1), dtype=np.int64), np.array([R], dtype=np.int64),
                               np.array([0, 1], dtype=np.int64), D, D,
                               NUMERATOR["6"], nib, sv, dtype == torch.bfloat16)
    assert list(start) == [0, R]
    # K transposed [D, R + 16 padding columns] (the score loop's layout), V along the rows [R, D] (the output loop's)
    k, v = torch.from_numpy(kt[:, :R].T.copy()), torch.from_numpy(v.copy())
    assert torch.equal(k.view(torch.int32), v.view(torch.int32))
    return k


def test_parallel_kernel_gives_the_serial_kernels_bits():
    """The (request, KV head) pairs spread over numba's threads: each pair's arithmetic is unchanged."""
    import numba

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba runs one thread here (NUMBA_NUM_THREADS): the parallel kernel is not taken")
    cache = _garbage_past_lengths(_cache(9))
    q = torch.randn(16, HQ, D, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    serial = packed_attention(q, cache, TABLE, SEQ_LENS, QSL, D**-0.5, parallel=False)
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    threaded = packed_attention(q, cache, TABLE, SEQ_LENS, QSL, D**-0.5, parallel=True)
    assert torch.equal(serial.view(torch.int16), threaded.view(torch.int16))


def test_a_request_without_query_tokens_is_not_read():
    """A request with no query tokens this call (query_start_loc[r + 1] == query_start_loc[r]) has its block
    table row never read, whatever it holds (here block ids far past the cache)."""
    cache = _garbage_past_lengths(_cache(11))
    q = torch.randn(16, HQ, D, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    table = torch.cat((TABLE, torch.full((1, 3), 1 << 30, dtype=torch.int32)))
    seq_lens = torch.cat((SEQ_LENS, torch.tensor([40], dtype=torch.int32)))
    qsl = torch.cat((QSL, QSL[-1:]))
    got = packed_attention(q, cache, table, seq_lens, qsl, D**-0.5)
    want = packed_attention(q, cache, TABLE, SEQ_LENS, QSL, D**-0.5)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_bf16_result_written_in_place_is_torchs_cast_of_the_float32_result():
    """The kernel reads a bf16 query as its bits and rounds its float32 results to bf16 itself (no float32
    copies): the bits equal torch's cast of the float32 result, for a contiguous and a strided `out`, and for a
    call with NaN results (a NaN query element: such calls are cast by torch, whose NaN bits depend on its loop)."""
    cache = _garbage_past_lengths(_cache(13))
    q = (torch.randn(16, HQ, D, generator=torch.Generator().manual_seed(14)) * 30).to(torch.bfloat16)
    for nan in (False, True):
        if nan:
            q[5, 2, 7] = float("nan")
        f32 = torch.empty(16, HQ * D, dtype=torch.float32)
        packed_attention(q, cache, TABLE, SEQ_LENS, QSL, D**-0.5, out=f32)
        assert f32.isnan().any() == nan
        want = f32.to(torch.bfloat16).view(torch.int16)
        cast = CALLS["kv_attention_cast_by_torch"]
        got = packed_attention(q, cache, TABLE, SEQ_LENS, QSL, D**-0.5).view(16, HQ * D).view(torch.int16)
        assert torch.equal(got, want)
        assert CALLS["kv_attention_cast_by_torch"] == cast + nan  # only the NaN call is cast by torch
        wide = torch.zeros(16, 2 * HQ * D, dtype=torch.bfloat16)
        packed_attention(q, cache, TABLE, SEQ_LENS, QSL, D**-0.5, out=wide[:, 1 : 1 + HQ * D])
        assert torch.equal(wide[:, 1 : 1 + HQ * D].view(torch.int16), want)
        assert CALLS["kv_attention_cast_by_torch"] == cast + nan + 1  # a strided out is, always
        assert (wide[:, 0] == 0).all() and (wide[:, 1 + HQ * D :] == 0).all()


def test_the_16_lane_max_is_the_scalar_loops_max():
    """vec16.max16 against the scalar loop it replaced (`m = -inf; if s[t] > m: m = s[t]`), for lengths below, at
    and past a block of 16, with NaN (never taken), +-inf and zeros of both signs: the same value (of equal zeros
    it may keep the other sign, which the softmax's s - m cannot show)."""
    import numba

    from trace_kernels.cpu_native.vec16 import max16

    @numba.njit(cache=False)
    def both(s, n):
        m = np.float32(-np.inf)
        for t in range(n):
            if s[t] > m:
                m = s[t]
        return m, max16(s, n)

    rng = np.random.default_rng(3)
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0], np.float32)
    for n in list(range(1, 40)) + [64, 100, 131]:
        for trial in range(6):
            s = (rng.standard_normal(n + 16) * 10.0 ** rng.integers(-3, 4)).astype(np.float32)
            if trial % 2:
                s[rng.integers(0, n, 3)] = specials[rng.integers(0, 5, 3)]
            if trial == 4:
                s[:n] = np.where(rng.random(n) < 0.5, np.float32(-0.0), np.float32(0.0)); s[n:] = 5.0  # past n: unread
            if trial == 5:
                s[:n] = np.nan
            want, got = both(s, n)
            assert (np.isnan(want) and np.isnan(got)) or want == got, (n, trial, want, got)
            assert not np.isnan(got) or np.isnan(s[:n]).all()


def test_held_index_views_and_wider_index_tensors_give_the_same_bits():
    """The engine's caller hands over numpy views it keeps across calls (`held`), and the index tensors whole
    (vLLM's are wider than the batch: the kernel reads table rows r < len(seq_lens) and query_start_loc
    entries r <= len(seq_lens)): the same bits as the per-call views of exactly sized tensors. A held view
    reads the tensor's values at each call: a table rewritten in place is seen."""
    from trace_kernels.cpu_native.attention import index_views

    cache = _garbage_past_lengths(_cache(15))
    q = torch.randn(16, HQ, D, generator=torch.Generator().manual_seed(16)).to(torch.bfloat16)
    want = packed_attention(q, cache, TABLE, SEQ_LENS, QSL, D**-0.5)
    wide_table = torch.cat((TABLE, torch.full((2, 3), 1 << 30, dtype=torch.int32)))  # rows past R: never read
    wide_qsl = torch.cat((QSL, torch.tensor([99, 99], dtype=torch.int32)))
    assert torch.equal(packed_attention(q, cache, wide_table, SEQ_LENS, wide_qsl, D**-0.5).view(torch.int16),
                       want.view(torch.int16))
    *views, are_views = index_views(wide_table, SEQ_LENS, wide_qsl)
    assert are_views
    held = (cache.numpy(), *views)
    got = packed_attention(q, cache, wide_table, SEQ_LENS, wide_qsl, D**-0.5, held=held)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    wide_table[0] = TABLE[1]  # in place: the held view sees it
    moved = packed_attention(q, cache, wide_table[:4].clone(), SEQ_LENS, QSL, D**-0.5)
    got = packed_attention(q, cache, wide_table, SEQ_LENS, wide_qsl, D**-0.5, held=held)
    assert torch.equal(got.view(torch.int16), moved.view(torch.int16))
    assert not torch.equal(moved.view(torch.int16), want.view(torch.int16))
    *_, are_views = index_views(TABLE.to(torch.int16), SEQ_LENS, QSL)  # converted: a copy, not to be held
    assert not are_views


def test_permute_build_gives_the_select_builds_bits():
    """vec16._build16's two builds of a block's 16 values (the lane permute of the eight magnitudes, taken on AVX-512
    hosts, and the integer selects, taken elsewhere) give the same bits for every code byte (both nibbles, both
    signs) under r1 / r15 bits of positive normal numbers across the exponent range, bf16-rounded and not."""
    import numba
    import numpy as np

    from trace_kernels.cpu_native import vec16

    if not vec16._host_has_avx512f():
        pytest.skip("the permute build needs AVX-512F (this host runs the select build only)")

    def build_all(src, b1, b15, dst):
        for i in range(b1.shape[0]):
            for k in range(src.shape[0] // 8):
                vec16.build_row16(dst, (i * (src.shape[0] // 8) + k) * 16, src, 8 * k, b1[i], b15[i])

    rng = np.random.default_rng(3)
    src = np.arange(256, dtype=np.uint8)  # every code byte, 32 blocks of 8
    m = (2.0 ** rng.integers(-120, 118, 300) * rng.uniform(1, 2, 300)).astype(np.float32)
    bits = [m.view(np.uint32), (m * np.float32(1.5)).view(np.uint32)]
    bf16 = [(((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16).astype(np.uint32) for b in bits]
    saved = vec16._PERMUTE
    try:
        got = {}
        for permute in (True, False):
            vec16._PERMUTE = permute  # read at code generation: each njit below is compiled fresh, uncached
            fn = numba.njit(build_all)
            for name, (b1, b15) in (("f32", bits), ("bf16", bf16)):
                dst = np.empty(b1.shape[0] * 256 * 2, dtype=np.uint32)
                fn(src, b1, b15, dst)
                got[(permute, name)] = dst
    finally:
        vec16._PERMUTE = saved
    for name in ("f32", "bf16"):
        assert np.array_equal(got[(True, name)], got[(False, name)])
        assert (got[(True, name)] == 0).any() and (got[(True, name)] == 0x80000000).any()

"""The native sparse decode (kernels/cpu_native/sparse_decode.py) is bit-identical with the torch reference:
the torch CPU steps it reproduces (topk's tie order, float32 sum order), the staged and wide flip-pattern
search, and whole decodes (codes, scales, amaxes, every report counter) on the cases the reference and
Triton tests use and on records of real encodes at several noise levels. Non-finite input is a counted
fallback to the reference."""

import numpy as np
import pytest
import torch

import trace_kernels as tk
from trace_kernels import cpu_native
from trace_kernels.cpu_native import sparse_decode as nd
from trace_kernels.guides import sparse as sg
from trace_kernels.guides.sparse import decoder as sparse_decoder
from trace_kernels.guides.sparse import header as hd
from trace_kernels.guides.sparse import parity, search

pytest.importorskip("numba")


def _rows(seed: int, rows: int, K: int, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, K, generator=g) * torch.rand(rows, 1, generator=g) * 4).to(dtype)
    return x, tk.quantize(x, tk.row_amax(x))


def _trainer_values(x: torch.Tensor, seed: int, noise: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    return x.float() * (1 + noise * torch.randn(x.shape, generator=g))


def _both(guide, x, block_scale="6"):
    """(reference decode, its report, native decode, its report); the native one must not fall back."""
    before = cpu_native.fallbacks().get("eager:sparse_decode", 0)
    r_ref, r_nat = sg.DecodeReport(), sg.DecodeReport()
    ref = sg.decode(guide, x, r_ref, backend="torch", block_scale=block_scale)
    nat = sg.decode(guide, x, r_nat, backend="native", block_scale=block_scale)
    assert cpu_native.fallbacks().get("eager:sparse_decode", 0) == before, "the native decode fell back"
    return ref, r_ref, nat, r_nat


def _assert_same(ref, r_ref, nat, r_nat):
    assert torch.equal(nat.codes, ref.codes)
    assert torch.equal(nat.scales, ref.scales)
    assert torch.equal(nat.global_amax.view(torch.int32), ref.global_amax.view(torch.int32))
    assert r_nat == r_ref, (r_ref, r_nat)


def test_topk_reproduces_torchs_order_of_equal_costs():
    """Costs drawn from a few values (many exact ties) and inf: the same indices in the same order as
    torch.topk(largest=False), for the decoder's sizes (4 blocks; 32 and 64 values; 12 and 20 candidates)."""
    g = torch.Generator().manual_seed(0)
    for n, k in [(4, 4), (2, 2), (32, 12), (64, 12), (32, 20), (64, 20), (16, 12), (17, 12), (48, 20)]:
        for trial in range(300):
            levels = torch.tensor([0.006, 0.05, 0.05, 0.1, 0.2, float("inf")])
            cost = levels[torch.randint(0, 6 if trial % 3 else 2, (n,), generator=g)].to(torch.float32)
            if trial % 5 == 0:
                cost = torch.rand(n, generator=g)
            vals, idx = torch.topk(cost, k, largest=False)
            v = np.empty(n, np.float64)
            i = np.empty(n, np.int64)
            assert nd.topk_smallest(cost.numpy(), 0, n, k, v, i)
            assert i[:k].tolist() == idx.tolist(), (n, k, cost.tolist())
            assert np.array_equal(v[:k].astype(np.float32), vals.numpy())


# a row of flip costs (a decode at 2% noise) on which libstdc++'s nth_element reaches its depth limit and
# selects by heap (distinct values: no tied variant of it found reaches the heap; rounded, it tests ties
# on the ordinary path)
_HEAP_ROW = [
    float("inf"), float("inf"), 0.0853, 0.2736, 0.1988, 0.0333, 0.4438, 0.2271, 0.0866, 0.3189, 0.3966, 0.4203,
    0.0910, 0.6843, 0.0365, 0.2002, 0.2391, 0.1664, 0.6590, 0.1114, 0.9249, 0.3402, 0.3695, 0.1167, 0.0724,
    0.3765, 0.1056, 0.3730, 0.1546, 0.3063, 0.4556, 0.0269, 0.3542, 0.7676, 0.0217, 0.0373, 0.7415, 0.4036,
    0.3118, 0.0495, 0.1853, 0.4276, 0.2378, 0.2280, 0.1184, 0.2850, 0.0178, 0.2975, 0.2965, 0.0779, 0.0481,
    0.2987, 0.1112, float("inf"), 0.4400, 0.0748, 0.0504, 0.0730, float("inf"), 0.6052, 0.7538, 0.0645, 0.1992,
    0.2607,
]


def test_topk_heap_paths_and_partial_sort():
    """The depth-limit heap selection (the row above, and it with ties) and ATen's partial_sort branch
    (k * 64 <= n) give torch's order too."""
    g = torch.Generator().manual_seed(2)
    row = torch.tensor(_HEAP_ROW, dtype=torch.float32)
    cases = [(row, 12), (torch.round(row * 20) / 20, 12), (torch.round(row * 8) / 8, 20)]
    cases += [(torch.round(torch.rand(n, generator=g) * 6) / 6, k) for n, k in [(64, 1), (128, 2), (200, 3)] for _ in range(50)]
    for cost, k in cases:
        n = cost.numel()
        vals, idx = torch.topk(cost, k, largest=False)
        v = np.empty(n, np.float64)
        i = np.empty(n, np.int64)
        assert nd.topk_smallest(cost.numpy(), 0, n, k, v, i)
        assert i[:k].tolist() == idx.tolist(), (k, cost.tolist())


def test_float32_sums_follow_atens_order():
    """Rows of values whose sum depends on the order: the emulated cascade sum equals torch.sum(-1)."""
    g = torch.Generator().manual_seed(1)
    vec = nd._tables()["vec"]
    acc = np.empty(16 * vec + 16, np.float32)
    for n in list(range(1, 70)) + [96, 128, 255, 448, 1024, 1100]:
        x = (torch.rand(8, n, generator=g) * torch.logspace(-4, 4, n)[torch.randperm(n, generator=g)]).to(torch.float32)
        want = x.sum(-1)
        for r in range(8):
            got = nd.torch_sum(x[r].contiguous().numpy(), n, vec, acc)
            assert np.float32(got) == want[r].item(), (n, r)


def test_search_equals_the_staged_and_wide_reference_search():
    """test_sparse_triton's case: residuals of 0..6 true flips, costs with ties and forbidden (inf)
    positions; the same flips, resolved flags and pattern costs, incl. the wide search and beyond."""
    g = torch.Generator().manual_seed(0)
    N, n, m = 84, 64, 16
    cols = parity.columns(m, n, 2, "cpu").expand(N, n)
    cost = torch.rand(N, n, generator=g) * 0.3 + 0.006
    cost[torch.rand(N, n, generator=g) < 0.1] = torch.inf
    cost[:20, 5] = cost[:20, 7]  # exact ties between candidates
    cost[20:40] = torch.round(cost[20:40] * 20) / 20  # many ties
    true = torch.zeros(N, n, dtype=torch.bool)
    for i in range(N):
        true[i, torch.randperm(n, generator=g)[: i % 7]] = True
    residual = parity.syndrome(true.long(), m, 2)
    for wide in (True, False):
        ref = search.decode_bits(residual, cols, cost, wide=wide)
        got = nd.decode_bits(residual, cols, cost, wide=wide)
        for a, b in zip(ref, got):
            assert torch.equal(a, b)
    ref = search.decode_bits(residual, cols, cost)
    resolved_wide = ~search.decode_bits(residual, cols, cost, wide=False)[1] & ref[1]
    assert bool(resolved_wide.any()) and bool((~ref[1]).any()), "the data must reach the wide search and beyond"


def _whole_decode_case(K, site, noise):
    x, q = _rows(K + int(noise * 1000), 96, K)
    guide = sg.unpack(sg.pack(sg.encode(q, site)), (96,), K)
    x_t = _trainer_values(x, K, noise)
    if site == "moe_fc2_in":
        x_t[3] = _trainer_values(x[3:4], 9, 0.05)[0]
    _assert_same(*_both(guide, x_t))
    _assert_same(*_both(guide, x_t.to(torch.bfloat16)))


@pytest.mark.parametrize("K,site,noise", [
    (64, "k", 0.004), (32, "moe_fc1_in", 0.01), (64, "moe_fc2_in", 0.0), (128, "moe_fc1_in", 0.01),
    (256, "v", 0.002), (16, None, 0.01), (64, "moe_fc1_in", 0.0),
])
def test_whole_decodes_equal_the_reference(K, site, noise):
    """Records of real encodes, trainer values at several noise levels, every site's rates."""
    _whole_decode_case(K, site, noise)


@pytest.mark.parametrize("K,site,noise", [(128, "k", 0.03), (128, "v", 0.1)])
def test_whole_decodes_beyond_the_design_equal_the_reference(K, site, noise):
    """Beyond the design (3% and 10% noise) segments stay unresolved after the wide search and amaxes move
    past the coset window (list decode): slow only for the torch reference's wide searches (SLOW)."""
    _whole_decode_case(K, site, noise)


def test_the_report_reaches_every_counter():
    """One decode where the list, the wide search and both unresolved counters all fire, equal."""
    x, q = _rows(7, 128, 128)
    x_t = _trainer_values(x, 7, 0.02)
    ref, r_ref, nat, r_nat = _both(sg.encode(q, "moe_fc1_in"), x_t)
    _assert_same(ref, r_ref, nat, r_nat)
    assert r_ref.amax_list_rows and r_ref.unresolved_code_segments and r_ref.code_flips and r_ref.scale_flips
    # a check-only site with every scale LSB sent (and one with a 2-bit scale check): disagreeing scales
    # are counted, not followed
    for rates in (sg.Rates(3, 4, 14, check=True), sg.Rates(0, 2, 8, check=True)):
        ref, r_ref, nat, r_nat = _both(sg.encode(q, "k", rates), _trainer_values(x, 8, 0.05))
        _assert_same(ref, r_ref, nat, r_nat)
        assert r_ref.unresolved_scale_segments > 0


def test_an_amax_beyond_the_coset_window_and_ties_between_equal_values():
    """test_sparse_guidance's list-decode case (5 ulps below), and rows of repeated values (exact cost ties
    at the topk and in the pattern search)."""
    g = torch.Generator().manual_seed(21)
    x_r = torch.clamp(torch.randn(64, 32, generator=g), -3.5, 3.5)
    x_r[:, 7] = torch.linspace(4.5, 5.5, 64)
    x_r = x_r.to(torch.bfloat16)
    q = tk.quantize(x_r, tk.row_amax(x_r))
    x_t = x_r.clone()
    x_t[:, 7] = (x_r[:, 7].view(torch.int16) - 5).view(torch.bfloat16)
    ref, r_ref, nat, r_nat = _both(sg.encode(q, "k"), x_t)
    _assert_same(ref, r_ref, nat, r_nat)
    assert r_ref.amax_list_rows > 30
    # repeated values: every value appears 4 times in its row, so equal flip costs come in groups
    base = torch.randn(48, 16, generator=g) * 2
    x_r = base.repeat_interleave(4, dim=1)[:, torch.randperm(64, generator=g)].to(torch.bfloat16)
    q = tk.quantize(x_r, tk.row_amax(x_r))
    for noise in (0.01, 0.03):
        x_t = x_r.float() * (1 + noise * torch.randn(48, 16, generator=g).repeat_interleave(4, dim=1))
        _assert_same(*_both(sg.encode(q, "k"), x_t))


def test_static_amax_fp32_amax_rows_and_4over6_choice_bits():
    x, _ = _rows(5, 40, 64)
    x_t = _trainer_values(x, 5, 0.01)
    static = tk.quantize(x, torch.tensor(7.5))
    per_row = tk.quantize(x.float() * 1.001, tk.row_amax(x.float() * 1.001))  # amaxes not bf16 values (shift 0)
    for q in (static, per_row):
        _assert_same(*_both(sg.encode(q, "k"), x_t))
    q4 = tk.quantize(x, tk.row_amax(x), block_scale="4over6")
    ref, r_ref, nat, r_nat = _both(sg.encode(q4, "moe_fc1_in", block_scale="4over6"), x_t, block_scale="4over6")
    _assert_same(ref, r_ref, nat, r_nat)
    assert r_ref.code_flips > 0


def test_rates_from_the_header_drive_the_decode():
    """Rates other than the built-in ones (as the controller sets them): the decode reads them from the
    header, both paths alike."""
    x, q = _rows(11, 64, 64)
    x_t = _trainer_values(x, 11, 0.01)
    for rates in (sg.Rates(2, 4, 14), sg.Rates(4, 2, 18), sg.Rates(0, 0, 8), sg.Rates(3, 3, 20)):
        _assert_same(*_both(sg.encode(q, "k", rates), x_t))


def test_the_wide_search_widens_with_the_code_bits_as_the_reference_does():
    """Raised code rates (as calibration sets them) widen the code stage's wide search
    (search.wide_search_for); the native decode follows, segment search and whole site alike."""
    g = torch.Generator().manual_seed(5)
    N, n, m = 24, 64, 22
    assert search.wide_search_for(m, n) == (8, 24)
    cols = parity.columns(m, n, 2, "cpu").expand(N, n)
    cost = torch.rand(N, n, generator=g) * 0.3 + 0.006
    true = torch.zeros(N, n, dtype=torch.bool)
    for i in range(N):
        pos = torch.randperm(n, generator=g)[: 5 + i % 4]  # 5..8 flips at the cheapest positions
        cost[i, pos] = torch.rand(pos.numel(), generator=g) * 0.01
        true[i, pos] = True
    residual = parity.syndrome(true.long(), m, 2)
    ref = search.decode_bits(residual, cols, cost, widths=(8, 24))
    got = nd.decode_bits(residual, cols, cost, widths=(8, 24))
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    assert bool(ref[1].all()) and not bool(search.decode_bits(residual, cols, cost)[1].all()), \
        "some segment must need the wider search"
    x, q = _rows(17, 64, 128)
    x_t = _trainer_values(x, 17, 0.02)
    _assert_same(*_both(sg.encode(q, "moe_fc1_in", sg.Rates(3, 3, 22)), x_t))


def test_non_finite_values_fall_back_to_the_reference_counted():
    x, q = _rows(3, 16, 64)
    x_t = _trainer_values(x, 3, 0.01)
    x_t[2, 5] = float("nan")
    x_t[4, 9] = float("inf")
    before = cpu_native.fallbacks().get("eager:sparse_decode", 0)
    r_ref, r_nat = sg.DecodeReport(), sg.DecodeReport()
    ref = sg.decode(sg.encode(q, "k"), x_t, r_ref, backend="torch")
    nat = sg.decode(sg.encode(q, "k"), x_t, r_nat, backend="native")
    assert cpu_native.fallbacks()["eager:sparse_decode"] == before + 1
    assert "not finite" in cpu_native.NOT_NATIVE["sparse_decode"]
    _assert_same(ref, r_ref, nat, r_nat)


def test_env_selects_the_native_decode(monkeypatch):
    monkeypatch.setenv("TRACE_FP4_CPU_BACKEND", "native")
    x, q = _rows(4, 8, 64)
    x_t = _trainer_values(x, 4, 0.01)
    before = cpu_native.fallbacks().get("eager:sparse_decode", 0)
    out, rep = sg.encode(q, "k").rounding_target(x_t)
    assert cpu_native.fallbacks().get("eager:sparse_decode", 0) == before
    monkeypatch.setenv("TRACE_FP4_CPU_BACKEND", "eager")
    ref, rep_ref = sg.encode(q, "k").rounding_target(x_t)
    assert torch.equal(out.codes, ref.codes) and rep == rep_ref


def test_codeword_mismatch_count_equals_the_reference(monkeypatch):
    """FullGuide.mismatches on the native path (cpu_native/guided.py) counts as the torch one: random
    codes with both zeros (+0 and -0 are one codeword) and a few differing nibbles."""
    g = torch.Generator().manual_seed(6)
    a = torch.randint(0, 256, (300, 32), generator=g, dtype=torch.uint8)
    b = a.clone()
    flip = torch.rand(a.shape, generator=g) < 0.1
    b[flip] = torch.randint(0, 256, (int(flip.sum()),), generator=g, dtype=torch.uint8)
    b = torch.where(torch.rand(a.shape, generator=g) < 0.05, a ^ 0x88, b)  # sign flips, incl. of zeros
    qa = tk.NVFP4Tensor(a, torch.zeros(300, 4, dtype=torch.uint8), torch.ones(300))
    qb = tk.NVFP4Tensor(b, torch.zeros(300, 4, dtype=torch.uint8), torch.ones(300))
    want = qa.mismatches(qb)
    monkeypatch.setenv("TRACE_FP4_CPU_BACKEND", "native")
    from trace_kernels.cpu_native.guided import codeword_mismatches

    assert qa.mismatches(qb) == want == codeword_mismatches(b, a) > 0
    zeros = torch.tensor([[0x00, 0x80, 0x08, 0x88]], dtype=torch.uint8)  # +0 / -0 in either nibble
    assert codeword_mismatches(zeros, torch.zeros_like(zeros)) == 0
    assert codeword_mismatches(zeros | 0x11, zeros) == 8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("block_scale", ["6", "4over6"])
def test_values_from_the_decode_pass_equal_dequantize(dtype, block_scale):
    """decode_dequantized on the native path (values written by the decode kernel) equals the reference
    decode dequantized by backend.dequantize, bit for bit, incl. -0 codes and both block-scale rules."""
    x, _ = _rows(12, 40, 128)
    q = tk.quantize(x, tk.row_amax(x), block_scale=block_scale)
    x_t = _trainer_values(x, 12, 0.01).to(dtype)
    x_t[0, :16] = 0.0
    x_t[1, :16] = -1e-30  # codes of -0
    guide = sg.encode(q, "moe_fc1_in", block_scale=block_scale)
    r_ref, r_nat = sg.DecodeReport(), sg.DecodeReport()
    ref = sg.decode(guide, x_t, r_ref, backend="torch", block_scale=block_scale)
    want = ref.dequantize(dtype, block_scale=block_scale)
    nat, vals = sparse_decoder.decode_dequantized(guide, x_t, r_nat, backend="native", block_scale=block_scale)
    _assert_same(ref, r_ref, nat, r_nat)
    assert vals.dtype == dtype
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[dtype]
    assert torch.equal(vals.view(bits), want.view(bits))
    if dtype != torch.float16:  # (-1e-30 is -0 in float16: no negative value to round)
        assert bool(torch.signbit(want[1, :16]).all()) and bool((want[1, :16] == 0).all())  # -0 codes, kept


def test_rows_split_over_threads_equal_one_thread():
    """decode_site_chunks (rows split into contiguous ranges, one numba thread each) against its one-chunk
    (serial, this thread) run on the same site: the same codes, scales, amaxes, values and counters, for several splits
    (uneven ones included); and of non-finite rows in two chunks, the first is the one reported."""
    x, q = _rows(11, 96, 128)
    guide = sg.encode(q, "moe_fc1_in")
    x_t = _trainer_values(x, 11, 0.02).to(torch.bfloat16)
    header = guide.row_header.reshape(-1).to(torch.int64)
    shift, rates, static = sparse_decoder.check_header(header, 128)

    def run(chunks, xv):
        """The decode with its rows in `chunks` ranges (more ranges than threads queue on the pool)."""
        pick = nd._chunks
        try:
            nd._chunks = lambda R, K: chunks
            report = sg.DecodeReport()
            got, why = nd.decode(guide, xv, report, rates, shift, static, header, "6", True)
            return got, why, report
        finally:
            nd._chunks = pick

    one, _, r_one = run(1, x_t)
    assert r_one.code_flips > 0 and r_one.scale_flips > 0
    for chunks in (2, 3, 7):
        many, _, r_many = run(chunks, x_t)
        assert all(torch.equal(a, b) for a, b in zip(one, many)) and r_many == r_one
    bad = x_t.clone()
    bad[90, 3] = float("nan")
    bad[40, 5] = float("inf")
    for chunks in (1, 2, 3):
        got, why, _ = run(chunks, bad)
        assert got is None and why.startswith("row 40:"), why


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_rtn_from_the_decode_pass_equals_quantize(dtype):
    """The decode pass's round-to-nearest (`rtn_out`: under each row's own amax) is `quantize(x, row_amax(x))`
    byte for byte: zero rows, -0, tiny (E4M3-subnormal scale) and large rows, values on the E2M1 midpoints;
    the decode itself unchanged by asking for it; split over threads alike; 4over6 leaves the list empty."""
    x, _ = _rows(13, 48, 128)
    q = tk.quantize(x, tk.row_amax(x))
    x_t = _trainer_values(x, 13, 0.01)
    x_t[0] = 0.0
    x_t[1, :16] = -0.0
    x_t[2] *= 1e-6
    x_t[3] *= 1e4 if dtype != torch.float16 else 1e2  # (float16 tops out at 65504: no inf, the decode would fall back)
    x_t[4, :8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0])  # midpoints under a row amax of 6
    x_t[4, 8] = 6.0
    x_t = x_t.to(dtype)
    guide = sg.encode(q, "moe_fc1_in")
    want = tk.quantize(x_t, tk.row_amax(x_t))
    r_plain = sg.DecodeReport()
    plain, v_plain = sparse_decoder.decode_dequantized(guide, x_t, r_plain, backend="native")
    pick = nd._chunks
    for chunks in (None, 1, 3):
        try:
            if chunks is not None:
                nd._chunks = lambda R, K: chunks
            rtn, report = [], sg.DecodeReport()
            got, v_got = sparse_decoder.decode_dequantized(guide, x_t, report, backend="native", rtn_out=rtn)
        finally:
            nd._chunks = pick
        _assert_same(plain, r_plain, got, report)
        assert torch.equal(v_got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                           v_plain.view(torch.int16 if dtype != torch.float32 else torch.int32))
        (r,) = rtn
        assert torch.equal(r.codes, want.codes) and torch.equal(r.scales, want.scales)
        assert torch.equal(r.global_amax.view(torch.int32), want.global_amax.view(torch.int32))
    q46 = tk.quantize(x, tk.row_amax(x), block_scale="4over6")
    rtn = []
    sparse_decoder.decode_dequantized(sg.encode(q46, "moe_fc1_in", block_scale="4over6"), x_t, sg.DecodeReport(),
                                      backend="native", block_scale="4over6", rtn_out=rtn)
    assert rtn == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_row_max_from_the_bits_and_every_non_finite_position(dtype):
    """The kernel takes a row's largest |value| and its finiteness from one integer max over the values' bits
    (sign cleared): the row amax it reports with the RTN rows must be row_amax's bits (largest value
    negative, +-ties, a subnormal row, a row of +-0 only, values near the dtype's largest), the decode the
    reference's; and an inf, -inf or NaN at the first, a middle or the last value of a row (of either sign
    bit) must send the whole call to the counted fallback, the decode still the reference's."""
    x, q = _rows(21, 24, 64)
    x_t = _trainer_values(x, 21, 0.01)
    x_t[0] = -x_t[0].abs()  # the largest |value| negative
    x_t[1, 7], x_t[1, 40] = -3.0, 3.0  # a tie of opposite signs as the largest
    x_t[1] = x_t[1].clamp(-3.0, 3.0)
    x_t[2] = x_t[2] * 1e-40 if dtype == torch.float32 else x_t[2] * 1e-39  # subnormal values
    x_t[3] = 0.0
    x_t[3, ::3] = -0.0
    x_t[4] = x_t[4] / x_t[4].abs().amax() * torch.finfo(dtype).max * 0.5  # near the top of the range
    x_t = x_t.to(dtype)
    guide = sg.encode(q, "moe_fc1_in")
    header = guide.row_header.reshape(-1).to(torch.int64)
    _assert_same(*_both(guide, x_t))
    rtn = []
    sparse_decoder.decode_dequantized(guide, x_t, sg.DecodeReport(), backend="native", rtn_out=rtn)
    assert torch.equal(rtn[0].global_amax.view(torch.int32), tk.row_amax(x_t).reshape(-1).float().view(torch.int32))
    for bad in (float("inf"), float("-inf"), float("nan"), -float("nan")):
        for row, col in ((5, 0), (6, 33), (23, 63)):
            y = x_t.clone()
            y[row, col] = bad
            before = cpu_native.fallbacks().get("eager:sparse_decode", 0)
            r_ref, r_nat = sg.DecodeReport(), sg.DecodeReport()
            ref = sg.decode(guide, y, r_ref, backend="torch")
            nat = sg.decode(guide, y, r_nat, backend="native")
            assert cpu_native.fallbacks()["eager:sparse_decode"] == before + 1, (bad, row, col)
            # the kernel's own answer names the row and the reason (NOT_NATIVE keeps the first reason seen)
            shift, rates, static = hd.check_header(header, 64)
            assert nd.decode(guide, y, sg.DecodeReport(), rates, shift, static, header, "6") == (
                None, f"row {row}: trainer values not finite")
            _assert_same(ref, r_ref, nat, r_nat)

"""Sparse guidance (kernels/guides/sparse/): the trainer recovers the rollout's codes from syndromes and
its own values within the noise the encoding is designed for, counts what it cannot recover beyond it,
and refuses damaged payloads."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import trace_kernels as tk
from record_factory import SHAPE, captured_builder
from trace_kernels import reference
from trace_kernels.guides import sparse as sg
from trace_kernels.guides.sparse import decoder as sparse_decode
from trace_kernels.guides.sparse.parity import column_ints
from trace_kernels.format import E2M1_MIDPOINTS

SPARSE = tk.TraceConfig(guidance="sparse", guided_layers="all")
FULL = tk.TraceConfig(guidance="full", guided_layers="all")


def _rollout_rows(seed: int, rows: int, K: int, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, K, generator=g) * torch.rand(rows, 1, generator=g) * 4).to(dtype)
    return x, tk.quantize(x, tk.row_amax(x))


def _designed_noise(x_r: torch.Tensor, q: tk.NVFP4Tensor, seed: int) -> torch.Tensor:
    """The trainer's values within the designed noise: in each segment at most one value moves across
    its rounding midpoint, and it is the segment's value nearest a midpoint (the cheapest flip); every
    other value, every block amax and the row amax stay put. Float32, so the move is exact."""
    R, K = x_r.shape
    seg = sg.segment(K)
    x = x_r.float().clone()
    _, g_dec = reference.global_scales(q.global_amax)
    y = reference._scaled(x.reshape(R, K // 16, 16), reference.decode_e4m3(q.scales), g_dec).reshape(R, K)
    mids = torch.tensor(E2M1_MIDPOINTS)
    a = y.abs()
    dist, which = (a[..., None] - mids).abs().min(-1)
    block_max = x.abs().reshape(R, K // 16, 16).amax(-1, keepdim=True).expand(-1, -1, 16).reshape(R, K)
    movable = (x.abs() < block_max) & (a < 6)  # leave block maxima (scales, amax) alone
    g = torch.Generator().manual_seed(seed)
    flip_seg = torch.rand(R, K // seg, generator=g) < 0.5
    d = torch.where(movable, dist, torch.inf).reshape(R, K // seg, seg)
    j = d.argmin(-1)  # the cheapest candidate of each segment
    for r in range(R):
        for s in range(K // seg):
            if not flip_seg[r, s] or not torch.isfinite(d[r, s, j[r, s]]):
                continue
            col = s * seg + int(j[r, s])
            m = mids[which[r, col]]
            # move |y| to the other side of its midpoint by a quarter of its distance (still the nearest)
            target = m + (m - a[r, col]) * 0.25
            if (target - m).abs() < 1e-3:
                continue
            x[r, col] = x[r, col] * (target / a[r, col])
    return x


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), K=st.sampled_from([32, 64, 128]))
def test_decode_equals_full_guidance_within_the_designed_noise(seed, K):
    x_r, q = _rollout_rows(seed, 12, K)
    x_t = _designed_noise(x_r, q, seed)
    report = sg.DecodeReport()
    decoded = sg.decode(sg.unpack(sg.pack(sg.encode(q, "k")), (12,), K), x_t, report)
    full = tk.quantize_guided(x_t, q)  # what full guidance gives the same trainer values
    assert torch.equal(tk.codewords(decoded), tk.codewords(q))
    assert torch.equal(tk.codewords(decoded), tk.codewords(full))
    assert torch.equal(decoded.scales, q.scales) and torch.equal(decoded.global_amax, q.global_amax)
    assert report.unresolved_code_segments == 0 and report.unresolved_scale_segments == 0


def test_noise_actually_flips_the_trainers_own_rounding():
    """The designed noise of the property test is not vacuous: RTN with the rollout's scales misses."""
    x_r, q = _rollout_rows(3, 64, 64)
    x_t = _designed_noise(x_r, q, 3)
    rtn = tk.quantize_guided(x_t, None, global_amax=q.global_amax)
    assert int((tk.codewords(rtn) != tk.codewords(q)).sum()) > 20
    decoded = sg.decode(sg.encode(q), x_t)
    assert torch.equal(tk.codewords(decoded), tk.codewords(q))


def test_amax_and_scale_disagreements_are_resolved():
    """A bf16 amax a few ulps off, and block scales across an E4M3 boundary, come back exactly."""
    x_r, q = _rollout_rows(5, 256, 32)
    g = torch.Generator().manual_seed(1)
    noise = 1 + (torch.rand(x_r.shape, generator=g) - 0.5) * 2**-6  # up to about one bf16 ulp
    x_t = (x_r.float() * noise).to(torch.bfloat16)
    own = tk.quantize(x_t, tk.row_amax(x_t))
    assert not torch.equal(own.global_amax, q.global_amax)  # amax moved on some rows
    report = sg.DecodeReport()
    decoded = sg.decode(sg.encode(q, "k"), x_t, report)
    key = lambda a: a.view(torch.int32) >> 16  # noqa: E731
    close = (key(tk.row_amax(x_t)) - key(q.global_amax)).abs() <= 1
    assert torch.equal(decoded.global_amax[close], q.global_amax[close])
    assert torch.equal(decoded.scales[close], q.scales[close])
    removed = 1 - (tk.codewords(decoded) != tk.codewords(q)).sum() / (tk.codewords(own) != tk.codewords(q)).sum()
    assert removed > 0.95, float(removed)


def test_beyond_the_design_it_degrades_to_counted_misses():
    """Large noise: no crash, valid codes, and the segments the search cannot explain are counted."""
    x_r, q = _rollout_rows(7, 64, 64)
    g = torch.Generator().manual_seed(2)
    x_t = x_r.float() * (1 + 0.3 * torch.randn(x_r.shape, generator=g))
    report = sg.DecodeReport()
    decoded = sg.decode(sg.encode(q), x_t, report)
    assert decoded.codes.shape == q.codes.shape and decoded.scales.shape == q.scales.shape
    assert report.unresolved_code_segments > 0 and report.segments == 64
    # where nothing was resolved the trainer keeps its own rounding with the decoded scales
    own = tk.quantize_guided(x_t, None, global_amax=decoded.global_amax)
    assert float((tk.codewords(decoded) != tk.codewords(own)).float().mean()) < 0.2


def test_static_amax_is_sent_once():
    x_r, _ = _rollout_rows(9, 8, 64)
    amax = torch.tensor([10.0])
    q = tk.quantize(x_r, amax)
    guide = sg.encode(q, "k")
    blob = sg.pack(guide)
    r = sg.rates_for("k", 64)
    assert blob.numel() == 3 + 4 + math.ceil(8 * sg.row_bits(64, sg.Rates(0, r.scale_bits, r.code_bits)) / 8)
    decoded = sg.decode(sg.unpack(blob, (8,), 64), x_r.float())
    assert torch.equal(decoded.global_amax, amax.expand(8)) and torch.equal(tk.codewords(decoded), tk.codewords(q))


@pytest.mark.parametrize(
    "damage",
    ["truncate", "extend", "version", "rates"],
)
def test_corrupt_payloads_are_refused(damage):
    _, q = _rollout_rows(11, 6, 32)
    blob = sg.pack(sg.encode(q)).clone()
    if damage == "truncate":
        blob = blob[:-1]
    elif damage == "extend":
        blob = torch.cat([blob, blob[-1:]])
    elif damage == "version":
        blob[0] = (blob[0] & 0xF) | (9 << 4)
    else:
        blob[2] = 63 + 1  # m_c beyond 62
    with pytest.raises(sg.SparseError):
        sg.unpack(blob, (6,), 32)


def test_sparse_records_round_trip_and_reencode_from_full():
    builder = captured_builder(FULL)
    full = builder.build()
    sparse = tk.GuidanceRecord.from_bytes(builder.build(SPARSE).to_bytes(), expect_shape=SHAPE)
    assert sparse.modes == ("sparse",) * SHAPE.num_layers
    again = full.reencode(SPARSE)
    for layer in range(SHAPE.num_layers):
        assert torch.equal(sparse.routed_experts(layer), full.routed_experts(layer))
        for site in ("moe_fc1_in", "moe_fc2_in", "k", "v"):
            a, b = sparse.site(layer, site), again.site(layer, site)
            assert isinstance(a, sg.SparseGuide) and a.shape == full.site(layer, site).shape
            assert all(torch.equal(x, y) for x, y in zip(a.fields(), b.fields()))
            # the trainer with the rollout's own values recovers the full record exactly
            x = full.site(layer, site).dequantize()
            assert torch.equal(tk.codewords(sg.decode(a, x)), tk.codewords(full.site(layer, site)))
    # compact records carry enough (mantissa bits, scale LSBs, amax) to re-encode too
    compact = builder.build(tk.TraceConfig(guidance="compact", guided_layers="all"))
    assert torch.equal(compact.reencode(SPARSE).tensors["layer.0.k.sparse"], sparse.tensors["layer.0.k.sparse"])
    with pytest.raises(tk.RecordError, match="recorded as sparse"):
        sparse.reencode(FULL)
    assert sparse.nbytes * 8 / (full.nbytes * 8) < 0.15  # ~0.4 of 5.5 bits per value


def test_a_damaged_sparse_record_is_refused():
    data = bytearray(captured_builder(SPARSE).build().to_bytes())
    data[-3] ^= 0xFF  # inside the last tensor's bytes
    with pytest.raises(tk.RecordError, match="checksum"):
        tk.GuidanceRecord.from_bytes(bytes(data))
    record = captured_builder(SPARSE).build()
    tensors = dict(record.tensors)
    tensors["layer.1.v.sparse"] = tensors["layer.1.v.sparse"][:-1]
    bad = tk.GuidanceRecord(record.shape, record.config, record.num_tokens, record.modes, tensors)
    with pytest.raises(tk.RecordError, match="layer 1, site v"):
        tk.GuidanceRecord.from_bytes(bad.to_bytes()).site(1, "v")


@pytest.mark.parametrize("K", [32, 64])
def test_every_single_flip_has_its_own_syndrome_and_bch_rates_separate_pairs(K):
    """The parity-check matrices: distinct non-zero columns at every correcting rate in use (a single flip
    is always found; at check-only sites every odd number of flips is seen), and at BCH rates (m >= 2q) every pair of flips has its own syndrome too (distance 5)."""
    import itertools

    seg = sg.segment(K)
    for site in ("moe_fc1_in", "moe_fc2_in", "k", "v"):
        m = sg.rates_for(site, K).code_bits
        cols = column_ints(m, seg, 2)
        if sg.rates_for(site, K).check:  # a checksum: every column has the parity row, so any odd number of flips shows
            assert all(c & 1 for c in cols) and all(c < 1 << m for c in cols), (site, m)
            continue
        assert len(set(cols)) == seg and 0 not in cols and all(c < 1 << m for c in cols), (site, m)
        q = next(q for q in (5, 6, 7) if (1 << q) > seg)
        if m >= 2 * q:
            pairs = [a ^ b for a, b in itertools.combinations(cols, 2)]
            assert len(set(pairs)) == len(pairs) and not set(pairs) & set(cols), (site, m)


def test_an_amax_beyond_the_coset_window_is_list_decoded():
    """A trainer amax 5 bf16 ulps below the rollout's (outside the -4..+3 window of 3 coset bits; 1 in
    1000 fc2 rows measured after the grouped GEMM, before fc2 became check-only): the nearest coset member is wrong by 8 ulps. Where
    that wrong amax makes the syndromes need flips, the decoder tries the next member, whose scales and
    codes need none, and takes it (counted). Where a wrong amax changes no code and no scale parity the
    syndromes cannot tell (the codewords are right; the amax is not): those rows stay, as without the
    list, and the align job's |delta logp| is what shows them."""
    g = torch.Generator().manual_seed(21)
    x_r = torch.clamp(torch.randn(64, 32, generator=g), -3.5, 3.5)
    x_r[:, 7] = torch.linspace(4.5, 5.5, 64)  # one clear maximum per row (distinct: per-row amax, not static)
    x_r = x_r.to(torch.bfloat16)
    q = tk.quantize(x_r, tk.row_amax(x_r))
    x_t = x_r.clone()
    x_t[:, 7] = (x_r[:, 7].view(torch.int16) - 5).view(torch.bfloat16)  # 5 ulps below
    assert sg.rates_for("k", 32).amax_bits == 3
    report = sg.DecodeReport()
    decoded = sg.decode(sg.encode(q, "k"), x_t, report)
    right = decoded.global_amax == q.global_amax
    old = sparse_decode.AMAX_LIST
    try:
        sparse_decode.AMAX_LIST = 0
        plain = sg.decode(sg.encode(q, "k"), x_t)
    finally:
        sparse_decode.AMAX_LIST = old
    assert not bool((plain.global_amax == q.global_amax).any())  # the window alone gets none of them
    # most rows come back right, every one of them through the list (counted); a list pick can be wrong
    # too (measured here: 1 of 42), which is why the list is tried only where the nearest member needs flips
    assert int(right.sum()) > 32 and report.amax_list_rows >= int(right.sum()), (report.amax_list_rows, int(right.sum()))
    assert torch.equal(tk.codewords(decoded)[right], tk.codewords(q)[right])
    assert torch.equal(decoded.scales[right], q.scales[right])


def test_a_check_only_site_accepts_exact_values_and_counts_the_rest():
    """moe_fc2_in is check-only: no amax or scale bits, 4 check bits per segment. Values equal to the
    rollout's decode to its codes with nothing flipped; rows the trainer did not reproduce (here: one
    value per row moved across its midpoint, which the k site would correct) keep the trainer's own
    rounding, and the segments whose check disagrees are counted, never guessed."""
    r = sg.rates_for("moe_fc2_in", 32)
    assert r.check and r.amax_bits == 0 and r.scale_bits == 0 and r.code_bits == 4
    x_r, q = _rollout_rows(13, 48, 32)
    guide = sg.unpack(sg.pack(sg.encode(q, "moe_fc2_in")), (48,), 32)
    assert sg.payload_bits(guide) == 8 * 3 + 48 * 4  # header + 4 bits per row of 32: 0.125 bits per value
    report = sg.DecodeReport()
    exact = sg.decode(guide, x_r, report)
    assert torch.equal(tk.codewords(exact), tk.codewords(q)) and torch.equal(exact.global_amax, q.global_amax)
    assert report.unresolved_code_segments == 0 and report.code_flips == 0
    x_t = _designed_noise(x_r, q, 13)
    own = tk.quantize(x_t, tk.row_amax(x_t))
    wrong = (tk.codewords(own) != tk.codewords(q)).any(-1)
    assert int(wrong.sum()) > 10
    report = sg.DecodeReport()
    decoded = sg.decode(guide, x_t, report)
    assert report.code_flips == 0 and report.amax_list_rows == 0
    assert torch.equal(tk.codewords(decoded), tk.codewords(own))  # the trainer's own rounding, not a guess
    # a single flip changes the 4-bit syndrome (distinct non-zero columns), so every such row is caught
    assert report.unresolved_code_segments == int(wrong.sum())
    # the same noise at a correcting site is corrected: the check is what fc2 chose, not a weaker decoder
    assert torch.equal(tk.codewords(sg.decode(sg.encode(q, "k"), x_t)), tk.codewords(q))


def test_check_only_payloads_need_version_3_and_version_2_payloads_still_load():
    _, q = _rollout_rows(17, 6, 32)
    blob = sg.pack(sg.encode(q, "moe_fc2_in")).clone()
    assert blob[0] >> 4 == 3 and (blob[1] >> 5) & 1
    v2 = blob.clone()
    v2[0] = (v2[0] & 0xF) | (2 << 4)  # a version-2 payload cannot be check-only
    with pytest.raises(sg.SparseError, match="version 2"):
        sg.unpack(v2, (6,), 32)
    k = sg.pack(sg.encode(q, "k")).clone()
    k[0] = (k[0] & 0xF) | (2 << 4)  # an old k payload: same layout, still read
    assert not sg.unpack(k, (6,), 32).shape != (6, 32)


def test_quantize_guided_takes_a_sparse_guide_and_rounds_what_it_decodes():
    """Every encoding resolves through the one entry point: a sparse guide is decoded against the
    trainer's values first, so its result equals guided rounding toward the decoded rows. A sparse guide
    cannot be handed to the rounding kernels as it is."""
    x_r, q = _rollout_rows(11, 16, 64)
    x_t = _designed_noise(x_r, q, 11)
    sparse = sg.unpack(sg.pack(sg.encode(q, "k")), (16,), 64)
    via_entry_point = tk.quantize_guided(x_t, sparse)
    decoded, _ = sparse.rounding_target(x_t)
    toward_decoded = tk.quantize_guided(x_t, decoded)
    assert torch.equal(via_entry_point.codes, toward_decoded.codes)
    assert torch.equal(via_entry_point.scales, q.scales)
    assert torch.equal(tk.codewords(via_entry_point), tk.codewords(q))
    assert not torch.equal(tk.codewords(tk.quantize_guided(x_t, None, global_amax=q.global_amax)), tk.codewords(q))
    with pytest.raises(TypeError, match="sparse guidance is rounded through its rounding_target"):
        sparse.round_rows(x_t, q.global_amax, use_triton=False, out_dtype=None, capture=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("noise,block_scale", [(0.004, "6"), (0.03, "6"), (0.01, "4over6")])
def test_a_sparse_decode_is_its_own_rounding_so_the_trainer_only_dequantizes_it(dtype, noise, block_scale):
    """The trainer used to round a sparse site twice: the decode (which ends with x's guided rounding)
    and fake_quantize toward the decode. Dequantizing the decode gives the same bits, unresolved
    segments and list-decoded amaxes included, and the same straight-through gradient."""
    x_r, _ = _rollout_rows(5, 64, 128)
    q = tk.quantize(x_r, tk.row_amax(x_r), block_scale=block_scale)
    g = torch.Generator().manual_seed(9)
    x_t = (x_r.float() * (1 + noise * torch.randn(x_r.shape, generator=g))).to(dtype).requires_grad_(True)
    report = sg.DecodeReport()
    decoded = sg.decode(sg.encode(q, "k", block_scale=block_scale), x_t, report, block_scale=block_scale)
    twice, q_twice = tk.fake_quantize(x_t, guide=decoded, return_quantized=True, block_scale=block_scale)
    once = tk.fake_dequantize(x_t, decoded, block_scale=block_scale)
    assert once.dtype == twice.dtype == dtype
    assert torch.equal(once.detach().view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       twice.detach().view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    assert torch.equal(q_twice.codes, decoded.codes) and torch.equal(q_twice.scales, decoded.scales)
    w = torch.randn(x_t.shape, generator=g).to(dtype)
    (g_once,) = torch.autograd.grad((once * w).sum(), x_t)
    (g_twice,) = torch.autograd.grad((twice * w).sum(), x_t)
    assert torch.equal(g_once, g_twice) and torch.equal(g_once, w)
    if noise > 0.01:
        assert report.unresolved_code_segments > 0 or report.amax_list_rows > 0

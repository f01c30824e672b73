"""TraceConfig(block_scale="4over6"): the 4-over-6 block scale (docs/four_over_six.md).

The rule against an independent oracle written from the published reference (tests/helpers/nvfp4_oracle.py),
exact ties, the global scale 6 * 256 / amax, the Triton kernels (interpreted on a CPU) bit for bit with
the torch reference, and sparse guidance's per-block choice bits. Small shapes: interpreted launches cost.
"""

import numpy as np
import pytest
import torch

import nvfp4_oracle as oracle
import trace_kernels as tk
from adversarial import cases
from record_factory import SHAPE, captured_builder
from trace_kernels import RecordError, TraceConfig, reference
from trace_kernels.grouped_mm import PackedExperts, grouped_mm
from trace_kernels.guides import sparse as sg
from trace_kernels.guides.sparse import codec

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
E4M3_256, E4M3_384 = 0x78, 0x7C  # 256 = 2^8 (exponent field 15), 384 = 1.5 * 2^8


def _rows(R=24, K=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    spread = torch.logspace(-2, 1, K // 16).repeat_interleave(16)
    return (torch.randn(R, K, generator=g) * spread * torch.rand(R, 1, generator=g)).to(torch.bfloat16).float()


# ---- the config ------------------------------------------------------------------------------------------
def test_config_default_serialises_as_before_and_bad_values_name_the_key():
    assert TraceConfig().block_scale == "6" and "block_scale" not in TraceConfig().to_dict()
    c = TraceConfig(block_scale="4over6")
    assert TraceConfig.from_dict(c.to_dict()) == c and c.to_dict()["block_scale"] == "4over6"
    for bad in ("4", "4/6", 6, None):
        with pytest.raises(ValueError, match="TraceConfig.block_scale must be one of"):
            TraceConfig(block_scale=bad)


def test_a_record_of_the_other_block_scale_is_refused():
    config = TraceConfig(guidance="full", guided_layers="all", block_scale="4over6")
    record = captured_builder(config).build()
    record.check_compatible(SHAPE, config)
    with pytest.raises(RecordError, match="block_scale"):
        record.check_compatible(SHAPE, TraceConfig(guidance="full", guided_layers="all"))


# ---- the rule ------------------------------------------------------------------------------------------
def test_exact_tie_keeps_6_strictly_lower_error_takes_4_and_the_global_scale_is_6x256():
    """amax 1.5: g_enc = 1536 / 1.5 = 1024, g_dec = 2^-10 exactly; a block whose amax is 1.5 gets the
    6-candidate scale 256 (it would be 448 under the default rule) and the 4-candidate 384.
    Block 0 [1.5, 0.84375]: 0.84375 / 0.25 = 3.375 -> 3 and 0.84375 / 0.375 = 2.25 -> 2 both give 0.75:
    equal errors, so 6 stays. Block 1 [1.5, 1.125]: 4.5 -> 4 (error 0.125) vs 3 -> exact: 4 wins."""
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1], x[0, 16], x[0, 17] = 1.5, 0.84375, 1.5, -1.125
    amax = torch.tensor([1.5])
    codes, scales, four = reference.quantize_with_choice(x, amax, "4over6")
    assert scales[0].tolist() == [E4M3_256, E4M3_384] and four[0].tolist() == [False, True]
    c = reference.unpack_nibbles(codes)[0]
    assert c[:2].tolist() == [7, 5] and c[16:18].tolist() == [6, 8 | 5]  # 6, 3 | 4, -3
    ocodes, obytes, ofour, e6, e4 = oracle.quantize_4over6(x, amax)
    assert e6[0, 0] == e4[0, 0] and e4[0, 1] < e6[0, 1]  # the oracle sees the same tie and the same win
    assert obytes[0].tolist() == scales[0].tolist() and ofour[0].tolist() == four[0].tolist()
    assert tk.dequantize(tk.quantize(x, amax, block_scale="4over6"), block_scale="4over6")[0, [0, 1, 16, 17]].tolist() == \
        [1.5, 0.75, 1.5, -1.125]
    assert reference.quantize(x, amax)[1][0, 0] == 0x7E  # the default rule: 448 * 6 / 1.5 maps 1.5 to 448


def test_reference_agrees_with_the_independent_oracle_except_at_float_near_ties():
    """Bit for bit on every block whose two errors are not within float32 rounding of each other (the
    oracle sums in float64 with the published dequantization, the contract in float32 in a fixed order);
    the near-ties where they may part are counted and must be rare."""
    x = _rows(64, 256, seed=3)
    amax = tk.row_amax(x)
    codes, scales, four = reference.quantize_with_choice(x, amax, "4over6")
    ocodes, obytes, ofour, e6, e4 = oracle.quantize_4over6(x, amax)
    near_tie = np.abs(e4 - e6) <= 1e-5 * np.maximum(e6, e4)
    differ = (four.numpy() != ofour) | (scales.numpy() != obytes)
    assert not (differ & ~near_tie).any(), np.argwhere(differ & ~near_tie)[:5]
    assert differ.sum() <= 2 and 0.1 < four.float().mean() < 0.7  # the rule is exercised both ways
    same_block = ~differ.repeat(16, axis=1)
    assert (oracle.signed_value(oracle.unpack(codes))[same_block] == oracle.signed_value(ocodes)[same_block]).all()


def test_4over6_lowers_the_quantization_error():
    x = _rows(32, 256, seed=5)
    amax = tk.row_amax(x)
    err = {bs: float(((tk.dequantize(tk.quantize(x, amax, block_scale=bs), block_scale=bs) - x) ** 2).sum())
           for bs in ("6", "4over6")}
    assert err["4over6"] < 0.95 * err["6"], err


# ---- Triton (interpreted on a CPU) == torch --------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_triton_quantize_dequantize_and_guided_equal_the_reference(device):
    names = ("e2m1_midpoints_and_ulps", "e4m3_scale_ties", "zero_blocks_per_row", "subnormal_block_scales",
             "saturation_static_amax", "signed_zeros")
    adversarial = [(n, x, a) for n, x, a in cases() if n in names]
    assert len(adversarial) == len(names)
    bad = _rows(4, 64)
    bad[1, 5], bad[2, 40] = float("nan"), float("inf")  # their blocks: NaN scale byte, codes 0, choice 6
    rows = [("random", _rows(8, 128), None), ("nonfinite", bad, None)] + adversarial
    for name, x, amax in rows:
        amax = tk.row_amax(x).nan_to_num(1.0) if amax is None else amax
        ref = tk.quantize(x, amax, block_scale="4over6", backend="torch")
        xd, ad = x.to(device), amax.to(device)
        tri = tk.quantize(xd, ad, block_scale="4over6", backend="triton")
        assert torch.equal(ref.codes, tri.codes.cpu()) and torch.equal(ref.scales, tri.scales.cpu()), name
        out_ref, _ = tk.quantize_dequantize(x.to(torch.bfloat16), global_amax=amax, block_scale="4over6", backend="torch")
        out_tri, _ = tk.quantize_dequantize(xd.to(torch.bfloat16), global_amax=ad, block_scale="4over6", backend="triton")
        torch.testing.assert_close(out_ref, out_tri.cpu(), rtol=0, atol=0, equal_nan=True)
        deq = tk.dequantize(tri, backend="triton", block_scale="4over6").cpu()
        torch.testing.assert_close(tk.dequantize(ref, backend="torch", block_scale="4over6"), deq, rtol=0, atol=0, equal_nan=True)
        # guided rounding of perturbed values toward these rows (full and compact): same bits
        xt = x * (1 + 1e-3 * torch.sin(torch.arange(x.numel()).reshape(x.shape)))
        for guide in (ref, tk.compact(ref)):
            g_ref = tk.quantize_guided(xt, guide, block_scale="4over6", backend="torch")
            g_tri = tk.quantize_guided(xt.to(device), guide.to(device), block_scale="4over6", backend="triton")
            assert torch.equal(g_ref.codes, g_tri.codes.cpu()), (name, type(guide).__name__)


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_mm_triton_equals_torch_and_captures_the_4over6_codes(device):
    E, N, K, Ra = 3, 32, 64, 6
    g = torch.Generator().manual_seed(2)
    w = PackedExperts.empty(E, N, K, block_scale="4over6")
    for e in range(E):
        w.quantize_expert_(e, torch.randn(N, K, generator=g) * (e + 1))
    a = (torch.randn(Ra, K, generator=g) * torch.logspace(-1, 1, K // 16).repeat_interleave(16)).to(torch.bfloat16)
    offs = torch.tensor([2, 2, 6], dtype=torch.int32)
    outs = {}
    for backend, dev in (("torch", "cpu"), ("triton", device)):
        wd = PackedExperts(w.codes.to(dev), w.scales.to(dev), w.amax.to(dev), w.block_scale)
        cc = torch.zeros((Ra, K // 2), dtype=torch.uint8, device=dev)
        cs = torch.zeros((Ra, K // 16), dtype=torch.uint8, device=dev)
        dest = torch.arange(Ra, device=dev)
        out = grouped_mm(a.to(dev), wd, offs.to(dev), capture=(dest, cc, cs), backend=backend)
        outs[backend] = (out.cpu(), cc.cpu(), cs.cpu())
    for r, t in zip(outs["torch"], outs["triton"]):
        torch.testing.assert_close(r, t, rtol=0, atol=0)
    q = tk.quantize(a, tk.row_amax(a), block_scale="4over6", backend="torch")
    assert torch.equal(outs["torch"][1], q.codes) and torch.equal(outs["torch"][2], q.scales)
    # the GEMM is the dequantized operands' product under the 4over6 global scales
    deq_a = tk.dequantize(q, block_scale="4over6")
    expect = torch.cat([deq_a[s:e] @ w.dequantize(i).T for i, (s, e) in enumerate([(0, 2), (2, 2), (2, 6)])])
    torch.testing.assert_close(outs["torch"][0], expect, rtol=1e-5, atol=1e-5)


# ---- sparse guidance: the per-block choice ---------------------------------------------------------------
def test_sparse_rows_carry_the_choice_and_decode_the_rollout_exactly():
    x_r = _rows(24, 128, seed=7)
    q = tk.quantize(x_r, tk.row_amax(x_r), block_scale="4over6")
    assert torch.equal(codec.block_choices(q).bool(), reference.quantize_with_choice(x_r, tk.row_amax(x_r), "4over6")[2])
    x_t = (x_r * (1 + 2e-3 * torch.cos(torch.arange(x_r.numel()).reshape(x_r.shape)))).to(torch.bfloat16).float()
    blob = sg.pack(sg.encode(q, "moe_fc1_in", block_scale="4over6"))
    assert blob[0] >> 4 == 4 and (blob[1] >> 6) & 1  # version 4, choice bits present
    plain = sg.pack(sg.encode(q, "moe_fc1_in"))
    assert plain[0] >> 4 == 3  # without choice bits the payload is what version 3 wrote
    assert abs((blob.numel() - plain.numel()) - 24 * (128 // 16) / 8) <= 1  # one bit per block: 1/16 bit per value
    guide = sg.unpack(blob, (24,), 128)
    own = tk.quantize(x_t, tk.row_amax(x_t), block_scale="4over6")
    report = sg.DecodeReport()
    decoded = sg.decode(guide, x_t, report, block_scale="4over6")
    assert (tk.codewords(own) != tk.codewords(q)).sum() > 0  # there is something to correct
    assert torch.equal(decoded.scales, q.scales) and torch.equal(tk.codewords(decoded), tk.codewords(q)), report
    with pytest.raises(sg.SparseError, match="4over6 choice bits"):
        sg.decode(guide, x_t, block_scale="6")
    with pytest.raises(sg.SparseError, match="full codes"):
        sg.encode(tk.compact(q), "k", block_scale="4over6")


def test_a_version_3_payload_reader_refuses_choice_bits_it_cannot_place():
    x_r = _rows(4, 64, seed=1)
    blob = sg.pack(sg.encode(tk.quantize(x_r, tk.row_amax(x_r), block_scale="4over6"), "k", block_scale="4over6")).clone()
    blob[0] = (blob[0] & 0xF) | (3 << 4)
    with pytest.raises(sg.SparseError, match="version 3"):
        sg.unpack(blob, (4,), 64)


@pytest.mark.parametrize("K,site", [(128, "moe_fc1_in"), (96, "k"), (64, "moe_fc2_in")])
def test_the_fused_encoder_writes_the_reference_choice_payload_byte_for_byte(K, site):
    from trace_kernels.guides.sparse import wire
    from trace_kernels.guides.sparse.fused_encode import encode_payload
    from trace_kernels.guides.sparse.rates import rates_for, with_choice

    x = _rows(5, K, seed=K)
    q = tk.quantize(x, tk.row_amax(x), block_scale="4over6")
    rates = with_choice(rates_for(site, K), "4over6")
    reference_blob = wire.pack(sg.SparseGuide(*codec.encode_fields(q, site, rates)))
    assert torch.equal(encode_payload(q, site, rates), reference_blob)
    assert wire.payload_rates(reference_blob) == rates


def test_4over6_rows_asked_of_the_triton_encoder_run_the_reference_counted():
    """The Triton encoder writes no choice bits: 4over6 rows must not lose them on the kernel path."""
    import warnings

    from trace_kernels.guides.sparse import dispatch, wire
    from trace_kernels.guides.sparse.fused_encode import encode_payload
    from trace_kernels.guides.sparse.rates import rates_for, with_choice

    pytest.importorskip("triton")
    x = _rows(6, 64, seed=11)
    q = tk.quantize(x, tk.row_amax(x), block_scale="4over6")
    rates = with_choice(rates_for("k", 64), "4over6")
    dispatch.reset_fallbacks()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        got = encode_payload(q, "k", rates, backend="triton")
    assert torch.equal(got, wire.pack(sg.SparseGuide(*codec.encode_fields(q, "k", rates))))
    assert dispatch.fallbacks() == {"encode.4over6_choice_bits": 1}


def test_4over6_sparse_decode_on_the_triton_kernels_equals_the_reference():
    from trace_kernels.guides.sparse.rates import rates_for, with_choice

    pytest.importorskip("triton")
    x = _rows(8, 64, seed=12)
    q = tk.quantize(x, tk.row_amax(x), block_scale="4over6")
    rates = with_choice(rates_for("k", 64), "4over6")
    guide = sg.unpack(sg.pack(sg.SparseGuide(*codec.encode_fields(q, "k", rates))), (8,), 64)
    x_t = x * (1 + 0.01 * torch.randn(x.shape, generator=torch.Generator().manual_seed(3)))
    r_ref, r_tri = sg.DecodeReport(), sg.DecodeReport()
    ref = sg.decode(guide, x_t, r_ref, backend="torch", block_scale="4over6")
    got = sg.decode(guide, x_t, r_tri, backend="triton", block_scale="4over6")
    assert torch.equal(got.codes, ref.codes) and torch.equal(got.scales, ref.scales)
    assert r_ref == r_tri and r_ref.code_flips + r_ref.scale_flips > 0


def test_4over6_sparse_decode_on_the_compiled_cpu_path_runs_eager_counted_once(monkeypatch):
    """The compiled pieces implement the default rule: a 4over6 decode asked of them runs the reference,
    and that is counted once per decode (not per stage)."""
    from trace_kernels import cpu_compiled
    from trace_kernels.guides.sparse.rates import rates_for, with_choice

    x = _rows(8, 64, seed=13)
    q = tk.quantize(x, tk.row_amax(x), block_scale="4over6")
    rates = with_choice(rates_for("k", 64), "4over6")
    guide = sg.unpack(sg.pack(sg.SparseGuide(*codec.encode_fields(q, "k", rates))), (8,), 64)
    x_t = x * (1 + 0.01 * torch.randn(x.shape, generator=torch.Generator().manual_seed(4)))
    ref = sg.decode(guide, x_t, backend="torch", block_scale="4over6")
    monkeypatch.setenv("TRACE_FP4_CPU_BACKEND", "compiled")
    before = cpu_compiled.fallbacks()
    got = sg.decode(guide, x_t, block_scale="4over6")
    after = cpu_compiled.fallbacks()
    assert torch.equal(got.codes, ref.codes) and torch.equal(got.scales, ref.scales)
    grew = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
    # the flip search (search.py) follows the env var on its own: its staging counts are not the decoder's
    assert grew.get("kept_eager:block_scale_4over6") == 1 and "kept_eager:amax_list" not in grew, grew

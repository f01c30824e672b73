"""Rates that follow the data: per-layer, per-site sparse rates carried in every record, the audit (full
codes of a sample of tokens) that measures the residual, and the controller that moves the rates."""

import math

import pytest
import torch

import trace_kernels as tk
from record_factory import SHAPE, captured_builder
from trace_kernels.guides import sparse as sg
from trace_kernels.guides.sparse.audit import audit_rows
from trace_kernels.guides.sparse.controller import RateController, bits_per_value_change, site_counts
from trace_kernels.records.layout import expected_tensors

FULL = tk.TraceConfig(guidance="full", guided_layers="all")
SPARSE = tk.TraceConfig(guidance="sparse", guided_layers="all")
AUDIT_1PCT = tk.TraceConfig(guidance="sparse", guided_layers="all", sparse_audit=0.01)  # 3 rows of 300 tokens


def _full(steps=(40, 1, 1), seed=0):
    return captured_builder(FULL, steps=steps, seed=seed).build()


@pytest.mark.parametrize("bad, match", [
    ({"sparse_rates": {"9x.k": [3, 1, 11]}}, "sparse_rates key"),
    ({"sparse_rates": {"1.q": [3, 1, 11]}}, "sparse_rates key"),
    ({"sparse_rates": {"1.k": [3, 1]}}, r"sparse_rates\['1.k'\]"),
    ({"sparse_rates": {"1.k": [3, 9, 11]}}, "scale_bits 0..4"),
    ({"sparse_rates": {"1.k": [3, 1, 11], "01.k": [3, 1, 12]}}, "two entries"),
    ({"sparse_audit": 1.5}, "sparse_audit"),
    ({"sparse_audit": True}, "sparse_audit"),
    ({"rates_version": -1}, "rates_version"),
])
def test_bad_rate_settings_are_refused_by_name(bad, match):
    with pytest.raises(ValueError, match=match):
        tk.TraceConfig(guidance="sparse", **bad)


def test_a_config_without_the_rate_keys_reads_as_the_built_in_rates():
    d = SPARSE.to_dict()
    for key in ("sparse_rates", "sparse_audit", "rates_version"):
        d.pop(key)
    assert tk.TraceConfig.from_dict(d) == SPARSE
    with pytest.raises(ValueError, match="names"):
        tk.TraceConfig(guidance="sparse", sparse_rates={"7.k": [3, 1, 11]}).check_layers(4)


def test_records_carry_the_rates_of_each_layer_and_site_and_decode_exactly():
    full = _full(steps=(12, 1))
    raised = tk.TraceConfig(guidance="sparse", guided_layers="all", sparse_rates={"1.k": [3, 1, 16], "2.moe_fc1_in": [4, 3, 24]})
    base, hi = full.reencode(SPARSE), full.reencode(raised)
    hi = tk.GuidanceRecord.from_bytes(hi.to_bytes(), expect_shape=SHAPE)
    r0, r1 = base.rates(), hi.rates()
    assert r1["1.k"] == [3, 1, 16] and r1["2.moe_fc1_in"] == [4, 3, 24]
    assert r0["1.k"] == [3, 1, 11] and r0["2.moe_fc1_in"] == [3, 3, 16]
    assert {k: v for k, v in r1.items() if k not in ("1.k", "2.moe_fc1_in")} == {
        k: v for k, v in r0.items() if k not in ("1.k", "2.moe_fc1_in")}
    assert r1["0.moe_fc2_in"] == [0, 0, 4]  # check-only sites keep their check
    assert hi.tensors["layer.1.k.sparse"].numel() > base.tensors["layer.1.k.sparse"].numel()
    assert json_config(hi)["sparse_rates"] == {"1.k": [3, 1, 16], "2.moe_fc1_in": [4, 3, 24]}
    for layer in range(SHAPE.num_layers):
        for site in SHAPE.layer_sites(layer):
            x = full.site(layer, site).dequantize()
            assert torch.equal(tk.codewords(sg.decode(hi.site(layer, site), x)), tk.codewords(full.site(layer, site)))
    # A trainer whose rates moved on still takes the record (its payloads carry their own rates), but
    # not one whose guidance differs.
    hi.check_compatible(SHAPE, SPARSE)
    base.check_compatible(SHAPE, raised)
    with pytest.raises(tk.RecordError, match="guidance"):
        hi.check_compatible(SHAPE, tk.TraceConfig(guidance="compact", guided_layers="all"))


def json_config(record):
    import json

    return json.loads(record._metadata()["config"])


def test_audit_rows_follow_a_seed_of_the_record_identity():
    a = audit_rows(1000, 1, "k", 0.01, "digest-a")
    assert torch.equal(a, audit_rows(1000, 1, "k", 0.01, "digest-a"))
    assert not torch.equal(a, audit_rows(1000, 1, "k", 0.01, "digest-b"))
    assert not torch.equal(a, audit_rows(1000, 2, "k", 0.01, "digest-a"))
    assert a.numel() == 10 and bool((a[1:] > a[:-1]).all())
    # short records: floor(f * T + u) rows, so the mean over many records is f * T
    counts = [audit_rows(70, 0, "v", 0.01, f"d{i}").numel() for i in range(2000)]
    assert set(counts) <= {0, 1}
    assert abs(sum(counts) / len(counts) - 0.7) < 0.05


def test_the_audit_holds_full_codes_of_its_rows_and_is_counted_in_the_bits():
    full = _full(steps=(300,))
    rec = full.reencode(AUDIT_1PCT)
    off = full.reencode(tk.TraceConfig(guidance="sparse", guided_layers="all", sparse_audit=0.0))
    # without an audit a record is what it was before audits existed: the same tensors, byte for byte
    assert set(off.tensors) == set(expected_tensors(SHAPE, off.num_tokens, off.modes))
    assert all(torch.equal(off.tensors[n], rec.tensors[n]) for n in off.tensors)
    audit_bytes = rec.nbytes - off.nbytes
    values = 0
    for layer in range(SHAPE.num_layers):
        for site in SHAPE.layer_sites(layer):
            rows, codes = rec.audit(layer, site)
            assert rows.numel() == 3  # floor(0.01 * 300 + u)
            assert torch.equal(codes, full.site(layer, site)[rows].codes)
            values += rec.num_tokens * math.prod(SHAPE.row_shape(site))
    bits = 8 * audit_bytes / values
    assert 0.04 <= bits <= 0.046, bits  # 1% of the 4-bit codes, plus the rows' index (32 bits a token)
    again = tk.GuidanceRecord.from_bytes(rec.to_bytes(), expect_shape=SHAPE)
    assert torch.equal(again.audit(1, "k")[1], rec.audit(1, "k")[1])
    assert off.audit(1, "k") is None and full.audit(1, "k") is None
    # the default audits 0.25% of the tokens (0 or 1 of 300 per site): about a quarter of that cost,
    # within the 0.4 b/v budget
    default = full.reencode(SPARSE)
    assert 0.1 * audit_bytes <= default.nbytes - off.nbytes <= 0.45 * audit_bytes
    # kept byte for byte through a sparse -> sparse re-encode
    assert torch.equal(rec.reencode(SPARSE).tensors["layer.1.k.audit"], rec.tensors["layer.1.k.audit"])


def test_a_damaged_audit_is_refused_naming_it():
    import json
    import struct

    rec = _full(steps=(300,)).reencode(AUDIT_1PCT)
    data = bytearray(rec.to_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    begin, _ = json.loads(data[8 : 8 + n])["layer.2.v.audit"]["data_offsets"]
    data[8 + n + begin + 20] ^= 1
    with pytest.raises(tk.RecordError, match="layer 2, site v: checksum mismatch in tensor layer.2.v.audit"):
        tk.GuidanceRecord.from_bytes(bytes(data), expect_shape=SHAPE)
    blob = rec.tensors["layer.2.v.audit"].clone()
    blob[:12] = torch.tensor([5, 3, 4], dtype=torch.int32).view(torch.uint8)
    rec.tensors["layer.2.v.audit"] = blob
    with pytest.raises(tk.RecordError, match="layer 2, site v: audit rows must be increasing"):
        rec.audit(2, "v")
    rec.tensors["layer.2.v.audit"] = blob[:-1]
    with pytest.raises(tk.RecordError, match="layer 2, site v: audit tensor is"):
        rec.audit(2, "v")


def _metrics(layer, site, values, mismatch, segments=100, unresolved=0, unresolved_scales=0):
    p = f"trace/layer{layer}/{site}"
    return {f"{p}/audit_values": values, f"{p}/audit_mismatch": mismatch, f"{p}/audit_mismatch_rtn": 10 * mismatch,
            f"{p}/sparse_segments": segments, f"{p}/sparse_unresolved_code_segments": unresolved,
            f"{p}/sparse_unresolved_scale_segments": unresolved_scales, f"{p}/audit_residual": 0.5}


def test_the_controller_raises_lowers_and_waits_for_enough_audited_values():
    m = {**_metrics(0, "k", 5000, 50, unresolved_scales=20),  # 1%: 10x the target
         **_metrics(1, "k", 5000, 6),  # 0.12%: just above
         **_metrics(2, "k", 40000, 1),  # far below, on enough values: lower
         **_metrics(3, "k", 1000, 2),  # 0.2%, but two mismatches are not evidence yet
         **_metrics(3, "moe_fc2_in", 9000, 900)}  # check-only: never moved
    assert set(site_counts(m)) == {(0, "k"), (1, "k"), (2, "k"), (3, "k"), (3, "moe_fc2_in")}
    ctl = RateController(target=1e-3, relative_target=None)  # the absolute target alone
    ctl.observe(m)
    new, changes = ctl.update(SPARSE, SHAPE)
    by = {c["site"]: c for c in changes}
    assert by["0.k"]["to"] == [3, 2, 15]  # +4 code bits (>= 4x the target) and a scale bit
    assert by["1.k"]["to"] == [3, 1, 12]  # 1.2x the target: one bit halves it
    assert by["2.k"]["to"] == [3, 1, 10]
    assert set(by) == {"0.k", "1.k", "2.k"}
    assert new.rates_version == 1 and new.sparse_rates == {s: c["to"] for s, c in by.items()}
    assert bits_per_value_change(SPARSE, new, SHAPE)["0.k"] == pytest.approx(5 / 32)
    # layer 3's k waits for more evidence: the next step's counts add up, then it is raised
    ctl.observe(_metrics(3, "k", 1000, 2))
    newer, changes = ctl.update(new, SHAPE)
    assert [c["site"] for c in changes] == ["3.k"] and newer.rates_version == 2
    assert newer.sparse_rates["0.k"] == [3, 2, 15]  # earlier decisions stay
    # nothing observed: the same config, no new version
    assert ctl.update(newer, SHAPE) == (newer, [])


def test_a_site_whose_audit_saw_no_rtn_flip_is_kept_or_raised_never_divided_by():
    """Flip density 0 (the audit saw no RTN mismatch: a small model, few rows) makes the relative target 0.
    The controller neither lowers such a site nor divides by its target (a ZeroDivisionError ended
    `trace-fp4 align` on the tiny GLM); guided mismatches there still raise it."""
    def no_flips(layer, values, mismatch):
        return {**_metrics(layer, "k", values, mismatch), f"trace/layer{layer}/k/audit_mismatch_rtn": 0}

    ctl = RateController(target=1e-3, relative_target=0.005)
    ctl.observe({**no_flips(0, 40000, 0), **no_flips(1, 5000, 4)})
    new, changes = ctl.update(SPARSE, SHAPE)
    assert [c["site"] for c in changes] == ["1.k"] and changes[0]["target"] == 0 and changes[0]["flip_density"] == 0
    assert changes[0]["to"][2] > changes[0]["from"][2]  # raised: 4 guided mismatches against a target of 0
    assert "0.k" not in new.sparse_rates  # 0 of 40,000 values wrong, but nothing to be far below: kept


@pytest.mark.parametrize("K, rates, static, compact", [
    (64, None, False, False), (128, sg.Rates(3, 2, 20), False, False), (32, sg.Rates(3, 2, 11), False, True),
    (48, None, False, False), (64, sg.Rates(0, 0, 4, check=True), False, False), (64, None, True, False),
    (96, sg.Rates(5, 0, 9), False, False),
])
def test_the_fused_encoder_writes_the_reference_payload_byte_for_byte(K, rates, static, compact):
    from trace_kernels.guides.sparse.fused_encode import encode_payload

    g = torch.Generator().manual_seed(K)
    x = torch.randn(7, 3, K, generator=g) * torch.rand(7, 3, 1, generator=g) * 3
    amax = torch.full((7, 3), 2.5) if static else tk.row_amax(x.to(torch.bfloat16)).float()
    q = tk.quantize(x, amax.reshape(-1)[:1] if static else amax)
    if compact:  # a compact record's rows (mantissa bits) re-encode to the same payload
        q = _compact_rows(x)
    want = sg.pack(sg.encode(q, "k", rates))
    got = encode_payload(q, "k", rates)
    assert got.dtype == torch.uint8 and torch.equal(got, want)


def _compact_rows(x):
    from trace_kernels.guides.compact import CompactGuide

    q = tk.quantize(x, tk.row_amax(x.to(torch.bfloat16)).float())
    return CompactGuide.encode(q, "k")

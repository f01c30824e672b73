"""The native unpack of a sparse payload (kernels/cpu_native/sparse_wire.py) gives the torch reference's
fields (syndromes, scale syndromes with 4over6 choice bits, row headers) bit for bit, at every site's
rates, static and per-row amaxes, and for a record of no rows."""

import pytest
import torch

import trace_kernels as tk
from trace_kernels.guides import sparse as sg
from trace_kernels.errors import SparseError
from trace_kernels.guides.sparse import wire

pytest.importorskip("numba")


def _payload(seed, lead, K, site, rates=None, static=False, block_scale="6"):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, K, generator=g) * torch.rand(*lead, 1, generator=g) * 4).to(torch.bfloat16)
    amax = torch.full(lead, 7.5) if static else tk.row_amax(x)
    q = tk.quantize(x, amax, block_scale=block_scale) if block_scale != "6" else tk.quantize(x, amax)
    return wire.pack(sg.encode(q, site, rates, block_scale=block_scale))


@pytest.mark.parametrize("lead,K,site,rates,static,block_scale", [
    ((37,), 128, "moe_fc1_in", None, False, "6"),
    ((29, 2), 64, "moe_fc2_in", None, False, "6"),
    ((16, 4), 32, "k", None, False, "6"),
    ((16,), 16, None, None, False, "6"),
    ((21,), 64, "v", None, True, "6"),
    ((13,), 128, "moe_fc1_in", sg.Rates(5, 4, 22), False, "6"),
    ((19,), 64, "k", None, False, "4over6"),
    ((0,), 64, "k", None, False, "6"),
])
def test_native_unpack_equals_the_reference(monkeypatch, lead, K, site, rates, static, block_scale):
    blob = _payload(len(lead) * 100 + K, lead, K, site, rates, static, block_scale)
    monkeypatch.setenv("TRACE_FP4_CPU_BACKEND", "eager")
    ref = wire.unpack_fields(blob, lead, K)
    monkeypatch.setenv("TRACE_FP4_CPU_BACKEND", "native")
    nat = wire.unpack_fields(blob, lead, K)
    for a, b in zip(ref, nat):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if lead[0]:
        assert bool((ref[0] != 0).any())  # not a vacuous comparison
    # a payload of the wrong length is refused on the native path too (the checks run before the kernel)
    with pytest.raises(SparseError, match="bytes"):
        wire.unpack_fields(torch.cat([blob, torch.zeros(1, dtype=torch.uint8)]), lead, K)


@pytest.mark.parametrize("K,site,inner,static", [(128, "moe_fc1_in", (), False), (64, "moe_fc2_in", (2,), False),
                                                  (32, "k", (4,), False), (64, "v", (), True)])
def test_one_unpack_of_several_payloads_equals_each_unpacked_then_concatenated(monkeypatch, K, site, inner, static):
    """wire.unpack_fields_many (a trainer's batch: one payload per record of a site, one native call for all)
    gives unpack_fields of each, concatenated, on both paths; each payload's rates are its own; a broken
    payload is refused naming it."""
    lengths = [7, 0, 12, 5]
    rates = [None, None, sg.Rates(5, 4, 22) if site == "moe_fc1_in" else None, None]
    blobs = [_payload(50 + i, (n, *inner), K, site, r, static) for i, (n, r) in enumerate(zip(lengths, rates))]
    leads = [(n, *inner) for n in lengths]
    for backend in ("eager", "native"):
        monkeypatch.setenv("TRACE_FP4_CPU_BACKEND", backend)
        each = [wire.unpack_fields(b, lead, K) for b, lead in zip(blobs, leads)]
        many = wire.unpack_fields_many(blobs, leads, K)
        for f, got in zip(zip(*each), many):
            want = torch.cat(f)
            assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
        assert bool((many[0] != 0).any())
        broken = blobs[:2] + [blobs[2][:-1]] + blobs[3:]
        with pytest.raises(SparseError, match="payload 2: sparse payload has"):
            wire.unpack_fields_many(broken, leads, K, where=lambda i: f"payload {i}")

"""The sparse guide's Triton kernels (kernels/guides/sparse/triton_jit.py), run under the Triton
interpreter on a CPU, are bit-identical with the torch reference: the encoder's payload bytes, the
syndromes, the staged and wide flip-pattern search, and the whole decode (scales, codes, amax list,
report). Small shapes: every interpreted launch costs a second or more."""

import warnings

import pytest
import torch

import trace_kernels as tk
from trace_kernels.guides import sparse as sg
from trace_kernels.guides.compact import CompactGuide
from trace_kernels.guides.sparse import dispatch, parity, search, triton_launch
from trace_kernels.guides.sparse.fused_encode import encode_payload
from trace_kernels.guides.sparse.rates import Rates

pytest.importorskip("triton")

# CPU: the interpreter; CUDA (bench/gpu_check.py runs the "cuda" cases): the compiled kernels
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _on(q, device):
    return tk.NVFP4Tensor(q.codes.to(device), q.scales.to(device), q.global_amax.to(device))


def _rows(seed: int, rows: int, K: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, K, generator=g) * torch.rand(rows, 1, generator=g) * 4).to(torch.bfloat16)
    return x, tk.quantize(x, tk.row_amax(x))


def _trainer_values(x: torch.Tensor, seed: int, noise: float) -> torch.Tensor:
    """The rollout's values with relative noise: enough to move some codes, scales and row amaxes."""
    g = torch.Generator().manual_seed(seed + 1)
    return x.float() * (1 + noise * torch.randn(x.shape, generator=g))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("K,rates", [
    (64, Rates(3, 3, 16)),  # BCH code rows, scale syndrome of 3 bits over 4 blocks
    (64, Rates(3, 4, 14)),  # every scale LSB sent
    (32, Rates(2, 1, 11)),
    (16, Rates(3, 1, 6)),
    (64, Rates(0, 0, 4, check=True)),  # a check-only site
])
def test_encode_kernel_writes_the_reference_payload(K, rates, device):
    _, q = _rows(K + rates.code_bits, 37, K)
    ref = sg.pack(sg.encode(q, rates=rates))
    q = _on(q, device)
    assert torch.equal(encode_payload(q, rates=rates, backend="torch"), ref)
    assert torch.equal(encode_payload(q, rates=rates, backend="triton"), ref)


def test_encode_kernel_static_amax_and_fp32_amax_rows():
    x, _ = _rows(5, 9, 64)
    static = tk.quantize(x, torch.tensor(7.5))
    per_row = tk.quantize(x.float() * 1.001, tk.row_amax(x.float() * 1.001))  # amaxes not bf16 values
    for q in (static, per_row):
        assert torch.equal(encode_payload(q, "k", backend="triton"), sg.pack(sg.encode(q, "k")))


@pytest.mark.parametrize("m,n", [(3, 4), (16, 64), (62, 64), (11, 32)])
def test_syndrome_kernel(m, n):
    g = torch.Generator().manual_seed(m * n)
    bits = (torch.rand(50, n, generator=g) < 0.4).to(torch.int64)
    got = triton_launch.syndrome(bits, m, 2)
    assert torch.equal(got, parity.syndrome(bits, m, 2))
    assert bool((got != 0).any())


@pytest.mark.parametrize("device", DEVICES)
def test_search_kernel_matches_the_staged_and_wide_search(device):
    """Residuals of 0..6 true flips, costs with ties and forbidden (inf) positions: the kernel's flips,
    resolved flags and pattern costs equal the reference's, including the segments only the wide search
    resolves and those that stay unresolved."""
    g = torch.Generator().manual_seed(0)
    N, n, m = 56, 64, 16
    cols = parity.columns(m, n, 2, "cpu").expand(N, n)
    cost = torch.rand(N, n, generator=g) * 0.3 + 0.006
    cost[torch.rand(N, n, generator=g) < 0.1] = torch.inf
    cost[:20, 5] = cost[:20, 7]  # exact ties between candidates
    true = torch.zeros(N, n, dtype=torch.bool)
    for i in range(N):
        true[i, torch.randperm(n, generator=g)[: i % 7]] = True
    residual = parity.syndrome(true.long(), m, 2)
    residual, cols, cost = residual.to(device), cols.to(device), cost.to(device)
    ref = search.decode_bits(residual, cols, cost)
    got = triton_launch.decode_bits(residual, cols, cost)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    resolved_wide = ~search.decode_bits(residual, cols, cost, wide=False)[1] & ref[1]
    assert bool(resolved_wide.any()) and bool((~ref[1]).any()), "the data must reach the wide search and beyond"


@pytest.mark.parametrize("device", DEVICES)
def test_search_kernel_matches_the_wider_search_at_raised_code_bits(device):
    """16-value segments at 16 code bits: the wide search takes wide_search_for's 8 flips (the old one
    stopped at 6), and the kernel finds the same patterns, the 7- and 8-flip ones included."""
    g = torch.Generator().manual_seed(1)
    N, n, m = 24, 16, 16
    widths = search.wide_search_for(m, n)
    assert widths[0] > search.WIDE_FLIPS
    cols = parity.columns(m, n, 2, "cpu").expand(N, n)
    cost = torch.rand(N, n, generator=g) * 0.3 + 0.006
    cost[torch.rand(N, n, generator=g) < 0.05] = torch.inf
    true = torch.zeros(N, n, dtype=torch.bool)
    for i in range(N):
        true[i, torch.randperm(n, generator=g)[: i % 9]] = True
    residual = parity.syndrome(true.long(), m, 2)
    residual, cols, cost = residual.to(device), cols.to(device), cost.to(device)
    ref = search.decode_bits(residual, cols, cost, widths=widths)
    got = triton_launch.decode_bits(residual, cols, cost, widths=widths)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    old = search.decode_bits(residual, cols, cost)
    assert bool((ref[1] & ~old[1]).any()), "some segment only the wider search resolves"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("K,site,noise", [(64, "k", 0.004), (32, "moe_fc1_in", 0.01), (64, "moe_fc2_in", 0.0)])
def test_decode_kernels_equal_the_reference_decode(K, site, noise, device):
    x, q = _rows(K, 24, K)
    guide = sg.unpack(sg.pack(sg.encode(q, site)), (24,), K)
    x_t = _trainer_values(x, K, noise)
    if site == "moe_fc2_in":  # check-only: one row the trainer did not reproduce
        x_t[3] = _trainer_values(x[3:4], 9, 0.05)[0]
    x_t = x_t.to(device)
    guide = sg.SparseGuide(*(t.to(device) for t in guide.fields()))
    r_ref, r_tri = sg.DecodeReport(), sg.DecodeReport()
    ref = sg.decode(guide, x_t, r_ref, backend="torch")
    got = sg.decode(guide, x_t, r_tri, backend="triton")
    assert torch.equal(got.codes, ref.codes) and torch.equal(got.scales, ref.scales)
    assert torch.equal(got.global_amax, ref.global_amax)
    assert r_ref == r_tri
    if noise:
        assert r_ref.code_flips > 0 and r_ref.scale_flips > 0  # the search had work to do
    else:
        assert r_ref.unresolved_code_segments > 0  # the check-only site counted the row


def test_compact_rows_into_the_triton_encoder_are_a_counted_fallback():
    _, q = _rows(1, 8, 64)
    compact = CompactGuide.encode(q, "k")
    dispatch.reset_fallbacks()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = encode_payload(compact, "k", backend="triton")
    assert torch.equal(out, sg.pack(sg.encode(q, "k")))
    assert dispatch.fallbacks() == {"encode.compact_rows": 1}
    assert any("compact_rows" in str(w.message) for w in caught)

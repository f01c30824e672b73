"""The NVFP4 grouped GEMM: Triton kernel (interpreter on CPU, compiled with CUDA) == torch backend bit
for bit; its captured codes == trace_kernels.quantize of the same rows; and routed_experts built on it.

Small shapes and large tiles: every interpreted launch costs seconds.
"""

import pytest
import torch
import torch.nn.functional as F

import trace_kernels as tk
from adversarial import cases, ragged_expert_rows
from trace_kernels.grouped_mm import PackedExperts, grouped_mm
from trace_kernels.routed_experts import routed_experts, routed_experts_emulated

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _same(a, b):
    torch.testing.assert_close(a.cpu(), b.cpu(), rtol=0, atol=0, equal_nan=True)


def _packed(E, N, K, seed=0, spread=True):
    g = torch.Generator().manual_seed(seed)
    w = PackedExperts.empty(E, N, K)
    for e in range(E):
        # Columns of very different magnitude: block scales differ along K, so the K order matters.
        scale = torch.logspace(-3, 2, K // 16).repeat_interleave(16) if spread else torch.ones(K)
        w.quantize_expert_(e, torch.randn(N, K, generator=g) * scale * (e + 1))
    return w


def _to(w: PackedExperts, device):
    return PackedExperts(w.codes.to(device), w.scales.to(device), w.amax.to(device))


def _run(a, w, offs, rows, dest, backend, device, amax=None):
    Ra, K = a.shape
    cc = torch.zeros((Ra, K // 2), dtype=torch.uint8, device=device)
    cs = torch.zeros((Ra, K // 16), dtype=torch.uint8, device=device)
    out = grouped_mm(
        a.to(device), _to(w, device), offs.to(device), a_rows=None if rows is None else rows.to(device),
        a_amax=None if amax is None else amax.to(device), capture=(dest.to(device), cc, cs), backend=backend,
    )
    return out.cpu(), cc.cpu(), cs.cpu()


def _backends_agree_and_capture_the_contract(x, w, offs, dest, device, amax):
    """The Triton kernel equals the torch backend bit for bit, and the codes / scales both captured are
    `trace_kernels.quantize` of the same rows; returns the torch backend's (out, codes, scales)."""
    ref = _run(x, w, offs, None, dest, "torch", "cpu", amax)
    tri = _run(x, w, offs, None, dest, "triton", device, amax)
    for a, b in zip(ref, tri):
        _same(a, b)
    q = tk.quantize(x, amax, backend="torch")
    assert torch.equal(ref[1], q.codes) and torch.equal(ref[2], q.scales)
    return ref


@pytest.mark.parametrize("device", DEVICES)
def test_ragged_experts_with_empty_ones_and_gathered_rows(device):
    """Experts 1 and 4 get no rows, expert 2 more than one M tile; rows gathered with repeats."""
    E, N, K, Ra = 5, 40, 96, 9
    w = _packed(E, N, K)
    counts = [3, 0, 70, 2, 0]
    a, rows, offs, dest, g = ragged_expert_rows(counts, Ra, K, torch.bfloat16)
    ref = _run(a, w, offs, rows, dest, "torch", "cpu")
    tri = _run(a, w, offs, rows, dest, "triton", device)
    for x, y in zip(ref, tri):
        _same(x, y)
    # The capture is the contract's quantization of exactly the rows that were multiplied.
    q = tk.quantize(a, tk.row_amax(a), backend="torch")
    seen = sorted(dest[dest >= 0].tolist())  # every source row, once (at its first use)
    assert torch.equal(tri[1][seen], q.codes[seen]) and torch.equal(tri[2][seen], q.scales[seen])
    # And the GEMM is that quantization times the dequantized weights (up to fp32 summation order).
    start = 0
    for e, n in enumerate(counts):
        if n:
            expect = q[rows[start : start + n]].dequantize() @ w.dequantize(e).T
            torch.testing.assert_close(ref[0][start : start + n], expect, rtol=1e-5, atol=1e-5 * expect.abs().max().item())
        start += n


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,x,amax", cases(), ids=[c[0] for c in cases()])
def test_adversarial_rows(name, x, amax, device):
    """Ties, zero blocks, subnormal scales, saturation, NaN/Inf blocks and +-0 as A rows; static and
    per-row global amax."""
    if x.shape[1] % 16:
        pytest.skip("K not a multiple of 16")
    R, K = x.shape
    E, N = 2, 16
    w = _packed(E, N, K, seed=3)
    offs = torch.tensor([R // 2, R], dtype=torch.int32)
    dest = torch.arange(R, dtype=torch.int64)
    amax = amax if amax.numel() == 1 else amax.reshape(R)
    ref = _backends_agree_and_capture_the_contract(x, w, offs, dest, device, amax)


def _moe(T=6, H=64, I=32, E=4, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w13, w2 = PackedExperts.empty(E, 2 * I, H), PackedExperts.empty(E, H, I)
    for e in range(E):
        w13.quantize_expert_(e, torch.randn(2 * I, H, generator=g) / H**0.5)
        w2.quantize_expert_(e, torch.randn(H, I, generator=g) / I**0.5)
    # Expert 3 gets no token.
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, k, generator=g), -1)
    return x, weights, ids, w13, w2


@pytest.mark.parametrize("device", DEVICES)
def test_routed_experts_backends_agree_and_capture_the_gemm_inputs(device):
    x, weights, ids, w13, w2 = _moe()
    T, k = ids.shape
    out_t, q1_t, q2_t = routed_experts(x, weights, ids, w13, w2, "silu", capture=True, backend="torch")
    out_k, q1_k, q2_k = routed_experts(
        x.to(device), weights.to(device), ids.to(device), _to(w13, device), _to(w2, device), "silu",
        capture=True, backend="triton",
    )
    _same(out_t, out_k)
    for a, b in ((q1_t, q1_k), (q2_t, q2_k)):
        assert torch.equal(a.codes, b.codes.cpu()) and torch.equal(a.scales, b.scales.cpu())
        _same(a.global_amax, b.global_amax)
    # Captures: the contract's quantization of the token rows and of the unscaled activation.
    q_x = tk.quantize(x, tk.row_amax(x))
    assert torch.equal(q1_t.codes, q_x.codes) and torch.equal(q1_t.scales, q_x.scales)
    # Reference computation per (token, slot) with dequantized operands: close (fp32 sum order).
    ref = torch.zeros(T, x.shape[1])
    xq = q_x.dequantize()
    I = w2.shape[2]
    for t in range(T):
        for s in range(k):
            e = int(ids[t, s])
            gu = (xq[t : t + 1] @ w13.dequantize(e).T).to(torch.bfloat16).float()
            h = (F.silu(gu[:, :I]) * gu[:, I:]).to(torch.bfloat16)
            q_h = tk.quantize(h, tk.row_amax(h))
            assert tk.codewords(q2_t[t, s : s + 1]).equal(tk.codewords(q_h)), (t, s)
            ref[t] += (q_h.dequantize() @ w2.dequantize(e).T)[0] * weights[t, s]
    torch.testing.assert_close(out_t.float(), ref, rtol=2e-2, atol=2e-2)


def test_static_amax_and_no_capture():
    x, weights, ids, w13, w2 = _moe(seed=2)
    static = torch.tensor([4.0])
    config = tk.TraceConfig(activation_scale="static", static_activation_amax={"0.moe_fc1_in": 4.0, "0.moe_fc2_in": 4.0})
    saturated = tk.SaturationCounter()

    def amax(site, rows):
        return tk.site_amax(config, 0, site, rows, saturated=saturated)

    out, q1, q2 = routed_experts(x, weights, ids, w13, w2, "silu", capture=True, amax=amax)
    assert bool((q1.global_amax == 4.0).all()) and bool((q2.global_amax == 4.0).all())
    q_x = tk.quantize(x, static)
    assert torch.equal(q1.codes, q_x.codes)
    # values of x above the static amax were counted (fc1); fc2's count is over the activation rows
    assert saturated.counts()["0.moe_fc1_in"] == int((x.abs() > 4.0).sum())
    out2, n1, n2 = routed_experts(x, weights, ids, w13, w2, "silu", capture=False, amax=amax)
    assert n1 is None and n2 is None and torch.equal(out, out2)


def test_emulated_path_is_close_to_the_packed_gemm():
    """The ablation path (per-expert dequantize + float32 GEMM) computes the same function."""
    x, weights, ids, w13, w2 = _moe(seed=4)
    out, _, _ = routed_experts(x, weights, ids, w13, w2, "silu")
    emu, _, _ = routed_experts_emulated(x, weights, ids, w13, w2, "silu", lambda t, s: tk.quantize_dequantize(t.float()))
    torch.testing.assert_close(out.float(), emu.float(), rtol=2e-2, atol=2e-2)


def test_bad_inputs_are_named():
    x, weights, ids, w13, w2 = _moe()
    offs = torch.tensor([2, 4, 6, 12], dtype=torch.int32)
    with pytest.raises(ValueError, match="K=32"):
        grouped_mm(x[:, :32], w13, offs)
    with pytest.raises(ValueError, match="offs must be int32"):
        grouped_mm(x, w13, offs.long())
    with pytest.raises(ValueError, match="backend"):
        grouped_mm(x, w13, offs, backend="cuda")
    with pytest.raises(ValueError, match="shape"):
        w13.quantize_expert_(0, torch.zeros(3, 64))


@pytest.mark.parametrize("device", DEVICES)
def test_nonfinite_rows_poison_only_their_blocks(device):
    """NaN / Inf in A, a non-finite or zero row amax: NaN scale bytes in the capture (as the contract),
    NaN outputs in those rows only, identical in both backends."""
    R, K, E, N = 6, 64, 2, 16
    g = torch.Generator().manual_seed(5)
    x = torch.randn(R, K, generator=g)
    x[0, 3] = float("nan")
    x[1, 20] = float("inf")
    x[3] = 0.0
    x[4, :16] = -0.0
    amax = x.abs().amax(-1)
    amax[5] = float("inf")
    w = _packed(E, N, K, seed=6)
    offs = torch.tensor([3, R], dtype=torch.int32)
    dest = torch.arange(R, dtype=torch.int64)
    ref = _backends_agree_and_capture_the_contract(x, w, offs, dest, device, amax)
    bad = ref[0].isnan().any(-1)
    assert bad.tolist() == [True, True, False, False, False, True]


def test_lean_cpu_quantizer_is_the_contract():
    """The torch backend's quantizer (fewer ops) == trace_kernels.reference.quantize."""
    from trace_kernels import reference as contract
    from trace_kernels.grouped_mm.reference import quantize_rows

    g = torch.Generator().manual_seed(8)
    for i in range(8):
        x = torch.randn(32, 128, generator=g) * torch.logspace(-8, 8, 32)[:, None]
        amax = x.abs().amax(-1) * (1 + (i % 3) * torch.rand(32, generator=g))
        for xx in (x, x.to(torch.bfloat16)):
            assert all(torch.equal(u, v) for u, v in zip(contract.quantize(xx.float(), amax), quantize_rows(xx, amax)))
    for name, x, amax in cases():
        a = amax.expand(x.shape[0]).contiguous() if amax.numel() == 1 else amax.reshape(-1)
        assert all(torch.equal(u, v) for u, v in zip(contract.quantize(x.float(), a), quantize_rows(x, a))), name


# ---- gpt-oss: expert biases in the epilogue, the clamped SwiGLU ----------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_bias_is_one_fp32_add_after_the_scaled_dot(device):
    """With a per-expert bias, both backends give exactly (the bias-free GEMM) + bias[expert] in fp32,
    bit for bit (the Triton add is not contracted into an FMA), and the capture is unchanged."""
    E, N, K, Ra = 3, 48, 64, 7
    w = _packed(E, N, K, seed=11)
    g = torch.Generator().manual_seed(12)
    a = torch.randn(Ra, K, generator=g).to(torch.bfloat16)
    bias = torch.randn(E, N, generator=g) * 3
    counts = [4, 0, 5]
    rows = torch.randint(0, Ra, (sum(counts),), generator=g)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    e_of = torch.repeat_interleave(torch.arange(E), torch.tensor(counts))
    plain = grouped_mm(a, w, offs, a_rows=rows, backend="torch")
    for backend in ("torch", "triton"):
        out = grouped_mm(a.to(device), _to(w, device), offs.to(device), a_rows=rows.to(device), bias=bias.to(device), backend=backend)
        _same(out, plain + bias[e_of])
    with pytest.raises(ValueError, match=r"bias must be float32 \[3, 48\]"):
        grouped_mm(a, w, offs, a_rows=rows, bias=bias.to(torch.bfloat16))


def _gpt_oss_moe(T=5, H=64, I=32, E=4, k=2, seed=0):
    x, weights, ids, w13, w2 = _moe(T, H, I, E, k, seed)
    g = torch.Generator().manual_seed(seed + 100)
    # Large enough that the clamp at +-7 bites on some gate/up values.
    b13 = (torch.randn(E, 2 * I, generator=g) * 4).to(torch.bfloat16)
    b2 = torch.randn(E, H, generator=g).to(torch.bfloat16)
    return x * 8, weights, ids, w13, w2, b13, b2


@pytest.mark.parametrize("device", DEVICES)
def test_swigluoai_with_biases_backends_agree_and_capture_the_activation(device):
    """gpt-oss experts: Triton == torch bit for bit; moe_fc2_in is the contract's quantization of
    swigluoai(gate/up + fc1 bias) (after the clamp), and the output adds the fc2 bias before the
    routing weight: rebuilt here from bias-free GEMMs, exactly."""
    from trace_kernels.routed_experts import SWIGLUOAI_LIMIT, swigluoai

    x, weights, ids, w13, w2, b13, b2 = _gpt_oss_moe()
    T, k = ids.shape
    E, H, I = w2.shape
    out_t, q1_t, q2_t = routed_experts(x, weights, ids, w13, w2, "swigluoai", capture=True, backend="torch", w13_bias=b13, w2_bias=b2)
    out_k, q1_k, q2_k = routed_experts(
        x.to(device), weights.to(device), ids.to(device), _to(w13, device), _to(w2, device), "swigluoai",
        capture=True, backend="triton", w13_bias=b13.to(device), w2_bias=b2.to(device),
    )
    _same(out_t, out_k)
    for a, b in ((q1_t, q1_k), (q2_t, q2_k)):
        assert torch.equal(a.codes, b.codes.cpu()) and torch.equal(a.scales, b.scales.cpu())
        _same(a.global_amax, b.global_amax)
    ref = torch.zeros(T, H)
    clamped = 0
    for t in range(T):
        for s in range(k):
            e = int(ids[t, s])
            offs = torch.zeros(E, dtype=torch.int32)
            offs[e:] = 1
            gu = grouped_mm(x[t : t + 1], w13, offs, backend="torch") + b13[e].float()
            gu = gu.to(torch.bfloat16).float()
            clamped += int((gu[:, :I] > SWIGLUOAI_LIMIT).sum() + (gu[:, I:].abs() > SWIGLUOAI_LIMIT).sum())
            h = swigluoai(gu[:, :I], gu[:, I:]).to(torch.bfloat16)
            q_h = tk.quantize(h, tk.row_amax(h))
            assert tk.codewords(q2_t[t, s : s + 1]).equal(tk.codewords(q_h)), (t, s)
            down = grouped_mm(h, w2, offs, backend="torch") + b2[e].float()
            ref[t] += down[0] * weights[t, s].float()
    assert clamped > 0, "the test data must reach the clamp"
    _same(out_t, ref.to(torch.bfloat16))
    # Without the biases the result differs (they are not silently dropped).
    out_nb, _, _ = routed_experts(x, weights, ids, w13, w2, "swigluoai", backend="torch")
    assert not torch.equal(out_nb, out_t)


def test_quantized_mm_is_the_grouped_gemm_on_given_codes():
    """`quantized_mm` (the trainer's expert GEMM) on the codes grouped_mm quantizes is grouped_mm's
    output bit for bit (fp32, batched decode of all experts in grouped_mm vs one expert here); on
    codes that are not A's own round-to-nearest (a guide's) it multiplies those codes, not A's."""
    from trace_kernels.grouped_mm import quantized_mm

    E, N, K = 3, 24, 64
    w = _packed(E, N, K, seed=4)
    g = torch.Generator().manual_seed(5)
    a = (torch.randn(20, K, generator=g) * torch.logspace(-2, 1, K // 16).repeat_interleave(16)).to(torch.bfloat16)
    counts = [7, 5, 8]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    out = grouped_mm(a, w, offs, backend="torch")
    q = tk.quantize(a, tk.row_amax(a))
    start = 0
    for e, n in enumerate(counts):
        w_e = tk.NVFP4Tensor(w.codes[e], w.scales[e], w.amax[e])
        _same(quantized_mm(q[start : start + n], w_e), out[start : start + n])
        start += n
    # other codes (one mantissa bit flipped per row): the product follows them
    flipped = tk.NVFP4Tensor(q.codes ^ torch.where(torch.arange(K // 2) == 3, 1, 0).to(torch.uint8), q.scales, q.global_amax)
    w0 = tk.NVFP4Tensor(w.codes[0], w.scales[0], w.amax[0])
    moved = quantized_mm(flipped[:7], w0)
    torch.testing.assert_close(moved, flipped[:7].dequantize() @ w.dequantize(0).T, rtol=1e-5, atol=1e-4)
    assert not torch.equal(moved, out[:7])
    with pytest.raises(ValueError, match="one global amax"):
        quantized_mm(q[:2], tk.NVFP4Tensor(w.codes[0][:2], w.scales[0][:2], torch.ones(2)))

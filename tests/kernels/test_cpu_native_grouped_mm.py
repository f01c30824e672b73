"""The native CPU grouped GEMM (trace_kernels.cpu_native.grouped_mm, numba) gives the torch backend's bits:
output, captured A codes and scales; on adversarial A rows (ties, zero / subnormal / saturated scales,
signed zeros, NaN / Inf blocks, NaN / Inf / zero amaxes), ragged experts with empty ones and gathered
rows, biases, weights with NaN block scales, the tiny model's shapes, and through routed_experts."""

import pytest
import torch

from adversarial import cases, ragged_expert_rows
from trace_kernels import cpu_native
from trace_kernels.grouped_mm import PackedExperts, grouped_mm
from trace_kernels.routed_experts import routed_experts


def _same(a, b):
    """Bit for bit: floats as integers (a -0.0 / +0.0 or NaN payload difference shows)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.is_floating_point():
        a, b = a.view(torch.int32), b.view(torch.int32)
    assert torch.equal(a, b)


def _packed(E, N, K, seed=0, nan_scale=False):
    g = torch.Generator().manual_seed(seed)
    w = PackedExperts.empty(E, N, K)
    for e in range(E):
        # Blocks of very different magnitude along K, so the K order matters.
        scale = torch.logspace(-3, 2, K // 16).repeat_interleave(16)
        w.quantize_expert_(e, torch.randn(N, K, generator=g) * scale * (e + 1))
    if nan_scale:
        w.scales[0, 1, 0] = 0x7F  # a poisoned weight block: its outputs are NaN in every backend
    return w


def _both(a, w, offs, rows=None, amax=None, dest=None, bias=None):
    """(torch, native) results: (out, captured codes, captured scales); no torch fallback counted."""
    Ra, K = a.shape
    res = []
    before = cpu_native.fallbacks()
    for backend in ("torch", "native"):
        cap = None
        if dest is not None:
            cap = (dest, torch.zeros((Ra, K // 2), dtype=torch.uint8), torch.zeros((Ra, K // 16), dtype=torch.uint8))
        out = grouped_mm(a, w, offs, a_rows=rows, a_amax=amax, capture=cap, bias=bias, backend=backend)
        res.append((out,) + (cap[1:] if cap else ()))
    assert cpu_native.fallbacks() == before
    for x, y in zip(*res):
        _same(x, y)
    return res[0]


@pytest.mark.parametrize("name,x,amax", cases(), ids=[c[0] for c in cases()])
def test_adversarial_rows(name, x, amax):
    R, K = x.shape
    w = _packed(2, 16, K, seed=3)
    offs = torch.tensor([R // 2, R], dtype=torch.int32)
    amax = amax if amax.numel() == 1 else amax.reshape(R)
    _both(x, w, offs, amax=amax, dest=torch.arange(R, dtype=torch.int64))


def test_nan_inf_blocks_nan_amaxes_and_a_poisoned_weight_block():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(7, 64, generator=g) * 3
    x[0, 5], x[1, 20], x[2, 40] = float("nan"), float("inf"), -float("inf")
    amax = x.abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).amax(-1)
    amax[3], amax[4], amax[5] = float("nan"), float("inf"), 0.0
    w = _packed(3, 24, 64, seed=4, nan_scale=True)
    offs = torch.tensor([2, 2, 7], dtype=torch.int32)
    out, _, _ = _both(x, w, offs, amax=amax, dest=torch.arange(7, dtype=torch.int64))
    assert torch.isnan(out[0]).all() and torch.isnan(out[3]).all() and not torch.isnan(out[6, 1:]).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ragged_experts_gathered_rows_capture_and_bias(dtype):
    """Experts 1 and 4 get no rows; rows gathered with repeats; only each source row's first use captured."""
    E, N, K, Ra = 5, 40, 96, 9
    w = _packed(E, N, K)
    counts = [3, 0, 70, 2, 0]
    a, rows, offs, dest, g = ragged_expert_rows(counts, Ra, K, dtype)
    bias = torch.randn(E, N, generator=g)
    _both(a, w, offs, rows=rows, dest=dest)
    _both(a, w, offs, rows=rows, bias=bias)
    _both(a, w, offs, rows=rows, amax=torch.tensor([3.0]))  # one static amax
    _both(a[:0], w, torch.zeros(E, dtype=torch.int32), rows=rows[:0], dest=dest[:0])  # no rows at all


def test_tiny_model_moe_through_routed_experts():
    """The tiny model's MoE layer (H 64, I 32, 8 experts, top 2) at prefill and decode batch sizes, with capture."""
    H, I, E, k = 64, 32, 8, 2
    g = torch.Generator().manual_seed(0)
    w13, w2 = PackedExperts.empty(E, 2 * I, H), PackedExperts.empty(E, H, I)
    for e in range(E):
        w13.quantize_expert_(e, torch.randn(2 * I, H, generator=g) / H**0.5)
        w2.quantize_expert_(e, torch.randn(H, I, generator=g) / I**0.5)
    for T in (1, 16, 203):
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        weights = torch.softmax(torch.randn(T, k, generator=g), -1)
        res = [routed_experts(x, weights, ids, w13, w2, "silu", capture=True, backend=b) for b in ("torch", "native")]
        for (o0, p0, q0), (o1, p1, q1) in zip(res[:1], res[1:]):
            _same(o0, o1)
            for t0, t1 in ((p0, p1), (q0, q1)):
                _same(t0.codes, t1.codes), _same(t0.scales, t1.scales), _same(t0.global_amax, t1.global_amax)


def test_four_over_six_runs_torch_counted():
    K = 64
    g = torch.Generator().manual_seed(2)
    w = PackedExperts.empty(2, 16, K, block_scale="4over6")
    for e in range(2):
        w.quantize_expert_(e, torch.randn(16, K, generator=g))
    a = torch.randn(4, K, generator=g)
    offs = torch.tensor([1, 4], dtype=torch.int32)
    n = cpu_native.fallbacks().get("eager:grouped_mm_4over6", 0)
    _same(grouped_mm(a, w, offs, backend="native"), grouped_mm(a, w, offs, backend="torch"))
    assert cpu_native.fallbacks()["eager:grouped_mm_4over6"] == n + 1

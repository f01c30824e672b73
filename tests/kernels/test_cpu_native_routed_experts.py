"""The native routed experts (trace_kernels.cpu_native.routed_experts: sort, fc1, silu, fc2, unsort and
the weighted sum in two numba calls) give torch routed_experts' bits: output, both captures (codes,
scales, amaxes); on the tiny model's shapes, ragged / empty experts, k from 1 to 16, rows of I with a
scalar tail in torch's silu loop, biases, -0 products, a static amax, NaN rows (torch's activation,
counted) and the activations / dtypes that stay torch (counted)."""

import pytest
import torch
import torch.nn.functional as F

from trace_kernels import cpu_native
from trace_kernels.cpu_native.quantize import CALLS
from trace_kernels.cpu_native.routed_experts import silu_tables
from trace_kernels.routed_experts import routed_experts

from packed_experts import random_packed_experts as _weights


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.is_floating_point():
        a, b = (a.view(torch.int16), b.view(torch.int16)) if a.element_size() == 2 else (a.view(torch.int32), b.view(torch.int32))
    assert torch.equal(a, b)


def _both(x, weights, ids, w13, w2, activation="silu", eager=(), **kw):
    """Runs torch and native; asserts equal bits and exactly the `eager` fallbacks counted."""
    res = [routed_experts(x, weights, ids, w13, w2, activation, capture=True, backend="torch", **kw)]
    before, calls = cpu_native.fallbacks(), CALLS["routed_experts"]
    res.append(routed_experts(x, weights, ids, w13, w2, activation, capture=True, backend="native", **kw))
    assert CALLS["routed_experts"] == calls + 1
    after = cpu_native.fallbacks()
    assert {p for p in after if after[p] != before.get(p, 0)} == {f"eager:{p}" for p in eager}
    (o0, p0, q0), (o1, p1, q1) = res
    _same(o0, o1)
    for t0, t1 in ((p0, p1), (q0, q1)):
        _same(t0.codes, t1.codes), _same(t0.scales, t1.scales), _same(t0.global_amax, t1.global_amax)
    return o1


@pytest.mark.parametrize("T", [1, 16, 203])
def test_tiny_model_shapes(T):
    H, I, E, k = 64, 32, 8, 2
    w13, w2 = _weights(E, H, I, 0)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    _both(x, torch.softmax(torch.randn(T, k, generator=g), -1), ids, w13, w2)


@pytest.mark.parametrize("k", [1, 3, 8, 16])
def test_ragged_experts_slots_and_a_silu_scalar_tail(k):
    """I = 48: torch's silu runs the last values of each row in its scalar loop (the other table);
    experts 1 and 3 get no rows; repeated experts within a token; weights of both signs and zeros."""
    H, I, E, T = 128, 48, 5, 37
    w13, w2 = _weights(E, H, I, k)
    g = torch.Generator().manual_seed(100 + k)
    x = (torch.randn(T, H, generator=g) * torch.logspace(-3, 2, H // 16).repeat_interleave(16)).to(torch.bfloat16)
    ids = torch.tensor([0, 2, 4])[torch.randint(0, 3, (T, k), generator=g)]
    wts = torch.randn(T, k, generator=g)
    wts[::5, 0] = 0.0  # -0 products: torch's sum starts from +0
    wts[1] = -0.0
    _both(x, wts, ids, w13, w2)


def test_bias_static_amax_and_weighted_sum_fallback():
    H, I, E, k, T = 64, 32, 4, 2, 9
    w13, w2 = _weights(E, H, I, 5)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, E, (T, k), generator=g)
    wts = torch.rand(T, k, generator=g)
    b13, b2 = torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g)
    _both(x, wts, ids, w13, w2, w13_bias=b13, w2_bias=b2)
    static = lambda site, rows: torch.full(rows.shape[:-1], 0.5)  # noqa: E731 (saturating static amax)
    _both(x, wts, ids, w13, w2, amax=static)
    w13, w2 = _weights(E, 48, I, 7)  # H % 64 != 0: torch's sum (counted)
    _both(torch.randn(T, 48, generator=g).to(torch.bfloat16), wts, ids, w13, w2, eager=["routed_experts_weighted_sum"])
    _both(x[:0], wts[:0], ids[:0], *_weights(E, H, I, 5))  # no tokens


def test_nan_rows_and_other_activations_run_torch_counted():
    H, I, E, k, T = 64, 32, 4, 2, 6
    w13, w2 = _weights(E, H, I, 8)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, E, (T, k), generator=g)
    wts = torch.rand(T, k, generator=g)
    xn = x.clone()
    xn[2, 3] = float("nan")
    out = _both(xn, wts, ids, w13, w2, eager=["routed_experts_nan"])
    assert torch.isnan(out[2]).all()
    for act in ("gelu", "gelu_tanh", "swigluoai"):
        _both(x, wts, ids, w13, w2, act, eager=[f"moe_activation_{act}_bfloat16"])
    _both(x.float(), wts, ids, w13, w2, eager=["moe_activation_silu_float32"])


def test_silu_tables_are_torchs_loops():
    """The two tables are torch's silu per position: the vector step W splits a row as torch does."""
    vec, scalar, W = silu_tables()
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 65536, (50, 2 * 37), generator=g)
    got = F.silu(x[idx][:, :37])  # a [50, 37] slice of a [50, 74] tensor, as routed_experts' gate
    n_vec = 37 - 37 % W if W else 37
    want = torch.cat((torch.from_numpy(vec)[idx[:, :n_vec]], torch.from_numpy(scalar)[idx[:, n_vec:37]]), 1)
    _same(got, want)


def test_expert_id_out_of_range_is_an_error():
    w13, w2 = _weights(2, 64, 32, 0)
    with pytest.raises(ValueError, match="expert id 2"):
        routed_experts(torch.randn(3, 64), torch.ones(3, 1), torch.tensor([[0], [2], [1]]), w13, w2, "silu", backend="native")


def _engine_only(monkeypatch):
    """Makes the two-call path an error: the call under test must be moe_kernel's."""
    from trace_kernels.cpu_native import routed_experts as native

    def refuse(*a, **k):
        raise AssertionError("the engine's case ran the two-call path")

    monkeypatch.setattr(native, "_general", refuse)


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_engine_case_is_one_kernel_call_with_torchs_bits(monkeypatch, ids_dtype):
    """silu on bf16, per-row amax, no bias: moe_kernel alone (ids as they come, int32 as vLLM's router
    gives them), with and without capture, and the output's bf16 rounding at the extremes of the range
    (subnormal and overflowing float32 sums: torch's cast is round to nearest even there too)."""
    _engine_only(monkeypatch)
    H, I, E, k, T = 64, 32, 8, 2, 16
    g = torch.Generator().manual_seed(11)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(ids_dtype)
    wts = torch.softmax(torch.randn(T, k, generator=g), -1)
    for seed, scale, w_scale in ((0, 1.0, 1.0), (1, 1.0, 1e-39), (2, 3e36, 1.0)):
        w13, w2 = _weights(E, H, I, seed)
        x = (torch.randn(T, H, generator=g) * scale).to(torch.bfloat16)
        out = _both(x, wts * w_scale, ids, w13, w2)
        ref = routed_experts(x, wts * w_scale, ids, w13, w2, "silu", backend="torch")[0]
        _same(routed_experts(x, wts * w_scale, ids, w13, w2, "silu", backend="native")[0], ref)  # capture off
        o = out.float().abs()
        if w_scale < 1:  # float32 and bf16 subnormal outputs (routing weights ~1e-39) are rounded here
            assert ((o > 0) & (o < 2.0**-126)).any()
        if scale > 1:  # silu's inf reaches fc2 as a NaN block: NaN outputs, whose bits torch's cast decides
            assert torch.isnan(o).any()


def test_engine_case_reads_the_weights_as_they_are_now(monkeypatch):
    """The weights' numpy views are kept on the PackedExperts: an update in place is seen, and a tensor
    given new storage gets new views."""
    _engine_only(monkeypatch)
    H, I, E, k, T = 64, 32, 4, 2, 8
    w13, w2 = _weights(E, H, I, 3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, E, (T, k), generator=g)
    wts = torch.rand(T, k, generator=g)
    first = _both(x, wts, ids, w13, w2)
    for e in range(E):  # an RL weight sync: requantized in place
        w13.quantize_expert_(e, torch.randn(2 * I, H, generator=g))
    second = _both(x, wts, ids, w13, w2)
    assert not torch.equal(first, second)
    w2.codes.data = w2.codes.data.clone()  # new storage behind the same tensor object
    w2.codes.zero_()
    _both(x, wts, ids, w13, w2)


def test_engine_case_nan_output_and_bad_ids(monkeypatch):
    """A NaN block scale in w2 makes NaN outputs: their bf16 bits are torch's cast of the float32 output.
    An expert id out of range is the two-call path's error."""
    H, I, E, k, T = 64, 32, 4, 2, 8
    w13, w2 = _weights(E, H, I, 5)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, E, (T, k), generator=g)
    wts = torch.rand(T, k, generator=g)
    w2.scales[int(ids[0, 0]), 5, 1] = 0x7F
    with monkeypatch.context() as m:
        _engine_only(m)
        out = _both(x, wts, ids, w13, w2)
    assert torch.isnan(out[0, 5])
    with pytest.raises(ValueError, match=f"expert id {E}"):
        routed_experts(x, wts, torch.full((T, k), E), w13, w2, "silu", backend="native")


@pytest.mark.parametrize("seed", range(6))
def test_engine_case_on_random_bf16_bit_patterns(monkeypatch, seed):
    """moe_kernel takes the row amaxes and the quantizes of both sites from the bf16 bits (x's, and the
    activation's): torch's bits on x drawn as random bf16 bit patterns (both signs, subnormals, +-0, zero
    rows, magnitudes from 2^-133 to 2^20), with and without capture."""
    _engine_only(monkeypatch)
    H, I, E, k, T = 64, 32, 8, 2, 24
    w13, w2 = _weights(E, H, I, 20 + seed)
    g = torch.Generator().manual_seed(100 + seed)
    sign = torch.randint(0, 2, (T, H), generator=g) << 15
    exp = torch.randint(0, 148, (T, H), generator=g)
    exp = torch.where(torch.rand(T, H, generator=g) < 0.2, torch.zeros_like(exp), exp)  # subnormals and zeros
    bits = sign | (exp << 7) | torch.randint(0, 128, (T, H), generator=g)
    bits[3] = 0
    bits[5] = 1 << 15  # a row of -0
    x = bits.to(torch.int16).view(torch.bfloat16)
    assert torch.isfinite(x.float()).all()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    wts = torch.softmax(torch.randn(T, k, generator=g), -1)
    _both(x, wts, ids, w13, w2)
    ref = routed_experts(x, wts, ids, w13, w2, "silu", backend="torch")[0]
    _same(routed_experts(x, wts, ids, w13, w2, "silu", backend="native")[0], ref)  # capture off

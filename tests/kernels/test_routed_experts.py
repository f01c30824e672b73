"""The emulated routed-expert loop of the ablation modes (trace_kernels.routed_experts_emulated);
the FP4 path (routed_experts on packed weights) is tested in test_grouped_mm.py."""

import pytest
import torch
import torch.nn.functional as F

import trace_kernels
from trace_kernels.routed_experts import activation_fn, routed_experts_emulated as routed_experts

T, H, I, E, K = 5, 32, 16, 4, 2


def per_token(x, site):
    return trace_kernels.quantize_dequantize(x)


def _moe_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, K, generator=g), -1)
    return x, w13, w2, ids, weights


def _gemm(a, w):
    return F.linear(a.float(), w.float())


def test_down_input_is_quantized_before_the_routing_weight():
    x, w13, w2, ids, weights = _moe_inputs()
    out, q1, q2 = routed_experts(x, weights, ids, w13, w2, "silu", per_token)
    xq, q_x = trace_kernels.quantize_dequantize(x)
    assert torch.equal(q1.codes, q_x.codes) and torch.equal(q1.scales, q_x.scales)
    ref = torch.zeros(T, H)
    for t in range(T):
        for s in range(K):
            e = int(ids[t, s])
            gu = _gemm(xq[t : t + 1], w13[e]).to(torch.bfloat16).float()
            h = (F.silu(gu[:, :I]) * gu[:, I:]).to(torch.bfloat16)
            hq, q_h = trace_kernels.quantize_dequantize(h)  # unscaled by weights[t, s]
            assert torch.equal(q2.codes[t, s : s + 1], q_h.codes), (t, s)
            ref[t] += _gemm(hq, w2[e]).float()[0] * weights[t, s]
    assert torch.equal(out, ref.to(torch.bfloat16))


def test_without_quantization_it_is_the_plain_moe():
    x, w13, w2, ids, weights = _moe_inputs(1)
    out, q1, q2 = routed_experts(x, weights, ids, w13, w2, "silu", None)
    assert q1 is None and q2 is None
    ref = torch.zeros(T, H)
    for t in range(T):
        for s in range(K):
            e = int(ids[t, s])
            gu = _gemm(x[t : t + 1], w13[e]).to(torch.bfloat16).float()
            h = (F.silu(gu[:, :I]) * gu[:, I:]).to(torch.bfloat16)
            ref[t] += _gemm(h, w2[e]).float()[0] * weights[t, s]
    assert torch.equal(out, ref.to(torch.bfloat16))


def test_unsupported_activation_is_named():
    with pytest.raises(NotImplementedError, match="'relu2' is not supported"):
        activation_fn("relu2")


def test_static_activation_amax_from_the_config():
    cfg = trace_kernels.TraceConfig(activation_scale="static", static_activation_amax={"3.k": 2.5})
    assert cfg.activation_amax(3, "k").tolist() == [2.5]
    assert trace_kernels.TraceConfig().activation_amax(3, "k") is None
    with pytest.raises(KeyError, match="no entry '3.v'"):
        cfg.activation_amax(3, "v")


def test_swigluoai_experts_with_biases_are_hf_gpt_oss_experts():
    """Unquantized, in fp32: routed_experts_emulated with de-interleaved weights and biases computes
    transformers' own GptOssExperts (interleaved gate_up_proj, clamped SwiGLU, fc2 bias before the
    routing weight) up to fp32 summation order."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from trace_kernels.routed_experts import deinterleave_gate_up

    cfg = GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K)
    cfg._experts_implementation = "eager"
    hf = GptOssExperts(cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        hf.gate_up_proj.copy_(torch.randn(E, H, 2 * I, generator=g) / H**0.5 * 6)
        hf.gate_up_proj_bias.copy_(torch.randn(E, 2 * I, generator=g) * 3)
        hf.down_proj.copy_(torch.randn(E, I, H, generator=g) / I**0.5)
        hf.down_proj_bias.copy_(torch.randn(E, H, generator=g))
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, K, generator=g), -1)
    with torch.no_grad():
        expect = hf(x, ids, weights)
        w13 = deinterleave_gate_up(hf.gate_up_proj, -1).transpose(1, 2)  # [E, 2I, H], [gate; up]
        b13 = deinterleave_gate_up(hf.gate_up_proj_bias, -1)
        out, _, _ = routed_experts(x, weights, ids, w13, hf.down_proj.transpose(1, 2), "swigluoai", None,
                                   w13_bias=b13, w2_bias=hf.down_proj_bias)
        # the clamp is reached by these weights (else the test would not see a wrong clamp)
        gu = torch.einsum("th,ehn->ten", x, hf.gate_up_proj) + hf.gate_up_proj_bias
        assert bool((gu.abs() > 7).any())
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)

"""The trace spec builds a Megatron-Core GPTModel that trains on the FP4 path (real Megatron-Core, CPU)."""

import pytest
import torch

pytest.importorskip("megatron.core")
import megatron_cpu as mc  # noqa: E402

mc.init_parallel()

import trace_megatron  # noqa: E402
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from trace_kernels import TraceConfig  # noqa: E402
from trace_megatron.attention import TraceDotProductAttention  # noqa: E402
from trace_megatron.linears import TraceExpertColumnParallelLinear, TraceExpertRowParallelLinear  # noqa: E402

NO_FP4 = TraceConfig(quantize_expert_weights=False, quantize_expert_inputs=False, quantize_kv=False)


def test_spec_swaps_only_routed_experts_and_core_attention():
    cfg = mc.tiny_config(moe_shared_expert_intermediate_size=32, moe_layer_freq=[1, 0])
    model = mc.tiny_model(cfg)
    moe, dense = model.decoder.layers
    for layer in (moe, dense):
        assert isinstance(layer.self_attention.core_attention, TraceDotProductAttention)
        assert type(layer.self_attention.linear_qkv) is ColumnParallelLinear
        assert type(layer.self_attention.linear_proj) is RowParallelLinear
    expert = moe.mlp.experts.local_experts[0]
    assert isinstance(expert.linear_fc1, TraceExpertColumnParallelLinear)
    assert isinstance(expert.linear_fc2, TraceExpertRowParallelLinear)
    assert type(moe.mlp.shared_experts.linear_fc1) is ColumnParallelLinear  # shared experts stay BF16
    assert type(dense.mlp.linear_fc1) is ColumnParallelLinear  # dense MLP stays BF16


def test_layer_spec_function_matches_block_spec():
    spec = trace_megatron.get_gpt_layer_with_trace_spec(num_experts=4, qk_layernorm=True, normalization="RMSNorm")
    attn = spec.submodules.self_attention.submodules.core_attention
    assert attn.func is TraceDotProductAttention
    dense = trace_megatron.get_gpt_layer_with_trace_spec(num_experts=None)
    assert dense.submodules.self_attention.submodules.core_attention.func is TraceDotProductAttention


def test_without_quantization_it_is_megatrons_model():
    """Probability applied after linear_fc2 instead of before: the same function (fc2 is linear)."""
    cfg = mc.tiny_config()
    ref = mc.tiny_model(cfg, trace=False, seed=3)
    ours = mc.tiny_model(cfg, trace_config=NO_FP4, seed=3)
    ours.load_state_dict(ref.state_dict())
    ids, pos, mask = mc.padded_batch([16, 16], 16)
    torch.testing.assert_close(ours(ids, pos, mask), ref(ids, pos, mask), rtol=1e-5, atol=1e-5)


def test_fp4_forward_backward_reaches_expert_weights():
    cfg = mc.tiny_config()
    model = mc.tiny_model(cfg, seed=1)
    ref = mc.tiny_model(cfg, trace_config=NO_FP4, seed=1)
    ids, pos, mask = mc.padded_batch([16, 12], 16)
    out = model(ids, pos, mask)
    assert not torch.allclose(out, ref(ids, pos, mask))  # FP4 changes the numbers
    out.float().pow(2).mean().backward()
    for layer in model.decoder.layers:
        for expert in layer.mlp.experts.local_experts:
            for lin in (expert.linear_fc1, expert.linear_fc2):
                assert lin.weight.grad is not None and torch.isfinite(lin.weight.grad).all()
        grads = [e.linear_fc1.weight.grad.abs().sum() for e in layer.mlp.experts.local_experts]
        assert sum(float(g) for g in grads) > 0


def test_straight_through_gradient_is_the_gradient_at_the_quantized_point():
    """d loss / d W through the fake-quantized expert equals the gradient of the same GEMM evaluated at
    the dequantized weight (straight-through: the rounding passes the gradient unchanged)."""
    cfg = mc.tiny_config(num_layers=1)
    model = mc.tiny_model(cfg, trace_config=TraceConfig(quantize_kv=False, quantize_expert_inputs=False), seed=2)
    lin = model.decoder.layers[0].mlp.experts.local_experts[0].linear_fc1
    x = torch.randn(5, cfg.hidden_size)
    out, _ = lin(x)
    out.sum().backward()
    expected = torch.ones(5, out.shape[-1]).t() @ x  # d sum(x W^T) / dW
    torch.testing.assert_close(lin.weight.grad, expected)


def test_expert_gemm_is_the_engines_and_its_gradient_is_straight_through():
    """With inputs and weights quantized, an expert linear returns the engine's exact FP4 GEMM of the
    codes (trace_kernels.grouped_mm.quantized_mm, fp32), not a BF16 GEMM of dequantized operands, and
    backpropagates the gradient of x_fq @ W_fq^T at the quantized point (input and weight)."""
    import trace_kernels as tk
    from trace_kernels.grouped_mm import quantized_mm

    cfg = mc.tiny_config(num_layers=1, params_dtype=torch.bfloat16, bf16=True)
    model = mc.tiny_model(cfg, trace_config=TraceConfig(quantize_kv=False), seed=3)
    lin = model.decoder.layers[0].mlp.experts.local_experts[0].linear_fc1
    x = (torch.randn(6, cfg.hidden_size, generator=torch.Generator().manual_seed(4)) * 3).to(torch.bfloat16).requires_grad_()
    out, _ = lin(x)
    qx = tk.quantize(x.detach(), tk.row_amax(x.detach()))
    qw = tk.quantize(lin.weight.detach(), tk.tensor_amax(lin.weight.detach()))
    assert out.dtype == torch.float32 and torch.equal(out, quantized_mm(qx, qw))
    bf16_gemm = qx.dequantize(torch.bfloat16) @ qw.dequantize(torch.bfloat16).t()
    assert not torch.equal(out, bf16_gemm.float())  # the BF16 GEMM differs in the last bits
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    out.backward(g)
    gb = g.to(torch.bfloat16)
    torch.testing.assert_close(x.grad, gb @ qw.dequantize(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(lin.weight.grad, gb.t() @ qx.dequantize(torch.bfloat16), rtol=0, atol=0)


def test_transformer_engine_requested_but_absent_is_an_error():
    from megatron.core.extensions.transformer_engine import HAVE_TE

    if HAVE_TE:
        pytest.skip("Transformer Engine is installed here")
    with pytest.raises(RuntimeError, match="Transformer Engine is not installed"):
        trace_megatron.get_gpt_layer_with_trace_spec(num_experts=4, use_transformer_engine=True)
    with pytest.raises(RuntimeError, match="Transformer Engine is not installed"):
        trace_megatron.get_gpt_decoder_block_with_trace_spec(mc.tiny_config(), use_transformer_engine=True)


def test_grouped_gemm_request_is_warned_and_counted():
    with pytest.warns(UserWarning, match="moe_grouped_gemm"):
        spec = trace_megatron.get_gpt_layer_with_trace_spec(num_experts=4, moe_grouped_gemm=True)
    assert trace_megatron.spec_fallbacks_of(spec)["grouped_gemm_experts_as_sequential"] == 1
    plain = trace_megatron.get_gpt_layer_with_trace_spec(num_experts=4)
    assert trace_megatron.spec_fallbacks_of(plain)["grouped_gemm_experts_as_sequential"] == 0


def test_routing_replay_must_be_enabled():
    with pytest.raises(ValueError, match="moe_enable_routing_replay"):
        mc.tiny_model(mc.tiny_config(moe_enable_routing_replay=False))


def test_probabilities_on_input_are_refused():
    cfg = mc.tiny_config(moe_router_topk=1, moe_router_pre_softmax=True, moe_apply_probs_on_input=True)
    with pytest.raises(ValueError, match="moe_apply_probs_on_input"):
        mc.tiny_model(cfg)


def test_unsupported_layer_kinds_are_refused():
    # MLA is supported (site kv_latent; tests/archs/test_deepseek_v3_megatron.py).
    from trace_megatron.mla import MLADotProductAttention, TraceMLASelfAttention

    mla = trace_megatron.get_gpt_layer_with_trace_spec(4, False, True, True).submodules.self_attention
    assert mla.module is TraceMLASelfAttention and mla.submodules.core_attention is MLADotProductAttention
    with pytest.raises(ValueError, match="fp8"):
        trace_megatron.get_gpt_layer_with_trace_spec(num_experts=4, fp8="hybrid")
    with pytest.raises(ValueError, match="dispatchers"):
        mc.tiny_model(mc.tiny_config(dispatcher="flex"))


def test_any_core_attention_class_can_be_wrapped():
    """The TE branch wraps TEDotProductAttention with the same K/V mixin; exercise that mechanism on a
    core-attention class other than Megatron's local one."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt import GPTModel
    from trace_megatron.attention import KVQuantMixin

    class OtherAttention(DotProductAttention):
        pass

    base = get_gpt_layer_local_spec(num_experts=4, qk_layernorm=True, normalization="RMSNorm")
    base.submodules.self_attention.submodules.core_attention = OtherAttention
    spec = trace_megatron.to_trace_layer_spec(base, TraceConfig(guidance="full", guided_layers="all"))
    cfg = mc.tiny_config(num_layers=1)
    torch.manual_seed(0)
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=mc.VOCAB, max_sequence_length=mc.MAX_SEQ,
                     position_embedding_type="rope")
    attn = model.decoder.layers[0].self_attention.core_attention
    assert isinstance(attn, KVQuantMixin) and isinstance(attn, OtherAttention)
    assert type(attn).__name__ == "TraceOtherAttention"
    ids, pos, mask = mc.padded_batch([16, 10], 16)
    layout = trace_megatron.TokenLayout.padded([16, 10], 16)
    with torch.no_grad(), trace_megatron.capture(model, layout) as cap:
        model(ids, pos, mask)
    with torch.no_grad(), trace_megatron.guidance(model, cap.build_records(), layout) as batch:
        model(ids, pos, mask)
    m = batch.metrics()
    assert m["trace/all/k/guided_rows"] == 26 and m["trace/all/k/mismatch_guided"] == 0

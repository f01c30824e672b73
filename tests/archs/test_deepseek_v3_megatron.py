"""DeepSeek-V3 in real Megatron-Core on the CPU: MLA on the local spec (with trace_megatron's
MLADotProductAttention, since the local DotProductAttention refuses k_channels / v_channels), dense
first layer, shared expert, sigmoid grouped routing with the correction bias as expert_bias; the HF ->
Megatron converter checked by fp32 logits parity with transformers."""

import json
import warnings

import pytest
import torch

from megatron_cpu import causal_mask, init_parallel

from trace_fp4.archs import deepseek_v3 as ds
from trace_fp4.hf_to_megatron import load_into
from vllm_helpers import MODELS_DIR


@pytest.fixture(scope="module")
def tiny_ds():
    init_parallel()
    path = ds.build_tiny(MODELS_DIR / "deepseek_v3")
    return path, json.loads((path / "config.json").read_text())


def _gpt(cfg, spec, tc):
    from megatron.core.models.gpt import GPTModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GPTModel(
            config=tc, transformer_layer_spec=spec, vocab_size=cfg["vocab_size"], max_sequence_length=512,
            position_embedding_type="none",  # MLA applies its own RoPE to q_pe / k_pe
            share_embeddings_and_output_weights=False,
        )


def _state(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_local_dot_product_attention_refuses_mla_channels():
    """Why MLADotProductAttention exists (re-check when Megatron-Core changes)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    import inspect

    params = inspect.signature(DotProductAttention.__init__).parameters
    assert "k_channels" not in params and "v_channels" not in params


def test_logits_parity_with_transformers_fp32(tiny_ds):
    from transformers import AutoModelForCausalLM

    path, cfg = tiny_ds
    tc = ds.transformer_config(cfg)
    model = _gpt(cfg, ds.megatron_layer_spec(tc), tc)
    assert [type(layer.mlp).__name__ for layer in model.decoder.layers] == ["MLP", "MoELayer", "MoELayer"]
    load_into(model, ds.convert_state_dict(_state(path), cfg))
    model.eval()
    ids = torch.randint(1, cfg["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(12)[None].expand(2, 12)
    with torch.no_grad():
        logits = model(ids, pos, causal_mask(12)).float()
        ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()(ids).logits.float()
    assert ref.abs().max() > 1.0
    assert (logits - ref).abs().max() < 5e-5  # measured 6.1e-6


def _noisy_engine(x):
    """A second engine's numerics: about one BF16 ulp of value-determined relative noise."""
    xf = x.float()
    noise = torch.frac(torch.sin(xf * 12345.678) * 43758.5453) - 0.5
    return (xf * (1 + 2.0**-7 * noise)).to(x.dtype)


def test_kv_latent_guidance_reproduces_a_second_engines_codes(tiny_ds):
    """The trace spec on the converted model: the normalised latent (kv_layernorm output, before the
    up-projection) is the kv_latent site at every layer; routes, expert sites only at the MoE layers;
    full guidance reproduces every code of records made with other numerics."""
    import trace_megatron
    from trace_kernels import TraceConfig

    path, cfg = tiny_ds
    tc = ds.transformer_config(cfg)
    full = TraceConfig(guidance="full", guided_layers="all")
    model = _gpt(cfg, ds.megatron_layer_spec(tc, trace_config=full), tc)
    load_into(model, ds.convert_state_dict(_state(path), cfg))
    model.eval()
    assert trace_megatron.model_shape(tc).describe_layers() == ["dense+mla", "moe+mla", "moe+mla"]
    lengths, seq = [12, 9], 12
    ids = torch.randint(1, cfg["vocab_size"], (2, seq), generator=torch.Generator().manual_seed(1))
    inputs = (ids, torch.arange(seq)[None].expand(2, seq), causal_mask(seq))
    layout = trace_megatron.TokenLayout.padded(lengths, seq)
    with torch.no_grad(), trace_megatron.capture(model, layout, perturb=_noisy_engine) as cap:
        model(*inputs)
    records = cap.build_records()
    assert records[0].site(0, "kv_latent").codes.shape == (12, 1, 256)
    with torch.no_grad(), trace_megatron.guidance(model, records, layout) as batch:
        model(*inputs)
    m = batch.metrics()
    for layer in range(3):
        p = f"trace/layer{layer}/kv_latent"
        assert m[f"{p}/guided_rows"] == sum(lengths) and m[f"{p}/mismatch_guided"] == 0, p
    assert m["trace/all/kv_latent/mismatch_rtn"] > 0  # the noise made round-to-nearest disagree
    assert not any(k.startswith("trace/layer0/moe") for k in m)
    assert all(m[f"trace/layer{i}/{s}/mismatch_guided"] == 0 for i in (1, 2) for s in ("moe_fc1_in", "moe_fc2_in"))

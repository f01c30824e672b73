"""gpt-oss HF -> Megatron-Core (local spec, on a CPU): logits parity with transformers in fp32, the
sliding-window layers included, and the trace spec's experts computing trace_kernels' swigluoai with
biases."""

import json
import warnings

import pytest
import torch

from trace_fp4 import megatron_cpu
from trace_fp4.archs import gpt_oss
from trace_fp4.hf_checkpoint import load_tensors


@pytest.fixture(scope="module")
def megatron():
    megatron_cpu.install()
    megatron_cpu.init_parallel()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return gpt_oss.build_tiny(tmp_path_factory.mktemp("gpt_oss") / "tiny")


def _megatron(model_dir, spec_fn=None):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    cfg = json.loads((model_dir / "config.json").read_text())
    tc = gpt_oss.transformer_config(cfg)
    spec = spec_fn(tc) if spec_fn else get_gpt_decoder_block_spec(tc, use_transformer_engine=False, normalization="RMSNorm")
    model = gpt_oss.build_gpt_model(cfg, spec, tc)
    from trace_fp4.hf_to_megatron import load_into

    load_into(model, gpt_oss.convert_state_dict(load_tensors(model_dir), cfg))
    return model.eval()


def _logits(model, ids):
    T = ids.shape[1]
    with torch.no_grad():
        return model(ids, torch.arange(T)[None].expand_as(ids), megatron_cpu.causal_mask(T))


def test_logits_match_transformers_in_fp32(model_dir, megatron):
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 384, (2, 24), generator=torch.Generator().manual_seed(0))  # 24 > window 8
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        expected = ref(ids).logits
    got = _logits(_megatron(model_dir), ids)
    err = (got - expected).abs().max().item()
    print(f"max |logit diff| = {err:.2e} (logit scale {expected.abs().max():.2f})")
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_window_matters(model_dir, megatron):
    """The parity above depends on the sliding-window layers: without the window the logits move."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from trace_fp4.hf_to_megatron import load_into

    ids = torch.randint(0, 384, (1, 24), generator=torch.Generator().manual_seed(0))
    cfg = json.loads((model_dir / "config.json").read_text())
    tc = gpt_oss.transformer_config(cfg, window_size=None)
    model = gpt_oss.build_gpt_model(cfg, get_gpt_decoder_block_spec(tc, use_transformer_engine=False, normalization="RMSNorm"), tc)
    load_into(model, gpt_oss.convert_state_dict(load_tensors(model_dir), cfg))
    assert (_logits(model.eval(), ids) - _logits(_megatron(model_dir), ids)).abs().max() > 1e-2


def test_trace_spec_experts_run_trace_kernels_swigluoai(model_dir, megatron):
    """The trace spec's experts (fc1 + bias -> trace_kernels.swigluoai -> fc2 + bias, probability
    after) with every quantization off are the same model as Megatron's local spec; with FP4 on they
    run and move the logits."""
    import trace_megatron
    from trace_kernels import TraceConfig

    ids = torch.randint(0, 384, (2, 24), generator=torch.Generator().manual_seed(1))
    off = TraceConfig(quantize_expert_weights=False, quantize_expert_inputs=False, quantize_kv=False, capture=False, guided_layers="none")

    def spec(cfg_off):
        return lambda tc: trace_megatron.get_gpt_decoder_block_with_trace_spec(tc, normalization="RMSNorm", trace_config=cfg_off)

    plain = _logits(_megatron(model_dir), ids)
    model = _megatron(model_dir, spec(off))
    experts = model.decoder.layers[0].mlp.experts
    assert type(experts).__name__ == "TraceSequentialMLP" and experts.activation_name == "swigluoai"
    torch.testing.assert_close(_logits(model, ids), plain, rtol=1e-5, atol=1e-5)
    fp4 = _logits(_megatron(model_dir, spec(TraceConfig(guided_layers="none", capture=False))), ids)
    assert (fp4 - plain).abs().max() > 1e-3

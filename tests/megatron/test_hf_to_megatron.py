"""HF Qwen3-MoE / Qwen2-MoE -> Megatron-Core: logits parity with transformers, and clear refusals."""

import json
import warnings

import pytest
import torch

from trace_fp4 import hf_to_megatron as h2m
from trace_fp4 import megatron_cpu
from trace_fp4.hf_checkpoint import CheckpointError, load_tensors, read_config
from trace_fp4.tiny_model import build_tiny_qwen3_dense, build_tiny_qwen3_moe


@pytest.fixture(scope="module")
def megatron():
    megatron_cpu.init_parallel()


def _tiny_qwen2_moe(path):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=False, max_position_embeddings=256, initializer_range=0.2,
    )
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Qwen2MoeForCausalLM(cfg).save_pretrained(path)
    return path


def _megatron_logits(model_dir, ids):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    hf = read_config(model_dir)
    cfg = h2m.transformer_config(hf)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    model = h2m.build_gpt_model(hf, spec, cfg)
    h2m.load_into(model, h2m.convert_state_dict(load_tensors(model_dir), hf))
    model.eval()
    T = ids.shape[1]
    with torch.no_grad():
        return model(ids, torch.arange(T)[None].expand_as(ids), megatron_cpu.causal_mask(T))


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_logits_match_transformers_in_fp32(arch, tmp_path, megatron):
    from transformers import AutoModelForCausalLM

    d = build_tiny_qwen3_moe(tmp_path / arch) if arch == "qwen3_moe" else _tiny_qwen2_moe(tmp_path / arch)
    ids = torch.randint(0, read_config(d).vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = ref(ids).logits
    got = _megatron_logits(d, ids)
    assert expected.abs().max() > 0.5  # logits of a real spread, so the bound below means something
    assert (got - expected).abs().max() < 5e-5


def test_shuffled_qkv_layout_breaks_parity(tmp_path, megatron):
    """The per-KV-group QKV layout is load-bearing: the naive [Q; K; V] concatenation differs."""
    d = build_tiny_qwen3_moe(tmp_path / "m")
    hf = read_config(d)
    state = load_tensors(d)
    a = state["model.layers.0.self_attn.q_proj.weight"]
    k = state["model.layers.0.self_attn.k_proj.weight"]
    v = state["model.layers.0.self_attn.v_proj.weight"]
    assert not torch.equal(h2m._fused_qkv(a, k, v, hf), torch.cat([a, k, v]))


def test_bad_model_directories_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="no such directory"):
        read_config(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        read_config(tmp_path / "empty")
    dense = build_tiny_qwen3_dense(tmp_path / "dense")
    with pytest.raises(CheckpointError, match=r"Qwen3ForCausalLM.*not supported \(a dense model: TRACE needs routed experts\)"):
        read_config(dense)
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["UnknownMoeForCausalLM"], "num_local_experts": 8}))
    with pytest.raises(CheckpointError, match=r"\['UnknownMoeForCausalLM'\] is not supported; supported: Qwen3MoeForCausalLM"):
        read_config(other)
    moe = build_tiny_qwen3_moe(tmp_path / "moe")
    state = load_tensors(moe)
    del state["model.layers.1.mlp.experts.3.up_proj.weight"]
    with pytest.raises(CheckpointError, match="no tensor 'model.layers.1.mlp.experts.3.up_proj.weight'"):
        h2m.convert_state_dict(state, read_config(moe))

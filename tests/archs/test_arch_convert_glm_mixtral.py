"""HF GLM-4.5 / Mixtral -> Megatron-Core: fp32 logits parity with transformers on tiny checkpoints built
with transformers' own config and model classes, and the switches that parity depends on."""

import dataclasses
import json
import warnings

import pytest
import torch

from trace_fp4 import hf_to_megatron as h2m
from trace_fp4 import megatron_cpu
from trace_fp4.archs import glm4_moe, mixtral
from trace_fp4.hf_checkpoint import CheckpointError, load_tensors

FAMILIES = {"glm4_moe": glm4_moe, "mixtral": mixtral}


@pytest.fixture(scope="module")
def megatron():
    megatron_cpu.init_parallel()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """family -> (dir, HFMoeConfig, ids, transformers' fp32 logits)."""
    from transformers import AutoModelForCausalLM

    out = {}
    for name, fam in FAMILIES.items():
        d = fam.build_tiny(tmp_path_factory.mktemp(name) / name)
        hf = fam.read_config(json.loads((d / "config.json").read_text()), str(d))
        ids = torch.randint(0, hf.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        with torch.no_grad():
            out[name] = (d, hf, ids, ref(ids).logits)
    return out


def _megatron_logits(fam, d, hf, ids, state=None):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    cfg = fam.transformer_config(hf)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    model = fam.build_gpt_model(hf, spec, cfg)
    h2m.load_into(model, state if state is not None else fam.convert_state_dict(load_tensors(d), hf))
    model.eval()
    T = ids.shape[1]
    with torch.no_grad():
        return model(ids, torch.arange(T)[None].expand_as(ids), megatron_cpu.causal_mask(T)), model


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_match_transformers_in_fp32(name, built, megatron):
    d, hf, ids, expected = built[name]
    got, model = _megatron_logits(FAMILIES[name], d, hf, ids)
    assert expected.abs().max() > 0.5  # logits of a real spread, so the bound below means something
    assert (got - expected).abs().max() < 5e-5
    kinds = [type(layer.mlp).__name__ for layer in model.decoder.layers]
    if name == "glm4_moe":  # first_k_dense_replace=1: a dense MLP, then MoE layers with a shared expert
        assert kinds == ["MLP", "MoELayer", "MoELayer", "MoELayer"]
        assert model.decoder.layers[1].mlp.shared_experts is not None
        assert model.decoder.layers[1].mlp.router.expert_bias.abs().max() > 0
    else:
        assert kinds == ["MoELayer"] * 4


def test_glm_parity_depends_on_the_expert_bias_and_partial_rotary(built, megatron):
    """The correction bias reorders experts and partial rotary is load-bearing: drop either, parity breaks."""
    d, hf, ids, expected = built["glm4_moe"]
    state = glm4_moe.convert_state_dict(load_tensors(d), hf)
    no_bias = {k: (torch.zeros_like(v) if k.endswith("router.expert_bias") else v) for k, v in state.items()}
    got, _ = _megatron_logits(glm4_moe, d, hf, ids, no_bias)
    assert (got - expected).abs().max() > 1e-2
    full_rotary = dataclasses.replace(hf, rotary_percent=1.0)
    got, _ = _megatron_logits(glm4_moe, d, full_rotary, ids)
    assert (got - expected).abs().max() > 1e-2


def test_configs_are_checked(built):
    d, hf, _, _ = built["glm4_moe"]
    cfg = json.loads((d / "config.json").read_text())
    assert hf.moe_layers == (1, 2, 3) and hf.dense_intermediate_size == 128 and hf.rotary_percent == 0.5
    assert hf.score_function == "sigmoid" and hf.expert_bias and hf.routed_scaling_factor == 2.5
    with pytest.raises(CheckpointError, match="norm_topk_prob=false with sigmoid routing"):
        glm4_moe.read_config({**cfg, "norm_topk_prob": False}, "m")
    with pytest.raises(CheckpointError, match="first_k_dense_replace=4 leaves no MoE layer"):
        glm4_moe.read_config({**cfg, "first_k_dense_replace": 4}, "m")
    with pytest.raises(CheckpointError, match="moe_intermediate_size=40 is not divisible by 16"):
        glm4_moe.read_config({**cfg, "moe_intermediate_size": 40}, "m")
    mcfg = json.loads((built["mixtral"][0] / "config.json").read_text())
    with pytest.raises(CheckpointError, match="sliding_window=4096 is not supported"):
        mixtral.read_config({**mcfg, "sliding_window": 4096}, "m")
    with pytest.raises(CheckpointError, match="no 'num_local_experts'"):
        mixtral.read_config({k: v for k, v in mcfg.items() if k != "num_local_experts"}, "m")


def test_missing_tensor_is_named(built):
    d, hf, _, _ = built["mixtral"]
    state = load_tensors(d)
    del state["model.layers.2.block_sparse_moe.experts.5.w3.weight"]
    with pytest.raises(CheckpointError, match="no tensor 'model.layers.2.block_sparse_moe.experts.5.w3.weight'"):
        mixtral.convert_state_dict(state, hf)


def test_registered_families_are_read_through_read_config(built, tmp_path):
    """hf_checkpoint.read_config (what align and the trainer call) dispatches to the family reader, and its
    shape is model_shape_from_hf's (the engines')."""
    from trace_fp4.hf_checkpoint import read_config
    from trace_kernels import model_shape_from_hf

    for name in FAMILIES:
        d, hf, _, _ = built[name]
        got = read_config(d)
        assert got == hf
        assert got.model_shape() == model_shape_from_hf(json.loads((d / "config.json").read_text()))
    broken = tmp_path / "broken"
    broken.mkdir()
    cfg = json.loads((built["mixtral"][0] / "config.json").read_text())
    del cfg["hidden_size"]
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=f"--model {broken}: config.json has no 'hidden_size'"):
        read_config(broken)

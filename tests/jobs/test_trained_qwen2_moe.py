"""The second held-out family of issue 27: `trained_tiny` trains a tiny Qwen2-MoE with a gated shared
expert, written under the classic tensor names every loader here reads (2 steps here; align uses 300)."""

import pytest
import torch

from trace_fp4 import hf_to_megatron as h2m
from trace_fp4.hf_checkpoint import read_config
from trace_fp4.trained_tiny import build_trained_tiny_qwen3_moe


def test_a_trained_qwen2_moe_with_a_shared_expert_loads_and_moved(tmp_path):
    from safetensors.torch import load_file

    out = build_trained_tiny_qwen3_moe(tmp_path / "q2", family="qwen2_moe", steps=2, num_layers=2)
    hf = read_config(out)
    assert hf.architecture == "Qwen2MoeForCausalLM" and hf.shared_expert_intermediate_size == 64
    trained = load_file(str(out / "model.safetensors"))
    base = load_file(str(tmp_path / ".q2.base" / "model.safetensors"))
    assert set(trained) == set(base)  # the base checkpoint's names, experts one by one
    moved = [n for n in base if not torch.equal(base[n], trained[n])]
    assert any(".mlp.experts.0." in n for n in moved) and any(".shared_expert." in n for n in moved)
    state = h2m.convert_state_dict(trained, hf)
    assert any("shared_experts" in n for n in state)
    # the same arguments reuse the checkpoint; another family is refused by name
    assert build_trained_tiny_qwen3_moe(tmp_path / "q2", family="qwen2_moe", steps=2, num_layers=2) == out

    with pytest.raises(ValueError, match="family"):
        build_trained_tiny_qwen3_moe(tmp_path / "x", family="llama")

"""A trainer's weight sync through vLLM's weight-loading path re-quantizes the experts: afterwards the
engine computes exactly what a fresh engine loaded with the new weights computes."""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import trace_kernels
import trace_vllm_plugin as tvp
from vllm_helpers import MODELS_DIR, FULL_ALL, PROMPTS, expert_weights, greedy, make_llm, shutdown, tiny_moe

KEYS = ("w13_codes", "w2_codes", "w13_scales", "w2_scales", "w13_deq", "w2_deq")


def _new_expert_weights() -> Path:
    """A checkpoint equal to the tiny model except for its expert weights (those of seed 1): the part
    of the model a trainer step changes that trace_fp4 quantizes. (Other CPU layers prepack their
    weights at load and cannot take a second load_weights in this vLLM build.)"""
    old, donor = tiny_moe(), tiny_moe(seed=1)
    dst = MODELS_DIR / "moe_new_experts"
    if not (dst / "model.safetensors").exists():
        shutil.copytree(old, dst, dirs_exist_ok=True)
        weights = load_file(old / "model.safetensors")
        new = load_file(donor / "model.safetensors")
        weights.update({k: v for k, v in new.items() if ".mlp.experts." in k})
        save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _sync_weights(worker, path: str) -> int:
    """What verl / slime do after a training step: the model's load_weights with the new tensors,
    then each updated layer's quant method post-processing."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    model = worker.model_runner.model
    weights = {k: v for k, v in load_file(path).items() if ".mlp.experts." in k}
    model.load_weights(weights.items())
    n = 0
    for module in model.modules():
        if isinstance(module, RoutedExperts):
            module.quant_method.process_weights_after_loading(module)
            n += 1
    return n


def test_weight_update_requantizes_like_a_fresh_engine():
    old, new = tiny_moe(), _new_expert_weights()
    params = [greedy(6), greedy(3), greedy(9)]

    llm = make_llm(old, quant_config=FULL_ALL)
    try:
        before = llm.apply_model(expert_weights)[0]
        old_records = tvp.get_records(llm, llm.generate(PROMPTS, params))
        n = llm.collective_rpc(_sync_weights, args=(str(new / "model.safetensors"),))[0]
        assert n == 4  # every MoE layer re-quantized
        synced = llm.apply_model(expert_weights)[0]
        synced_out = llm.generate(PROMPTS, params)
        synced_records = tvp.get_records(llm, synced_out)
        assert tvp.stats(llm)["counters"]["expert_weight_quantizations"] == 2 * len(synced)
    finally:
        shutdown(llm)

    llm = make_llm(new, quant_config=FULL_ALL)
    try:
        fresh = llm.apply_model(expert_weights)[0]
        fresh_out = llm.generate(PROMPTS, params)
        fresh_records = tvp.get_records(llm, fresh_out)
    finally:
        shutdown(llm)

    for layer in fresh:
        assert not torch.equal(before[layer]["w13_codes"], synced[layer]["w13_codes"]), "weights did not change"
        for key in KEYS:
            assert torch.equal(synced[layer][key], fresh[layer][key]), (layer, key)
    for a, b, sa, sb in zip(synced_records, fresh_records, synced_out, fresh_out):
        assert sa.outputs[0].token_ids == sb.outputs[0].token_ids
        for name, t in a.tensors.items():
            assert torch.equal(t, b.tensors[name]), name
    # The records name their weights: the update bumped the version, and the synced engine's expert
    # weights digest is a fresh engine's; a trainer expecting the new policy refuses the old records.
    assert {r.identity.weights_version for r in old_records} == {0}
    assert {r.identity.weights_version for r in synced_records} == {1}
    assert {r.identity.weights_digest for r in synced_records} == {r.identity.weights_digest for r in fresh_records}
    assert old_records[0].identity.weights_digest != synced_records[0].identity.weights_digest
    with pytest.raises(trace_kernels.RecordError, match=r"record of sample 0 \(request \S+\): weights differ"):
        trace_kernels.check_identity(old_records[0], source="record of sample 0", weights_version=1)

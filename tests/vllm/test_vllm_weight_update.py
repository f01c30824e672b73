"""Weight sync into a trace_fp4 vLLM engine, through the engine's own update paths, requantizes the
experts into the resident packed tensors: afterwards the engine holds exactly the codes of a fresh
engine loaded with the new weights and generates exactly what that engine generates. No BF16 copy of
the routed experts is held, after the load or after an update."""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import trace_kernels
import trace_vllm_plugin as tvp
from vllm_helpers import (
    FULL_ALL, MODELS_DIR, PROMPTS, checkpoint_expert_codes, expert_residency, expert_storage, expert_weights, greedy, make_llm,
    shutdown, tiny_moe,
)

KEYS = ("w13_codes", "w2_codes", "w13_scales", "w2_scales", "w13_amax", "w2_amax")


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


def _expert_tensors(path) -> list:
    return [(k, v) for k, v in load_file(str(path)).items() if ".mlp.experts." in k]


def _load_weights(worker, path: str) -> int:
    """What verl / slime do after a training step: the model's own load_weights with the new tensors
    (gate, up and down of each expert as separate checkpoint tensors). Nothing else is called."""
    loaded = worker.model_runner.model.load_weights(iter(_expert_tensors(path)))
    return len(loaded)


def _reload_weights(worker, path: str) -> None:
    """vLLM's in-place reload (layerwise reload machinery) with an iterator of the new tensors."""
    worker.reload_weights(weights_iterator=iter(_expert_tensors(path)))


def _resident(model):
    from trace_kernels.grouped_mm import resident_bytes

    return [resident_bytes(layer.mlp.experts.routed_experts) for layer in model.model.layers]


def _assert_packed_only(residency: dict) -> None:
    for layer, held in residency.items():
        floats = {n: b for n, (dt, b) in held.items() if dt.is_floating_point and dt != torch.float32 and b}
        assert not floats, f"layer {layer}: model-dtype expert tensors with storage remain: {floats}"
        big_f32 = {n: b for n, (dt, b) in held.items() if dt == torch.float32 and b > 4 * 64}
        assert not big_f32, f"layer {layer}: float32 expert tensors beyond the per-expert amax: {big_f32}"


def _assert_codes(engine: dict, expect: dict, what: str) -> None:
    for layer in expect:
        for key in KEYS:
            assert torch.equal(engine[layer][key], expect[layer][key]), (what, layer, key)


def test_weight_updates_requantize_like_a_fresh_engine():
    old, new = tiny_moe(), _new_expert_weights()
    params = [greedy(6), greedy(3), greedy(9)]
    old_codes, new_codes = checkpoint_expert_codes(old / "model.safetensors"), checkpoint_expert_codes(new / "model.safetensors")

    llm = make_llm(old, quant_config=FULL_ALL)
    try:
        _assert_packed_only(llm.apply_model(expert_residency)[0])
        _assert_codes(llm.apply_model(expert_weights)[0], old_codes, "fresh load")
        storage = llm.apply_model(expert_storage)[0]
        old_out = llm.generate(PROMPTS, params)
        old_records = tvp.get_records(llm, old_out)

        # 1. model.load_weights (the RL frameworks' sync).
        n = llm.collective_rpc(_load_weights, args=(str(new / "model.safetensors"),))[0]
        assert n > 0
        _assert_codes(llm.apply_model(expert_weights)[0], new_codes, "load_weights")
        # Written in place: a CUDA graph captured at start keeps reading live weights.
        assert llm.apply_model(expert_storage)[0] == storage, "load_weights moved packed expert storage"
        _assert_packed_only(llm.apply_model(expert_residency)[0])
        synced_out = llm.generate(PROMPTS, params)
        synced_records = tvp.get_records(llm, synced_out)

        # 2. vLLM's reload_weights back to the old experts: the original codes and outputs again.
        llm.collective_rpc(_reload_weights, args=(str(old / "model.safetensors"),))
        _assert_codes(llm.apply_model(expert_weights)[0], old_codes, "reload_weights")
        assert llm.apply_model(expert_storage)[0] == storage, "reload_weights moved packed expert storage"
        _assert_packed_only(llm.apply_model(expert_residency)[0])
        back_out = llm.generate(PROMPTS, params)
        held, bf16 = map(sum, zip(*llm.apply_model(_resident)[0]))
        back_records = tvp.get_records(llm, back_out)
        counters = tvp.stats(llm)["counters"]
    finally:
        shutdown(llm)
    assert [o.outputs[0].token_ids for o in back_out] == [o.outputs[0].token_ids for o in old_out]
    assert counters.get("expert_weight_shards_quantized", 0) == 3 * 3 * 4 * 8  # 3 loads x 3 shards x 4 layers x 8 experts
    # Memory held by the routed-expert layers, measured in the engine: NVFP4 is 4.5 bits / parameter.
    assert 0 < held <= 0.30 * bf16, (held, bf16)
    assert held == sum(v for k, v in counters.items() if k.startswith("expert_resident_bytes."))

    llm = make_llm(new, quant_config=FULL_ALL)
    try:
        fresh = llm.apply_model(expert_weights)[0]
        fresh_out = llm.generate(PROMPTS, params)
        fresh_records = tvp.get_records(llm, fresh_out)
    finally:
        shutdown(llm)

    _assert_codes(fresh, new_codes, "fresh engine on the new weights")
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
    # load_weights alone (no process_weights_after_loading) settled version 1 above; the reload back to
    # the old experts is version 2 and carries the old weights' digest again.
    assert {r.identity.weights_version for r in back_records} == {2}
    assert {r.identity.weights_digest for r in back_records} == {old_records[0].identity.weights_digest}

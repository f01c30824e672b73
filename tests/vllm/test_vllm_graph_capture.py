"""Capture that a CUDA graph can hold, in the real vLLM engine (CPU build, one engine start shared):

- the engine's own layer calls (the sparse MoE block and the attention's KV write) with capture on
  and the Triton backend (interpreted) make no host synchronisation and no data-dependent shape, and
  their captures land in the store's static buffers;
- a step larger than the static buffers is captured eagerly, counted, with the same records.
vLLM's compiled mode with the buffers is tests/vllm/test_vllm_compile.py.
"""

import pytest
import torch

import trace_vllm_plugin as tvp
from host_sync_mode import NoHostSync
from vllm_helpers import FULL_ALL, PROMPTS, greedy, make_llm, shutdown, tiny_moe

PARAMS = [greedy(6), greedy(3), greedy(9)]


def _store(model):
    return model.model.layers[0].mlp.experts.routed_experts.quant_method.store


@pytest.fixture(scope="module")
def eager():
    llm = make_llm(tiny_moe(), quant_config=FULL_ALL)
    try:
        yield llm
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def eager_records(eager):
    out = eager.generate(PROMPTS, PARAMS)
    return out, tvp.get_records(eager, out)


def _layer_calls_without_host_sync(vllm_config):
    """In the worker: one decoder layer's MoE block and KV write, Triton backend, under NoHostSync."""
    from vllm.forward_context import set_forward_context

    def run(model):
        store = _store(model)
        layer = model.model.layers[1]
        attn = layer.self_attn.attn
        T = 5
        g = torch.Generator().manual_seed(0)
        hidden = torch.randn(T, model.config.hidden_size, generator=g).to(torch.bfloat16)
        heads, D = attn.num_kv_heads, attn.head_size
        key, value = (torch.randn(T, heads, D, generator=g).to(torch.bfloat16) for _ in range(2))
        kv_cache = attn.kv_cache[0] if isinstance(attn.kv_cache, list) else attn.kv_cache
        block = kv_cache.shape[2]
        # Two padded tokens (slot -1), as in a CUDA graph's padded batch; real slots in the last block.
        base = (kv_cache.shape[0] - 1) * block
        slots = torch.tensor([base, base + 1, base + 2, -1, -1])
        before = kv_cache.clone()
        store.kernel_backend = "triton"
        mode = NoHostSync()
        try:
            with torch.inference_mode(), set_forward_context(None, vllm_config), mode:
                layer.mlp(hidden)
                attn.impl.do_kv_cache_update(attn, key, value, kv_cache, slots)
        finally:
            store.kernel_backend = "auto"
            kv_cache.copy_(before)
        keys = [(1, "moe_fc1_in"), (1, "moe_fc2_in"), ("routing", 1), (1, "k"), (1, "v")]
        rows = store.buffers.read(keys, 0, T)
        return mode.ops, mode.allowed, {str(k): tuple(getattr(v, "codes", v).shape) for k, v in rows.items()}

    return run


def test_engine_layer_calls_with_capture_have_no_host_sync(eager, eager_records):
    ops, allowed, shapes = eager.apply_model(_layer_calls_without_host_sync(eager.llm_engine.vllm_config))[0]
    assert ops > 100
    # The 5 rows the calls wrote are in the static buffers, one row per token.
    assert all(s[0] == 5 for s in shapes.values()) and len(shapes) == 5, shapes


def test_a_step_over_the_buffers_capacity_is_captured_eagerly_with_the_same_records(eager, eager_records):
    def set_capacity(n):
        def run(model):
            store = _store(model)
            old, store.buffers.capacity = store.buffers.capacity, n
            return old
        return run

    full = eager.apply_model(set_capacity(4))[0]  # the prompts (more than 4 tokens) do not fit
    try:
        out = eager.generate(PROMPTS, PARAMS)
        records = tvp.get_records(eager, out)
    finally:
        eager.apply_model(set_capacity(full))
    counters = tvp.stats(eager)["counters"]
    assert counters["capture_buffer_overflow_steps"] >= 1 and counters.get("steps_missing_capture", 0) == 0
    ref_out, ref = eager_records
    for a, b, oa, ob in zip(ref, records, ref_out, out):
        assert oa.outputs[0].token_ids == ob.outputs[0].token_ids
        for name, t in a.tensors.items():
            assert torch.equal(t, b.tensors[name]), name

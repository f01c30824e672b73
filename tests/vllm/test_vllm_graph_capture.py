"""Capture that a CUDA graph can hold, in the real vLLM engine (CPU build, one engine start shared):

- the engine's own layer calls (the sparse MoE block and the attention's KV write) with capture on
  and the Triton backend (interpreted) make no host synchronisation and no data-dependent shape, and
  their captures land in the store's static buffers;
- a step larger than the static buffers is captured eagerly, counted, with the same records;
- the MoE op declares the capture buffers it mutates (its schema) and writes through those operands
  only, so what torch.compile is told is what happens.
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
    # 32-token KV blocks (vLLM-CPU's default is 128): the interpreted Triton decode attention's tiles stay small.
    llm = make_llm(tiny_moe(), quant_config=FULL_ALL, block_size=32)
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


def _op_writes_its_operands(vllm_config):
    """In the worker: call the MoE op of layer 1 with fresh capture operands; returns what each got."""
    from vllm.forward_context import set_forward_context

    from trace_kernels.routed_experts import routed_experts

    def run(model):
        method = model.model.layers[1].mlp.experts.routed_experts.quant_method
        store = method.store
        T, E, k = 5, model.config.num_experts, model.config.num_experts_per_tok
        g = torch.Generator().manual_seed(3)
        x = torch.randn(T, model.config.hidden_size, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
        wts = torch.rand(T, k, generator=g)
        engine_bufs = [t.clone() for t in method.capture_operands[:-1]]
        fresh = [torch.full_like(t, 7) for t in engine_bufs]  # not the engine's buffers
        step = torch.tensor([41], dtype=torch.int64)
        with torch.inference_mode(), set_forward_context(None, vllm_config):
            torch.ops.vllm.trace_fp4_moe_experts(x, wts, ids, method.op_layer_name, *fresh, step)
        _, q1, q2 = routed_experts(x, wts, ids, *method.gemm_weights(method_layer(model)), method.activation, capture=True)
        untouched = all(torch.equal(a, b) for a, b in zip(engine_bufs, method.capture_operands[:-1]))
        ids_buf, c1, s1, a1, c2, s2, a2, stamps = fresh
        return {
            "engine_buffers_untouched": untouched,
            "stamps": stamps.tolist(),
            "ids": torch.equal(ids_buf[:T], ids.to(torch.int16)) and bool((ids_buf[T:] == 7).all()),
            "fc1": torch.equal(c1[:T], q1.codes) and torch.equal(s1[:T], q1.scales) and torch.equal(a1[:T], q1.global_amax),
            "fc2": torch.equal(c2[:T], q2.codes) and torch.equal(s2[:T], q2.scales) and torch.equal(a2[:T], q2.global_amax),
            "rows_past_T_untouched": bool((c1[T:] == 7).all() and (c2[T:] == 7).all()),
        }

    def method_layer(model):
        return model.model.layers[1].mlp.experts.routed_experts

    return run


def test_the_moe_op_declares_and_writes_exactly_its_capture_buffers(eager, eager_records):
    from trace_vllm_plugin.experts import CAPTURE_OPERANDS, MUTATED_OPERANDS

    schema = torch.ops.vllm.trace_fp4_moe_experts.default._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == set(MUTATED_OPERANDS) == set(CAPTURE_OPERANDS) - {"step"}
    got = eager.apply_model(_op_writes_its_operands(eager.llm_engine.vllm_config))[0]
    assert got.pop("stamps") == [[41, 5]] * 3
    assert all(got.values()), got


def _decode_kernel(on: bool):
    def run(model):
        model.model.layers[1].self_attn.attn.impl._trace_fp4_decode_kernel = on
    return run


def test_decode_batches_read_the_packed_pages_through_the_triton_kernel(eager, eager_records):
    """TRACE_FP4_KV_DECODE_ATTENTION=triton's read path, in the engine (switched on for layer 1 only:
    with the variable set at start every decode step of this module would run interpreted, seconds per
    layer). Its decode step attends straight from the packed pages (no blocks dequantized into a
    scratch), prefill keeps the scratch; the tokens are the scratch path's, and so is every record row
    computed before the first Triton-attended step."""
    prompts, params = PROMPTS[1:2], greedy(2)  # one decode step: one interpreted launch
    scratch_out = eager.generate(prompts, params)
    scratch = tvp.get_records(eager, scratch_out)
    before = tvp.stats(eager)["counters"]
    eager.apply_model(_decode_kernel(True))
    try:
        out = eager.generate(prompts, params)
    finally:
        eager.apply_model(_decode_kernel(False))
    records = tvp.get_records(eager, out)
    after = tvp.stats(eager)["counters"]
    assert after["kv_decode_attention_triton_calls"] - before.get("kv_decode_attention_triton_calls", 0) == 1
    # The decode step's layer 1 read no scratch: one block fewer than the scratch run dequantized.
    blocks = after["kv_blocks_dequantized"] - before["kv_blocks_dequantized"]
    layers = len(records[0].modes)
    P = len(out[0].prompt_token_ids)
    assert P <= 32 and blocks == 2 * layers - 1  # prefill: one block per layer; decode: all but layer 1
    for a, b, oa, ob in zip(scratch, records, scratch_out, out):
        assert oa.outputs[0].token_ids == ob.outputs[0].token_ids
        for name, t in a.tensors.items():
            if "routed" not in name:
                assert torch.equal(t[:P], b.tensors[name][:P]), name  # rows of the prefill step

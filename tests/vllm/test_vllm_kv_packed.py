"""The packed NVFP4 KV cache in real vLLM (CPU_ATTN, in-process engine).

Two engines on one tiny Qwen3-MoE with head_dim 128 (the Qwen3-30B-A3B head), same trace_fp4 config
and capture: the default packed cache, and TRACE_FP4_KV_CACHE=dequantized (the model-dtype cache
holding the dequantized NVFP4 values, 1.0x BF16 bytes per token). Asserted: vLLM's own KV capacity
for the same kv_cache_memory_bytes, identical greedy tokens and log-probs bit for bit, the cache bytes
at a token's slot equal to its record rows, and only the blocks a batch uses are dequantized.
"""

import math
import os

import pytest
import torch

import trace_vllm_plugin as tvp
from trace_kernels.kv_layout import pack_rows, packed_row_bytes
from vllm_helpers import FULL_ALL, KV_BYTES, PROMPTS, greedy, make_llm, shutdown, tiny_moe

HEAD_DIM = 128
NUM_KV_HEADS = 2
NUM_LAYERS = 4
BLOCK = 32  # small blocks: requests span several, so the block-table remap is exercised
LONG = " ".join(["The lazy dog jumps over the quick brown fox, and the fox runs away."] * 4)


def _model():
    return tiny_moe(head_dim=HEAD_DIM)


def _engine(mode: str):
    old = os.environ.get("TRACE_FP4_KV_CACHE")
    os.environ["TRACE_FP4_KV_CACHE"] = mode
    try:
        # Chunked prefill (32 tokens per step) next to decodes: prefill chunks read earlier blocks back.
        return make_llm(_model(), quant_config=FULL_ALL, block_size=BLOCK, max_num_batched_tokens=32)
    finally:
        if old is None:
            del os.environ["TRACE_FP4_KV_CACHE"]
        else:
            os.environ["TRACE_FP4_KV_CACHE"] = old


def _run(llm):
    outs = llm.generate(PROMPTS + [LONG], greedy(12, logprobs=3, prompt_logprobs=3))
    tvp.get_records(llm, outs)  # consume the records
    return [
        (
            o.prompt_token_ids,
            list(o.outputs[0].token_ids),
            [sorted((t, lp.logprob) for t, lp in d.items()) for d in o.outputs[0].logprobs],
            [sorted((t, lp.logprob) for t, lp in d.items()) if d else None for d in o.prompt_logprobs],
        )
        for o in outs
    ]


def _capacity(llm):
    cfg = llm.llm_engine.vllm_config.cache_config
    return cfg.num_gpu_blocks, cfg.block_size


@pytest.fixture(scope="module")
def dequantized():
    llm = _engine("dequantized")
    try:
        yield {"outputs": _run(llm), "capacity": _capacity(llm), "stats": tvp.stats(llm)["counters"]}
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def llm(dequantized):
    llm = _engine("packed")
    yield llm
    shutdown(llm)


def test_packed_cache_holds_3_2x_the_tokens(llm, dequantized):
    blocks, bs = _capacity(llm)
    ref_blocks, ref_bs = dequantized["capacity"]
    assert bs == ref_bs == BLOCK
    ratio = blocks / ref_blocks
    # vLLM divides the budget by the page: 2 rows x (64 codes + 8 scales + 4 amax) B per token and head
    # in packed mode, 2 x 256 B in the model dtype.
    page_packed = NUM_KV_HEADS * BLOCK * 2 * packed_row_bytes(HEAD_DIM) * NUM_LAYERS
    page_bf16 = NUM_KV_HEADS * BLOCK * 2 * HEAD_DIM * 2 * NUM_LAYERS
    print(f"vLLM KV capacity: packed {blocks * bs} tokens, dequantized {ref_blocks * ref_bs} tokens ({ratio:.2f}x)")
    assert blocks == KV_BYTES // page_packed and ref_blocks == KV_BYTES // page_bf16
    assert ratio >= 3.2
    assert tvp.stats(llm)["counters"]["kv_cache_packed_layers"] == NUM_LAYERS
    assert "kv_cache_packed_layers" not in dequantized["stats"]


def test_outputs_equal_the_dequantized_cache_bit_for_bit(llm, dequantized):
    got = _run(llm)
    want = dequantized["outputs"]
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g[0] == w[0], i
        assert g[1] == w[1], f"request {i}: generated tokens differ"
        assert g[2] == w[2], f"request {i}: sampled log-probs differ"
        assert g[3] == w[3], f"request {i}: prompt log-probs differ"


def _install_slot_probe(model):
    impl = model.model.layers[0].self_attn.attn.impl
    slots = []
    cls_update = type(impl).do_kv_cache_update

    def update(layer, key, value, kv_cache, slot_mapping):
        slots.append(slot_mapping.clone())
        return cls_update(impl, layer, key, value, kv_cache, slot_mapping)

    impl.do_kv_cache_update = update
    model._trace_slots = slots


def _take_cache_rows(model):
    impl = model.model.layers[0].self_attn.attn.impl
    del impl.do_kv_cache_update
    slots = torch.cat(model._trace_slots).to(torch.int64)
    del model._trace_slots
    rows = {}
    for i, layer in enumerate(model.model.layers):
        cache = layer.self_attn.attn.kv_cache
        bs = cache.shape[2]
        rows[i] = cache[slots // bs, :, slots % bs].clone()  # [T, H, 2 * row]
    return rows


def test_cache_bytes_are_the_captured_rows(llm):
    llm.apply_model(_install_slot_probe)
    out = llm.generate([LONG], greedy(5))[0]
    rows = llm.apply_model(_take_cache_rows)[0]
    record = tvp.get_record(llm, out)
    T = record.num_tokens
    rk = packed_row_bytes(HEAD_DIM)
    for layer in range(NUM_LAYERS):
        assert rows[layer].shape == (T, NUM_KV_HEADS, 2 * rk), layer
        assert torch.equal(rows[layer][..., :rk], pack_rows(record.site(layer, "k"))), (layer, "k")
        assert torch.equal(rows[layer][..., rk:], pack_rows(record.site(layer, "v"))), (layer, "v")


def test_reads_dequantize_only_the_blocks_in_use(llm):
    before = tvp.stats(llm)["counters"]
    out = llm.generate([PROMPTS[1]], greedy(1))[0]
    tvp.get_record(llm, out)
    after = tvp.stats(llm)["counters"]
    P = len(out.prompt_token_ids)
    assert P <= 32  # one prefill step, no decode step
    blocks = after["kv_blocks_dequantized"] - before.get("kv_blocks_dequantized", 0)
    assert blocks == NUM_LAYERS * math.ceil(P / BLOCK)


def _install_decode_attention_probe(model):
    """On layer 1's first step with two decode requests, one spanning blocks: run trace_kernels' Triton decode
    attention (interpreted) on the very query, packed cache and block table vLLM's CPU_ATTN packed path
    just attended with, and keep both outputs (and the torch reference's)."""
    from trace_kernels.attention import packed_decode_attention, reference

    target = model.model.layers[1].self_attn.attn.impl
    cls = type(target)
    base_forward = cls.forward
    seen = []

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        res = base_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        if self is target and attn_metadata is not None and not seen:
            qsl = attn_metadata.query_start_loc.to(torch.int64)
            decode = ((qsl[1:] - qsl[:-1]) == 1).nonzero().flatten()
            # Two or more decode requests, one of them past its first block.
            lens = attn_metadata.seq_lens[decode]
            if decode.numel() >= 2 and int(lens.max()) > kv_cache.shape[2]:
                # Interpreted launches cost seconds: the longest decode request and the next, KV head 1 and
                # its query heads (a view of the cache: the head offset goes through the strides).
                pick = torch.cat((lens.argmax().reshape(1), (lens.argmax() + 1).reshape(1) % decode.numel()))
                decode, lens = decode[pick], lens[pick]
                rows = qsl[decode]
                G = self.num_heads // self.num_kv_heads
                q = query[rows].reshape(2, self.num_heads, self.head_size)[:, G : 2 * G]
                cache = kv_cache[:, 1:2]
                table = attn_metadata.block_table[decode]
                ours = packed_decode_attention(q, cache, table, lens, self.scale)
                ref = reference.packed_decode_attention(q, cache, table, lens, self.scale)
                cpu = output[rows].reshape(2, self.num_heads, -1)[:, G : 2 * G].clone()
                seen.append((ours, ref, cpu, lens.clone()))
        return res

    cls.forward = forward
    model._trace_attn_probe = (cls, base_forward, seen)


def _take_decode_attention_probe(model):
    cls, base_forward, seen = model._trace_attn_probe
    cls.forward = base_forward
    del model._trace_attn_probe
    return seen


def test_triton_attention_over_the_packed_pages_matches_cpu_attn(llm):
    """trace_kernels' Triton decode attention reads the engine's packed cache directly. The values it
    attends to are those CPU_ATTN's packed path dequantizes (tests/kernels/test_packed_kv_attention.py);
    the outputs differ from vLLM's CPU kernel only by that kernel's own arithmetic (another summation
    order and exp, and its BF16 handling of the probabilities), which the torch float32 reference
    shows: the Triton kernel is within one BF16 ulp of the reference, and both within two BF16 ulps of
    the CPU kernel (one measured)."""
    llm.apply_model(_install_decode_attention_probe)
    try:
        outs = llm.generate(PROMPTS + [LONG], greedy(8))
    finally:
        seen = llm.apply_model(_take_decode_attention_probe)[0]
    tvp.get_records(llm, outs)
    assert len(seen) == 1, "no step with two decode requests, one spanning blocks"
    ours, ref, cpu, lens = seen[0]
    assert int(lens.max()) > BLOCK  # a sequence spanning more than one block
    ulp = torch.nextafter(ref.abs(), torch.tensor(float("inf"), dtype=ref.dtype)).float() - ref.abs().float()
    assert ((ours.float() - ref.float()).abs() <= ulp).all()
    cpu_err = (cpu.float() - ref.float()).abs() / ulp
    ours_err = (ours.float() - cpu.float()).abs() / ulp
    print(f"\nTriton vs CPU_ATTN: max {ours_err.max():.0f} BF16 ulps (reference vs CPU_ATTN: {cpu_err.max():.0f}); "
          f"{int((ours != cpu).sum())} of {ours.numel()} outputs differ")
    assert ours_err.max() <= 2 and cpu_err.max() <= 2

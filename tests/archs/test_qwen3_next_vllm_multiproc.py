"""Qwen3-Next capture in vLLM's multiprocess engine (VLLM_ENABLE_V1_MULTIPROCESSING=1): the worker runs
in a process of its own ("mp" executor) and cannot turn prefix caching off for the scheduler, and a
hybrid model's state-cache mode depends on it, so the worker refuses with one line that says to pass
enable_prefix_caching=False (instead of vLLM's later assertion on hybrid block sizes).

Checked on vLLM's real engine config for the tiny model (what the worker receives), not by starting a
multiprocess engine (two more interpreter starts, ~95 s here). By hand: the multiprocess engine start
fails with this line in the worker's log; with enable_prefix_caching=False it generates the in-process
engine's tokens and its records carry K/V only for layer 3. The in-process path (flip to mode 'none')
is tests/archs/test_qwen3_next_vllm.py."""

import os

import pytest

from trace_fp4.archs import qwen3_next
from vllm_helpers import FULL_ALL, MODELS_DIR


def _engine_config(multiprocess: bool):
    from vllm.engine.arg_utils import EngineArgs

    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    try:
        model = qwen3_next.build_tiny(MODELS_DIR / "qwen3_next", seed=0)
        return EngineArgs(model=str(model), dtype="bfloat16", enforce_eager=True, max_model_len=512,
                          hf_overrides={"quantization_config": FULL_ALL}).create_engine_config()
    finally:
        if old is None:
            del os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old


def test_a_worker_in_its_own_process_refuses_prefix_caching_on_a_hybrid_model():
    from trace_vllm_plugin.capture import CaptureStore
    from trace_vllm_plugin.config import _mamba_cache_without_prefix_caching

    store = CaptureStore()
    cfg = _engine_config(multiprocess=True)
    assert cfg.model_config.is_hybrid and cfg.parallel_config.distributed_executor_backend == "mp"
    assert cfg.cache_config.enable_prefix_caching and cfg.cache_config.mamba_cache_mode == "align"
    with pytest.raises(NotImplementedError, match=r"own process \(executor 'mp'\).*enable_prefix_caching=False"):
        _mamba_cache_without_prefix_caching(cfg, store)
    assert cfg.cache_config.mamba_cache_mode == "align"  # untouched
    assert store.counters["mamba_cache_mode_none_for_capture"] == 0


def test_an_in_process_worker_takes_the_state_cache_out_of_align_mode():
    from trace_vllm_plugin.capture import CaptureStore
    from trace_vllm_plugin.config import _mamba_cache_without_prefix_caching

    store = CaptureStore()
    cfg = _engine_config(multiprocess=False)
    assert cfg.parallel_config.distributed_executor_backend == "uni"
    _mamba_cache_without_prefix_caching(cfg, store)
    assert store.counters["mamba_cache_mode_none_for_capture"] == 1
    assert cfg.cache_config.mamba_cache_mode == "none"
    assert cfg.cache_config.mamba_block_size == cfg.model_config.max_model_len

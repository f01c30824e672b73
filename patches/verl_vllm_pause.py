"""Let verl 0.9.1's vLLM server pause vLLM 0.32 for a weight sync.

verl's `vLLMHttpServer.abort_all_requests` (what the fully async trainer and the checkpoint managers
call before a weight sync, and what makes a partial rollout) calls
`AsyncLLM.pause_generation(wait_for_inflight_requests=False, clear_cache=...)`. vLLM 0.32 replaced that
keyword with `mode` ("abort" / "wait" / "keep"), so the call fails with a TypeError and no request is
ever aborted. This wraps `AsyncLLM.pause_generation` to take the old keyword as well: False is "abort"
(verl's intent: abort the in-flight requests), True is "wait". Calls with `mode` pass through.

Supported: vLLM 0.32.x with verl 0.9.1; installed by the TRACE vLLM server (trace_verl/rollout_vllm.py)
in its own process. Any other vLLM fails at install.
"""

import functools
import inspect

SUPPORTED_VLLM = "0.32."


def install():
    import vllm
    from vllm.v1.engine.async_llm import AsyncLLM

    if getattr(AsyncLLM.pause_generation, "__trace_fp4_wrapped__", False):
        return
    params = inspect.signature(AsyncLLM.pause_generation).parameters
    if not vllm.__version__.startswith(SUPPORTED_VLLM) or "mode" not in params or "wait_for_inflight_requests" in params:
        raise RuntimeError(
            f"trace_fp4_patches.verl_vllm_pause supports vLLM {SUPPORTED_VLLM}x (pause_generation(mode=...)); this is "
            f"vLLM {vllm.__version__} with pause_generation{inspect.signature(AsyncLLM.pause_generation)}"
        )
    original = AsyncLLM.pause_generation

    @functools.wraps(original)
    async def pause_generation(self, *args, wait_for_inflight_requests=None, **kwargs):
        if wait_for_inflight_requests is not None and "mode" not in kwargs:
            kwargs["mode"] = "wait" if wait_for_inflight_requests else "abort"
        return await original(self, *args, **kwargs)

    pause_generation.__trace_fp4_wrapped__ = True
    AsyncLLM.pause_generation = pause_generation

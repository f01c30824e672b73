"""Where trace_fp4 plugs into SGLang 0.5.23 (through SGLang's own HookRegistry; see versions.py).

  DefaultPoolConfigurator._compute_cell_size  around: bytes per token of the packed KV pool (kv_sizing.py)
  ModelRunner.init_routed_experts_capturer   after:  size trace_fp4's capture buffers; pack the KV pool
  ModelRunner.forward                         around: per-forward capture context; staging -> host by slot
  RadixAttention.forward                      around: the backend gets NVFP4 (fake-quantized) K/V (kv.py)
  MHATokenToKVPool.set_kv_buffer              around: NVFP4 K/V with capture into the packed pool (kv.py)
  SchedulerBatchResultProcessor._maybe_collect_routed_experts
                                              after:  on request finish, build the record into
                                                      req.customized_info["trace_fp4"]
  SchedulerOutputStreamer.is_request_level_customized_info_key
                                              around: "trace_fp4" is emitted once per request, at finish
  model_loader.utils.get_model_architecture   around: a trace_fp4 Mixtral keeps the FusedMoE model,
                                                      not QuantMixtralForCausalLM (architectures.py)
From there SGLang's own customized_info path carries the payload through the detokenizer to the
response's meta_info. Each hook finds its engine's state on the object it receives (state.state_of).
"""

import logging

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from . import transport
from .architectures import model_architecture_hook
from .capture_setup import init_capture
from .kv import attention_forward_hook, set_kv_buffer_hook
from .kv_sizing import packed_cell_size_hook
from .state import state_of

logger = logging.getLogger(__name__)

_MR = "sglang.srt.model_executor.model_runner.ModelRunner"
_POOL = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool"
_ATTN = "sglang.srt.layers.radix_attention.RadixAttention"
_POOL_SIZING = "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator"
_RESULTS = "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"
_STREAMER = "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer"


def _after_init_capturer(result, runner, *args, **kwargs):
    if not getattr(runner, "is_draft_worker", False):
        init_capture(runner)
    return result


def _around_forward(original, runner, *args, **kwargs):
    state = state_of(runner)
    if state is None or not state.active:
        return original(runner, *args, **kwargs)
    forward_batch = args[0] if args else kwargs["forward_batch"]
    state.begin_forward(forward_batch)
    try:
        out = original(runner, *args, **kwargs)
    except BaseException:
        state.abandon_forward()
        raise
    state.end_forward(forward_batch)
    return out


def _after_request_finished(result, processor, req, *args, **kwargs):
    state = state_of(processor.req_to_token_pool)
    if state is None or state.buffers is None:
        return result
    counters = state.counters
    if _is_aborted(req):
        # An aborted sample is not trained on: build nothing (its slots are reused like any other).
        counters.count("records_skipped.aborted")
        return result
    if getattr(req, "stream", False):
        # SGLang 0.5.23 sends request-level customized_info of a streamed request with its first
        # chunk only, before the record exists: counted and logged, never silently lost.
        counters.count("records_not_returned.streaming")
        logger.warning("trace_fp4: request %s is streamed; its guidance record cannot be returned", req.rid)
        return result
    seqlen = len(req.origin_input_ids) + len(req.output_ids_through_stop)
    slots = processor.req_to_token_pool.req_to_token[req.kv.req_pool_idx][: seqlen - 1]
    # Identity: the ids whose rows the record holds (prompt + generated, without the last sampled one).
    tokens = list(req.origin_input_ids) + list(req.output_ids_through_stop)
    record = state.build_record(slots, token_ids=tokens[: seqlen - 1], num_prompt_tokens=len(req.origin_input_ids))
    if record is None:
        return result  # tensor parallel, not rank 0: this rank sent its part; rank 0 returns the record
    counters.count("records_built")
    payload = transport.encode(record, req.rid, counters.snapshot(), state.weights.current()[1])
    if req.customized_info is None:
        req.customized_info = {}
    req.customized_info[transport.META_KEY] = [payload]
    return result


def _is_aborted(req) -> bool:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return isinstance(req.finished_reason, FINISH_ABORT)


def _around_request_level_key(original, streamer, key, *args, **kwargs):
    return key == transport.META_KEY or original(streamer, key, *args, **kwargs)


def register_hooks() -> None:
    HookRegistry.register(f"{_MR}.init_routed_experts_capturer", _after_init_capturer, HookType.AFTER)
    HookRegistry.register(f"{_MR}.forward", _around_forward, HookType.AROUND)
    HookRegistry.register(f"{_POOL_SIZING}._compute_cell_size", packed_cell_size_hook, HookType.AROUND)
    HookRegistry.register(f"{_ATTN}.forward", attention_forward_hook, HookType.AROUND)
    HookRegistry.register(f"{_POOL}.set_kv_buffer", set_kv_buffer_hook, HookType.AROUND)
    HookRegistry.register(f"{_RESULTS}._maybe_collect_routed_experts", _after_request_finished, HookType.AFTER)
    HookRegistry.register(f"{_STREAMER}.is_request_level_customized_info_key", _around_request_level_key, HookType.AROUND)
    # (HookRegistry also rebinds loader.py's `from .utils import get_model_architecture`)
    HookRegistry.register("sglang.srt.model_loader.utils.get_model_architecture", model_architecture_hook, HookType.AROUND)

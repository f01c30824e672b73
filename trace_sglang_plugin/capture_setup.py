"""Setting up trace_fp4 in an SGLang model runner once its KV pool exists (SGLang 0.5.23).

`init_capture(runner)` finds the engine's state (made by its TraceFp4SGLangConfig), checks the model and
the server set-up against what capture assumes (refusing the rest with a message), packs the KV pool
(TRACE_FP4_KV_CACHE), sizes the capture buffers, and hangs the state on the objects the hooks receive.
"""

import logging

from trace_kernels import model_shape_from_hf
from trace_kernels.engine import kv_cache_mode
from trace_kernels.engine.refusals import refuse_kv_head_split, refuse_multiple_ranks

from .capture_buffers import CaptureBuffers
from .config import TraceFp4SGLangConfig
from .kv_pool import make_packed
from .state import STATE_ATTR, EngineState

logger = logging.getLogger(__name__)


def init_capture(runner) -> None:
    """Called once the KV pool exists (after SGLang sets up its own routed-experts capturer)."""
    state = _find_state(runner.model)
    if state is None:
        return  # not a trace_fp4 model: stay inactive
    trace = state.trace
    hf = runner.model_config.hf_text_config
    where = f"model {getattr(runner.model_config, 'model_path', '')}".rstrip()
    shape = model_shape_from_hf(hf, where=f"trace_fp4: {where}")  # the one per-layer definition
    L = shape.num_layers
    trace.check_layers(L, where=where, shape=shape)
    if shape.kv_kind == "mla" and trace.quantize_kv:
        # The K/V hook quantizes RadixAttention's k/v, which for MLA are not the cached latent kv_c:
        # refuse rather than record the wrong tensor (the vLLM plugin has the kv_latent site).
        raise NotImplementedError(
            f"trace_fp4 (SGLang): {where}: MLA latent KV (site kv_latent) is not implemented in the SGLang "
            "plugin; use vLLM, or quantize_kv=false"
        )
    if sorted(state.moe_layers) != shape.moe_layer_list():
        raise ValueError(
            f"trace_fp4: the model's routed-expert layers per its config are {shape.moe_layer_list()}, but "
            f"trace_fp4's MoE method was built for layers {sorted(state.moe_layers)}"
        )
    if trace.capture and not (trace.quantize_expert_inputs and trace.quantize_kv):
        if any(m is not None for m in trace.layer_modes(L)):
            raise ValueError(
                "trace_fp4: capture with guided layers needs quantize_expert_inputs=true and "
                "quantize_kv=true (guidance is the codes of the quantized inputs and KV)"
            )
    _check_kv_pool(runner.token_to_kv_pool)
    _check_server_args()
    from .tensor_parallel import rank_shape, refuse_padded_layout, tp_rank_and_size

    state.tp_rank, state.tp_size = tp_rank_and_size()
    refuse_padded_layout(hf, state.tp_size)
    refuse_kv_head_split(shape, state.tp_size)
    state.shape = shape
    state.kv_pool = runner.token_to_kv_pool
    state.adopt_counters(runner.model_config)
    if trace.quantize_kv:
        mode = kv_cache_mode()
        if mode == "packed" and trace.bf16_layers:
            raise ValueError(
                f"trace_fp4: bf16_layers={list(trace.bf16_layers)} keep those layers' K/V in BF16, but the packed KV "
                "pool holds NVFP4 rows for every layer; set TRACE_FP4_KV_CACHE=dequantized"
            )
        if mode == "packed" and not getattr(runner.token_to_kv_pool, "trace_fp4_packed", False):
            make_packed(runner.token_to_kv_pool, state.current_forward_batch, runner.req_to_token_pool, state.counters,
                        trace.block_scale)
            logger.info("trace_fp4: KV pool holds packed NVFP4 rows (%s)", runner.token_to_kv_pool.get_kv_size_bytes())
    if trace.capture:
        from sglang.srt.runtime_context import get_schedule

        num_slots = runner.kv_index_translator.capture_token_capacity(runner.max_token_pool_size)
        max_tokens = max(int(get_schedule().chunked_prefill_size or 0), int(runner.max_running_requests), 1)
        guided = [m is not None for m in trace.layer_modes(L)]
        kv_layers = [i for i in shape.kv_layer_list() if not trace.is_bf16_layer(i)]
        # Tensor parallel: this rank's rows (its fc2 slice, its KV heads); the record is assembled at TP rank 0.
        state.buffers = CaptureBuffers(rank_shape(shape, state.tp_size), guided, num_slots, max_tokens, runner.device,
                                       kv_layers)
        logger.info(
            "trace_fp4: capture buffers for %d KV slots (%.1f MB host), staging %d tokens",
            num_slots,
            state.buffers.host_nbytes() / 2**20,
            max_tokens,
        )
    _hang(state, runner)


def _hang(state, runner) -> None:
    """Hang the state on the objects the hooks receive, so each finds its own engine's state."""
    from sglang.srt.layers.radix_attention import RadixAttention

    for obj in (runner, runner.token_to_kv_pool, runner.req_to_token_pool):
        setattr(obj, STATE_ATTR, state)
    for module in runner.model.modules():
        if isinstance(module, RadixAttention):
            setattr(module, STATE_ATTR, state)


def _find_state(model) -> EngineState | None:
    """The EngineState of the model's trace_fp4 quant config (on the model, or on its MoE methods)."""
    qc = getattr(model, "quant_config", None)
    if isinstance(qc, TraceFp4SGLangConfig):
        return qc.state
    for module in model.modules():
        qc = getattr(module, "quant_config", None)
        if isinstance(qc, TraceFp4SGLangConfig):
            return qc.state
        state = getattr(getattr(module, "quant_method", None), "state", None)
        if isinstance(state, EngineState):
            return state
    return None


def _check_kv_pool(pool) -> None:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from .kv_pool import TraceFp4PackedKVPool

    if type(pool) not in (MHATokenToKVPool, TraceFp4PackedKVPool):
        raise NotImplementedError(
            f"trace_fp4: the KV pool is {type(pool).__name__}; the NVFP4 KV path hooks "
            "MHATokenToKVPool.set_kv_buffer only (plain multi-head attention KV cache, --kv-cache-dtype auto)"
        )
    if getattr(pool, "is_quantized_kv_cache", False):
        raise NotImplementedError("trace_fp4: use --kv-cache-dtype auto; trace_fp4 quantizes the KV cache itself")


def _check_server_args() -> None:
    """Set-ups where KV write slots, MoE token order or record ownership differ from what capture assumes."""
    from sglang.srt.runtime_context import get_server_args

    args = get_server_args()
    refused = {
        "enable_unified_memory": "the unified KV pool writes to physical ids that differ from req_to_token's",
        "enable_dp_attention": "DP attention scatters a batch's tokens across ranks",
        "speculative_algorithm": "speculative decoding runs draft/verify tokens that are not the sample's",
    }
    for name, why in refused.items():
        if getattr(args, name, None):
            raise NotImplementedError(f"trace_fp4: {name} is not supported with capture ({why})")
    # Tensor parallel ranks each capture their part; TP rank 0 assembles the record (tensor_parallel.py).
    refuse_multiple_ranks({"pp_size": getattr(args, "pp_size", 1), "ep_size": getattr(args, "ep_size", 1)})

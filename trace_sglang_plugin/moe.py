"""TraceFp4MoEMethod: SGLang's FusedMoE quant method for trace_fp4 (routed experts only; SGLang 0.5.23).

Weights: packed NVFP4 only (docs/architecture.md): `layer.trace_w13`, `layer.trace_w2`
(`trace_kernels.grouped_mm.PackedExperts`: codes uint8 [E, N, K/2], E4M3 scales [E, N, K/16], fp32
amax [E]). `w13_weight` / `w2_weight` are meta-device parameters (no storage) that keep SGLang's
checkpoint mapping working; their `weight_loader` requantizes each expert's projection as it arrives
(`ExpertWeightStream`: RTN with the expert's own tensor amax, the vLLM plugin's and the trainer's
convention; gate and up of one expert are held until both have come). So the initial load and
SGLang's weight updates (`update_weights_from_tensor`, `update_weights_from_distributed`,
`update_weights_from_disk`, all through `model.load_weights`) write the packed tensors in place;
`process_weights_after_loading` (load, and `end_weight_update`) checks that no half is left waiting
and refreshes the weight digest. `restore_weights_before_loading` has nothing to undo.
(`load_format="direct"` copies into parameters by name and bypasses the loaders: not supported.)

`quantize_expert_weights=false` (ablation) keeps SGLang's BF16 parameters.

Forward: `trace_kernels.routed_experts`, the NVFP4 grouped GEMM that quantizes the inputs of both
expert GEMMs on load and returns the captured codes (Triton on CUDA tensors, the bit-identical torch
backend on the CPU).
"""

from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod
from sglang.srt.utils import set_weight_attrs

import trace_kernels

from trace_kernels.engine.refusals import (
    check_expert_dims, refuse_non_gated, refuse_parallel_experts, refuse_router_weight_on_input,
)
from trace_kernels.grouped_mm import install_packed_experts, resident_bytes
from trace_kernels.routed_experts import activation_fn, routed_experts, routed_experts_emulated
from trace_kernels.weight_digest import layer_digest


class TraceFp4MoEMethod(UnquantizedFusedMoEMethod):
    def __init__(self, trace, prefix: str, state):
        super().__init__(use_triton_kernels=False)
        self.trace = trace
        self.state = state  # the engine's EngineState (state.py)
        self.counters = state.counters
        self.prefix = prefix
        self.layer_id: int | None = None
        self.tp_rank, self.tp_size = 0, 1

    # ---- weights -------------------------------------------------------------------------------
    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype, **extra):
        check_expert_dims(self.prefix, hidden_size, intermediate_size_per_partition)
        if extra.get("with_bias"):
            raise NotImplementedError(f"trace_fp4: {self.prefix}: expert biases are not supported")
        # Tensor parallel: each rank holds every expert's slice of the intermediate dimension, quantized
        # with the whole expert's amax (tensor_parallel.py). Expert parallel is not wired here yet.
        refuse_parallel_experts(self.prefix, 1, getattr(layer, "moe_ep_size", 1), "run with ep_size=1")
        self.tp_rank, self.tp_size = int(getattr(layer, "moe_tp_rank", 0)), int(getattr(layer, "moe_tp_size", 1))
        if self.tp_size > 1 and not self.trace.quantize_expert_weights:
            raise NotImplementedError(f"trace_fp4: {self.prefix}: tp_size={self.tp_size} with quantize_expert_weights=false "
                                      "(the BF16 ablation) is not supported; run with tp_size=1")
        self.layer_id = int(layer.layer_id)
        self.state.register_moe_layer(self.layer_id)
        # A BF16 boundary layer keeps its experts unquantized (TraceConfig.for_layer); every other
        # decision of this method reads self.trace.
        self.trace = self.trace.for_layer(self.layer_id)
        if not self.trace.quantize_expert_weights:
            super().create_weights(layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype, **extra)
            return
        self.stream = install_packed_experts(
            layer, num_experts, intermediate_size_per_partition, hidden_size, params_dtype, where=self.prefix,
            attrs={k: v for k, v in extra.items() if k not in ("weight_loader", "with_bias")},
            set_weight_attrs=set_weight_attrs, weight_loader=self._make_loader(layer),
            tp_rank=self.tp_rank, tp_size=self.tp_size, block_scale=self.trace.block_scale,
        )

    def _make_loader(self, layer):
        def weight_loader(param, loaded_weight, weight_name, shard_id, expert_id=None):
            """Requantize one expert's projection into the packed tensors as it arrives."""
            if expert_id is None:
                raise NotImplementedError(f"trace_fp4: {self.prefix}: fused all-expert weight tensors are not supported")
            e = layer._map_global_expert_id_to_local_expert_id(expert_id)
            if e == -1:
                return
            full = layer.trace_w2.shape[2] * self.tp_size
            got = loaded_weight.shape[1] if shard_id == "w2" else loaded_weight.shape[0]
            if self.tp_size > 1 and got < full:
                # SGLang's CPU engine padded moe_intermediate_size for this tp_size (tensor_parallel.py).
                raise NotImplementedError(
                    f"trace_fp4: {self.prefix}: tp_size={self.tp_size}: SGLang padded moe_intermediate_size from "
                    f"{got} to {full} to split it over the ranks, and a record holds the model's own rows; use a "
                    f"tp_size that divides it (on the CPU moe_intermediate_size must be a multiple of 32 x tp_size)"
                )
            self.stream.load(shard_id, e, loaded_weight)
            self.counters.count("expert_weight_shards_quantized")

        return weight_loader

    def create_moe_runner(self, layer, moe_runner_config):
        cfg = moe_runner_config
        refuse_non_gated(self.prefix, cfg.is_gated, cfg.activation)
        activation_fn(cfg.activation)  # clear error now for an unsupported activation
        if cfg.activation == "swigluoai":
            # trace_kernels has gpt-oss's swigluoai (and expert biases), but this plugin's loaders do not
            # de-interleave gpt-oss's gate/up rows or take biases yet: refuse rather than compute wrongly.
            raise NotImplementedError(
                f"trace_fp4: {self.prefix}: gpt-oss experts (swigluoai) are supported by the vLLM plugin only, not yet in SGLang"
            )
        refuse_router_weight_on_input(self.prefix, cfg.apply_router_weight_on_input)
        if getattr(cfg, "num_fused_shared_experts", 0):
            raise NotImplementedError(f"trace_fp4: {self.prefix}: fused shared experts are not supported")
        self.moe_runner_config = cfg
        # No SGLang runner: `apply` runs trace_kernels.routed_experts (get_moe_runner_backend() -> None
        # means "a direct kernel consuming standard TopK with local ids").
        self.runner = None
        self._aiter_runner = None

    def get_moe_runner_backend(self, layer):
        return None

    def process_weights_after_loading(self, layer) -> None:
        """At load and at the end of every weight update: the loaders already quantized each expert;
        check that no gate/up half is left waiting, and refresh the weight digest."""
        digest = None
        if self.trace.quantize_expert_weights:
            self.stream.check_complete()
            digest = self._digest(layer)
        if not self.trace.is_bf16_layer(self.layer_id):  # the digest covers the NVFP4 expert layers only
            self.state.weights.updated(self.layer_id, digest)  # version: one more than before (1 at load)
        self.counters.count("expert_weight_quantizations")
        held, bf16 = resident_bytes(layer)  # memory measured in the engine (bench/sglang_capture.py)
        self.counters.set_value(f"expert_resident_bytes.layer{self.layer_id}", held)
        self.counters.set_value(f"expert_bf16_bytes.layer{self.layer_id}", bf16)

    def _digest(self, layer) -> str:
        """The layer's weights digest in the single-rank layout (with TP a collective over the ranks)."""
        if self.tp_size == 1:
            return layer_digest(layer.trace_w13, layer.trace_w2)
        from .tensor_parallel import full_layer_digest

        return full_layer_digest(layer.trace_w13, layer.trace_w2, self.prefix)

    def restore_weights_before_loading(self, layer) -> None:
        # Nothing was repacked: new weights stream into the packed tensors through the loaders.
        self.counters.count("expert_weight_restores")

    # ---- forward -------------------------------------------------------------------------------
    def _amax(self, site, t):
        # per-token amax (batch invariant) unless the config calibrated a static one; values above a
        # static amax are counted (the decision vLLM and the trainer make too)
        a = trace_kernels.site_amax(self.trace, self.layer_id, site, t, saturated=self.counters.saturation)
        if site == "moe_fc2_in" and self.tp_size > 1 and self.trace.activation_scale != "static":
            # Tensor parallel: each rank holds a slice of the row; its amax spans all of them.
            from .tensor_parallel import all_reduce_row_amax

            a = all_reduce_row_amax(a)
        return a

    def apply(self, layer, dispatch_output):
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput

        x = dispatch_output.hidden_states
        topk_weights, topk_ids, _ = dispatch_output.topk_output
        idx = self.layer_id
        act = self.moe_runner_config.activation
        self.counters.count("moe_calls")
        self.counters.count(f"moe_calls.layer{idx}")
        if self.trace.quantize_expert_weights and self.trace.quantize_expert_inputs:
            self.counters.count("nvfp4_grouped_gemm_calls")
            out, q1, q2 = routed_experts(
                x, topk_weights, topk_ids, layer.trace_w13, layer.trace_w2, act, capture=True, amax=self._amax,
            )
        else:
            # Ablation modes: a per-expert float32 loop (counted: not the FP4 execution path).
            self.counters.count("emulated_expert_gemm_calls")
            if self.trace.quantize_expert_weights:
                w13, w2 = layer.trace_w13, layer.trace_w2
            else:
                w13, w2 = layer.w13_weight, layer.w2_weight
            quantize = None
            if self.trace.quantize_expert_inputs:
                # per-token amax (batch invariant) unless the config calibrated a static one
                quantize = lambda t, site: trace_kernels.quantize_dequantize(  # noqa: E731
                    t, global_amax=trace_kernels.site_amax(self.trace, idx, site, t, saturated=self.counters.saturation),
                    block_scale=self.trace.block_scale,
                )
            out, q1, q2 = routed_experts_emulated(x, topk_weights, topk_ids, w13, w2, act, quantize)
        self.state.capture_moe(idx, topk_ids, q1, q2)
        return StandardCombineInput(hidden_states=out)

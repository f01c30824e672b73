"""TraceFP4MoEMethod: the FusedMoE quant method of trace_fp4 (routed experts only).

Weights: packed NVFP4 only (DESIGN.md section 9). Resident per layer: `layer.trace_w13` and
`layer.trace_w2` (`trace_kernels.grouped_mm.PackedExperts`: codes uint8 [E, N, K/2], E4M3 scales
[E, N, K/16], fp32 amax [E]). There is no BF16 master: `w13_weight` / `w2_weight` exist only as
meta-device parameters (no storage) so that vLLM's checkpoint mapping finds them, and their
`weight_loader` requantizes each expert's slice as it arrives (`ExpertWeightStream`: round-to-nearest
with the expert's own tensor amax, the trainer's and a fresh load's convention; gate and up of one
expert are held until both have come). So loading, an RL trainer's `model.load_weights(...)`
weight sync, and vLLM's `reload_weights` (layerwise reload) all end in the same packed tensors,
written in place.

vLLM's layerwise reload materializes each layer's meta parameters after its weights have arrived and
replays the loaders on them; the replay finds the experts already quantized and skips them (the
materialized BF16 storage is released when the layer is put back).

`quantize_expert_weights=false` (ablation) keeps vLLM's BF16 parameters instead.

The forward is `experts.moe_experts` behind a custom op (see experts.py).
"""

import torch

import trace_kernels
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.models.utils import extract_layer_index
from vllm.model_executor.utils import set_weight_attrs

from trace_kernels.grouped_mm import install_packed_experts, resident_bytes
from trace_kernels.routed_experts import activation_fn
from trace_kernels.weight_digest import layer_digest

from . import experts
from .capture import STORE

logger = init_logger(__name__)


class TraceFP4MoEMethod(FusedMoEMethodBase):
    def __init__(self, moe, config, layer_name: str):
        super().__init__(moe)
        self.config = config
        self.layer_name = layer_name
        self.layer_idx = extract_layer_index(layer_name)
        self.activation = moe.activation.value
        activation_fn(self.activation)  # clear error now for unsupported activations
        if not moe.activation.is_gated:
            raise NotImplementedError(f"trace_fp4: non-gated MoE activation {self.activation!r}")
        if moe.has_bias:
            raise NotImplementedError(f"trace_fp4: {layer_name}: expert biases are not supported")
        if moe.moe_parallel_config.tp_size > 1 or moe.moe_parallel_config.ep_size > 1:
            raise NotImplementedError(
                f"trace_fp4: {layer_name}: tensor/expert parallel MoE is not supported yet (records "
                "would be split across ranks); run with tensor_parallel_size=1"
            )
        self.weights_version = 0

    # ---- weights -------------------------------------------------------------------------------
    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype, **extra):
        for name, size in (("hidden_size", hidden_size), ("moe_intermediate_size", intermediate_size_per_partition)):
            if size % trace_kernels.BLOCK_SIZE:
                raise ValueError(
                    f"trace_fp4: {self.layer_name}: {name}={size} is not divisible by "
                    f"{trace_kernels.BLOCK_SIZE} (NVFP4 quantizes blocks of 16 along the GEMM K dimension)"
                )
        if getattr(layer, "apply_router_weight_on_input", False):
            raise NotImplementedError(
                f"trace_fp4: {self.layer_name}: apply_router_weight_on_input models are not supported "
                "(the routing weight must be applied after the down projection)"
            )
        # Unique per module instance: two engines in one process must not share a registry entry.
        self.op_layer_name = f"{layer.layer_name}@{id(layer):x}"
        experts.LAYERS[self.op_layer_name] = layer
        if not self.config.quantize_expert_weights:
            # Ablation: vLLM's own BF16 parameters and loaders.
            UnquantizedFusedMoEMethod.create_weights(
                self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype, **extra
            )
            return
        self.stream = install_packed_experts(
            layer, num_experts, intermediate_size_per_partition, hidden_size, params_dtype, where=self.layer_name,
            attrs={k: v for k, v in extra.items() if k != "weight_loader"},
            set_weight_attrs=set_weight_attrs, weight_loader=self._make_loader(layer),
        )

    def _make_loader(self, layer):
        def weight_loader(param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
            """Requantize one expert's projection into the packed tensors as it arrives."""
            e = layer._map_global_expert_id_to_local_expert_id(expert_id)
            if e == -1:
                return False if return_success else None
            if not param.is_meta:
                # vLLM's layerwise reload replays the loaders on materialized copies of the meta
                # parameters: these experts were quantized when the weights first arrived.
                STORE.count("expert_weight_replays_skipped")
                return True if return_success else None
            self.stream.load(shard_id, e, loaded_weight)
            STORE.count("expert_weight_shards_quantized")
            STORE.weights_changed(self.layer_idx, lambda: layer_digest(layer.trace_w13, layer.trace_w2))
            # A copy into the meta parameter costs nothing; vLLM's layerwise reload counts copied
            # elements to know when a layer is complete.
            rows = slice(None) if shard_id == "w2" else (
                slice(0, param.shape[1] // 2) if shard_id == "w1" else slice(param.shape[1] // 2, None)
            )
            param.data[e, rows].copy_(loaded_weight.to("meta"))
            return True if return_success else None

        return weight_loader

    def process_weights_after_loading(self, layer) -> None:
        """Nothing to quantize here (the loaders did it expert by expert): check that no gate/up half
        is still waiting for its partner, and count the update."""
        if self.config.quantize_expert_weights:
            self.stream.check_complete()
        self.weights_version += 1
        # The records' weights identity: version counter and the digest both engines compute.
        digest = layer_digest(layer.trace_w13, layer.trace_w2) if self.config.quantize_expert_weights else None
        STORE.weights_updated(self.layer_idx, digest, self.weights_version)
        STORE.count("expert_weight_quantizations")
        # Memory measured in the engine. (Inside vLLM's layerwise reload the placeholder parameters
        # are transiently materialized here; they are put back on meta right after, so they are not
        # counted: tests/test_vllm_weight_update.py measures the layer after the reload as well.)
        held, bf16 = resident_bytes(layer, skip=("w13_weight", "w2_weight") if self.config.quantize_expert_weights else ())
        STORE.counters[f"expert_resident_bytes.layer{self.layer_idx}"] = held
        STORE.counters[f"expert_bf16_bytes.layer{self.layer_idx}"] = bf16

    def gemm_weights(self, layer):
        """(w13, w2): PackedExperts, or vLLM's BF16 parameters in the ablation mode."""
        if self.config.quantize_expert_weights:
            return layer.trace_w13, layer.trace_w2
        return layer.w13_weight.data, layer.w2_weight.data

    def get_fused_moe_quant_config(self, layer) -> FusedMoEQuantConfig | None:
        return FusedMoEQuantConfig.make()

    # ---- forward -------------------------------------------------------------------------------
    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        # Shared experts (if any) are run by vLLM's MoE runner before this call, outside the FP4 path.
        return torch.ops.vllm.trace_fp4_moe_experts(x, topk_weights, topk_ids, self.op_layer_name)


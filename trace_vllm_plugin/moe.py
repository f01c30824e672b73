"""TraceFP4MoEMethod: the FusedMoE quant method of trace_fp4 (routed experts only).

Weights: packed NVFP4 only (docs/architecture.md). Resident per layer: `layer.trace_w13` and
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

gpt-oss (`has_bias`, activation "swigluoai"): the expert biases (fc1 [E, 2I], fc2 [E, H]) are plain
parameters in the model dtype, NOT quantized (they never enter an FP4 GEMM; the grouped GEMM adds them
in fp32 after the scaled dot, `trace_kernels.routed_experts`). HF stores gate/up interleaved; the
loader (`load_gpt_oss_expert`) de-interleaves weight rows and fc1 bias to [gate; up] once, at load,
which changes no FP4 code. vLLM's gpt-oss loader bypasses weight loaders for fused expert tensors, so
`trace_fp4_patches.vllm_gpt_oss_experts` routes them here. Capture is unchanged: moe_fc1_in is the
token row, moe_fc2_in the activation's output (after bias and clamp), unscaled by the routing weight.
"""

import torch

from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.models.utils import extract_layer_index
from vllm.model_executor.utils import set_weight_attrs

from trace_kernels.engine.refusals import (
    check_expert_dims, refuse_non_gated, refuse_router_weight_on_input,
)
from trace_kernels.grouped_mm import install_packed_experts, resident_bytes
from trace_kernels.routed_experts import SWIGLUOAI_LIMIT, activation_fn, deinterleave_gate_up
from trace_kernels.weight_digest import layer_digest

from .experts import capture_operands, layer_experts, register_layer

logger = init_logger(__name__)


class TraceFP4MoEMethod(FusedMoEMethodBase):
    def __init__(self, moe, config, layer_name: str, store):
        super().__init__(moe)
        self.config = config
        self.store = store  # the engine's CaptureStore (trace_vllm_plugin.capture)
        self.layer_name = layer_name
        self.layer_idx = extract_layer_index(layer_name)
        self.activation = moe.activation.value
        activation_fn(self.activation)  # clear error now for unsupported activations
        refuse_non_gated(layer_name, moe.activation.is_gated, self.activation)
        self.has_bias = bool(moe.has_bias)
        if self.activation == "swigluoai":
            _check_swigluoai_model(layer_name)
        par = moe.moe_parallel_config
        # Tensor parallel: each rank holds every expert's slice of the intermediate dimension; expert
        # parallel: each rank holds whole experts (tensor_parallel.py).
        self.tp_rank, self.tp_size = (par.tp_rank, par.tp_size) if par.tp_size > 1 else (0, 1)
        self.ep_size = par.ep_size if par.use_ep and par.ep_size > 1 else 1
        what = f"tensor_parallel_size={self.tp_size}" if self.tp_size > 1 else f"expert parallel size {self.ep_size}"
        if (self.tp_size > 1 or self.ep_size > 1) and not config.quantize_expert_weights:
            raise NotImplementedError(
                f"trace_fp4: {layer_name}: {what} with quantize_expert_weights=false (the BF16 ablation) is not "
                "supported; run with one rank"
            )
        if (self.tp_size > 1 or self.ep_size > 1) and self.has_bias:
            raise NotImplementedError(
                f"trace_fp4: {layer_name}: {what} with expert biases (gpt-oss) is not supported; run with one rank"
            )
        self.weights_version = 0

    # ---- weights -------------------------------------------------------------------------------
    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype, **extra):
        check_expert_dims(self.layer_name, hidden_size, intermediate_size_per_partition)
        refuse_router_weight_on_input(self.layer_name, getattr(layer, "apply_router_weight_on_input", False))
        # The custom op finds the layer in this engine's forward context by this name.
        self.op_layer_name = register_layer(layer)
        # The static capture buffers the op writes, made now so that they exist (at fixed addresses)
        # before vLLM compiles the model or captures a graph; passed to the op as its operands.
        self.capture_operands = capture_operands(
            self.store, self.layer_idx, hidden_size, intermediate_size_per_partition, self.moe.experts_per_token
        )
        if not self.config.quantize_expert_weights:
            # Ablation: vLLM's own BF16 parameters and loaders (biases included when the model has them).
            UnquantizedFusedMoEMethod.create_weights(
                self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype, **extra
            )
            return
        loader = self._make_loader(layer)
        self.stream = install_packed_experts(
            layer, num_experts, intermediate_size_per_partition, hidden_size, params_dtype, where=self.layer_name,
            attrs={k: v for k, v in extra.items() if k != "weight_loader"},
            set_weight_attrs=set_weight_attrs, weight_loader=loader, tp_rank=self.tp_rank, tp_size=self.tp_size,
            block_scale=self.config.block_scale,
        )
        if self.has_bias:
            # Expert biases stay in the model dtype, unquantized ([gate; up] order for fc1).
            for name, shape in (("w13_bias", (num_experts, 2 * intermediate_size_per_partition)), ("w2_bias", (num_experts, hidden_size))):
                param = torch.nn.Parameter(torch.zeros(shape, dtype=params_dtype), requires_grad=False)
                layer.register_parameter(name, param)
                set_weight_attrs(param, {k: v for k, v in extra.items() if k != "weight_loader"})
                param.weight_loader = loader

    # ---- gpt-oss: fused / per-expert HF tensors (interleaved gate/up) ------------------------------
    def load_gpt_oss_expert(self, layer, kind: str, e: int, w: torch.Tensor) -> None:
        """One expert's tensor in HF gpt-oss layout: w13_weight [H, 2I] (gate/up interleaved along 2I),
        w2_weight [I, H], w13_bias [2I] (interleaved), w2_bias [H]."""
        if not w.is_floating_point():
            # gpt-oss's released checkpoints hold MXFP4 blocks (uint8) under these names.
            raise ValueError(
                f"trace_fp4: {self.layer_name}: {kind} is {w.dtype} (an MXFP4 gpt-oss checkpoint?); trace_fp4 "
                "requantizes BF16 expert weights: dequantize the checkpoint to BF16 first"
            )
        if kind == "w13_weight":
            w = deinterleave_gate_up(w, -1).t()  # [2I, H], [gate; up]
        elif kind == "w2_weight":
            w = w.t()  # [H, I]
        elif kind == "w13_bias":
            w = deinterleave_gate_up(w, -1)
        elif kind != "w2_bias":
            raise ValueError(f"trace_fp4: {self.layer_name}: unknown gpt-oss expert tensor {kind!r}")
        if kind.endswith("_bias"):
            getattr(layer, kind).data[e].copy_(w)
            self.store.count("expert_bias_rows_loaded")
        elif self.config.quantize_expert_weights:
            (layer.trace_w13 if kind == "w13_weight" else layer.trace_w2).quantize_expert_(e, w)
            self.store.count("expert_weight_shards_quantized")
            self.store.weights.changed(self.layer_idx, lambda: self._digest(layer))
        else:
            getattr(layer, kind).data[e].copy_(w)

    def load_gpt_oss_experts(self, layer, kind: str, w: torch.Tensor) -> None:
        """A fused HF tensor of all experts ([E, ...]; what vLLM's gpt-oss loader would `copy_`)."""
        E = layer.trace_w13.shape[0] if self.config.quantize_expert_weights else layer.w13_weight.shape[0]
        if w.shape[0] != E:
            raise ValueError(f"trace_fp4: {self.layer_name}: {kind} has {w.shape[0]} experts, the layer {E}")
        for e in range(E):
            g = layer._map_global_expert_id_to_local_expert_id(e)
            if g != -1:
                self.load_gpt_oss_expert(layer, kind, g, w[e])

    def _make_loader(self, layer):
        def weight_loader(param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
            """Requantize one expert's projection into the packed tensors as it arrives."""
            e = layer._map_global_expert_id_to_local_expert_id(expert_id)
            if e == -1:
                return False if return_success else None
            if shard_id in ("gpt_oss_w13", "gpt_oss_w2"):
                # vLLM's streamed gpt-oss checkpoints (one expert per tensor, HF layout).
                kind = ("w13_" if shard_id == "gpt_oss_w13" else "w2_") + ("bias" if weight_name.endswith("_bias") else "weight")
                self.load_gpt_oss_expert(layer, kind, e, loaded_weight)
                return True if return_success else None
            if param.dim() == 2:  # an expert bias through FusedMoE's shard convention (w1 / w3 / w2)
                rows = slice(None) if shard_id == "w2" else (
                    slice(0, param.shape[1] // 2) if shard_id == "w1" else slice(param.shape[1] // 2, None)
                )
                param.data[e, rows].copy_(loaded_weight)
                self.store.count("expert_bias_rows_loaded")
                return True if return_success else None
            if not param.is_meta:
                # vLLM's layerwise reload replays the loaders on materialized copies of the meta
                # parameters: these experts were quantized when the weights first arrived.
                self.store.count("expert_weight_replays_skipped")
                return True if return_success else None
            self.stream.load(shard_id, e, loaded_weight)
            self.store.count("expert_weight_shards_quantized")
            self.store.weights.changed(self.layer_idx, lambda: self._digest(layer))
            # A copy into the meta parameter costs nothing; vLLM's layerwise reload counts copied
            # elements to know when a layer is complete.
            rows = slice(None) if shard_id == "w2" else (
                slice(0, param.shape[1] // 2) if shard_id == "w1" else slice(param.shape[1] // 2, None)
            )
            if self.tp_size > 1:  # the full projection arrived; this rank holds its slice
                dim = 1 if shard_id == "w2" else 0
                n = loaded_weight.shape[dim] // self.tp_size
                loaded_weight = loaded_weight.narrow(dim, self.tp_rank * n, n)
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
        digest = self._digest(layer) if self.config.quantize_expert_weights else None
        if not self.config.is_bf16_layer(self.layer_idx):  # the digest covers the NVFP4 expert layers only
            self.store.weights.updated(self.layer_idx, digest, self.weights_version)
        self.store.count("expert_weight_quantizations")
        # Memory measured in the engine. (Inside vLLM's layerwise reload the placeholder parameters
        # are transiently materialized here; they are put back on meta right after, so they are not
        # counted: tests/vllm/test_vllm_weight_update.py measures the layer after the reload as well.)
        held, bf16 = resident_bytes(layer, skip=("w13_weight", "w2_weight") if self.config.quantize_expert_weights else ())
        self.store.counters.set_value(f"expert_resident_bytes.layer{self.layer_idx}", held)
        self.store.counters.set_value(f"expert_bf16_bytes.layer{self.layer_idx}", bf16)

    def _digest(self, layer) -> str:
        """The layer's weights digest in the single-rank layout (with TP / EP a collective over the ranks)."""
        if self.ep_size > 1:
            from .tensor_parallel import expert_parallel_digest, local_expert_ids

            ids = local_expert_ids(layer)
            self.store.ep_experts = ids  # which global experts this rank's records hold rows of
            return expert_parallel_digest(layer.trace_w13, layer.trace_w2, ids, layer.global_num_experts, self.layer_name)
        if self.tp_size == 1:
            return layer_digest(layer.trace_w13, layer.trace_w2)
        from .tensor_parallel import full_layer_digest

        return full_layer_digest(layer.trace_w13, layer.trace_w2, self.layer_name)

    def expert_biases(self, layer):
        """(fc1 bias [E, 2I], fc2 bias [E, H]) in the model dtype, or (None, None)."""
        if not self.has_bias:
            return None, None
        return layer.w13_bias.data, layer.w2_bias.data

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
        if torch.compiler.is_compiling():  # the graph holds the opaque custom op (experts.py: why)
            return torch.ops.vllm.trace_fp4_moe_experts(x, topk_weights, topk_ids, self.op_layer_name, *self.capture_operands)
        # Eager: the op's body itself, without torch's dispatcher and the forward-context lookup of the layer
        # (a few us a layer call); the same code and the same operands as the op.
        return layer_experts(layer, x, topk_weights, topk_ids, self.capture_operands)



def _check_swigluoai_model(layer_name: str) -> None:
    """gpt-oss's clamped SwiGLU: trace_kernels implements it with gpt-oss's constants (alpha 1.702,
    limit 7.0, as vLLM's own kernels do); a checkpoint with another swiglu_limit is refused. Installs
    the gpt-oss fused-expert loader patch (see trace_fp4_patches.vllm_gpt_oss_experts)."""
    from vllm.config import get_current_vllm_config

    from trace_fp4_patches.vllm_gpt_oss_experts import install_gpt_oss_loader

    hf = get_current_vllm_config().model_config.hf_config
    limit = getattr(hf, "swiglu_limit", SWIGLUOAI_LIMIT)
    if float(limit) != SWIGLUOAI_LIMIT:
        raise NotImplementedError(
            f"trace_fp4: {layer_name}: swiglu_limit={limit}; the swigluoai experts support gpt-oss's {SWIGLUOAI_LIMIT} only"
        )
    install_gpt_oss_loader()

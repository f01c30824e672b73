"""The routed experts of a Hugging Face MoE checkpoint, quantized exactly as the trace_fp4 engines hold them.

Per expert, gate and up are quantized as one tensor ([gate; up], one global amax over both: the
engines' resident w13 and vLLM's fused w13 share one global scale), down on its own. The codes and
scales come from `trace_kernels.grouped_mm.PackedExperts.quantize_expert_`, the very function the
vLLM and SGLang plugins run at load and after every weight update, on the weights cast to the dtype
the engines serve in. Nothing here quantizes by itself: the export only re-lays these bytes out.
"""

import re
from dataclasses import dataclass

import torch

from trace_kernels import BLOCK_SIZE, NVFP4Tensor
from trace_kernels.grouped_mm import PackedExperts

# Qwen3-MoE / Qwen2-MoE naming: one Linear per projection and expert.
EXPERT_WEIGHT = re.compile(r"^(?P<prefix>.*\.layers\.(?P<layer>\d+)\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class ExportError(ValueError):
    """A checkpoint that cannot be exported; the message names the tensor or field."""


@dataclass(frozen=True)
class QuantizedExpert:
    """One expert's projections: name -> NVFP4Tensor [N, K] with a one-element global amax.
    gate_proj and up_proj carry the same global amax (it covers both)."""

    layer: int
    expert: int
    prefix: str  # "model.layers.3.mlp.experts" (the expert index follows it)
    projections: dict[str, NVFP4Tensor]


def expert_weight_names(state: dict[str, torch.Tensor]) -> dict[tuple[int, int], dict[str, str]]:
    """(layer, expert) -> {projection: tensor name} for every routed-expert weight of the checkpoint."""
    found: dict[tuple[int, int], dict[str, str]] = {}
    for name in state:
        m = EXPERT_WEIGHT.match(name)
        if m:
            found.setdefault((int(m["layer"]), int(m["expert"])), {})[m["proj"]] = name
    return found


def check_expert_tensors(state: dict[str, torch.Tensor], experts: dict[tuple[int, int], dict[str, str]]) -> None:
    """Refuse, naming the tensor, an expert weight NVFP4 cannot hold: not 2-D, not a float, a last
    dimension that does not split into 16-value blocks, a missing projection, or gate/up of different
    shapes (they share one global scale, so they must stack)."""
    for (layer, expert), names in sorted(experts.items()):
        missing = [p for p in PROJECTIONS if p not in names]
        if missing:
            raise ExportError(f"layer {layer} expert {expert} has no {', '.join(missing)} weight (found {sorted(names.values())})")
        for proj in PROJECTIONS:
            name = names[proj]
            t = state[name]
            if t.dim() != 2 or not t.is_floating_point():
                raise ExportError(f"tensor {name}: expected a 2-D float weight, got {t.dtype} of shape {tuple(t.shape)}")
            if t.shape[1] % BLOCK_SIZE:
                raise ExportError(
                    f"tensor {name} has shape {tuple(t.shape)}: its input dimension {t.shape[1]} does not divide "
                    f"into {BLOCK_SIZE}-value NVFP4 blocks (one E4M3 scale per {BLOCK_SIZE} consecutive weights)"
                )
            if t.shape[1] % 2:
                raise ExportError(f"tensor {name} has shape {tuple(t.shape)}: two FP4 codes per byte need an even input dimension")
        g, u = state[names["gate_proj"]], state[names["up_proj"]]
        if g.shape != u.shape:
            raise ExportError(
                f"tensors {names['gate_proj']} {tuple(g.shape)} and {names['up_proj']} {tuple(u.shape)} differ: gate and "
                "up share one NVFP4 global scale and must have the same shape"
            )


def quantize_expert(state: dict[str, torch.Tensor], layer: int, expert: int, names: dict[str, str], dtype: torch.dtype,
                    block_scale: str = "6") -> QuantizedExpert:
    """Quantize one expert through the engines' resident-weight path (PackedExperts), with the config's
    block-scale rule."""
    gate, up, down = (state[names[p]].to(dtype) for p in PROJECTIONS)
    I, H = gate.shape
    w13 = PackedExperts.empty(1, 2 * I, H, block_scale=block_scale)
    w13.quantize_expert_(0, torch.cat((gate, up)))
    w2 = PackedExperts.empty(1, *down.shape, block_scale=block_scale)
    w2.quantize_expert_(0, down)
    fc1, fc2 = w13.expert(0), w2.expert(0)
    projections = {
        "gate_proj": NVFP4Tensor(fc1.codes[:I].clone(), fc1.scales[:I].clone(), fc1.global_amax.clone()),
        "up_proj": NVFP4Tensor(fc1.codes[I:].clone(), fc1.scales[I:].clone(), fc1.global_amax.clone()),
        "down_proj": NVFP4Tensor(fc2.codes.clone(), fc2.scales.clone(), fc2.global_amax.clone()),
    }
    prefix = names["gate_proj"].rsplit(".", 3)[0]  # "<...>.mlp.experts"
    return QuantizedExpert(layer, expert, prefix, projections)

"""compressed-tensors `nvfp4-pack-quantized`: the routed-expert tensors and the quantization_config.

Per expert projection `<prefix>.<e>.<proj>`:
  weight_packed        uint8 [N, K/2]   our packed E2M1 codes (element 2i in the low nibble, as
                                         compressed-tensors' `pack_fp4_to_uint8` lays them out)
  weight_scale         float8_e4m3fn [N, K/16]   our E4M3 block-scale bytes, reinterpreted
  weight_global_scale  float32 [1]      g_enc = 2688 / amax (gate and up: the same value)
  input_global_scale   float32 [1]      only with a calibrated static activation amax: g_enc of it
The config group targets the expert Linears by regex; everything else is listed in `ignore`, so the
engines keep it in the checkpoint's dtype. vLLM's compressed-tensors scheme chooses
CompressedTensorsW4A4Nvfp4MoEMethod for it (W4A4 with input scales, W4A16 without).
"""

import torch

from .experts import QuantizedExpert
from .scales import encode_scale

FORMAT = "nvfp4-pack-quantized"
EXPERT_TARGET = r"re:.*mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)$"

_FP4 = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group"}


def expert_tensors(q: QuantizedExpert, input_amax: dict[str, torch.Tensor] | None, block_scale: str = "6") -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one expert. `input_amax`: projection -> static activation amax, or None.
    `block_scale`: the weights' rule (scales.py: it sets their global scale)."""
    out = {}
    for proj, t in q.projections.items():
        p = f"{q.prefix}.{q.expert}.{proj}"
        out[f"{p}.weight_packed"] = t.codes.contiguous()
        out[f"{p}.weight_scale"] = t.scales.contiguous().view(torch.float8_e4m3fn)
        out[f"{p}.weight_global_scale"] = encode_scale(t.global_amax, block_scale).reshape(1).contiguous()
        if input_amax is not None:
            out[f"{p}.input_global_scale"] = encode_scale(input_amax[proj]).reshape(1).contiguous()
    return out


def quantization_config(static_inputs: bool, ignore: list[str]) -> dict:
    """The config.json `quantization_config` compressed-tensors and vLLM read."""
    group = {
        "targets": [EXPERT_TARGET],
        "weights": dict(_FP4, dynamic=False, observer="memoryless_minmax"),
        # Block scales of the activations are computed by the engine (dynamic "local"); the global
        # scale is the checkpoint's static input_global_scale.
        "input_activations": dict(_FP4, dynamic="local", observer="static_minmax") if static_inputs else None,
        "output_activations": None,
        "format": FORMAT,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": FORMAT,
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": ignore,
        "kv_cache_scheme": None,
    }

"""ModelOpt NVFP4 (`quant_algo: NVFP4`): the routed-expert tensors, hf_quant_config.json and the
config.json quantization_config vLLM and SGLang read.

Per expert projection `<prefix>.<e>.<proj>`:
  weight          uint8 [N, K/2]            our packed E2M1 codes
  weight_scale    float8_e4m3fn [N, K/16]   our E4M3 block-scale bytes, reinterpreted
  weight_scale_2  float32 []                g_dec = 1 / g_enc, the contract's own float32 decode scale
  input_scale     float32 []                only with a calibrated static activation amax: its g_dec
Without a static amax the checkpoint is declared weight-only (`W4A16_NVFP4`), the mode vLLM routes a
checkpoint without input scales to anyway.
"""

import torch

from .experts import QuantizedExpert
from .scales import decode_scale


def expert_tensors(q: QuantizedExpert, input_amax: dict[str, torch.Tensor] | None, block_scale: str = "6") -> dict[str, torch.Tensor]:
    out = {}
    for proj, t in q.projections.items():
        p = f"{q.prefix}.{q.expert}.{proj}"
        out[f"{p}.weight"] = t.codes.contiguous()
        out[f"{p}.weight_scale"] = t.scales.contiguous().view(torch.float8_e4m3fn)
        out[f"{p}.weight_scale_2"] = decode_scale(t.global_amax, block_scale).reshape(()).contiguous()
        if input_amax is not None:
            out[f"{p}.input_scale"] = decode_scale(input_amax[proj]).reshape(()).contiguous()
    return out


def quant_algo(static_inputs: bool) -> str:
    return "NVFP4" if static_inputs else "W4A16_NVFP4"


def hf_quant_config(static_inputs: bool, exclude: list[str], producer_version: str) -> dict:
    """hf_quant_config.json, ModelOpt's own file (SGLang and TensorRT-LLM read it)."""
    return {
        "producer": {"name": "trace-fp4", "version": producer_version},
        "quantization": {
            "quant_algo": quant_algo(static_inputs),
            "kv_cache_quant_algo": None,
            "group_size": 16,
            "exclude_modules": exclude,
        },
    }


def quantization_config(static_inputs: bool, exclude: list[str]) -> dict:
    """config.json's quantization_config in the flat form vLLM's and SGLang's ModelOpt parsers read
    (its exclusion list is called `ignore` there, `exclude_modules` in hf_quant_config.json)."""
    return {
        "quant_method": "modelopt",
        "quant_algo": quant_algo(static_inputs),
        "group_size": 16,
        "ignore": exclude,
    }

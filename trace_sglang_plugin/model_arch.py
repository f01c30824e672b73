"""Mixtral under trace_fp4 loads SGLang's regular MixtralForCausalLM (SGLang 0.5.23).

SGLang's `get_model_architecture` sends a quantized Mixtral whose method is not on a fixed list (fp8,
compressed-tensors, gptq_marlin, awq_marlin, quark_int4fp8_moe) to `QuantMixtralForCausalLM`
(models/mixtral_quant.py): per-expert MLPs of plain linears, no FusedMoE, so trace_fp4's routed-expert
method would never see the experts (and its records no routing). trace_fp4 quantizes FusedMoE's experts
itself, as for the listed methods, so for it the function resolves as for those: the quantization name
is shown as "fp8" to that one check, for the duration of the call (it is read nowhere else there), and
put back. Counted in `counters["mixtral_regular_model_for_trace_fp4"]`.
"""

from trace_kernels.config import QUANT_METHOD

from . import counters

TARGETS = ("sglang.srt.model_loader.utils.get_model_architecture",)


def around_get_model_architecture(original, model_config, *args, **kwargs):
    archs = getattr(model_config.hf_config, "architectures", None) or []
    if model_config.quantization != QUANT_METHOD or "MixtralForCausalLM" not in archs:
        return original(model_config, *args, **kwargs)
    model_config.quantization = "fp8"  # one of SGLang's Mixtral-with-FusedMoE methods
    try:
        return original(model_config, *args, **kwargs)
    finally:
        model_config.quantization = QUANT_METHOD
        counters.count("mixtral_regular_model_for_trace_fp4")

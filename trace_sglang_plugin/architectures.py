"""Model classes SGLang picks for a trace_fp4 model.

SGLang 0.5.23 swaps Mixtral for `QuantMixtralForCausalLM` whenever the quantization method is not in a
short hard-coded list (model_loader/utils.py, `get_model_architecture`). That class runs each expert as
its own pair of linears, without FusedMoE, so trace_fp4's MoE method would never see the routed
experts. For a trace_fp4 model we resolve the architecture SGLang would use unquantized
(`MixtralForCausalLM`, FusedMoE) instead; this is counted (`mixtral_fused_moe_kept`).
"""

from trace_kernels.config import QUANT_METHOD

from .state import model_counters


def model_architecture_hook(original, model_config, *args, **kwargs):
    archs = list(getattr(model_config.hf_config, "architectures", None) or [])
    if getattr(model_config, "quantization", None) != QUANT_METHOD or "MixtralForCausalLM" not in archs:
        return original(model_config, *args, **kwargs)
    from sglang.srt.model_loader.utils import _model_impl_from_architecture
    from sglang.srt.models.registry import ModelRegistry

    model_cls, arch = ModelRegistry.resolve_model_cls(["MixtralForCausalLM"])
    model_config._resolved_model_arch = arch
    model_config._resolved_model_impl = _model_impl_from_architecture(arch)
    model_counters(model_config).count("mixtral_fused_moe_kept")
    return model_cls, arch

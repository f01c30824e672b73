"""gpt-oss fused expert tensors into trace_fp4's packed experts (vLLM 0.32.x `GptOssModel`).

vLLM's `GptOssModel._load_weights_other` (the BF16 / non-MXFP4 path, which `quantization="trace_fp4"`
takes) writes HF's fused `gate_up_proj` [E, H, 2I], `down_proj` [E, I, H] and their biases straight into
the FusedMoE parameters with `param.copy_(...)`, bypassing every weight loader. trace_fp4's experts
have no BF16 parameter to copy into (the packed NVFP4 tensors are the only copy; `w13_weight` /
`w2_weight` are meta placeholders), so that copy would silently do nothing. This wrapper takes the
expert tensors of trace_fp4 layers out of the weight stream and hands them to the layer's MoE method
(`TraceFP4MoEMethod.load_gpt_oss_experts`: de-interleave gate/up, requantize expert by expert, keep
the biases), then lets vLLM load everything else. It runs on every `load_weights` call, so RL weight
sync goes through it too. Other layers and other quantization methods are untouched.

Supported: vLLM 0.32.x; anything else fails at model build.
"""

import vllm

SUPPORTED_VLLM = "0.32."
_installed = False
EXPERT_TENSORS = ("w13_weight", "w2_weight", "w13_bias", "w2_bias")


def install_gpt_oss_loader() -> None:
    global _installed
    if _installed:
        return
    if not vllm.__version__.startswith(SUPPORTED_VLLM):
        raise RuntimeError(
            f"trace_fp4: the gpt-oss expert loader supports vLLM {SUPPORTED_VLLM}x, found {vllm.__version__}; "
            "update patches/vllm_gpt_oss_experts.py for this version"
        )
    from vllm.model_executor.model_loader.weight_utils import maybe_remap_moe_expert_param_name
    from vllm.model_executor.models.gpt_oss import GptOssModel

    if not hasattr(GptOssModel, "_load_weights_other"):
        raise RuntimeError(f"trace_fp4: vLLM {vllm.__version__} GptOssModel has no _load_weights_other()")
    orig = GptOssModel._load_weights_other

    def _load_weights_other(self, ep_rank_end, ep_rank_start, heads_per_rank, head_start, weights, mapping):
        from trace_vllm_plugin.moe import TraceFP4MoEMethod

        targets = {}  # full parameter name -> (module, tensor kind)
        for mod_name, mod in self.named_modules():
            if isinstance(getattr(mod, "quant_method", None), TraceFP4MoEMethod):
                for kind in EXPERT_TENSORS:
                    targets[f"{mod_name}.{kind}"] = (mod, kind)
        if not targets:
            return orig(self, ep_rank_end, ep_rank_start, heads_per_rank, head_start, weights, mapping)
        params = dict(self.named_parameters())
        taken: set[str] = set()

        def rest():
            for name, w in weights:
                full = maybe_remap_moe_expert_param_name(name, params)
                if full in targets:
                    mod, kind = targets[full]
                    mod.quant_method.load_gpt_oss_experts(mod, kind, w)
                    taken.add(full)
                    continue
                yield name, w

        loaded = orig(self, ep_rank_end, ep_rank_start, heads_per_rank, head_start, rest(), mapping)
        return set(loaded) | taken

    GptOssModel._load_weights_other = _load_weights_other
    _installed = True

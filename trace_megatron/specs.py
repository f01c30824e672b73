"""Drop-in GPT layer / decoder-block specs whose routed experts and KV run on the rollout's FP4 path.

Modelled on Megatron-Core's `get_gpt_layer_local_spec` / `get_gpt_decoder_block_spec`: take the spec
Megatron would build and swap three things, leaving everything else (dense MLPs, shared experts,
attention projections, norms, router) in the model's dtype:

  routed experts   MoELayer -> TraceMoELayer; SequentialMLP -> TraceSequentialMLP whose linear_fc1 /
                   linear_fc2 are TraceExpertColumn/RowParallelLinear (FP4 weights + guided FP4 inputs)
  core attention   DotProductAttention -> TraceDotProductAttention (guided FP4 K and V)

With `use_transformer_engine=True` the base is Megatron's TE spec and core attention becomes a trace
subclass of TEDotProductAttention; routed experts still use TraceSequentialMLP with Megatron's local
linears, because the FP4 fake-quantization must sit inside each expert's GEMM inputs (a TE grouped GEMM
offers no such hook). Requesting TE where it is not installed is an error, not a silent fallback.
"""

import dataclasses
import warnings
from functools import partial

from megatron.core.extensions.transformer_engine import HAVE_TE
from megatron.core.models.gpt import gpt_layer_specs as mcore_specs
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules
from trace_kernels import ModelShape, TraceConfig

from .attention import TraceDotProductAttention, make_trace_core_attention
from .experts import TraceSequentialMLP
from .linears import TraceExpertColumnParallelLinear, TraceExpertRowParallelLinear
from .moe_layer import TraceMoELayer
from .spec_fallbacks import SpecFallbacks


def _require_te() -> None:
    if not HAVE_TE:
        raise RuntimeError(
            "trace_megatron: use_transformer_engine=True but Transformer Engine is not installed; install it, or "
            "build the spec with use_transformer_engine=False (Megatron-Core's local modules)"
        )


def _trace_core_attention(base, trace_config: TraceConfig):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    cls = TraceDotProductAttention if base is DotProductAttention else make_trace_core_attention(base)
    return partial(cls, trace_config=trace_config)


def _trace_experts(trace_config: TraceConfig, moe_grouped_gemm: bool, fallbacks: SpecFallbacks):
    if moe_grouped_gemm:
        fallbacks["grouped_gemm_experts_as_sequential"] += 1
        warnings.warn(
            "trace_megatron: moe_grouped_gemm=True — routed experts run as TraceSequentialMLP (one GEMM per "
            "expert) so that every expert input is fake-quantized; counted in the batch metrics "
            "(trace/spec/grouped_gemm_experts_as_sequential)",
            stacklevel=3,
        )
    return partial(
        TraceSequentialMLP,
        trace_config=trace_config,
        submodules=MLPSubmodules(
            linear_fc1=partial(TraceExpertColumnParallelLinear, trace_config=trace_config),
            linear_fc2=partial(TraceExpertRowParallelLinear, trace_config=trace_config),
        ),
    )


def _trace_mla_attention(attn: ModuleSpec, trace_config: TraceConfig) -> ModuleSpec:
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from .mla import MLADotProductAttention, TraceMLASelfAttention

    if attn.module is not MLASelfAttention:
        raise ValueError(f"trace_megatron: MLA module {attn.module.__name__} is not supported (MLASelfAttention only)")
    core = attn.submodules.core_attention
    if core is DotProductAttention:
        core = MLADotProductAttention  # the local DotProductAttention refuses MLA's k/v channels
    return dataclasses.replace(
        attn,
        module=TraceMLASelfAttention,
        params={**(attn.params or {}), "trace_config": trace_config},
        submodules=dataclasses.replace(attn.submodules, core_attention=core),
    )


def to_trace_block_spec(block: TransformerBlockSubmodules, trace_config: TraceConfig | None = None, *, moe_grouped_gemm=False):
    """Every layer spec of a decoder block spec rewritten by `to_trace_layer_spec` (one fallback counter)."""
    fallbacks = SpecFallbacks()
    layer_specs = [to_trace_layer_spec(s, trace_config, moe_grouped_gemm=moe_grouped_gemm, fallbacks=fallbacks)
                   for s in block.layer_specs]
    return dataclasses.replace(block, layer_specs=layer_specs)


def to_trace_layer_spec(layer_spec: ModuleSpec, trace_config: TraceConfig | None = None, *, moe_grouped_gemm=False,
                        fallbacks: SpecFallbacks | None = None) -> ModuleSpec:
    """Rewrite a Megatron GPT TransformerLayer spec (local or TE) into its trace version. `fallbacks`
    counts the substitutions (shared by the layers of one block; a new counter by default)."""
    trace_config = trace_config or TraceConfig()
    fallbacks = fallbacks if fallbacks is not None else SpecFallbacks()
    sub: TransformerLayerSubmodules = layer_spec.submodules
    attn = sub.self_attention
    if isinstance(attn, ModuleSpec) and isinstance(attn.submodules, MLASelfAttentionSubmodules):
        # MLA (DeepSeek-V3 / Kimi K2): the FP4 KV site is the latent kv_c (mla.py); core attention and
        # the RoPE key stay in the model dtype.
        new_attn = _trace_mla_attention(attn, trace_config)
    elif not (isinstance(attn, ModuleSpec) and isinstance(attn.submodules, SelfAttentionSubmodules)):
        raise ValueError("trace_megatron supports standard self-attention and MLA layers (not experimental variants)")
    else:
        new_attn = dataclasses.replace(
            attn,
            submodules=dataclasses.replace(
                attn.submodules, core_attention=_trace_core_attention(attn.submodules.core_attention, trace_config)
            ),
        )
    mlp = sub.mlp
    if isinstance(mlp, partial) and isinstance(mlp.func, type) and issubclass(mlp.func, MoELayer):
        moe_sub: MoESubmodules = mlp.keywords["submodules"]
        mlp = partial(
            TraceMoELayer,
            trace_config=trace_config,
            spec_fallbacks=fallbacks,
            submodules=dataclasses.replace(moe_sub, experts=_trace_experts(trace_config, moe_grouped_gemm, fallbacks)),
        )
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(sub, self_attention=new_attn, mlp=mlp))


def get_gpt_layer_with_trace_spec(
    num_experts: int | None = None,
    moe_grouped_gemm: bool | None = False,
    qk_layernorm: bool | None = False,
    multi_latent_attention: bool | None = False,
    fp8: str | None = None,
    normalization: str | None = None,
    qk_l2_norm: bool | None = False,
    *,
    trace_config: TraceConfig | None = None,
    use_transformer_engine: bool = False,
) -> ModuleSpec:
    """GPT layer spec (like `get_gpt_layer_local_spec`, same leading arguments) on the rollout's FP4
    execution path.

    Args:
        num_experts: routed experts (None: a dense layer; only its K/V are quantized).
        moe_grouped_gemm: accepted for signature compatibility; experts run sequentially (see module doc).
        qk_layernorm, normalization, qk_l2_norm: as in Megatron-Core.
        multi_latent_attention: MLA layers quantize the latent kv_c (site kv_latent) instead of K/V.
        fp8: must stay off (Megatron's own FP8 recipe would quantize the same GEMMs a second way).
        trace_config: what is quantized (`trace_kernels.TraceConfig`; default: everything, sparse guidance
            at every layer). Guidance modes per layer come from the records, which must match it.
        use_transformer_engine: build on Megatron's TE spec (needs Transformer Engine).
    """
    if fp8 is not None:
        raise ValueError("trace_megatron cannot be combined with Megatron's fp8 recipe")
    if use_transformer_engine:
        _require_te()
        base = mcore_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm, qk_layernorm=qk_layernorm, qk_l2_norm=qk_l2_norm,
            multi_latent_attention=multi_latent_attention,
        )
    else:
        base = mcore_specs.get_gpt_layer_local_spec(
            num_experts=num_experts,
            moe_grouped_gemm=moe_grouped_gemm,
            qk_layernorm=qk_layernorm,
            normalization=normalization,
            qk_l2_norm=qk_l2_norm,
            multi_latent_attention=multi_latent_attention,
        )
    return to_trace_layer_spec(base, trace_config, moe_grouped_gemm=bool(moe_grouped_gemm and num_experts))


def get_gpt_decoder_block_with_trace_spec(
    config: TransformerConfig,
    use_transformer_engine: bool = False,
    normalization: str | None = None,
    qk_l2_norm: bool | None = False,
    vp_stage: int | None = None,
    pp_rank: int | None = None,
    *,
    trace_config: TraceConfig | None = None,
) -> TransformerBlockSubmodules:
    """Decoder block spec (like `get_gpt_decoder_block_spec`): MoE / dense layers per
    `config.moe_layer_freq`, this pipeline stage's slice, every layer rewritten by `to_trace_layer_spec`."""
    if use_transformer_engine:
        _require_te()
    (trace_config or TraceConfig()).check_layers(config.num_layers, where="the TransformerConfig")
    block = mcore_specs.get_gpt_decoder_block_spec(
        config, use_transformer_engine, normalization=normalization, qk_l2_norm=qk_l2_norm, vp_stage=vp_stage, pp_rank=pp_rank
    )
    return to_trace_block_spec(block, trace_config, moe_grouped_gemm=bool(config.moe_grouped_gemm))


def moe_layer_pattern(config: TransformerConfig) -> list[bool]:
    """Which layers (0-based, the whole model) have routed experts, by Megatron's own rule: no experts
    at all without num_moe_experts; `moe_layer_freq` an int k: every k-th layer from the first; a list:
    1 = MoE, 0 = dense MLP (GLM-4.5 / DeepSeek-V3's first_k_dense_replace)."""
    if not config.num_moe_experts:
        return [False] * config.num_layers
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(config.num_layers)]
    if len(freq) != config.num_layers:
        raise ValueError(f"moe_layer_freq has {len(freq)} entries for {config.num_layers} layers")
    return [bool(f) for f in freq]


def model_shape(config: TransformerConfig) -> ModelShape:
    """The record shape a model with this TransformerConfig reads, layer by layer: dense-MLP layers
    (moe_layer_freq) have no routing ids and no moe sites; every layer has standard K/V, or MLA's latent
    row (multi_latent_attention)."""
    if not config.num_moe_experts:
        raise ValueError("trace_megatron: the TransformerConfig has no routed experts (num_moe_experts); TRACE needs them")
    pattern = moe_layer_pattern(config)
    if not any(pattern):
        raise ValueError(f"trace_megatron: moe_layer_freq={config.moe_layer_freq} leaves no routed-expert layer")
    if getattr(config, "multi_latent_attention", False):
        # MLA: one latent row (kv_lora_rank values) per token, site kv_latent (mla.py).
        kv = dict(num_kv_heads=1, head_dim=config.kv_lora_rank, kv_kind="mla")
    else:
        kv = dict(num_kv_heads=config.num_query_groups or config.num_attention_heads, head_dim=config.kv_channels)
    return ModelShape(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        moe_intermediate_size=config.moe_ffn_hidden_size,
        num_experts=config.num_moe_experts,
        top_k=config.moe_router_topk,
        moe_layers=tuple(i for i, moe in enumerate(pattern) if moe),
        **kv,
    )

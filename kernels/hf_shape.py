"""The record shape (ModelShape) of a Hugging Face MoE config: one definition for both engine plugins,
the converter and `trace-fp4 align`, so the rollout and the trainer agree on which layers have routed
experts and a KV cache.

Per layer, from the config fields the model families use:
- routed experts: every layer, except the dense-MLP layers named by `first_k_dense_replace` (and
  `moe_layer_freq`: DeepSeek-V2/V3, Kimi K2, GLM-4.5) or `mlp_only_layers` / `decoder_sparse_step`
  (Qwen2/Qwen3-MoE, Qwen3-Next);
- a KV cache: every layer, except those `layer_types` marks `linear_attention` (Qwen3-Next's Gated
  DeltaNet keeps a recurrent state, not a cache); sliding-window layers keep one;
- the KV kind: MLA (`kv_lora_rank` set) caches one latent row of kv_lora_rank values per token
  (site kv_latent), everything else K and V rows of head_dim per KV head.
"""

from .format import BLOCK_SIZE
from .model_shape import ModelShape

EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")
_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "attention")
_NO_KV_LAYER_TYPES = ("linear_attention",)


def _getter(cfg):
    if isinstance(cfg, dict):
        return cfg.get
    get_text = getattr(cfg, "get_text_config", None)
    if callable(get_text):
        cfg = get_text()
    return lambda key, default=None: getattr(cfg, key, default)


def _positive(get, key, where, default=None):
    v = get(key)
    if v is None:
        if default is not None:
            return default
        raise ValueError(f"{where}: config has no {key!r}")
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{where}: config {key}={v!r} must be a positive integer")
    return v


def moe_layer_list(get, num_layers: int, where: str) -> list[int]:
    """Indices of the routed-expert layers."""
    first_dense = get("first_k_dense_replace")
    freq = get("moe_layer_freq")
    if first_dense is not None or freq is not None:  # DeepSeek / Kimi / GLM family
        first_dense = first_dense or 0
        freq = 1 if freq is None else freq
        if isinstance(freq, bool) or not isinstance(freq, int) or freq <= 0:
            raise ValueError(f"{where}: config moe_layer_freq={freq!r} must be a positive integer")
        return [i for i in range(num_layers) if i >= first_dense and i % freq == 0]
    dense = get("mlp_only_layers") or []
    step = get("decoder_sparse_step") or 1
    if not isinstance(dense, (list, tuple)) or not all(isinstance(i, int) for i in dense):
        raise ValueError(f"{where}: config mlp_only_layers={dense!r} must be a list of layer indices")
    return [i for i in range(num_layers) if i not in dense and (i + 1) % step == 0]


def kv_layer_list(get, num_layers: int, where: str) -> list[int]:
    types = get("layer_types")
    if types is None:
        return list(range(num_layers))
    if not isinstance(types, (list, tuple)) or len(types) != num_layers:
        raise ValueError(f"{where}: config layer_types={types!r} must name each of the {num_layers} layers")
    unknown = sorted({t for t in types if t not in _ATTENTION_LAYER_TYPES + _NO_KV_LAYER_TYPES}, key=str)
    if unknown:
        raise ValueError(
            f"{where}: layer_types {unknown} are not supported (known: "
            f"{', '.join(_ATTENTION_LAYER_TYPES + _NO_KV_LAYER_TYPES)})"
        )
    return [i for i, t in enumerate(types) if t in _ATTENTION_LAYER_TYPES]


def model_shape_from_hf(cfg, *, where: str = "model") -> ModelShape:
    """The ModelShape of a transformers config (object or config.json dict); ValueError naming what
    makes the model unsupported."""
    get = _getter(cfg)
    num_experts = next((get(k) for k in EXPERT_COUNT_KEYS if get(k)), 0)
    if not num_experts:
        raise ValueError(
            f"{where}: trace_fp4 quantizes routed experts (Mixture-of-Experts models), but the config has "
            f"none (no {'/'.join(EXPERT_COUNT_KEYS)})"
        )
    num_layers = _positive(get, "num_hidden_layers", where)
    hidden = _positive(get, "hidden_size", where)
    heads = _positive(get, "num_attention_heads", where)
    moe_inter = get("moe_intermediate_size") or _positive(get, "intermediate_size", where)
    moe = moe_layer_list(get, num_layers, where)
    if not moe:
        raise ValueError(f"{where}: none of the {num_layers} layers has routed experts")
    kv = kv_layer_list(get, num_layers, where)
    if get("kv_lora_rank"):
        kv_kind, kv_heads, head_dim = "mla", 1, _positive(get, "kv_lora_rank", where)
    else:
        kv_kind = "kv"
        kv_heads = _positive(get, "num_key_value_heads", where, default=heads)
        head_dim = get("head_dim") or hidden // heads
    sizes = {"hidden_size": hidden, "moe_intermediate_size": moe_inter,
             ("kv_lora_rank" if kv_kind == "mla" else "head_dim"): head_dim}
    for name, size in sizes.items():
        if size % BLOCK_SIZE:
            raise ValueError(
                f"{where}: {name}={size} is not divisible by {BLOCK_SIZE}: NVFP4 quantizes blocks of "
                f"{BLOCK_SIZE} along it"
            )
    return ModelShape(
        num_layers=num_layers,
        hidden_size=hidden,
        moe_intermediate_size=moe_inter,
        num_experts=num_experts,
        top_k=_positive(get, "num_experts_per_tok", where),
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        moe_layers=tuple(moe),
        kv_layers=tuple(kv),
        kv_kind=kv_kind,
    )

"""The model dimensions a guidance record belongs to, layer by layer."""

import dataclasses
from dataclasses import dataclass

import torch

from .config import ALL_SITES, MOE_SITES
from .format import BLOCK_SIZE

KV_KINDS = ("kv", "mla")


@dataclass(frozen=True)
class ModelShape:
    """The model dimensions a record belongs to, layer by layer.

    Not every layer of the models people RL-train has routed experts and a K/V cache: DeepSeek-V3 and
    GLM-4.5 start with dense-MLP layers, Qwen3-Next's linear-attention layers keep no KV cache. So:
    - `moe_layers`: the layers with routed experts (None: every layer); only they have routing ids and
      the moe_fc1_in / moe_fc2_in sites.
    - `kv_layers`: the layers with a KV cache (None: every layer).
    - `kv_kind`: "kv", standard K/V rows [num_kv_heads, head_dim] (sites k, v); or "mla", the one
      latent row MLA caches per token (site kv_latent, rows [1, head_dim] with head_dim = kv_lora_rank
      and num_kv_heads = 1). MLA's rope part k_pe stays in the model dtype: it is 1/9 of the row and
      carries the positions.
    top_k, num_experts and moe_intermediate_size are the same in every MoE layer of these models.
    """

    num_layers: int
    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    num_kv_heads: int
    head_dim: int
    moe_layers: tuple[int, ...] | None = None
    kv_layers: tuple[int, ...] | None = None
    kv_kind: str = "kv"

    def __post_init__(self):
        for f in dataclasses.fields(self)[:7]:
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"ModelShape.{f.name} must be a positive int, got {v!r}")
        for name in ("hidden_size", "moe_intermediate_size", "head_dim"):
            if getattr(self, name) % BLOCK_SIZE:
                raise ValueError(
                    f"ModelShape.{name}={getattr(self, name)} is not divisible by {BLOCK_SIZE}: NVFP4 "
                    f"quantizes blocks of {BLOCK_SIZE} along it"
                )
        if self.top_k > self.num_experts:
            raise ValueError(f"ModelShape.top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.num_experts > torch.iinfo(torch.int16).max:
            raise ValueError(f"ModelShape.num_experts={self.num_experts} does not fit the int16 routing ids")
        for name in ("moe_layers", "kv_layers"):
            layers = getattr(self, name)
            if layers is None:
                continue
            if isinstance(layers, (str, bytes)) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in layers
            ):
                raise ValueError(f"ModelShape.{name} must be layer indices or None, got {layers!r}")
            layers = tuple(sorted(set(layers)))
            if any(not 0 <= i < self.num_layers for i in layers):
                raise ValueError(f"ModelShape.{name}={list(layers)} outside the {self.num_layers} layers")
            # Normalised: a shape that names every layer is the same shape as None (compares equal).
            object.__setattr__(self, name, None if layers == tuple(range(self.num_layers)) else layers)
        if self.moe_layers == ():
            raise ValueError("ModelShape.moe_layers is empty: TRACE needs at least one routed-expert layer")
        if self.kv_kind not in KV_KINDS:
            raise ValueError(f"ModelShape.kv_kind must be one of {KV_KINDS}, got {self.kv_kind!r}")
        if self.kv_kind == "mla" and self.num_kv_heads != 1:
            raise ValueError(
                f"ModelShape: kv_kind='mla' caches one latent row per token (num_kv_heads=1), got "
                f"num_kv_heads={self.num_kv_heads}"
            )

    # ---- per layer ------------------------------------------------------------------------------
    def has_moe(self, layer: int) -> bool:
        return self.moe_layers is None or layer in self.moe_layers

    def has_kv(self, layer: int) -> bool:
        return self.kv_layers is None or layer in self.kv_layers

    def moe_layer_list(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.has_moe(i)]

    def kv_layer_list(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.has_kv(i)]

    def kv_sites(self) -> tuple[str, ...]:
        return ("kv_latent",) if self.kv_kind == "mla" else ("k", "v")

    def layer_sites(self, layer: int) -> tuple[str, ...]:
        """The captured sites of `layer`, in record order."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range for a model of {self.num_layers} layers")
        return (MOE_SITES if self.has_moe(layer) else ()) + (self.kv_sites() if self.has_kv(layer) else ())

    def row_shape(self, site: str) -> tuple[int, ...]:
        """Shape of one token's data at `site`."""
        if site == "moe_fc1_in":
            return (self.hidden_size,)
        if site == "moe_fc2_in":
            return (self.top_k, self.moe_intermediate_size)
        if site in self.kv_sites():
            return (self.num_kv_heads, self.head_dim)
        if site in ALL_SITES:
            raise ValueError(f"site {site!r} does not exist in a model with kv_kind={self.kv_kind!r}")
        raise ValueError(f"unknown site {site!r}; sites are {ALL_SITES}")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for name in ("moe_layers", "kv_layers"):
            if d[name] is not None:
                d[name] = list(d[name])
        return d

    def describe_layers(self) -> list[str]:
        """One word per layer for tables: which sites it has ("moe+kv", "dense+kv", "moe", ...)."""
        kv = "mla" if self.kv_kind == "mla" else "kv"
        return [
            ("moe" if self.has_moe(i) else "dense") + (f"+{kv}" if self.has_kv(i) else "")
            for i in range(self.num_layers)
        ]

"""Core attention whose K and V are the FP4 KV cache entries the rollout engine read.

K arrives here after the QK norm and after RoPE (Megatron's SelfAttention applies both before core
attention), and before the grouped-query expansion, so each row is one (token, KV head) of head_dim
values — exactly a KV-cache entry. Each row is fake-quantized with guided rounding toward its record
(round-to-nearest with its own amax where there is none), straight-through.

`KVQuantMixin` is put in front of a core-attention class: Megatron's DotProductAttention here, or
TEDotProductAttention where Transformer Engine is installed. The local DotProductAttention has no packed
(THD) path and refuses context parallelism; `TraceDotProductAttention` builds on
`ContextParallelDotProductAttention`, which adds both (exact, but O(T^2) memory: meant for tests and
small runs; use TE for real packed or long-context training).
"""

import torch
from trace_kernels import TraceConfig

from .binding import BatchBinding
from .context_parallel import ContextParallelDotProductAttention
from .site_quant import SiteInput, fake_quantize_site


class KVQuantMixin:
    def _init_trace(self, layer_number: int, trace_config: TraceConfig | None):
        self.trace_config = trace_config or TraceConfig()
        self.trace_layer = layer_number - 1
        self.binding = BatchBinding(f"core attention of layer {layer_number}")

    def _kv_sites(self, batch, recompute, positions_n: int, local_heads: int):
        if batch is None:  # plain round-to-nearest; layer and site still decide the amax (static mode)
            return [SiteInput(batch=None, layer=self.trace_layer, site=name) for name in ("k", "v")]
        if positions_n != batch.layout.num_positions:
            raise ValueError(
                f"trace_megatron: layer {self.trace_layer} attention sees {positions_n} token positions, the guidance "
                f"layout describes {batch.layout.num_positions}"
            )
        positions = torch.arange(positions_n, device=batch.device)
        tp = getattr(self, "tp_group", None)
        tp_size, tp_rank = (tp.size(), tp.rank()) if tp is not None else (1, 0)
        if tp_size > 1 and batch.capture:
            raise NotImplementedError("trace_megatron: capture with tensor parallelism is not supported")
        sites = []
        for name in ("k", "v"):
            common = dict(batch=batch, layer=self.trace_layer, site=name, recompute=recompute, positions=positions)
            # the guided positions and their rows are the same in every forward of these records: made once
            table = batch.position_rows(self.trace_layer, name) if batch.records is not None else None
            if table is None:
                fb = {"not_guided": positions_n} if batch.records is not None else {}
                sites.append(SiteInput(fallback=fb, **common))
                continue
            idx, guide = table
            if local_heads != guide.shape[1]:  # tensor parallel: this rank's KV heads
                h0 = tp_rank * local_heads
                guide = guide.map_rows(lambda t: t[:, h0 : h0 + local_heads])
            sites.append(SiteInput(guide=guide, guided_idx=idx, fallback={"no_record": positions_n - idx.numel()}, **common))
        return sites

    def _quantize_kv(self, key, value, packed: bool):
        if not self.trace_config.quantize_kv or self.trace_config.is_bf16_layer(self.trace_layer):
            return key, value
        batch, recompute = self.binding.resolve()
        # [sk, b, ng, hn] (or [t, ng, hn] packed) -> [positions, ng, hn], positions s-major like the MoE layers
        shape = key.shape
        k = key.reshape(-1, shape[-2], shape[-1])
        v = value.reshape(-1, shape[-2], shape[-1])
        sk, sv = self._kv_sites(batch, recompute, k.shape[0], shape[-2])
        k = fake_quantize_site(k, sk, config=self.trace_config).reshape(shape)
        v = fake_quantize_site(v, sv, config=self.trace_config).reshape(value.shape)
        return k, v


class TraceDotProductAttention(KVQuantMixin, ContextParallelDotProductAttention):
    """Megatron's local core attention (with THD and context parallelism added, context_parallel.py) on
    guided FP4 K and V. Each CP rank quantizes its own rows before the K/V gather."""

    def __init__(self, config, layer_number, *args, trace_config: TraceConfig | None = None, **kwargs):
        super().__init__(config, layer_number, *args, **kwargs)
        self._init_trace(layer_number, trace_config)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        key, value = self._quantize_kv(key, value, packed_seq_params is not None)
        return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)


def make_trace_core_attention(base: type) -> type:
    """A core-attention class that quantizes K/V like TraceDotProductAttention, in front of `base` (e.g.
    TEDotProductAttention, which handles THD itself)."""

    class _TraceCoreAttention(KVQuantMixin, base):
        def __init__(self, config, layer_number, *args, trace_config: TraceConfig | None = None, **kwargs):
            super().__init__(config, layer_number, *args, **kwargs)
            self._init_trace(layer_number, trace_config)

        def forward(self, query, key, value, attention_mask, *args, packed_seq_params=None, **kwargs):
            key, value = self._quantize_kv(key, value, packed_seq_params is not None)
            return super().forward(query, key, value, attention_mask, *args, packed_seq_params=packed_seq_params, **kwargs)

    _TraceCoreAttention.__name__ = _TraceCoreAttention.__qualname__ = f"Trace{base.__name__}"
    return _TraceCoreAttention

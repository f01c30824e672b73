"""Multi-latent attention (DeepSeek-V3 / Kimi K2) in Megatron-Core's local spec, and its FP4 KV site.

Two pieces:

`MLADotProductAttention`: Megatron-Core 0.19.2's `MLASelfAttention` builds its core attention with
`k_channels=q_head_dim` and `v_channels=v_head_dim` (the query/key heads are qk_head_dim +
qk_pos_emb_head_dim wide, the value heads v_head_dim), but the local `DotProductAttention` accepts
neither keyword (only TEDotProductAttention does), so the local MLA spec cannot be built without
Transformer Engine. Its arithmetic is already shape-generic (baddbmm over whatever hn the query / key
have, bmm with the value's own width); only the output view assumes kv_channels-wide values. This
subclass takes the two keywords and sizes the output from v_channels. (A subclass of ours, not a
patch: the spec names it.)

`TraceMLASelfAttention`: the site "kv_latent" is the normalised latent `kv_c` (kv_lora_rank values per
token) that the engines cache: in Megatron it is the output of `kv_layernorm`, right before
`linear_kv_up_proj`. Fake-quantizing that output (guided toward the record, round-to-nearest without
one) is quantizing exactly the engines' cached tensor. The RoPE key part (k_pos_emb) and q stay in
the model dtype, as in the engines.
"""

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.utils import divide
from trace_kernels import TraceConfig

from .binding import BatchBinding
from .site_quant import SiteInput, fake_quantize_site

SITE = "kv_latent"


class MLADotProductAttention(DotProductAttention):
    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        self.k_channels = k_channels or config.kv_channels
        self.v_channels = v_channels or config.kv_channels
        world = self.tp_group.size()
        # The output is [sq, b, heads_per_partition * v_channels] (DotProductAttention assumes kv_channels).
        self.hidden_size_per_partition = divide(self.v_channels * config.num_attention_heads, world)
        self.hidden_size_per_attention_head = self.k_channels
        # (Megatron's Attention base first builds a core attention without MLA's softmax_scale, then
        # MLASelfAttention replaces it with one built with softmax_scale, k_channels and v_channels.)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        if packed_seq_params is not None:
            raise NotImplementedError("trace_megatron: packed (THD) sequences with MLA on the local spec are not supported")
        return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, None)


class TraceMLASelfAttention(MLASelfAttention):
    """MLASelfAttention whose kv_layernorm output (the latent kv_c, site kv_latent) is fake-quantized
    with guided rounding (round-to-nearest without a record), straight-through. A forward hook on
    kv_layernorm: parameter names stay Megatron's, so converted checkpoints load unchanged."""

    def __init__(self, *args, trace_config: TraceConfig | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.trace_config = trace_config or TraceConfig()
        self.trace_layer = self.layer_number - 1
        self.binding = BatchBinding(f"MLA latent of layer {self.layer_number}")
        if self.trace_config.quantize_kv and not self.trace_config.is_bf16_layer(self.trace_layer):
            self.kv_layernorm.register_forward_hook(self._quantize_latent)

    def _quantize_latent(self, module, args, y):
        batch, recompute = self.binding.resolve()
        shape = y.shape  # [s, b, kv_lora_rank] (or [t, kv_lora_rank] packed): one latent row per position
        rows = y.reshape(-1, 1, shape[-1])
        site = _latent_site(batch, recompute, self.trace_layer, rows.shape[0])
        return fake_quantize_site(rows, site, config=self.trace_config).reshape(shape)


def _latent_site(batch, recompute, layer: int, positions_n: int) -> SiteInput:
    if batch is None:
        return SiteInput(batch=None, layer=layer, site=SITE)
    if positions_n != batch.layout.num_positions:
        raise ValueError(
            f"trace_megatron: layer {layer} MLA latent has {positions_n} token positions, the guidance layout "
            f"describes {batch.layout.num_positions}"
        )
    positions = torch.arange(positions_n, device=batch.device)
    common = dict(batch=batch, layer=layer, site=SITE, recompute=recompute, positions=positions)
    table = batch.position_rows(layer, SITE) if batch.records is not None else None  # made once per records
    if table is None:
        fb = {"not_guided": positions_n} if batch.records is not None else {}
        return SiteInput(fallback=fb, **common)
    idx, guide = table
    return SiteInput(guide=guide, guided_idx=idx, fallback={"no_record": positions_n - idx.numel()}, **common)

"""Core attention under context parallelism without Transformer Engine.

Megatron-Core's local DotProductAttention refuses context_parallel_size > 1 ("only supported by
TEDotProductAttention"), and TE's ring attention needs CUDA. Here each CP rank all-gathers K and V over
the CP group and attends its own queries to every key, masked by the tokens' true positions:

  order     rank r holds chunks r and 2 * cp - 1 - r of every sequence (Megatron's load-balanced split,
            `get_batch_on_this_cp_rank`; per sample at cu_seqlens_padded for packed THD batches), so
            gathered keys are in rank order, not sequence order; the mask is built from each row's
            global position, never from its place in the gathered tensor
  gradient  the gather's backward sums every rank's gradient of the gathered K / V and keeps this rank's
            slice (a reduce-scatter, done as all-reduce + slice because gloo has no reduce-scatter)

Exact up to summation order (keys arrive in another order than at CP=1). Memory is O(T_local * T)
per head: meant for CPU tests, the align job and small runs; use TE's ring attention for real ones.
K/V are quantized before the gather, each rank its own rows, so the guidance rows follow the CP chunk
order (TokenLayout.context_parallel_shard) and no code depends on the layout.
"""

import copy

import torch
from megatron.core import parallel_state
from megatron.core.transformer.dot_product_attention import DotProductAttention

from .layout import cp_chunk_index


class _GatherSequence(torch.autograd.Function):
    """all-gather along dim 0 over `group` (rank order); backward: sum of the ranks' grads, own slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(group.size())]
        torch.distributed.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        n = grad.shape[0] // ctx.group.size()
        r = ctx.group.rank()
        return grad[r * n : (r + 1) * n], None


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    return _GatherSequence.apply(x, group)


def cp_global_index(local_len: int, cp_size: int, cp_rank: int, cu_seqlens_padded=None) -> torch.Tensor:
    """int64 [local_len]: the position in the whole (unsplit) sequence of each of this rank's positions.
    Padded batches: one sequence of local_len * cp_size. Packed: per sample span of cu_seqlens_padded."""
    if cp_size == 1:
        return torch.arange(local_len)
    if cu_seqlens_padded is None:
        return cp_chunk_index(local_len * cp_size, cp_size, cp_rank)
    cu = torch.as_tensor(cu_seqlens_padded, dtype=torch.int64).cpu().flatten()
    index = torch.cat([int(cu[i]) + cp_chunk_index(int(cu[i + 1] - cu[i]), cp_size, cp_rank) for i in range(cu.numel() - 1)])
    if index.numel() != local_len:
        raise ValueError(
            f"trace_megatron: this context-parallel rank holds {local_len} packed positions, cu_seqlens_padded "
            f"{cu.tolist()} split over {cp_size} ranks gives {index.numel()}"
        )
    return index


def cp_attention_mask(local_len: int, cp_size: int, cp_rank: int, device, attention_mask=None, cu_seqlens_padded=None):
    """bool [1 or b, 1 or np, local_len, cp_size * local_len], True = masked, keys in gathered (rank) order.
    Padded: the caller's full [.., S, S] mask indexed at the rows' positions (None: causal). Packed:
    causal within each sample, nothing across samples."""
    q = cp_global_index(local_len, cp_size, cp_rank, cu_seqlens_padded)
    k = torch.cat([cp_global_index(local_len, cp_size, r, cu_seqlens_padded) for r in range(cp_size)])
    if cu_seqlens_padded is not None:
        cu = torch.as_tensor(cu_seqlens_padded, dtype=torch.int64).cpu().flatten()
        seg_q, seg_k = (torch.bucketize(t, cu[1:], right=True) for t in (q, k))
        allowed = (seg_q[:, None] == seg_k[None, :]) & (k[None, :] <= q[:, None])
        return (~allowed)[None, None].to(device)
    if attention_mask is None:
        return (k[None, :] > q[:, None])[None, None].to(device)
    S = local_len * cp_size
    if tuple(attention_mask.shape[-2:]) != (S, S):
        raise ValueError(
            f"trace_megatron: under context parallelism the attention mask must cover the whole sequence "
            f"[..., {S}, {S}], got {tuple(attention_mask.shape)}"
        )
    idx_q, idx_k = q.to(attention_mask.device), k.to(attention_mask.device)
    return attention_mask[..., idx_q, :][..., idx_k]


class ContextParallelDotProductAttention(DotProductAttention):
    """Megatron's local DotProductAttention plus packed (THD) sequences and context parallelism.

    THD: one "batch" row holding all samples, masked block-diagonally (exact, O(T^2) memory)."""

    def __init__(self, config, layer_number, *args, **kwargs):
        cp_size = config.context_parallel_size
        if cp_size > 1:
            # The parent refuses CP; it only reads its config to size heads and the softmax, which CP
            # does not change. Build it with a copy that says CP=1, then keep the real config.
            local = copy.copy(config)
            local.context_parallel_size = 1
            super().__init__(local, layer_number, *args, **kwargs)
            self.config = config
        else:
            super().__init__(config, layer_number, *args, **kwargs)
        pgs = getattr(self, "pg_collection", None)
        group = getattr(pgs, "cp", None) if pgs is not None else None
        self.cp_group = group if group is not None or cp_size == 1 else parallel_state.get_context_parallel_group()
        if cp_size > 1 and self.cp_group.size() != cp_size:
            raise ValueError(
                f"trace_megatron: context_parallel_size={cp_size} but the context-parallel group has "
                f"{self.cp_group.size()} ranks"
            )

    @property
    def cp_size(self) -> int:
        return self.cp_group.size() if self.cp_group is not None else 1

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        packed = packed_seq_params is not None
        if packed and packed_seq_params.qkv_format != "thd":
            raise ValueError(f"trace_megatron: packed format {packed_seq_params.qkv_format!r} is not supported")
        if not packed and self.cp_size == 1:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, None)
        if packed:  # [t, n, h] -> [t, 1, n, h]
            query, key, value = (t.unsqueeze(1) if t.dim() == 3 else t for t in (query, key, value))
        cu = None
        if packed:
            psp = packed_seq_params
            cu = psp.cu_seqlens_q_padded if psp.cu_seqlens_q_padded is not None else psp.cu_seqlens_q
        local_len = query.shape[0]
        if self.cp_size > 1:
            key = gather_sequence(key, self.cp_group)
            value = gather_sequence(value, self.cp_group)
            mask = cp_attention_mask(local_len, self.cp_size, self.cp_group.rank(), query.device,
                                     None if packed else attention_mask, cu)
        else:
            mask = cp_attention_mask(local_len, 1, 0, query.device, None, cu)
        out = super().forward(query, key, value, mask, attn_mask_type, attention_bias, None)
        return out.reshape(out.shape[0], -1) if packed else out

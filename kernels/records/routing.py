"""Routing ids in a record: int16 [T, top_k] per MoE layer, or bit-packed where the layer's encoding
packs them (as few bits per id as the expert count needs)."""

import torch


def id_bits(num_experts: int) -> int:
    return max(1, (num_experts - 1).bit_length())


def packed_nbytes(T: int, top_k: int, num_experts: int) -> int:
    return (T * top_k * id_bits(num_experts) + 7) // 8


def pack_routing(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int [T, top_k] -> uint8 [ceil(T * top_k * b / 8)], b = bits per expert id, LSB first."""
    b = id_bits(num_experts)
    bits = ((ids.reshape(-1, 1).to(torch.int64) >> torch.arange(b)) & 1).reshape(-1)
    bits = torch.cat([bits, torch.zeros((-bits.numel()) % 8, dtype=torch.int64)]).reshape(-1, 8)
    return (bits << torch.arange(8)).sum(-1).to(torch.uint8)


def unpack_routing(packed: torch.Tensor, T: int, top_k: int, num_experts: int) -> torch.Tensor:
    b = id_bits(num_experts)
    bits = ((packed.to(torch.int64)[:, None] >> torch.arange(8)) & 1).reshape(-1)[: T * top_k * b]
    return (bits.reshape(T * top_k, b) << torch.arange(b)).sum(-1).reshape(T, top_k)

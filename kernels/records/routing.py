"""Routing ids in a record: int16 [T, top_k] per MoE layer, or bit-packed where the layer's encoding
packs them (as few bits per id as the expert count needs)."""

import numpy as np
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
    if packed.device.type == "cpu" and packed.dtype == torch.uint8 and packed.dim() == 1 and packed.numel() * 8 >= T * top_k * b:
        # the same ids with numpy (LSB first, as below): a trainer's step unpacks every MoE layer of every
        # record, and these six torch ops cost ~10x their numpy counterparts on a loaded two-core host. A
        # payload too short for T x top_k ids takes the torch lines, which refuse it as before.
        bits = np.unpackbits(packed.numpy(), bitorder="little")[: T * top_k * b].astype(np.int64)
        return torch.from_numpy((bits.reshape(T * top_k, b) << np.arange(b, dtype=np.int64)).sum(-1).reshape(T, top_k))
    bits = ((packed.to(torch.int64)[:, None] >> torch.arange(8)) & 1).reshape(-1)[: T * top_k * b]
    return (bits.reshape(T * top_k, b) << torch.arange(b)).sum(-1).reshape(T, top_k)

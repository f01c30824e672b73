"""Bit packing shared by the parity checks, the codec and the wire format (LSB first)."""

import torch


def bits_to_int(bits: torch.Tensor) -> torch.Tensor:
    w = torch.ones(bits.shape[-1], dtype=torch.int64, device=bits.device) << torch.arange(bits.shape[-1], device=bits.device)
    return (bits.to(torch.int64) * w).sum(-1)


def int_to_bits(v: torch.Tensor, n: int) -> torch.Tensor:
    return (v[..., None] >> torch.arange(n, dtype=torch.int64, device=v.device)) & 1


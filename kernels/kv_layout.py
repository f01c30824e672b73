"""The packed NVFP4 KV-cache row: how one K or V row (one token, one KV head) is laid out in bytes.

Both engines' packed KV caches store this row (docs/engines.md), so a cache byte at a token's
slot is exactly the captured NVFP4 data of that token's record row:

    [ codes: head_dim // 2 bytes | scales (E4M3): head_dim // 16 bytes | global amax: float32, 4 bytes ]

For head_dim 128 that is 64 + 8 + 4 = 76 bytes instead of 256 in BF16. The amax is stored per row even
when the site uses one static amax, so a row decodes on its own. The float32 is in the machine's byte
order (little endian on every platform the engines run on).
"""

import torch

from .format import BLOCK_SIZE
from .tensor import NVFP4Tensor


def packed_row_bytes(head_dim: int) -> int:
    """Bytes of one packed row of `head_dim` values."""
    if head_dim <= 0 or head_dim % BLOCK_SIZE:
        raise ValueError(f"head_dim={head_dim}: a packed NVFP4 row needs a positive multiple of {BLOCK_SIZE}")
    return head_dim // 2 + head_dim // BLOCK_SIZE + 4


def pack_rows(q: NVFP4Tensor) -> torch.Tensor:
    """NVFP4 rows `[..., head_dim]` -> uint8 `[..., packed_row_bytes(head_dim)]`."""
    lead = q.codes.shape[:-1]
    amax = q.global_amax.to(torch.float32)
    if amax.numel() == 1:
        amax = amax.reshape(1).expand(lead)
    elif tuple(amax.shape) != tuple(lead):
        raise ValueError(f"global_amax has shape {tuple(amax.shape)}; expected one element or {tuple(lead)}")
    amax_bytes = amax.contiguous().reshape(*lead, 1).view(torch.uint8)
    return torch.cat((q.codes, q.scales, amax_bytes), dim=-1)


def unpack_rows(packed: torch.Tensor, head_dim: int) -> NVFP4Tensor:
    """uint8 `[..., packed_row_bytes(head_dim)]` -> NVFP4 rows `[..., head_dim]` (per-row amax)."""
    width = packed_row_bytes(head_dim)
    if packed.dtype != torch.uint8 or packed.shape[-1] != width:
        raise ValueError(
            f"packed KV rows must be uint8 [..., {width}] for head_dim {head_dim}, got "
            f"{packed.dtype} {tuple(packed.shape)}"
        )
    nc, ns = head_dim // 2, head_dim // BLOCK_SIZE
    codes = packed[..., :nc]
    scales = packed[..., nc : nc + ns]
    amax = packed[..., nc + ns :].contiguous().view(torch.float32).squeeze(-1)
    return NVFP4Tensor(codes, scales, amax)

"""Alignment analysis on the rollout's grid: which rollout codewords guidance can reach.

Guided rounding only ever picks one of the two signed-grid neighbours of the trainer's value (scaled by
the rollout's scales). Where the rollout's codeword is one of them, full guidance reproduces it; where it
is not (the two sides' values are more than a grid step apart), nothing can. `adjacent` tells the two
cases apart, so a report can say how much mismatch is left and why. Torch reference arithmetic; this
is for measuring, not a hot path.
"""

import torch

from . import reference
from .api import _check_guide, _check_input, _rows_amax
from .format import BLOCK_SIZE
from .guides.full import codewords as _codewords
from .tensor import NVFP4Tensor


def codewords(q: NVFP4Tensor) -> torch.Tensor:
    """int32 [..., K]: sign and magnitude index per element, with -0 folded into +0."""
    return _codewords(q.codes)


def adjacent(x: torch.Tensor, guide: NVFP4Tensor, *, block_scale: str = "6") -> torch.Tensor:
    """bool [..., K]: the guide's codeword is a signed-grid neighbour of x under the guide's scales
    (`block_scale`: the rule the guide was quantized with, which sets its global scale)."""
    _check_input(x)
    _check_guide(x, guide)
    lead, K = x.shape[:-1], x.shape[-1]
    amax = _rows_amax(guide.global_amax, lead, x.device)
    xb = x.reshape(-1, K // BLOCK_SIZE, BLOCK_SIZE).to(torch.float32)
    _, g_dec = reference.global_scales(amax, block_scale)
    s_value = reference.decode_e4m3(guide.scales.reshape(-1, K // BLOCK_SIZE))
    y = reference._scaled(xb, s_value, g_dec)
    k, k_up = reference.grid_neighbours(y.abs())
    c = codewords(guide).reshape(y.shape)
    t_idx, t_neg = c & 0x7, (c & 0x8) != 0
    neg = y < 0
    # The rollout's signed value equals sign(y) * G[k] or sign(y) * G[k_up]; zero has no sign.
    same_side = (t_neg == neg) | (t_idx == 0)
    hit = same_side & ((t_idx == k) | (t_idx == k_up))
    # y in (-0.5, 0.5) also neighbours zero from either side: covered above; and a y of exactly 0
    # neighbours only zero.
    return hit.reshape(*lead, K)

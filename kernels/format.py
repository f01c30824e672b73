"""NVFP4 format constants (docs/architecture.md).

NVFP4 = E2M1 elements in blocks of 16 consecutive values along the last dimension, one FP8 E4M3 scale
per block, and one float32 global scale per tensor or per row.
"""

import torch

BLOCK_SIZE = 16
FP4_MAX = 6.0
E4M3_MAX = 448.0
FLT_MAX = torch.finfo(torch.float32).max
# (448 * 6): the global encode scale maps the global amax onto the largest (scale x element) product.
GLOBAL_ENC_NUMERATOR = E4M3_MAX * FP4_MAX

# Block-scale rules (TraceConfig.block_scale). "6": every block's amax maps to 6 (the contract above).
# "4over6" (Four Over Six, Cook et al., arXiv 2512.02010; mit-han-lab/fouroversix
# src/fouroversix/quantize/pytorch/reference.py: E4M3_MAX_FOUROVERSIX = 256, `scale_expansion_factor=1.5`,
# `select_fouroversix` with ScaleRule.mse): the global encode scale is 6 * 256 / amax, so a block scale
# 1.5x larger (block amax mapped to 4) still fits E4M3 (256 * 1.5 = 384 <= 448); each block is quantized
# with both candidates and takes the 4-candidate only where its summed squared error against the
# original values is strictly lower (ties keep 6).
BLOCK_SCALES = ("6", "4over6")
FOUR_OVER_SIX_SCALE_MAX = 256.0
FOUR_OVER_SIX_EXPANSION = 1.5  # 6 / 4: the 4-candidate's unrounded scale is the 6-candidate's times this
GLOBAL_ENC_NUMERATOR_4OVER6 = FOUR_OVER_SIX_SCALE_MAX * FP4_MAX


def check_block_scale(block_scale) -> bool:
    """True for "4over6", False for "6"; ValueError naming the key for anything else."""
    if block_scale not in BLOCK_SCALES:
        raise ValueError(f"block_scale must be one of {BLOCK_SCALES}, got {block_scale!r}")
    return block_scale == "4over6"


def global_enc_numerator(block_scale: str = "6") -> float:
    return GLOBAL_ENC_NUMERATOR_4OVER6 if check_block_scale(block_scale) else GLOBAL_ENC_NUMERATOR

# E2M1 magnitudes by 3-bit index: bits are e1 e0 m, so the mantissa bit is `index & 1` and any two
# neighbours on the signed grid differ in it (the property compact guidance relies on).
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
SIGN_BIT = 0x8
MAGNITUDE_MASK = 0x7

# Round-to-nearest-even decision points between consecutive magnitudes. A value exactly on one rounds
# to the neighbour with the even mantissa: down at 0.25, 1.25, 2.5, 5; up at 0.75, 1.75, 3.5.
#   |y| <= 0.25 -> 0, < 0.75 -> 0.5, <= 1.25 -> 1, < 1.75 -> 1.5, <= 2.5 -> 2, < 3.5 -> 3, <= 5 -> 4
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)

# E4M3 (bias 7, no infinities): the byte 0x7F is NaN. We store it as the block scale of any block
# that holds a NaN or an infinity, or whose global amax is not finite, so the damage stays visible.
E4M3_NAN_BYTE = 0x7F
E4M3_MIN_NORMAL = 2.0**-6
E4M3_SUBNORMAL_STEP = 2.0**-9

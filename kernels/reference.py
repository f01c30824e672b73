"""Torch reference of the NVFP4 numerics contract: round-to-nearest and guided rounding (docs/architecture.md).

Readable, float32 throughout, and the arithmetic every other path (Triton kernels, engines, trainer)
must match bit for bit. Roundings to E4M3 and E2M1 use integer and comparison arithmetic only, never a
library float8 / bfloat16 cast, so the same steps can be written in Triton and give the same bits under
the interpreter and on a GPU.

Inputs here are already validated and flattened by `trace_kernels.api`:
  x           float32 [R, K]          (K % 16 == 0)
  global_amax float32 [R]             (one per row; per-tensor amax is expanded by the caller)
"""

import torch

from .format import (
    BLOCK_SIZE,
    E2M1_GRID,
    E2M1_MIDPOINTS,
    E4M3_MAX,
    E4M3_NAN_BYTE,
    FLT_MAX,
    FOUR_OVER_SIX_EXPANSION,
    SIGN_BIT,
    check_block_scale,
    global_enc_numerator,
)

_F32 = torch.float32


def _c(value: float, like: torch.Tensor) -> torch.Tensor:
    """A float32 constant on `like`'s device, so no operation is computed in float64."""
    return torch.tensor(value, dtype=_F32, device=like.device)


def global_scales(global_amax: torch.Tensor, block_scale: str = "6") -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1: (g_enc, g_dec) from the global amax: (448 * 6) / amax, or (256 * 6) / amax for 4over6."""
    g_enc = _c(global_enc_numerator(block_scale), global_amax) / global_amax
    g_enc = torch.minimum(g_enc, _c(FLT_MAX, g_enc))
    g_enc = torch.where(g_enc == 0, _c(1.0, g_enc), g_enc)
    g_dec = _c(1.0, g_enc) / g_enc
    return g_enc, g_dec


def round_to_e4m3(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round non-negative finite float32 `s` (<= 448) to E4M3, nearest-even.

    Returns (byte, value): the E4M3 bit pattern as int32 and its float32 value.
    Normal range: round the float32 bit pattern to 3 mantissa bits (adding 0x7FFFF plus the kept LSB
    is round-half-even on the integer; a carry moves into the exponent exactly as it should).
    Subnormal range (< 2^-6): a multiple of 2^-9, found by rounding s * 512 half-to-even by hand.
    """
    bits = s.view(torch.int32)
    lsb = (bits >> 20) & 1
    rounded = (bits + 0x7FFFF + lsb) & ~0xFFFFF
    normal_value = rounded.view(_F32)
    exp_field = ((rounded >> 23) & 0xFF) - 127 + 7
    normal_byte = (exp_field << 3) | ((rounded >> 20) & 0x7)

    v = s * _c(512.0, s)  # exact: a power-of-two scaling of a value < 2^-6
    q = _round_half_even(v)
    sub_value = q * _c(2.0**-9, s)
    sub_byte = q.to(torch.int32)  # q == 8 is 2^-6, whose byte 0x08 is also the right normal encoding

    is_normal = s >= _c(2.0**-6, s)
    byte = torch.where(is_normal, normal_byte, sub_byte)
    value = torch.where(is_normal, normal_value, sub_value)
    return byte, value


def _round_half_even(v: torch.Tensor) -> torch.Tensor:
    f = torch.floor(v)
    d = v - f  # exact for the small magnitudes used here
    odd = torch.remainder(f, 2) == 1
    up = (d > 0.5) | ((d == 0.5) & odd)
    return f + up.to(_F32)


def decode_e4m3(byte: torch.Tensor) -> torch.Tensor:
    """E4M3 byte (int) -> float32 value; 0x7F / 0xFF decode to NaN."""
    byte = byte.to(torch.int32)
    exp_field = (byte >> 3) & 0xF
    mant = byte & 0x7
    normal = ((exp_field - 7 + 127) << 23 | (mant << 20)).view(_F32)
    sub = mant.to(_F32) * _c(2.0**-9, normal)
    value = torch.where(exp_field == 0, sub, normal)
    is_nan = (byte & 0x7F) == 0x7F
    return torch.where(is_nan, _c(float("nan"), value), value)


def e2m1_index(a: torch.Tensor) -> torch.Tensor:
    """Step 4: magnitude index 0..7 of |y| (<= 6) with ties to the even mantissa."""
    idx = torch.zeros_like(a, dtype=torch.int32)
    for i, m in enumerate(E2M1_MIDPOINTS):
        # Ties go to the even mantissa: down at even-numbered midpoints, up at odd-numbered ones.
        idx += ((a >= m) if i % 2 == 1 else (a > m)).to(torch.int32)
    return idx


def grid_floor_index(a: torch.Tensor) -> torch.Tensor:
    """Index k of the largest E2M1 magnitude <= a (a in [0, 6])."""
    idx = torch.zeros_like(a, dtype=torch.int32)
    for g in E2M1_GRID[1:]:
        idx += (a >= g).to(torch.int32)
    return idx


def grid_neighbours(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Magnitude indices (k, k_up) of the E2M1 values just below and above a (in [0, 6]); equal when a
    is on the grid."""
    k = grid_floor_index(a)
    on_grid = grid_value(k) == a
    return k, torch.where(on_grid, k, torch.clamp(k + 1, max=7))


def grid_value(idx: torch.Tensor) -> torch.Tensor:
    return _grid_table(idx.device)[idx.long()]


_GRID_TABLES: dict = {}


def _grid_table(device) -> torch.Tensor:
    """The E2M1 magnitudes on `device`, built once per device in eager mode (building it per call was a
    tenth of the sparse decode's time); under torch.compile a constant, no cache to guard on."""
    if torch.compiler.is_compiling():
        return torch.tensor(E2M1_GRID, dtype=_F32, device=device)
    if device not in _GRID_TABLES:
        _GRID_TABLES[device] = torch.tensor(E2M1_GRID, dtype=_F32, device=device)
    return _GRID_TABLES[device]


def _blocks(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], x.shape[1] // BLOCK_SIZE, BLOCK_SIZE)  # explicit sizes: R may be 0


def _bad_blocks(xb: torch.Tensor, global_amax: torch.Tensor) -> torch.Tensor:
    """[R, NB] True where a block holds NaN/Inf or the row's global amax is not finite."""
    return (~torch.isfinite(xb)).any(-1) | ~torch.isfinite(global_amax)[:, None]


def _scaled(xb: torch.Tensor, s_value: torch.Tensor, g_dec: torch.Tensor) -> torch.Tensor:
    """Step 3: y = clamp(x * min(1 / (s * g_dec), FLT_MAX), -6, 6)."""
    enc = _c(1.0, xb) / (s_value * g_dec[:, None])
    enc = torch.minimum(enc, _c(FLT_MAX, enc))
    return torch.clamp(xb * enc[..., None], -6.0, 6.0)


def unrounded_scales(xb: torch.Tensor, g_enc: torch.Tensor) -> torch.Tensor:
    """Step 2 before its E4M3 rounding: amax_b * (g_enc * (1/6)), clamped to [0, 448]."""
    amax_b = xb.abs().amax(-1)
    s = amax_b * (g_enc[:, None] * _c(1.0 / 6.0, g_enc))
    return _clamp_scale(s)


def _clamp_scale(s: torch.Tensor) -> torch.Tensor:
    s = torch.minimum(s, _c(FLT_MAX, s))
    s = torch.clamp(s, -E4M3_MAX, E4M3_MAX)
    return torch.nan_to_num(s, nan=0.0)  # bad blocks are overwritten later; keep the bit tricks defined


def four_scales(s6: torch.Tensor) -> torch.Tensor:
    """4over6: the 4-candidate's unrounded scale, the 6-candidate's times 1.5 (block amax mapped to 4)."""
    return _clamp_scale(s6 * _c(FOUR_OVER_SIX_EXPANSION, s6))


def block_scales(xb: torch.Tensor, g_enc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 2: E4M3 block scale (byte, value) for each block of `xb` [R, NB, 16]."""
    return round_to_e4m3(unrounded_scales(xb, g_enc))


def block_sq_error(xb: torch.Tensor, idx: torch.Tensor, y: torch.Tensor, s_value: torch.Tensor,
                   g_dec: torch.Tensor) -> torch.Tensor:
    """4over6's selection error of each block: sum over its 16 values of (v * (s * g_dec) - x)^2, float32,
    v the signed E2M1 value. The sum runs in one fixed order (pairs (2i, 2i+1), then pairs of those, ...)
    that the Triton kernels repeat, so every backend picks the same candidate."""
    mag = grid_value(idx)
    v = torch.where(y < 0, -mag, mag)
    d = v * (s_value * g_dec[:, None])[..., None] - xb
    e = d * d
    while e.shape[-1] > 1:
        e = e[..., 0::2] + e[..., 1::2]
    return e[..., 0]


def select_4over6(xb: torch.Tensor, g_enc: torch.Tensor, g_dec: torch.Tensor):
    """4over6's choice per block of `xb` [R, NB, 16]: both candidates, quantized, and the 4-candidate where
    its squared error is strictly lower. Returns (scale byte, scale value, y, magnitude index, choose4)."""
    s6 = unrounded_scales(xb, g_enc)
    byte6, value6 = round_to_e4m3(s6)
    byte4, value4 = round_to_e4m3(four_scales(s6))
    y6, y4 = _scaled(xb, value6, g_dec), _scaled(xb, value4, g_dec)
    idx6, idx4 = e2m1_index(y6.abs()), e2m1_index(y4.abs())
    four = block_sq_error(xb, idx4, y4, value4, g_dec) < block_sq_error(xb, idx6, y6, value6, g_dec)
    pick = four[..., None]
    return (torch.where(four, byte4, byte6), torch.where(four, value4, value6), torch.where(pick, y4, y6),
            torch.where(pick, idx4, idx6), four)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] int codes -> [..., K/2] uint8, element 2i in the low nibble."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _finish(y, idx, bad, scale_byte):
    """Attach sign bits, zero the codes of bad blocks, mark their scales NaN, and pack."""
    codes = idx | torch.where(y < 0, SIGN_BIT, 0).to(torch.int32)
    codes = torch.where(bad[..., None], 0, codes)
    scale_byte = torch.where(bad, E4M3_NAN_BYTE, scale_byte)
    R, NB, B = codes.shape
    return pack_nibbles(codes.reshape(R, NB * B)), scale_byte.to(torch.uint8)


def quantize(x: torch.Tensor, global_amax: torch.Tensor, block_scale: str = "6") -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest NVFP4: returns (packed codes uint8 [R, K/2], scale bytes uint8 [R, K/16])."""
    return quantize_with_choice(x, global_amax, block_scale)[:2]


def quantize_with_choice(x: torch.Tensor, global_amax: torch.Tensor, block_scale: str = "6"):
    """`quantize`, plus 4over6's per-block choice (bool [R, K/16], True where the block took the
    4-candidate; all False for "6" and for bad blocks)."""
    xb = _blocks(x.to(_F32))
    g_enc, g_dec = global_scales(global_amax, block_scale)
    bad = _bad_blocks(xb, global_amax)
    if check_block_scale(block_scale):
        scale_byte, _, y, idx, four = select_4over6(xb, g_enc, g_dec)
        four = four & ~bad
    else:
        scale_byte, s_value = block_scales(xb, g_enc)
        y = _scaled(xb, s_value, g_dec)
        idx = e2m1_index(y.abs())
        four = torch.zeros_like(bad)
    return (*_finish(y, idx, bad, scale_byte), four)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, global_amax: torch.Tensor, block_scale: str = "6") -> torch.Tensor:
    """value = e2m1(code) * (float(scale_e4m3) * g_dec), float32 [R, K]."""
    c = unpack_nibbles(codes).to(torch.int32)
    mag = grid_value(c & 0x7)
    val = torch.where((c & SIGN_BIT) != 0, -mag, mag)
    _, g_dec = global_scales(global_amax, block_scale)
    block_mult = decode_e4m3(scales) * g_dec[:, None]
    R, K = val.shape
    return (val.reshape(R, K // BLOCK_SIZE, BLOCK_SIZE) * block_mult[..., None]).reshape(R, K)


def guided_indices(y: torch.Tensor, target_idx=None, target_sign=None, target_mbit=None):
    """Guided rounding's choice of codeword, on scaled values `y` (already in the rollout's grid units).

    The two signed-grid neighbours of y are sign(y) * G[k] (toward zero) and sign(y) * G[k + 1] (away
    from zero), k = grid_floor_index(|y|); they coincide when |y| is on the grid. Full guidance picks
    the one nearer the rollout's codeword (never a tie: the rollout's value cannot lie strictly between
    two adjacent grid points). Compact guidance picks the one whose mantissa bit matches.
    Returns the chosen magnitude index (int32).
    """
    k, k_up = grid_neighbours(y.abs())
    if target_mbit is not None:
        return torch.where((k & 1) == target_mbit, k, k_up)
    neg = y < 0
    v_toward = torch.where(neg, -grid_value(k), grid_value(k))
    v_away = torch.where(neg, -grid_value(k_up), grid_value(k_up))
    t_mag = grid_value(target_idx)
    target = torch.where(target_sign, -t_mag, t_mag)
    return torch.where((v_toward - target).abs() <= (v_away - target).abs(), k, k_up)


def quantize_guided(
    x: torch.Tensor,
    scales: torch.Tensor,
    global_amax: torch.Tensor,
    codes: torch.Tensor | None = None,
    mbits: torch.Tensor | None = None,
    block_scale: str = "6",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Round `x` with the guide's scales toward the guide's codewords (full: `codes`, compact: `mbits`
    unpacked to one 0/1 int per element). Returns (packed codes, scale bytes) like `quantize`.
    The guide's scale bytes already hold 4over6's choice; `block_scale` sets the global scale only."""
    xb = _blocks(x.to(_F32))
    _, g_dec = global_scales(global_amax, block_scale)
    s_value = decode_e4m3(scales)
    y = _scaled(xb, torch.nan_to_num(s_value, nan=1.0), g_dec)
    if codes is not None:
        c = unpack_nibbles(codes).to(torch.int32).reshape(y.shape)
        idx = guided_indices(y, target_idx=c & 0x7, target_sign=(c & SIGN_BIT) != 0)
    else:
        idx = guided_indices(y, target_mbit=mbits.to(torch.int32).reshape(y.shape))
    bad = _bad_blocks(xb, global_amax) | ((scales.to(torch.int32) & 0x7F) == 0x7F)
    return _finish(y, idx, bad, scales.to(torch.int32))

"""An independent oracle for the NVFP4 contract (docs/architecture.md, the numerics contract), used only by the tests.

It shares no code with trace_kernels and reaches the same results by other means: numpy float32
scalar-style arithmetic, PyTorch's own float8_e4m3fn cast for the block scales (round-to-nearest-even in
c10), and a nearest-point search over the E2M1 grid with ties broken toward the even magnitude index.
"""

import numpy as np
import torch

F32 = np.float32
FLT_MAX = np.finfo(np.float32).max
GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)


def global_scales(amax: np.ndarray):
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        g_enc = F32(448.0 * 6.0) / amax.astype(F32)
        g_enc = np.minimum(g_enc, FLT_MAX).astype(F32)
        g_enc = np.where(g_enc == 0, F32(1.0), g_enc).astype(F32)
        g_dec = (F32(1.0) / g_enc).astype(F32)
    return g_enc, g_dec


def e4m3(s: np.ndarray):
    """(byte, value) through torch's float8_e4m3fn cast."""
    t = torch.from_numpy(np.ascontiguousarray(s, dtype=F32)).to(torch.float8_e4m3fn)
    return t.view(torch.uint8).numpy().astype(np.int64), t.to(torch.float32).numpy()


def nearest_index(a: np.ndarray) -> np.ndarray:
    """Index of the nearest E2M1 magnitude; exact ties go to the even index (even mantissa)."""
    d = np.abs(a[..., None].astype(np.float64) - GRID.astype(np.float64))
    best = d.min(-1, keepdims=True)
    candidates = d == best
    even_tie = candidates & (np.arange(8) % 2 == 0)
    pick = np.where(candidates.sum(-1) > 1, even_tie.argmax(-1), candidates.argmax(-1))
    return pick


def scaled(xb: np.ndarray, s_value: np.ndarray, g_dec: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        enc = np.minimum(F32(1.0) / (s_value * g_dec[:, None]).astype(F32), FLT_MAX).astype(F32)
        return np.clip((xb * enc[..., None]).astype(F32), F32(-6.0), F32(6.0))


def quantize(x: torch.Tensor, amax: torch.Tensor):
    """x [R, K] (any float dtype), amax float32 [R] -> (codes int [R, K], scale bytes int [R, K/16])."""
    xb = x.float().numpy().reshape(x.shape[0], -1, 16).astype(F32)
    amax = amax.numpy().astype(F32)
    g_enc, g_dec = global_scales(amax)
    with np.errstate(invalid="ignore", over="ignore"):
        amax_b = np.abs(xb).max(-1)
        s = (amax_b * (g_enc * F32(1.0 / 6.0)).astype(F32)[:, None]).astype(F32)
        s = np.clip(np.minimum(s, FLT_MAX), F32(-448.0), F32(448.0))
    bad = ~np.isfinite(xb).all(-1) | ~np.isfinite(amax)[:, None]
    s = np.where(bad, F32(0.0), s)
    byte, s_value = e4m3(s)
    y = scaled(xb, s_value, g_dec)
    codes = nearest_index(np.abs(y)) | np.where(y < 0, 8, 0)
    codes = np.where(bad[..., None], 0, codes)
    byte = np.where(bad, 0x7F, byte)
    return codes.reshape(x.shape[0], -1), byte


def rtn_with_scales(x: torch.Tensor, scale_bytes: np.ndarray, amax: torch.Tensor):
    """Round-to-nearest of x on a given grid (the rollout's scales): codes int [R, K]."""
    xb = x.float().numpy().reshape(x.shape[0], -1, 16).astype(F32)
    _, g_dec = global_scales(amax.numpy().astype(F32))
    s_value = torch.from_numpy(scale_bytes.astype(np.uint8)).view(torch.float8_e4m3fn).float().numpy()
    y = scaled(xb, s_value, g_dec)
    return (nearest_index(np.abs(y)) | np.where(y < 0, 8, 0)).reshape(x.shape[0], -1), y.reshape(x.shape[0], -1)


def unpack(codes: torch.Tensor) -> np.ndarray:
    c = codes.numpy().astype(np.int64)
    return np.stack((c & 0xF, c >> 4), -1).reshape(*c.shape[:-1], -1)


def signed_value(codes: np.ndarray) -> np.ndarray:
    """Grid value of each code (so +0 and -0 compare equal)."""
    mag = GRID[codes & 7]
    return np.where(codes & 8, -mag, mag)


# ---- 4over6 (Four Over Six, arXiv 2512.02010) --------------------------------------------------------
# Written from the published reference (mit-han-lab/fouroversix, quantize/pytorch/reference.py:
# E4M3_MAX_FOUROVERSIX = 256, the 4-candidate's scale = the 6-candidate's unrounded scale x 1.5,
# `select_fouroversix` with the MSE rule), not from trace_kernels: errors in float64 against the
# published dequantization q * s * amax / (6 * 256), candidate 4 only where its error is strictly lower.


def quantize_4over6(x: torch.Tensor, amax: torch.Tensor):
    """x [R, K], amax float32 [R] -> (codes int [R, K], scale bytes int [R, K/16], choose4 bool [R, K/16],
    err6, err4 float64 [R, K/16])."""
    xb = x.float().numpy().reshape(x.shape[0], -1, 16).astype(F32)
    a = amax.numpy().astype(F32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        g_enc = np.minimum(F32(256.0 * 6.0) / a, FLT_MAX).astype(F32)
        g_enc = np.where(g_enc == 0, F32(1.0), g_enc).astype(F32)
        g_dec = (F32(1.0) / g_enc).astype(F32)
        s6 = (np.abs(xb).max(-1) * (g_enc * F32(1.0 / 6.0)).astype(F32)[:, None]).astype(F32)
        s6 = np.clip(np.minimum(s6, FLT_MAX), F32(-448.0), F32(448.0))
        s4 = np.clip(np.minimum((s6 * F32(1.5)).astype(F32), FLT_MAX), F32(-448.0), F32(448.0))
    bad = ~np.isfinite(xb).all(-1) | ~np.isfinite(a)[:, None]
    out = []
    for s in (s6, s4):
        byte, value = e4m3(np.where(bad, F32(0.0), s))
        y = scaled(xb, value, g_dec)
        codes = nearest_index(np.abs(y)) | np.where(y < 0, 8, 0)
        deq = signed_value(codes).astype(np.float64) * value.astype(np.float64)[..., None] * a.astype(np.float64)[:, None, None] / 1536.0
        err = ((deq - xb.astype(np.float64)) ** 2).sum(-1)
        out.append((byte, codes, err))
    (b6, c6, e6), (b4, c4, e4) = out
    four = (e4 < e6) & ~bad
    codes = np.where(four[..., None], c4, c6)
    codes = np.where(bad[..., None], 0, codes)
    byte = np.where(bad, 0x7F, np.where(four, b4, b6))
    return codes.reshape(x.shape[0], -1), byte, four, e6, e4

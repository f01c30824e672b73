"""Native packed NVFP4 KV cache: the write of quantized K / V rows into their slots, and the read of the
blocks a batch uses back to model-dtype K and V (trace_vllm_plugin.kv_packed's CPU path).

Pages are `[num_blocks, kv_heads, block_size, 2 * row]` uint8, a row being `kv_layout`'s
`[codes D/2 | E4M3 scales D/16 | float32 amax]`, K's row then V's.

Write (`write_rows`): the rows `pack_rows` makes, stored at each token's slot; a padded token (slot
-1) writes nothing, which is what kv_packed.write_packed's graph-safe form amounts to (its padded
tokens rewrite a value some real token, or the slot itself, already holds).

Read (`dequantize_blocks`): per used block, per token a request attends to (`valid_rows`), per head, e2m1(code) * (e4m3(scale) * g_dec)
in float32 (quantize.dequantize_kernel's arithmetic: the reference's), then rounded to bf16 in the
kernel, nearest-even on the float32 bits as torch's cast rounds every non-NaN value. A NaN (a block
whose scale is NaN, or a NaN amax) makes the kernel report it, and the caller then casts with torch
instead: torch writes a NaN as 0x7FC0 in its scalar loop and 0xFFFF in its vector loop (AVX-512),
so only torch itself can reproduce its NaN bits. Model dtypes other than bf16 take the float32 output
and torch's cast.
"""

import numpy as np
import torch

from ..kv_layout import packed_row_bytes
from . import as_numpy, njit
from .quantize import CALLS, NUMERATOR, global_dec, np_view, quantize_kernel, row_amax_kernel, tables

F32 = np.float32


@njit
def _row_amax(page, b, h, t, off, fbuf, ibuf):
    """The float32 amax stored little-endian at bytes off..off+3 of a packed row."""
    ibuf[0] = np.int32(np.int64(page[b, h, t, off]) | (np.int64(page[b, h, t, off + 1]) << 8)
                       | (np.int64(page[b, h, t, off + 2]) << 16) | (np.int64(page[b, h, t, off + 3]) << 24))
    return fbuf[0]


@njit
def dequantize_blocks_kernel(page, ids, valid, D, DV, numerator, nib, sv, to_bf16, k_f, v_f, k_b, v_b, slots):
    """page u8 [B, H, block, 2 * row], ids i64 [U], valid i64 [U] (rows to read of each block, from its
    first) -> K / V of those rows, packed token-major [rows, H, D / DV]: float32 into k_f / v_f, or
    (to_bf16) bf16 bits into k_b / v_b; slots[row] = u * block + t. Returns True when a NaN was produced."""
    H, block = page.shape[1], page.shape[2]
    fbuf = np.empty(1, dtype=np.float32)
    ibuf = fbuf.view(np.int32)
    vals = np.empty(16, dtype=np.float32)
    vbits = vals.view(np.int32)
    saw_nan = False
    rk = D // 2 + D // 16 + 4
    row = 0
    for u in range(ids.shape[0]):
        b = ids[u]
        for t in range(valid[u]):
            slots[row] = u * block + t
            for h in range(H):
                for part in range(2):
                    n = D if part == 0 else DV
                    base = 0 if part == 0 else rk
                    nc = n // 2
                    g_dec = global_dec(_row_amax(page, b, h, t, base + nc + n // 16, fbuf, ibuf), numerator)[1]
                    for blk in range(n // 16):
                        m = sv[page[b, h, t, base + nc + blk]] * g_dec
                        if m != m:
                            saw_nan = True
                        for j in range(8):
                            c = page[b, h, t, base + blk * 8 + j]
                            vals[2 * j] = nib[c & 0xF] * m
                            vals[2 * j + 1] = nib[c >> 4] * m
                        o = blk * 16
                        if to_bf16:
                            for i in range(16):
                                x = np.int64(vbits[i]) & 0xFFFFFFFF
                                r = np.uint16(((x + 0x7FFF + ((x >> 16) & 1)) >> 16) & 0xFFFF)
                                if part == 0:
                                    k_b[row, h, o + i] = r
                                else:
                                    v_b[row, h, o + i] = r
                        else:
                            for i in range(16):
                                if part == 0:
                                    k_f[row, h, o + i] = vals[i]
                                else:
                                    v_f[row, h, o + i] = vals[i]
            row += 1
    return saw_nan


@njit
def write_rows_kernel(page, slots, kc, ks, ka, vc, vs, va):
    """Store token t's packed K and V rows (codes u8 [T, H, D/2], scales u8 [T, H, D/16], amax f32 [T, H])
    at slot slots[t] of page u8 [B, H, block, 2 * row]; slot < 0: nothing."""
    H, block = page.shape[1], page.shape[2]
    nck, nsk = kc.shape[2], ks.shape[2]
    ncv, nsv = vc.shape[2], vs.shape[2]
    rk = nck + nsk + 4
    fbuf = np.empty(1, dtype=np.float32)
    bbuf = fbuf.view(np.uint8)
    for t in range(slots.shape[0]):
        s = slots[t]
        if s < 0:
            continue
        b, p = s // block, s % block
        for h in range(H):
            for i in range(nck):
                page[b, h, p, i] = kc[t, h, i]
            for i in range(nsk):
                page[b, h, p, nck + i] = ks[t, h, i]
            fbuf[0] = ka[t, h]
            for i in range(4):
                page[b, h, p, nck + nsk + i] = bbuf[i]
            for i in range(ncv):
                page[b, h, p, rk + i] = vc[t, h, i]
            for i in range(nsv):
                page[b, h, p, rk + ncv + i] = vs[t, h, i]
            fbuf[0] = va[t, h]
            for i in range(4):
                page[b, h, p, rk + ncv + nsv + i] = bbuf[i]


def _rows_of(q, n: int):
    """(codes, scales, amax) of NVFP4 rows [T, H, *] as contiguous numpy arrays of the first n tokens."""
    codes, scales = q.codes[:n], q.scales[:n]
    amax = q.global_amax
    amax = amax.reshape(1, 1).expand(codes.shape[:2]) if amax.numel() == 1 else amax[:n]
    return np_view(codes), np_view(scales), np_view(amax.to(torch.float32))


def write_rows(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, qk, qv) -> None:
    """kv_packed.write_packed's result: packed K and V rows [T, H, *] at their slots (first len(slots) tokens)."""
    CALLS["kv_write"] += 1
    n = slot_mapping.shape[0]
    if not kv_cache.is_contiguous():
        raise ValueError("the native packed KV write needs a contiguous cache tensor")
    write_rows_kernel(kv_cache.numpy(), np_view(slot_mapping.to(torch.int64)), *_rows_of(qk, n), *_rows_of(qv, n))


@njit
def quantize_write_kernel(page, slots, kx, ka, vx, va, amax_native, numerator, nib, sv, kc, ks, vc, vs):
    """K and V rows x f32 [T, H, D], amax f32 [T, H] quantized (quantize_kernel) into codes / scales
    [T, H, *], then the first len(slots) tokens written at their slots (write_rows_kernel). With
    amax_native, ka / va are first written here: each row's max |value| (torch's per-row amax bits: a max
    is exact); a NaN stops it before anything is written (returns False: torch decides a NaN's bits)."""
    T, H, D = kx.shape
    DV = vx.shape[2]
    if amax_native:
        if not row_amax_kernel(kx.reshape(T * H, D), ka.reshape(T * H)):
            return False
        if not row_amax_kernel(vx.reshape(T * H, DV), va.reshape(T * H)):
            return False
    none = np.empty((0, 0), dtype=np.float32)
    quantize_kernel(kx.reshape(T * H, D), ka.reshape(T * H), numerator, kc.reshape(T * H, D // 2),
                    ks.reshape(T * H, D // 16), none, False, nib, sv)
    quantize_kernel(vx.reshape(T * H, DV), va.reshape(T * H), numerator, vc.reshape(T * H, DV // 2),
                    vs.reshape(T * H, DV // 16), none, False, nib, sv)
    write_rows_kernel(page, slots, kc, ks, ka, vc, vs, va)
    return True


def quantize_write(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   k_amax: torch.Tensor, v_amax: torch.Tensor, *, compute_amax: bool = False):
    """`quantize(key)`, `quantize(value)` and `write_rows` in one call, for the vLLM plugin's KV write,
    which checked once what the public entry point checks per call (CPU, contiguous cache, float K / V
    [T, H, D] with D % 16 == 0, the default block scale). k_amax / v_amax f32 [T, H]. Returns the
    (codes, scales) of K and of V, [T, H, D/2] and [T, H, D/16] uint8, for the capture. compute_amax:
    k_amax / v_amax (contiguous f32 [T, H]) are outputs, each row's amax (trace_kernels.row_amax's bits),
    computed inside the kernel (by torch when a row holds a NaN: torch decides its bits)."""
    CALLS["kv_quantize_write"] += 1
    T, H, D = key.shape
    DV = value.shape[2]
    # numpy arrays wrapped by torch.from_numpy (np.empty and from_numpy ~0.7 us a tensor on this CPU,
    # torch.empty and .numpy() ~2.8 us); fresh per call, which the capture store relies on (put_owned).
    out = [np.empty(shape, dtype=np.uint8) for shape in ((T, H, D // 2), (T, H, D // 16), (T, H, DV // 2), (T, H, DV // 16))]
    kc, ks, vc, vs = (torch.from_numpy(a) for a in out)
    nib, sv = tables()
    page, slots, kx, vx = kv_cache.numpy(), np_view(slot_mapping.to(torch.int64)), np_view(key.to(torch.float32)), np_view(value.to(torch.float32))
    done = quantize_write_kernel(page, slots, kx, np_view(k_amax), vx, np_view(v_amax), compute_amax, NUMERATOR["6"],
                                 nib, sv, *out)
    if not done:  # a NaN: torch's amax (its NaN bits), nothing was written yet
        from ..api import row_amax
        from . import count_eager

        count_eager("kv_write_amax_nan", "a NaN in K or V: torch's amax decides the NaN's bits")

        k_amax.copy_(row_amax(key)), v_amax.copy_(row_amax(value))
        quantize_write_kernel(page, slots, kx, np_view(k_amax), vx, np_view(v_amax), False, NUMERATOR["6"], nib, sv, *out)
    return (kc, ks), (vc, vs)


def dequantize_blocks(kv_cache: torch.Tensor, ids: torch.Tensor, head_size: int, head_size_v: int, dtype: torch.dtype,
                      block_scale: str = "6", valid: torch.Tensor | None = None):
    """kv_packed.dequantize_blocks(kv_cache[ids], ...) without the gather: (K, V) `[rows, H, D]` in dtype and
    the scratch slot of each row (u * block + t). `valid` (i64 [U]): read only the first valid[u] rows of
    block u (the rows a request can attend to); None: every row (then rows = U * block, in order)."""
    CALLS["kv_read"] += 1
    B, H, block, width = kv_cache.shape
    if width != packed_row_bytes(head_size) + packed_row_bytes(head_size_v):
        raise ValueError(f"packed KV pages of width {width} do not hold head sizes {head_size} / {head_size_v}")
    if not kv_cache.is_contiguous():  # a view of a larger buffer: gather the used blocks (never copy it all)
        kv_cache, ids = kv_cache[ids].contiguous(), torch.arange(ids.shape[0])
    U = ids.shape[0]
    valid_np = np.full(U, block, dtype=np.int64) if valid is None else as_numpy(valid.to(torch.int64))
    rows = int(valid_np.sum())
    page, ids_np = as_numpy(kv_cache), as_numpy(ids.to(torch.int64))
    slots = torch.empty(rows, dtype=torch.int64)
    nib, sv = tables()
    num = NUMERATOR[block_scale]
    if dtype == torch.bfloat16:
        k = torch.empty((rows, H, head_size), dtype=torch.bfloat16)
        v = torch.empty((rows, H, head_size_v), dtype=torch.bfloat16)
        nan = dequantize_blocks_kernel(page, ids_np, valid_np, head_size, head_size_v, num, nib, sv, True, _NO_F32,
                                       _NO_F32, as_numpy(k), as_numpy(v), slots.numpy())
        if not nan:
            return k, v, slots
    kf = torch.empty((rows, H, head_size), dtype=torch.float32)
    vf = torch.empty((rows, H, head_size_v), dtype=torch.float32)
    dequantize_blocks_kernel(page, ids_np, valid_np, head_size, head_size_v, num, nib, sv, False, kf.numpy(),
                             vf.numpy(), _NO_BF16, _NO_BF16, slots.numpy())
    return kf.to(dtype), vf.to(dtype), slots


@njit
def valid_rows_kernel(remapped, seq_lens, block, valid):
    """valid[pos] = rows of scratch block pos that some request attends to: for request r, column c of its
    (remapped) block table, min(block, seq_len - c * block)."""
    for r in range(seq_lens.shape[0]):
        L = seq_lens[r]
        for c in range((L + block - 1) // block):
            n = min(block, L - c * block)
            pos = remapped[r, c]
            if n > valid[pos]:
                valid[pos] = n


def valid_rows(remapped: torch.Tensor, seq_lens: torch.Tensor, block: int, num_used: int) -> torch.Tensor:
    """i64 [num_used]: how many leading rows of each used block (kv_packed.used_blocks' order) are read."""
    valid = torch.zeros(num_used, dtype=torch.int64)
    valid_rows_kernel(as_numpy(remapped.to(torch.int64)[: seq_lens.shape[0]]), as_numpy(seq_lens.to(torch.int64)),
                      block, valid.numpy())
    return valid


_NO_F32 = np.empty((0, 0, 0), dtype=np.float32)
_NO_BF16 = np.empty((0, 0, 0), dtype=np.uint16)

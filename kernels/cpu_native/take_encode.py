"""Every sparse payload and audit blob of one engine take in one numba call: for each guided site, the
requests' rows read straight from where they lie (the host arena's chunks, or one gathered tensor per
key) by (chunk, row) per token, encoded per record by sparse_encode's row writer, and the drawn audit
rows' blobs cut, all into one output buffer.

Why: the take called the encoder once per layer and site (16 calls a take on the tiny model, ~0.1 ms of
Python each around the kernel: rates, parity columns, tensor conversions, a split) after a numpy gather
of every key's rows (~1.8 ms a take: 48 fancy indexes of the site arrays, their tensors), and cut the
audit blobs with numpy per site. Here the gather is a row copy inside the kernel into a per-site scratch
(in cache, reused site after site), and the payload is written by the same `_write_rows` as
`sparse_encode.encode_many` (so the same bytes: the per-site call's, which tests compare with
`encode_payload` per record).

The sources are data addresses (pointers.py): the caller keeps the arrays alive, C-contiguous, and
every token's row inside its array for the call (engine/take.py checks that before it calls).
"""

import numpy as np
from numba import carray

from . import njit
from .pointers import int32_pointer, int64_pointer, uint8_pointer

# meta columns of a site (one int64 row per site; `encode_take`'s `meta`)
INNER, K_, SEG, AMAX_BITS, SCALE_BITS, CODE_BITS, CHECK, CHOICE, VERSION, SCOL, NSCOL, CCOL, NCCOL = range(13)
META = 13

_KERNEL = None
_head_of = _payload_size = _code_table = _write_rows = None  # sparse_encode's helpers, bound by _build


def _build():
    # sparse_encode's helpers read as this module's globals, not closure cells (sparse_encode._build says
    # why: a closure cell changes the kernel's cache key in every process)
    global _head_of, _payload_size, _code_table, _write_rows
    from . import sparse_encode

    sparse_encode.kernel()
    _head_of, _payload_size = sparse_encode._head_of, sparse_encode._payload_size
    _code_table, _write_rows = sparse_encode._code_table, sparse_encode._write_rows

    @njit
    def encode_take(ptrs, row_chunk, row_index, tokens, meta, cols, aud_start, aud_rows):
        """ptrs int64 [sites, chunks, 3]: the addresses of each site's codes, scales and float32 amax arrays in
        each chunk (rows of inner * K/2, inner * K/16, inner elements per token); token t (of all records, back
        to back) is row row_index[t] of chunk row_chunk[t]; record i's tokens [tokens[i], tokens[i + 1]), each
        non-empty. meta int64 [sites, META]: each site's shape and rates (cols: its parity columns at SCOL /
        CCOL). aud_start int64 [sites * n + 1]: record i of site k drew the token rows aud_rows[aud_start[k * n
        + i] : aud_start[k * n + i + 1]] (local to the record).

        Returns (bytes, sizes int64 [sites * 2n]): per site, record 0..n-1's payload (sparse_encode.encode_many's
        bytes), then record 0..n-1's audit blob (its rows as int32, then each row's codes; 0 bytes where none
        drawn), back to back in that order."""
        S, n, T = ptrs.shape[0], tokens.shape[0] - 1, row_index.shape[0]
        sizes = np.zeros(S * 2 * n, dtype=np.int64)
        # pass 1: every piece's size (a payload's from its records' amax alone), the scratch's largest site
        heads = np.zeros((S, n, 3), dtype=np.int64)
        most = 0
        amax_at = np.zeros(S + 1, dtype=np.int64)  # site k's amax rows: amaxes[amax_at[k] : amax_at[k + 1]]
        for k in range(S):
            amax_at[k + 1] = amax_at[k] + T * meta[k, INNER]
        amaxes = np.empty(amax_at[S], dtype=np.uint32)
        for k in range(S):
            inner, K = meta[k, INNER], meta[k, K_]
            R = T * inner
            most = max(most, R * (K // 2 + K // 16))
            amax = amaxes[amax_at[k] : amax_at[k + 1]]
            _rows_of(amax.view(np.uint8), ptrs[k, :, 2], row_chunk, row_index, inner * 4)
            for i in range(n):
                static, shift, a_bits = _head_of(amax, tokens[i] * inner, tokens[i + 1] * inner, meta[k, AMAX_BITS])
                heads[k, i, 0], heads[k, i, 1], heads[k, i, 2] = static, shift, a_bits
                sizes[k * 2 * n + i] = _payload_size((tokens[i + 1] - tokens[i]) * inner, static, a_bits, K, meta[k, SEG],
                                                     meta[k, SCALE_BITS], meta[k, CODE_BITS], meta[k, CHOICE])
                drawn = aud_start[k * n + i + 1] - aud_start[k * n + i]
                sizes[k * 2 * n + n + i] = drawn * (4 + inner * (K // 2))
        out = np.zeros(sizes.sum(), dtype=np.uint8)
        scratch = np.empty(most, dtype=np.uint8)
        no_mbits = np.zeros((1, 1), dtype=np.uint8)
        at = 0
        # pass 2: per site, its tokens' rows copied into the scratch, each record's payload, then the audit blobs
        for k in range(S):
            inner, K, seg = meta[k, INNER], meta[k, K_], meta[k, SEG]
            R = T * inner
            cb, sb = K // 2, K // 16
            amax = amaxes[amax_at[k] : amax_at[k + 1]]  # read in pass 1
            codes = scratch[: R * cb].reshape(R, cb)
            scales = scratch[R * cb : R * (cb + sb)].reshape(R, sb)
            _rows_of(scratch[: R * cb], ptrs[k, :, 0], row_chunk, row_index, inner * cb)
            _rows_of(scratch[R * cb : R * (cb + sb)], ptrs[k, :, 1], row_chunk, row_index, inner * sb)
            scol = cols[meta[k, SCOL] : meta[k, SCOL] + meta[k, NSCOL]]
            tab = _code_table(cols[meta[k, CCOL] : meta[k, CCOL] + meta[k, NCCOL]], seg, meta[k, CODE_BITS])
            for i in range(n):
                _write_rows(out, at, codes, no_mbits, False, scales, amax, tokens[i] * inner, tokens[i + 1] * inner,
                            heads[k, i, 0] != 0, heads[k, i, 1], heads[k, i, 2], K, seg, meta[k, SCALE_BITS],
                            meta[k, CODE_BITS], meta[k, CHECK] != 0, meta[k, CHOICE] != 0, meta[k, VERSION], scol, tab)
                at += sizes[k * 2 * n + i]
            token_bytes = inner * cb
            for i in range(n):
                a0, a1 = aud_start[k * n + i], aud_start[k * n + i + 1]
                for j in range(a0, a1):  # the rows as little-endian int32 (audit_blob_numpy's header)
                    v = aud_rows[j]
                    for b in range(4):
                        out[at + 4 * (j - a0) + b] = np.uint8((v >> (8 * b)) & 0xFF)
                p = at + 4 * (a1 - a0)
                for j in range(a0, a1):  # then each drawn token's codes (every inner row of it)
                    src = (tokens[i] + aud_rows[j]) * token_bytes
                    for b in range(token_bytes):
                        out[p + b] = scratch[src + b]
                    p += token_bytes
                at += sizes[k * 2 * n + n + i]
        return out, sizes

    return encode_take


@njit
def _rows_of(dst, chunk_ptrs, row_chunk, row_index, row_bytes):
    """dst[t * row_bytes : (t + 1) * row_bytes] = row row_index[t] of the array at chunk_ptrs[row_chunk[t]],
    for every token t. On the engine a request's tokens are one row of each decode step, the steps' rows
    interleaved by request: nearly every row stands alone, so each is copied by itself, as 8- or 4-byte
    words where the row size and the addresses allow (every site of the tiny model: a byte loop per row
    cost ~35 cycles of loop and address work a row, ~0.75 ms a take)."""
    T = row_index.shape[0]
    base = dst.ctypes.data
    word = 8 if row_bytes % 8 == 0 else 4 if row_bytes % 4 == 0 else 1
    if base % word:
        word = 1
    for c in range(chunk_ptrs.shape[0]):
        if chunk_ptrs[c] % word:
            word = 1
    if word == 8:
        w = row_bytes // 8
        d8 = carray(int64_pointer(base), (T * w,))
        for t in range(T):
            s8 = carray(int64_pointer(chunk_ptrs[row_chunk[t]] + row_index[t] * row_bytes), (w,))
            for i in range(w):
                d8[t * w + i] = s8[i]
    elif word == 4:
        w = row_bytes // 4
        d4 = carray(int32_pointer(base), (T * w,))
        for t in range(T):
            s4 = carray(int32_pointer(chunk_ptrs[row_chunk[t]] + row_index[t] * row_bytes), (w,))
            for i in range(w):
                d4[t * w + i] = s4[i]
    else:
        for t in range(T):
            s1 = carray(uint8_pointer(chunk_ptrs[row_chunk[t]] + row_index[t] * row_bytes), (row_bytes,))
            for i in range(row_bytes):
                dst[t * row_bytes + i] = s1[i]


def kernel():
    """The jitted kernel (compiled, or loaded from numba's disk cache, on first use)."""
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _build()
    return _KERNEL


def encode_take(arrays: list, guided: list, row_chunk: np.ndarray, row_index: np.ndarray, tokens: np.ndarray,
                meta: np.ndarray, cols: np.ndarray, aud_start: np.ndarray, aud_rows: np.ndarray):
    """(bytes, sizes): the kernel's answer for the `guided` site keys' rows in `arrays` (one {key: (codes,
    scales, float32 amax) numpy arrays} per chunk, C-contiguous, every token's row inside them: the caller
    checks that and keeps them alive for the call)."""
    ptrs = np.empty((len(guided), len(arrays), 3), dtype=np.int64)
    for c, arrs in enumerate(arrays):
        for k, key in enumerate(guided):
            codes, scales, amax = arrs[key]
            ptrs[k, c, 0], ptrs[k, c, 1], ptrs[k, c, 2] = codes.ctypes.data, scales.ctypes.data, amax.ctypes.data
    return kernel()(ptrs, row_chunk, row_index, tokens, meta, cols, aud_start, aud_rows)

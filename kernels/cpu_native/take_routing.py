"""Every packed routing payload of one engine take in one numba call: for each MoE layer whose mode packs its
ids, the requests' int16 routing rows read straight from the host arena's chunks by (chunk, row) per token,
range-checked, and bit-packed per record (records.routing.pack_routing's layout: b bits per id, LSB first,
zero-padded to a byte) into one output buffer.

Why: the take gathered each layer's ids with a numpy fancy index per layer (host_arena.gather_rows, ~0.74 ms
a take in the engine), then converted them to int64, unpacked every bit and np.packbits'ed each record
(take._pack_routing, ~0.44 ms). Here each id is read once where it lies and shifted into the record's bytes.

The sources are data addresses (pointers.py): the caller keeps the arrays alive, C-contiguous, int16 [rows,
top_k], and every token's row inside them for the call (engine/take.py checks that before it calls).
"""

import numpy as np
from numba import carray

from . import njit
from .pointers import int16_pointer


@njit
def _pack_take(ptrs, row_chunk, row_index, tokens, top_k, num_experts, bits):
    """ptrs int64 [layers, chunks]: each layer's int16 [rows, top_k] ids array in each chunk; token t (of all
    records, back to back) is row row_index[t] of chunk row_chunk[t]; record i's tokens [tokens[i], tokens[i +
    1]). Returns (bytes, sizes int64 [layers * n], bad): per layer, record 0..n-1's packed ids back to back;
    bad = 1 + the first layer's index holding an id outside [0, num_experts) (the bytes are then unfinished),
    else 0."""
    L, n = ptrs.shape[0], tokens.shape[0] - 1
    sizes = np.empty(L * n, dtype=np.int64)
    for k in range(L):
        for i in range(n):
            sizes[k * n + i] = ((tokens[i + 1] - tokens[i]) * top_k * bits + 7) // 8
    out = np.zeros(sizes.sum(), dtype=np.uint8)
    at = 0
    for k in range(L):
        for i in range(n):
            acc = np.uint64(0)  # bits not yet written, LSB first (fewer than 8 after each id's flush)
            held = 0
            p = at
            for t in range(tokens[i], tokens[i + 1]):
                row = carray(int16_pointer(ptrs[k, row_chunk[t]] + row_index[t] * top_k * 2), (top_k,))
                for j in range(top_k):
                    v = np.int64(row[j])
                    if v < 0 or v >= num_experts:
                        return out, sizes, k + 1
                    acc |= np.uint64(v) << np.uint64(held)
                    held += bits
                    while held >= 8:
                        out[p] = np.uint8(acc & np.uint64(0xFF))
                        acc >>= np.uint64(8)
                        held -= 8
                        p += 1
            if held:
                out[p] = np.uint8(acc & np.uint64(0xFF))
            at += sizes[k * n + i]
    return out, sizes, 0


def pack_take(arrays: list, row_chunk: np.ndarray, row_index: np.ndarray, tokens: np.ndarray, top_k: int,
              num_experts: int, bits: int):
    """(bytes, sizes, bad): the kernel's answer for `arrays` (per layer, one int16 [rows, top_k] numpy array
    per chunk, C-contiguous, every token's row inside it: the caller checks that and keeps them alive for
    the call)."""
    ptrs = np.empty((len(arrays), len(arrays[0]) if arrays else 0), dtype=np.int64)
    for k, per_chunk in enumerate(arrays):
        for c, a in enumerate(per_chunk):
            ptrs[k, c] = a.ctypes.data
    return _pack_take(ptrs, row_chunk, row_index, np.asarray(tokens, dtype=np.int64), top_k, num_experts, bits)

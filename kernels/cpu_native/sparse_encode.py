"""The sparse encoder as one numba kernel: rows (codes or mantissa bits, scales, amax) -> the packed
payload bytes, byte for byte what `guides/sparse/fused_encode.encode_payload` writes with torch.

Why: the torch encoder is ~40 small ops per site (bit unpacking, a float matmul per syndrome, bit
packing by weighted sums), ~0.4 ms per site on the tiny model whatever the row count; a record has 16
sites. The kernel walks each row once: the amax coset bits, per segment the scale LSBs (or their
syndrome), the code syndrome (XOR of the parity-check columns under the set mantissa bits: the
matmul's parity, exactly; one table entry per 8 values) and the 4over6 choice bits, written LSB first
into the body through a 64-bit accumulator as it goes.
Integer arithmetic only, so bit-identity does not depend on float rounding.

The payload (wire.py): 3 header bytes, a float32 amax when every row shares one (static), then per row
`amax_bits` key bits and per segment m_s + m_c (+ one choice bit per block) bits, LSB first, zero-padded
to a byte.
"""

import numpy as np
import torch

from . import as_numpy, njit

_KERNEL = None
_MANY = None
_head_of = _payload_size = _code_table = _write_rows = None  # the kernels' helpers, set by _build


def _build():
    # The helpers are module globals, not names of this function: a kernel that reads a helper through a
    # closure cell is cached under a hash of the cell's contents, and a dispatcher pickles differently in
    # every process (numba's `_index_key`), so `encode_many` / `encode_rows` missed numba's disk cache and
    # compiled again in every process (~1.5 s at its first take; 16 copies had piled up in main's cache).
    # Read as globals, they are resolved when the kernel compiles and left out of its cache key.
    global _head_of, _payload_size, _code_table, _write_rows

    @njit
    def _head_of(amax, r0, r1, rate_amax_bits):
        """(static, shift, amax bits per row) of rows [r0, r1): static when every row has one amax bit
        pattern (sent once), shift 16 when every amax is a bf16 value (the key counts bf16 ulps)."""
        static = True
        bf16 = True
        for r in range(r0, r1):
            if amax[r] != amax[r0]:
                static = False
            if amax[r] & np.uint32(0xFFFF) != 0:
                bf16 = False
        shift = 0 if static or not bf16 else 16
        return static, shift, 0 if static else rate_amax_bits

    @njit
    def _payload_size(R, static, a_bits, K, seg, scale_bits, code_bits, choice):
        per_seg = scale_bits + code_bits + (seg // 16 if choice else 0)
        return 3 + (4 if static else 0) + (R * (a_bits + (K // seg) * per_seg) + 7) // 8

    @njit
    def _code_table(ccol, seg, code_bits):
        """int64 [seg / 8, 256]: tab[q, m] is the XOR of the parity-check columns 8q + i of the set bits i of
        m: the code syndrome of a segment is the XOR of one entry per 8 values (their mantissa bits as one
        byte), not one test and XOR per value. Each entry from the one without its lowest bit."""
        nq = seg // 8
        tab = np.zeros((max(nq, 1), 256), dtype=np.int64)
        if code_bits:
            for q in range(nq):
                for m in range(1, 256):
                    low = m & -m
                    i = 0
                    while (1 << i) != low:
                        i += 1
                    tab[q, m] = tab[q, m ^ low] ^ ccol[q * 8 + i]
        return tab

    @njit
    def _write_rows(out, o0, codes, mbits, compact, scales, amax, r0, r1, static, shift, a_bits, K, seg, scale_bits,
                   code_bits, check, choice, version, scol, tab):
        """The payload of rows [r0, r1) written into out[o0:] (zeroed), payload_size bytes.

        The bits go LSB first through a 64-bit accumulator, whole bytes stored as they fill (not a test
        and an OR per bit), and the code syndrome is one table entry per 8 values (`code_table`): the
        same bits as the bit-by-bit walk it replaced (lane take10: equal on 4,000 random rate / shape
        cases, compact and full rows, and every test's payload)."""
        S = K // seg
        bps = seg // 16
        nq = seg // 8
        head = 3 + (4 if static else 0)
        out[o0] = np.uint8(version << 4 | a_bits)
        out[o0 + 1] = np.uint8(scale_bits | (1 << 3 if static else 0) | (1 << 4 if shift == 16 else 0)
                               | (1 << 5 if check else 0) | (1 << 6 if choice else 0))
        out[o0 + 2] = np.uint8(code_bits)
        if static:
            a = amax[r0]
            for i in range(4):
                out[o0 + 3 + i] = np.uint8((a >> np.uint32(8 * i)) & np.uint32(0xFF))
        p = o0 + head  # the next byte to store
        acc = np.uint64(0)  # the bits not stored yet, LSB first; fewer than 8 between fields
        nacc = 0
        amask = (np.int64(1) << a_bits) - 1
        smask = (np.int64(1) << scale_bits) - 1
        cmask = (np.int64(1) << code_bits) - 1
        for r in range(r0, r1):
            if a_bits:
                key = np.int64((amax[r] & np.uint32(0x7FFFFFFF)) >> np.uint32(shift))
                acc |= np.uint64(key & amask) << np.uint64(nacc)
                nacc += a_bits
                while nacc >= 8:
                    out[p] = np.uint8(acc & np.uint64(0xFF))
                    p += 1
                    acc >>= np.uint64(8)
                    nacc -= 8
            for s in range(S):
                b0 = s * bps
                if scale_bits == bps:  # every scale LSB as it is
                    v = np.int64(0)
                    for b in range(bps):
                        v |= np.int64(scales[r, b0 + b] & 1) << b
                    acc |= np.uint64(v) << np.uint64(nacc)
                    nacc += bps
                elif scale_bits:
                    syn = np.int64(0)
                    for b in range(bps):
                        syn ^= scol[b] & -np.int64(scales[r, b0 + b] & 1)
                    acc |= np.uint64(syn & smask) << np.uint64(nacc)
                    nacc += scale_bits
                while nacc >= 8:
                    out[p] = np.uint8(acc & np.uint64(0xFF))
                    p += 1
                    acc >>= np.uint64(8)
                    nacc -= 8
                if code_bits:
                    syn = np.int64(0)
                    if compact:
                        m0 = s * seg // 8
                        for q in range(nq):
                            syn ^= tab[q, mbits[r, m0 + q]]
                    else:  # the mantissa bit of a value is bit 0 of its nibble: 8 values' bits from 4 bytes
                        c0 = s * seg // 2
                        for q in range(nq):
                            c = c0 + 4 * q
                            m = ((codes[r, c] & 1) | ((codes[r, c] >> 3) & 2) | ((codes[r, c + 1] & 1) << 2)
                                 | ((codes[r, c + 1] >> 1) & 8) | ((codes[r, c + 2] & 1) << 4)
                                 | ((codes[r, c + 2] << 1) & 32) | ((codes[r, c + 3] & 1) << 6)
                                 | ((codes[r, c + 3] << 3) & 128))
                            syn ^= tab[q, m]
                    if code_bits > 32:  # up to 62 bits: the low 32 first (the accumulator holds 64)
                        acc |= np.uint64(syn & np.int64(0xFFFFFFFF)) << np.uint64(nacc)
                        nacc += 32
                        while nacc >= 8:
                            out[p] = np.uint8(acc & np.uint64(0xFF))
                            p += 1
                            acc >>= np.uint64(8)
                            nacc -= 8
                        acc |= np.uint64((syn >> 32) & ((np.int64(1) << (code_bits - 32)) - 1)) << np.uint64(nacc)
                        nacc += code_bits - 32
                    else:
                        acc |= np.uint64(syn & cmask) << np.uint64(nacc)
                        nacc += code_bits
                    while nacc >= 8:
                        out[p] = np.uint8(acc & np.uint64(0xFF))
                        p += 1
                        acc >>= np.uint64(8)
                        nacc -= 8
                if choice:  # 1 where the block's largest magnitude index is 6 (4over6's 4-candidate)
                    v = np.int64(0)
                    for b in range(bps):
                        top = 0
                        c0 = (b0 + b) * 8
                        for i in range(8):
                            byte = codes[r, c0 + i]
                            top = max(top, byte & 7, (byte >> 4) & 7)
                        if top == 6:
                            v |= np.int64(1) << b
                    acc |= np.uint64(v) << np.uint64(nacc)
                    nacc += bps
                    while nacc >= 8:
                        out[p] = np.uint8(acc & np.uint64(0xFF))
                        p += 1
                        acc >>= np.uint64(8)
                        nacc -= 8
        if nacc:  # the last partial byte (the payload's zero padding above it)
            out[p] = np.uint8(acc & np.uint64(0xFF))

    @njit
    def encode_rows(codes, mbits, compact, scales, amax, K, seg, rate_amax_bits, scale_bits, code_bits, check, choice,
                    version, scol, ccol):
        R = amax.shape[0]
        static, shift, a_bits = _head_of(amax, 0, R, rate_amax_bits)
        out = np.zeros(_payload_size(R, static, a_bits, K, seg, scale_bits, code_bits, choice), dtype=np.uint8)
        _write_rows(out, 0, codes, mbits, compact, scales, amax, 0, R, static, shift, a_bits, K, seg, scale_bits,
                    code_bits, check, choice, version, scol, _code_table(ccol, seg, code_bits))
        return out

    @njit
    def encode_many(codes, scales, amax, rows, K, seg, rate_amax_bits, scale_bits, code_bits, check, choice, version,
                    scol, ccol):
        """One payload per record of full rows: record i's rows are [rows[i], rows[i + 1]) (each non-empty);
        the payloads back to back in one array, record i's at [starts[i], starts[i + 1])."""
        n = rows.shape[0] - 1
        statics = np.zeros(n, dtype=np.bool_)
        shifts = np.zeros(n, dtype=np.int64)
        a_bits = np.zeros(n, dtype=np.int64)
        starts = np.zeros(n + 1, dtype=np.int64)
        for i in range(n):
            statics[i], shifts[i], a_bits[i] = _head_of(amax, rows[i], rows[i + 1], rate_amax_bits)
            starts[i + 1] = starts[i] + _payload_size(rows[i + 1] - rows[i], statics[i], a_bits[i], K, seg, scale_bits,
                                                      code_bits, choice)
        out = np.zeros(starts[n], dtype=np.uint8)
        no_mbits = np.zeros((1, 1), dtype=np.uint8)
        tab = _code_table(ccol, seg, code_bits)  # once for every record of the call
        for i in range(n):
            _write_rows(out, starts[i], codes, no_mbits, False, scales, amax, rows[i], rows[i + 1], statics[i], shifts[i],
                        a_bits[i], K, seg, scale_bits, code_bits, check, choice, version, scol, tab)
        return out, starts

    return encode_rows, encode_many


def kernel():
    """The jitted kernel (compiled, or loaded from numba's disk cache, on first use)."""
    global _KERNEL, _MANY
    if _KERNEL is None:
        _KERNEL, _MANY = _build()
    return _KERNEL


def many_kernel():
    """The batched kernel (`encode_many`): every record of a take in one call per layer and site."""
    kernel()
    return _MANY


_EMPTY = np.zeros((1, 1), dtype=np.uint8)
_COLS: dict = {}


def _columns(m: int, n: int, salt: int) -> np.ndarray:
    """int64 [n]: the parity-check columns of (m, n, salt) as integers (parity.column_ints), cached."""
    key = (m, n, salt)
    cols = _COLS.get(key)
    if cols is None:
        from ..guides.sparse.parity import column_ints

        cols = _COLS[key] = np.array(column_ints(m, n, salt) if m else (), dtype=np.int64)
    return cols


def encode_payload(codes, mbits, scales: torch.Tensor, amax: torch.Tensor, K: int, seg: int, rates, version: int) -> torch.Tensor:
    """uint8 [n]: the packed payload of R rows of K values. `codes` uint8 [R, K/2] (full rows) or None
    with `mbits` uint8 [R, K/8] (compact rows); `scales` uint8 [R, K/16]; `amax` float32 [R] (one per
    row); `rates` with scale_bits <= the blocks of a segment (checked by the caller). R > 0."""
    R = amax.shape[0]
    bps = seg // 16
    compact = codes is None
    c = _EMPTY if compact else as_numpy(codes.reshape(R, K // 2))
    m = as_numpy(mbits.reshape(R, K // 8)) if compact else _EMPTY
    s = as_numpy(scales.reshape(R, K // 16))
    a = as_numpy(amax.reshape(R)).view(np.uint32)
    scol = _columns(rates.scale_bits, bps, 1) if 0 < rates.scale_bits < bps else _columns(0, 0, 1)
    ccol = _columns(rates.code_bits, seg, 2)
    out = kernel()(c, m, compact, s, a, K, seg, rates.amax_bits, rates.scale_bits, rates.code_bits, rates.check,
                   rates.choice, version, scol, ccol)
    return torch.from_numpy(out)


def encode_many(codes: torch.Tensor, scales: torch.Tensor, amax: torch.Tensor, rows, K: int, seg: int, rates,
                version: int) -> tuple[np.ndarray, np.ndarray]:
    """The payloads of several records' full rows in one call (the engine's take: every request of it,
    per layer and site, instead of one call per record and site, whose Python around the kernel cost
    more than the kernel). `codes` uint8 [R, K/2], `scales` uint8 [R, K/16], `amax` float32 (R values) of every
    record's rows back to back; `rows` int64 [n + 1]: record i's rows are [rows[i], rows[i + 1]), each
    non-empty. Returns (payload bytes, int64 [n + 1] starts): record i's payload is
    bytes[starts[i]:starts[i + 1]], byte for byte what `encode_payload` writes for its rows alone."""
    R = amax.numel()
    bps = seg // 16
    c = as_numpy(codes.reshape(R, K // 2))
    s = as_numpy(scales.reshape(R, K // 16))
    a = as_numpy(amax.reshape(R)).view(np.uint32)
    scol = _columns(rates.scale_bits, bps, 1) if 0 < rates.scale_bits < bps else _columns(0, 0, 1)
    ccol = _columns(rates.code_bits, seg, 2)
    return many_kernel()(c, s, a, np.asarray(rows, dtype=np.int64), K, seg, rates.amax_bits, rates.scale_bits,
                         rates.code_bits, rates.check, rates.choice, version, scol, ccol)

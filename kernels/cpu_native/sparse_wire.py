"""A sparse payload's rows unpacked in one numba loop (the native path of guides/sparse/wire.py's
unpack_fields, which the trainer runs for every record, layer and site of a micro-batch).

Bit-identical by construction: integer shifts and ORs over the same LSB-first bit stream the torch
reference expands into a bit tensor (tests/kernels/test_cpu_native_sparse_wire.py checks all rates).
"""

import numpy as np
import torch

from . import njit


@njit
def unpack_rows(blob, off, R, nbits, amax_bits, S, m_s, m_c, choice, bps, header_bits, static_low, csyn, ssyn, header):
    """Rows of `nbits` from byte `off` of `blob`: per row `amax_bits` coset bits (or `static_low`), then per
    segment m_s scale-syndrome bits, m_c code-syndrome bits and, with `choice`, bps choice bits.
    Writes csyn int64 [R * S], ssyn uint8 [R * S * bps] (bit 0 syndrome, bit 1 choice), header int64 [R]
    (the coset bits OR `header_bits`)."""
    seg_bits = m_s + m_c + choice * bps
    for r in range(R):
        pos = r * nbits
        low = np.int64(0)
        if amax_bits:
            for j in range(amax_bits):
                p = pos + j
                low |= np.int64((blob[off + (p >> 3)] >> (p & 7)) & 1) << j
        else:
            low = static_low
        header[r] = low | header_bits
        pos += amax_bits
        for s in range(S):
            base = pos + s * seg_bits
            o = (r * S + s) * bps
            for j in range(bps):
                v = np.uint8(0)
                if j < m_s:
                    p = base + j
                    v = np.uint8((blob[off + (p >> 3)] >> (p & 7)) & 1)
                if choice:
                    p = base + m_s + m_c + j
                    v |= np.uint8(((blob[off + (p >> 3)] >> (p & 7)) & 1) << 1)
                ssyn[o + j] = v
            c = np.int64(0)
            for j in range(m_c):
                p = base + m_s + j
                c |= np.int64((blob[off + (p >> 3)] >> (p & 7)) & 1) << j
            csyn[r * S + s] = c


def unpack(blob: torch.Tensor, off: int, R: int, nbits: int, rates, S: int, bps: int, header_bits: int, static_low: int):
    """(csyn int64 [R * S], ssyn uint8 [R * S * bps], header int64 [R]) of a checked payload (wire.py)."""
    csyn = np.empty(R * S, np.int64)
    ssyn = np.empty(R * S * bps, np.uint8)
    header = np.empty(R, np.int64)
    unpack_rows(blob.contiguous().numpy(), off, R, nbits, rates.amax_bits, S, rates.scale_bits, rates.code_bits,
                int(rates.choice), bps, header_bits, static_low, csyn, ssyn, header)
    return torch.from_numpy(csyn), torch.from_numpy(ssyn), torch.from_numpy(header)


@njit
def unpack_rows_many(blob, starts, offs, Rs, nbits, amax_bits, m_s, m_c, choice, header_bits, static_low, S, bps,
                     csyn, ssyn, header):
    """unpack_rows of several payloads laid end to end in `blob` (payload i from byte starts[i], its
    own rates), their rows written one after the other."""
    r0 = 0
    for i in range(starts.shape[0]):
        R = Rs[i]
        unpack_rows(blob, starts[i] + offs[i], R, nbits[i], amax_bits[i], S, m_s[i], m_c[i], choice[i], bps,
                    header_bits[i], static_low[i], csyn[r0 * S:(r0 + R) * S], ssyn[r0 * S * bps:(r0 + R) * S * bps],
                    header[r0:r0 + R])
        r0 += R


def unpack_many(blobs: list, plans: list, header_bits: list, static_lows: list):
    """(csyn, ssyn, header) of several checked payloads of one site (wire.unpack_fields_many's plans:
    (R, S, nb, bps, off, nbits, rates, static, shift) each), rows concatenated; one numba call."""
    sizes = [b.numel() for b in blobs]
    starts = np.cumsum([0] + sizes[:-1]).astype(np.int64)
    blob = torch.cat(blobs).numpy()
    Rs = np.array([p[0] for p in plans], np.int64)
    S, bps, total = plans[0][1], plans[0][3], int(Rs.sum())
    col = lambda f: np.array([f(p) for p in plans], np.int64)  # noqa: E731
    csyn = np.empty(total * S, np.int64)
    ssyn = np.empty(total * S * bps, np.uint8)
    header = np.empty(total, np.int64)
    unpack_rows_many(blob, starts, col(lambda p: p[4]), Rs, col(lambda p: p[5]), col(lambda p: p[6].amax_bits),
                     col(lambda p: p[6].scale_bits), col(lambda p: p[6].code_bits), col(lambda p: int(p[6].choice)),
                     np.array(header_bits, np.int64), np.array(static_lows, np.int64), S, bps, csyn, ssyn, header)
    return torch.from_numpy(csyn), torch.from_numpy(ssyn), torch.from_numpy(header)

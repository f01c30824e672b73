"""The parity-check matrices H of the sparse syndromes: deterministic in (rows m, columns n, salt), so
the rollout and the trainer build the same H, and structured so that few flips never share a syndrome.
"""

from functools import lru_cache

import torch

_SEED = 0x5EED_6A1D

# GF(2^q) primitive polynomials for the BCH columns (q = 5, 6, 7: segments of up to 31, 63, 127).
_PRIMITIVE = {5: 0b100101, 6: 0b1000011, 7: 0b10000011}


def _gf_powers(q: int) -> list[int]:
    out, v = [], 1
    for _ in range((1 << q) - 1):
        out.append(v)
        v <<= 1
        if v >> q:
            v ^= _PRIMITIVE[q]
    return out


@lru_cache(maxsize=64)
def column_ints(m: int, n: int, salt: int) -> tuple[int, ...]:
    """Columns of the m x n parity-check matrix H, as m-bit integers. Random columns would collide
    (two equal columns make a two-flip pattern invisible; ~12% of random 12 x 32 matrices have some),
    so H is structured where m allows:
      m >= 2q + 1 (2^q > n): an all-ones parity row, then the rows of a binary BCH code of designed
                  distance 5 (columns alpha^j, alpha^3j over GF(2^q)): any 4 columns are independent,
                  so every pattern of <= 2 flips has its own syndrome and <= 4 flips are never silent;
                  further rows random;
      m == 2q:    the BCH rows alone (distance 5);
      smaller m:  random columns drawn to be non-zero, distinct and, where the room allows, never the
                  XOR of two others (distance 4), with row 0 all ones.
    Deterministic in (m, n, salt), so both sides build the same H."""
    g = torch.Generator().manual_seed(_SEED + 7919 * n + 104729 * m + salt)
    q = next((q for q in (5, 6, 7) if (1 << q) > n), None)
    if q is not None and m >= 2 * q:
        p = _gf_powers(q)
        bch = [p[j % len(p)] | (p[(3 * j) % len(p)] << q) for j in range(n)]
        if m == 2 * q:
            return tuple(bch)
        extra = torch.randint(0, 1 << 30, (n,), generator=g).tolist()
        rest = m - 2 * q - 1
        return tuple(1 | (c << 1) | ((e & ((1 << rest) - 1)) << (2 * q + 1)) for c, e in zip(bch, extra))
    cols: list[int] = []
    forbidden = {0}
    room = (1 << max(m - 1, 0)) > 1 + n + n * (n - 1) // 2
    for _ in range(n):
        # Up to 10000 draws per column until one is allowed (else the last one). Drawn as one batch and
        # then replayed to the accepted draw, so the generator ends where one-at-a-time drawing left it
        # (the columns, and with them every payload, stay what they were): where the allowed values run
        # out (few rows, e.g. a 4-bit check of 32 values) the one-at-a-time loop took seconds.
        if m:
            state = g.get_state()
            draws = torch.randint(0, 1 << max(m - 1, 0), (10000,), generator=g)
            allowed = ~torch.isin(1 | (draws << 1), torch.tensor(sorted(forbidden), dtype=torch.int64))
            i = int(allowed.int().argmax()) if bool(allowed.any()) else 9999
            g.set_state(state)
            c = 1 | (int(torch.randint(0, 1 << max(m - 1, 0), (i + 1,), generator=g)[-1]) << 1)
        else:
            c = 0
        cols.append(c)
        forbidden.add(c)
        if room:
            forbidden.update(c ^ d for d in cols[:-1])
    return tuple(cols)


_H: dict = {}  # (m, n, salt, device) -> (columns int64 [n], H^T float32 [n, m], 2**i int64 [m])


def matrix(m: int, n: int, salt: int, device):
    """H of (m, n, salt) on `device`, built once per process (encode and decode run per layer and site)."""
    key = (m, n, salt, str(device))
    if key not in _H:
        cols = torch.tensor(column_ints(m, n, salt), dtype=torch.int64, device=device)
        bits = torch.arange(m, device=device)
        _H[key] = (cols, ((cols[:, None] >> bits) & 1).to(torch.float32), torch.ones_like(bits) << bits)
    return _H[key]


def columns(m: int, n: int, salt: int, device) -> torch.Tensor:
    """int64 [n]: column j of H (m x n) as an integer, bit i = H[i, j]."""
    return matrix(m, n, salt, device)[0]


def syndrome(bits: torch.Tensor, m: int, salt: int) -> torch.Tensor:
    """H @ bits over GF(2) for rows bits [R, n] -> int64 [R] (bit i = syndrome bit i): one matmul counts
    the set bits under each row of H (<= n, exact in float32), their parities are the syndrome."""
    R, n = bits.shape
    if n == 0 or m == 0:
        return torch.zeros(R, dtype=torch.int64, device=bits.device)
    _, h, weights = matrix(m, n, salt, bits.device)
    return syndrome_with(bits, h, weights)


def syndrome_with(bits: torch.Tensor, h: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`syndrome` with H^T and the bit weights passed in (the form the compiled path compiles)."""
    parity = (bits.to(torch.float32) @ h).to(torch.int64) & 1  # [R, m]
    return (parity * weights).sum(-1)

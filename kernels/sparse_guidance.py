"""Sparse guidance (DESIGN.md section 10): send only what the trainer cannot work out from its own values.

Once every earlier site is guided, the trainer's value x_t of a captured element is the rollout's x_r
plus a little noise, so its own rounding already agrees with the rollout's code on ~98% of the
elements, and the disagreements sit where x_t lies near a rounding midpoint (codes) or an E4M3
rounding boundary (block scales), or where the row amax moved by a bf16 ulp or two. The record sends,
per row (one global amax; self-contained, so rows can travel through Megatron's token dispatcher),
split into segments of 64 elements (or 32 / 16 where the row is shorter):

  amax      the low `amax_bits` bits of the rollout's amax (as a bf16 bit pattern when it is one): a coset
            index. The trainer takes the member of that coset nearest its own amax (exact while the two
            differ by -2**(b-1) .. 2**(b-1) - 1 ulps) and, where that member sits at the window's edge
            and its decode needs flips, also decodes the next members on either side (AMAX_LIST) and
            keeps the cheapest (list decoding; counted in `DecodeReport.amax_list_rows`). A site whose rows share one amax (static scale)
            sends it once instead.
  scales    per segment an m_s-bit syndrome H_s @ lsb(scale bytes) over GF(2) (adjacent E4M3 bytes differ
            in their LSB; every LSB when m_s equals the segment's number of blocks).
  codes     per segment an m_c-bit syndrome H_c @ mantissa bits (adjacent E2M1 codewords differ in it).

This is syndrome (Slepian-Wolf) coding: the trainer computes its own bits b_t, so H @ b_t xor the sent
syndrome is H @ e, the syndrome of its error pattern e. It then takes the cheapest e with that syndrome
among patterns of up to MAX_FLIPS flips of its candidate positions (the CANDIDATES elements nearest a
midpoint; a flip's cost is the distance to the midpoint, so flipping a value far from one costs more),
and flips those bits (an exact branch-and-bound search in stages of 1, 2, ... flips); a segment that no
such pattern explains gets a wider search. H has distinct non-zero columns (a single flip always has its
own syndrome) and, at rates of 2q bits or more, the rows of a binary BCH code of distance 5 (every pair
of flips has its own syndrome too). The encoder needs only the rollout's codes, scales and amax (no
unrounded values): a full record can be re-encoded, and the rate is fixed per site (no counts to send).

What the trainer cannot resolve is counted, never hidden: `DecodeReport.unresolved_*_segments` (no
pattern searched explains the syndrome: the trainer keeps its own rounding there), per site, for codes
and scales. A wrong pattern with the right syndrome (rate 2**-m_c per cheaper pattern) is not
detectable by the trainer; the align job measures it against full records (residual mismatch).
Rates per site: `SITE_RATES`, tuned with bench/sparse_noise.py on the align pipeline's measured noise
(re-tuned, payload version 2, after the engine's grouped GEMM moved the fc2 input amax by up to 4 ulps).
Check-only sites (payload version 3, `Rates.check`): where the trainer's values are the rollout's by
construction (moe_fc2_in: the trainer runs the engine's expert GEMM on the rollout's fc1 codes), the
syndromes are a checksum with no search; a disagreeing segment is counted unresolved, not corrected.

On disk (one uint8 tensor per layer and site): a 3-byte header (version and rates), a float32 amax
when every row shares one (a static scale), then per row its amax bits and per segment m_s + m_c bits.
"""

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from . import reference
from .format import BLOCK_SIZE, E2M1_MIDPOINTS, E4M3_MAX, FLT_MAX
from .tensor import CompactGuide, NVFP4Tensor

VERSION = 3  # 2: per-site rates re-tuned after the grouped GEMM, amax list decoding; 3: check-only sites
READABLE_VERSIONS = (2, 3)  # a version-2 payload is a version-3 one without check-only sites
MAX_FLIPS = 4  # error patterns searched per segment: up to this many flips ...
CANDIDATES = 12  # ... among the elements (or blocks) of the segment nearest a rounding boundary
WIDE_FLIPS, WIDE_CANDIDATES = 6, 20  # a second, wider search for the segments the first leaves unresolved
_CHUNK = 4096  # segments searched at once (bounds the [segments, patterns] work tensors)
_SEED = 0x5EED_6A1D
FLIP_OFFSET = 0.006  # a flip costs its distance to the midpoint plus this (measured: makes no difference)
AMAX_LIST = 1  # amax candidates tried besides the nearest coset member: this many on either side
AMAX_PRIOR = 0.05  # cost per bf16 ulp between a candidate amax and the trainer's own (ties go to the nearest)


class SparseError(ValueError):
    """A sparse payload that cannot be decoded (damaged, wrong version or shape)."""


SEGMENT = 64  # elements per syndrome segment (rows split into segments of 64, or of 32 / 16 if K needs it)


@dataclass(frozen=True)
class Rates:
    """Bits the rollout sends per row (amax) and per segment (scales, codes). Fixed per site, recorded in
    the payload header, so the decoder never guesses them."""

    amax_bits: int  # coset bits of the row amax (0: the trainer's own amax, or one static amax sent once)
    scale_bits: int  # m_s per segment (= its number of blocks: every LSB)
    code_bits: int  # m_c per segment (<= 62)
    # check-only: the trainer's values are meant to be the rollout's exactly (moe_fc2_in, whose input the
    # trainer computes with the engine's own GEMM from the rollout's fc1 codes), so the syndromes are a
    # checksum: no flips are searched, and a segment whose syndrome disagrees is counted as unresolved
    # (the trainer keeps its own rounding there), never "corrected" into a guess.
    check: bool = False

    def __post_init__(self):
        if not (0 <= self.amax_bits <= 8 and 0 <= self.scale_bits <= 4 and 0 <= self.code_bits <= 62):
            raise SparseError(f"sparse rates out of range: {self}")


# Per site and segment size: measured on the align pipeline (bench/sparse_noise.py DIR, every earlier site
# guided) on the engine with the packed grouped GEMM, embedded tiny and trained tiny models. bf16 row
# amax keys, rollout minus trainer, lie in -4..+4 ulps (fc2: 1.5% of rows beyond -2..+1, which 2 coset
# bits missed and made 7% of fc2 rows take a wrong amax: the main loss after the grouped GEMM), so every
# site sends 3 coset bits and the decoder list-decodes the neighbouring coset members (AMAX_LIST) for the
# few beyond. 2.3-2.8% of block scales and 1.3-2.0% of codes flip at fc1 / k / v, 0.6-0.7% of codes at
# fc2. Code rates: the lowest that removed all (or all but one segment's) offline RTN mismatches on both
# models.
# moe_fc2_in is check-only (payload version 3): since the trainer runs the engine's own expert GEMM and
# activation (trace_megatron/linears.py, experts.py), its fc2 inputs are the rollout's bit for bit
# wherever its fc1 codes are (measured: 0 of 2792 / 2904 rows moved, amax, scales or codes, on both
# models; with Megatron's BF16 GEMM 2.3% of scales and 0.7% of codes flipped and amaxes moved by up to
# 4 ulps, which cost 3 + 1 + 8 bits per row). So fc2 sends no amax and no scale bits, and 4 check bits
# per segment that catch a row the trainer did not reproduce (15 in 16 of them) and count it.
SITE_RATES = {
    ("moe_fc1_in", 64): Rates(3, 3, 16), ("moe_fc1_in", 32): Rates(3, 2, 11),
    ("moe_fc2_in", 64): Rates(0, 0, 4, check=True), ("moe_fc2_in", 32): Rates(0, 0, 4, check=True),
    ("k", 64): Rates(3, 3, 16), ("k", 32): Rates(3, 1, 11),
    ("v", 64): Rates(3, 3, 16), ("v", 32): Rates(3, 1, 11),
}
# MLA's latent row (kv_latent: the normalised kv_c the cache holds) is K-like: K's rates.
SITE_RATES.update({("kv_latent", seg): r for (site, seg), r in list(SITE_RATES.items()) if site == "k"})
DEFAULT_RATES = {64: Rates(3, 4, 14), 32: Rates(3, 2, 10), 16: Rates(3, 1, 6)}


def segment(K: int) -> int:
    for seg in (SEGMENT, 32, 16):
        if K % seg == 0:
            return seg
    raise ValueError(f"K={K} is not a multiple of {BLOCK_SIZE}")


def rates_for(site: str | None, K: int) -> Rates:
    seg = segment(K)
    r = SITE_RATES.get((site, seg), DEFAULT_RATES[seg])
    return Rates(r.amax_bits, min(r.scale_bits, seg // BLOCK_SIZE), r.code_bits, r.check)


@dataclass(frozen=True)
class SparseGuide:
    """Sparse guidance rows `[..., K]` in memory, fixed width per row, so the row-selection code written
    for NVFP4Tensor / CompactGuide (index, cat, slot gather, head slice) works on it unchanged:
    `mbits`, `scales`, `global_amax` are its three per-row fields, in the same positions.

    mbits:       int64 `[..., K // seg]`: the code syndrome of each segment (m_c bits)
    scales:      uint8 `[..., K // 16]`: per segment, its m_s scale-syndrome bits in its first block slots
    global_amax: int64 `[...]`: row header (see `_header`): amax coset (or, static, the amax's float32
                 bits) | shift | rates | static flag
    """

    mbits: torch.Tensor
    scales: torch.Tensor
    global_amax: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.scales.shape[:-1], self.scales.shape[-1] * BLOCK_SIZE))

    def __getitem__(self, index) -> "SparseGuide":
        return SparseGuide(self.mbits[index], self.scales[index], self.global_amax[index])

    def nbytes(self) -> int:
        """Bytes on disk for these rows (header included)."""
        return (payload_bits(self) + 7) // 8


@dataclass
class DecodeReport:
    rows: int = 0
    segments: int = 0
    unresolved_code_segments: int = 0  # no pattern of <= MAX_FLIPS flips explains the code syndrome
    unresolved_scale_segments: int = 0
    code_flips: int = 0  # mantissa bits the decode changed from the trainer's own rounding
    scale_flips: int = 0  # block scales the decode moved across an E4M3 boundary
    amax_list_rows: int = 0  # rows whose amax is not the coset member nearest the trainer's own (list decode)

    def add(self, other: "DecodeReport") -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


# ---- the parity-check matrices ---------------------------------------------------------------------
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
def _column_ints(m: int, n: int, salt: int) -> tuple[int, ...]:
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


def _matrix(m: int, n: int, salt: int, device):
    """H of (m, n, salt) on `device`, built once per process (encode and decode run per layer and site)."""
    key = (m, n, salt, str(device))
    if key not in _H:
        cols = torch.tensor(_column_ints(m, n, salt), dtype=torch.int64, device=device)
        bits = torch.arange(m, device=device)
        _H[key] = (cols, ((cols[:, None] >> bits) & 1).to(torch.float32), torch.ones_like(bits) << bits)
    return _H[key]


def _columns(m: int, n: int, salt: int, device) -> torch.Tensor:
    """int64 [n]: column j of H (m x n) as an integer, bit i = H[i, j]."""
    return _matrix(m, n, salt, device)[0]


def _syndrome(bits: torch.Tensor, m: int, salt: int) -> torch.Tensor:
    """H @ bits over GF(2) for rows bits [R, n] -> int64 [R] (bit i = syndrome bit i): one matmul counts
    the set bits under each row of H (<= n, exact in float32), their parities are the syndrome."""
    R, n = bits.shape
    if n == 0 or m == 0:
        return torch.zeros(R, dtype=torch.int64, device=bits.device)
    _, h, weights = _matrix(m, n, salt, bits.device)
    parity = (bits.to(torch.float32) @ h).to(torch.int64) & 1  # [R, m]
    return (parity * weights).sum(-1)


# ---- shared helpers (both sides run the same arithmetic) -------------------------------------------
def _amax_key(amax: torch.Tensor, shift: int) -> torch.Tensor:
    return (amax.contiguous().view(torch.int32).to(torch.int64) & 0x7FFFFFFF) >> shift


def _unrounded_scales(xb: torch.Tensor, g_enc: torch.Tensor) -> torch.Tensor:
    """DESIGN.md section 3 step 2 before the E4M3 rounding."""
    amax_b = xb.abs().amax(-1)
    s = amax_b * (g_enc[:, None] * torch.tensor(1.0 / 6.0, dtype=torch.float32, device=xb.device))
    s = torch.minimum(s, torch.tensor(FLT_MAX, dtype=torch.float32, device=xb.device))
    return torch.nan_to_num(torch.clamp(s, -E4M3_MAX, E4M3_MAX), nan=0.0)


def _scale_flip_costs(s: torch.Tensor, byte: torch.Tensor, value: torch.Tensor):
    """For each block: the byte across the nearest E4M3 rounding boundary and the relative distance to it."""
    up = torch.clamp(byte + 1, max=0x7E)
    down = torch.clamp(byte - 1, min=0)
    v_up, v_down = reference.decode_e4m3(up), reference.decode_e4m3(down)
    d_up = torch.where(up != byte, ((value + v_up) / 2 - s).abs(), torch.inf)
    d_down = torch.where(down != byte, (s - (value + v_down) / 2).abs(), torch.inf)
    other = torch.where(d_up <= d_down, up, down)
    cost = torch.minimum(d_up, d_down) / torch.clamp(s, min=1e-30)
    return other, cost


def _code_flip_costs(a: torch.Tensor) -> torch.Tensor:
    """Distance of |y| to its nearest E2M1 rounding midpoint (grid units): the cost of flipping its bit."""
    mids = torch.tensor(E2M1_MIDPOINTS, dtype=torch.float32, device=a.device)
    dist = (a[..., None] - mids).abs()
    cost, which = dist.min(-1)
    cost = cost + FLIP_OFFSET
    k, k_up = reference.grid_neighbours(a)
    return torch.where(k == k_up, torch.inf, cost)  # on the grid (or saturated): nothing to flip to


def _bits_to_int(bits: torch.Tensor) -> torch.Tensor:
    w = torch.ones(bits.shape[-1], dtype=torch.int64, device=bits.device) << torch.arange(bits.shape[-1], device=bits.device)
    return (bits.to(torch.int64) * w).sum(-1)


def _int_to_bits(v: torch.Tensor, n: int) -> torch.Tensor:
    return (v[..., None] >> torch.arange(n, dtype=torch.int64, device=v.device)) & 1


# ---- encode (rollout side) -------------------------------------------------------------------------
def _rows_amax(q) -> torch.Tensor:
    R = math.prod(q.shape[:-1])
    amax = q.global_amax.to(torch.float32)
    return (amax.reshape(1).expand(R) if amax.numel() == 1 else amax.reshape(R)).contiguous()


def _header(low: torch.Tensor, shift: int, rates: Rates, static: bool) -> torch.Tensor:
    return (low | (shift << 32) | (rates.amax_bits << 37) | (rates.scale_bits << 41) | (rates.code_bits << 45)
            | (int(static) << 52) | (int(rates.check) << 53))


def _parse_header(word: int):
    """(shift, Rates, static) of one row header word."""
    rates = Rates((word >> 37) & 0xF, (word >> 41) & 0xF, (word >> 45) & 0x7F, bool((word >> 53) & 1))
    return (word >> 32) & 0x1F, rates, bool((word >> 52) & 1)


def encode(q: NVFP4Tensor | CompactGuide, site: str | None = None, rates: Rates | None = None) -> SparseGuide:
    """Sparse guide rows from the rollout's rows of `site`: full (codes, scales, amax) or compact
    (mantissa bits, scales, amax) will do, since the syndromes are of the mantissa bits and scale LSBs."""
    if not isinstance(q, (NVFP4Tensor, CompactGuide)):
        raise TypeError(f"encode needs an NVFP4Tensor or CompactGuide, got {type(q).__name__}")
    lead, K = q.shape[:-1], q.shape[-1]
    R, dev = math.prod(lead), q.scales.device
    seg, nb = segment(K), K // BLOCK_SIZE
    S, bps = K // seg, seg // BLOCK_SIZE
    rates = rates or rates_for(site, K)
    if rates.scale_bits > bps:
        raise SparseError(f"scale_bits={rates.scale_bits} exceeds the {bps} blocks of a segment of {seg}")
    amax = _rows_amax(q)
    bits = amax.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    static = R > 0 and bool((bits == bits[0]).all())
    if static:  # one amax for every row (a static / per-tensor scale): sent once, in the header
        shift, low, rates = 0, bits, Rates(0, rates.scale_bits, rates.code_bits, rates.check)
    else:
        shift = 16 if bool(((bits & 0xFFFF) == 0).all()) else 0
        low = _amax_key(amax, shift) & ((1 << rates.amax_bits) - 1)
    lsb = q.scales.reshape(R * S, bps).to(torch.int64) & 1
    ssyn = torch.zeros(R * S, bps, dtype=torch.int64, device=dev)
    if rates.scale_bits == bps:
        ssyn = lsb
    elif rates.scale_bits:
        ssyn[:, : rates.scale_bits] = _int_to_bits(_syndrome(lsb, rates.scale_bits, 1), rates.scale_bits)
    if isinstance(q, NVFP4Tensor):
        mbits = reference.unpack_nibbles(q.codes.reshape(R, K // 2)).to(torch.int64) & 1
    else:
        mbits = q.unpacked_bits().reshape(R, K).to(torch.int64)
    csyn = _syndrome(mbits.reshape(R * S, seg), rates.code_bits, 2)
    header = _header(low, shift, rates, static)
    return SparseGuide(csyn.reshape(*lead, S), ssyn.to(torch.uint8).reshape(*lead, nb), header.reshape(lead))


# ---- decode (trainer side) -------------------------------------------------------------------------
def _cheapest_pattern(residual: torch.Tensor, cols: torch.Tensor, cost: torch.Tensor, flips: int, chunk: int = _CHUNK):
    if residual.shape[0] > chunk:
        parts = [_cheapest_pattern(residual[i : i + chunk], cols[i : i + chunk], cost[i : i + chunk], flips, chunk)
                 for i in range(0, residual.shape[0], chunk)]
        return tuple(torch.cat([p[i] for p in parts]) for i in range(3))
    return _cheapest_pattern_chunk(residual, cols, cost, flips)


def _cheapest_pattern_chunk(residual: torch.Tensor, cols: torch.Tensor, cost: torch.Tensor, flips: int):
    """Per row, the cheapest set of <= MAX_FLIPS candidate positions whose columns XOR to `residual`
    (int64 [R]); cols: int64 [R, C], cost: [R, C] (inf: may not flip). Returns (flips [R, C], resolved [R],
    the pattern's cost [R]: inf where unresolved)."""
    R, C = cost.shape
    dev = cost.device
    best = torch.where(residual == 0, 0.0, torch.inf).to(torch.float32)
    choice = torch.zeros(R, C, dtype=torch.bool, device=dev)
    P = _patterns(C, min(flips, C), dev)
    if P.shape[0] and R:
        syn = torch.zeros(R, P.shape[0], dtype=torch.int64, device=dev)
        tot = torch.zeros(R, P.shape[0], dtype=torch.float32, device=dev)
        for j in range(C):
            sel = P[:, j][None]
            syn = torch.where(sel, syn ^ cols[:, j : j + 1], syn)
            tot = torch.where(sel, tot + cost[:, j : j + 1], tot)
        tot = torch.where(syn == residual[:, None], tot, torch.inf)
        cmin, arg = tot.min(-1)
        better = cmin < best
        best = torch.where(better, cmin, best)
        choice = torch.where(better[:, None], P[arg], choice)
    return choice, torch.isfinite(best), best


def _patterns_cpu(n: int, w: int) -> torch.Tensor:
    """bool [patterns, n]: every set of 1..w of n positions, by size, then in combinations order (so
    the table of w - 1 flips is this table's prefix)."""
    import itertools

    parts = [torch.zeros(0, n, dtype=torch.bool)]
    for k in range(1, w + 1):  # (torch.combinations builds the whole n**k grid first: too slow here)
        idx = torch.tensor(list(itertools.combinations(range(n), k)), dtype=torch.int64).reshape(-1, k)
        parts.append(torch.zeros(idx.shape[0], n, dtype=torch.bool).scatter_(1, idx, True))
    return torch.cat(parts)


_PATTERNS: dict = {}


def _patterns(n: int, w: int, device) -> torch.Tensor:
    """The patterns of 1..w flips of n positions on `device`: the prefix of one table per (n, device)
    built at the widest search's size, so the staged searches neither rebuild nor copy it."""
    width = min(n, max(w, MAX_FLIPS, WIDE_FLIPS))
    key = (n, width, str(device))
    if key not in _PATTERNS:
        _PATTERNS[key] = _patterns_cpu(n, width).to(device)
    return _PATTERNS[key][: sum(math.comb(n, k) for k in range(1, min(w, n) + 1))]


def _search(residual, cols, cost, candidates, max_flips, chunk=_CHUNK):
    """The cheapest pattern of <= max_flips flips among each segment's `candidates` cheapest positions,
    found in stages of growing pattern tables (up to 1 flip, 2 flips, ...): a segment leaves after the
    stage whose best pattern costs no more than its `w + 1` cheapest candidates together (no pattern of
    more flips can then be cheaper, and ties go to the fewer flips as in the full table, whose order
    the smaller tables share). The same patterns as one search over the full table, at a fraction of
    its work: most segments with flips need one or two. Segments whose syndrome already agrees need none."""
    R, n = cost.shape
    dev = cost.device
    C = min(candidates, n)
    W = min(max_flips, C)
    c_cost, c_idx = torch.topk(cost, C, dim=-1, largest=False)  # ascending: c_cost[:, :k].sum() bounds k flips
    flips_c = torch.zeros(R, C, dtype=torch.bool, device=dev)
    ok = residual == 0
    total = torch.where(ok, 0.0, torch.inf).to(torch.float32)
    todo = torch.nonzero(~ok).flatten()
    if todo.numel() and W:
        c_cols = torch.gather(cols, 1, c_idx)
        bound = torch.cumsum(c_cost, dim=-1)  # [R, C]: the cost of the k + 1 cheapest candidates at k
        for w in range(1, W + 1):
            if not todo.numel():
                break
            f, o, t = _cheapest_pattern(residual[todo], c_cols[todo], c_cost[todo], w, chunk)
            done = o & (t <= bound[todo, w]) if w < W else torch.ones_like(o)
            idx = todo[done]
            flips_c[idx], ok[idx], total[idx] = f[done], o[done], t[done]
            todo = todo[~done]
    flips = torch.zeros(R, n, dtype=torch.bool, device=dev)
    flips.scatter_(1, c_idx, flips_c)
    return flips, ok, total


def _decode_bits(residual, cols, cost, wide: bool = True, check: bool = False):
    """Flip mask [R, n] of the cheapest pattern among the CANDIDATES lowest-cost positions; segments it
    cannot explain get a wider search (few of them, so its larger pattern table stays cheap). Returns
    (flips, resolved, cost of the chosen pattern: inf where unresolved). `check`: no search, a
    segment is resolved only when its syndrome already agrees (check-only sites)."""
    if check:
        ok = residual == 0
        return torch.zeros_like(cost, dtype=torch.bool), ok, torch.where(ok, 0.0, torch.inf).to(torch.float32)
    flips, ok, total = _search(residual, cols, cost, CANDIDATES, MAX_FLIPS)
    redo = torch.nonzero(~ok).flatten()
    if wide and redo.numel() and WIDE_FLIPS > MAX_FLIPS:
        f2, ok2, t2 = _search(residual[redo], cols[redo], cost[redo], WIDE_CANDIDATES, WIDE_FLIPS, chunk=32)
        flips[redo] = f2
        ok, total = ok.clone(), total.clone()
        ok[redo], total[redo] = ok2, t2
    return flips, ok, total


def _check_header(header: torch.Tensor, K: int):
    """(shift, Rates, static) shared by every row; SparseError if the rows disagree or do not fit K."""
    first = int(header[0])
    shift, rates, static = _parse_header(first)
    same = bool(((header >> 32) == (first >> 32)).all()) and (not static or bool((header == first).all()))
    bps = segment(K) // BLOCK_SIZE
    if shift not in (0, 16) or not same or rates.scale_bits > bps or (static and rates.amax_bits):
        raise SparseError(f"sparse guide rows of K={K}: inconsistent row headers (shift {shift}, {rates}, "
                          f"static {static}, uniform {same})")
    return shift, rates, static


@dataclass
class _Hypothesis:
    """The decode of some rows under one amax per row: what the row would become, and what it cost."""

    scales: torch.Tensor  # uint8 [R, nb]
    bits: torch.Tensor  # int64 [R, K]: mantissa bits
    cost: torch.Tensor  # float32 [R]: summed cost of every flip the row needed (inf: a segment unresolved)
    code_unresolved: torch.Tensor  # int64 [R]: segments per row
    scale_unresolved: torch.Tensor
    code_flips: torch.Tensor
    scale_flips: torch.Tensor


def _decode_rows(xb, amax, mbits, ssyn, rates: Rates, seg: int, wide: bool = True) -> _Hypothesis:
    """Scales then codes of rows `xb` [R, nb, 16] for the given float32 amax [R] (section 3 of DESIGN.md
    with the trainer's values, then the cheapest flips that explain the syndromes). `wide`: give the
    segments the first search leaves unresolved the wider one (off for the amax list's alternatives:
    a wide search explains almost any syndrome, so it would not tell a wrong amax from the right one)."""
    R, nb, _ = xb.shape
    K, dev = nb * BLOCK_SIZE, xb.device
    S, bps = K // seg, seg // BLOCK_SIZE
    m_s, m_c = rates.scale_bits, rates.code_bits
    g_enc, g_dec = reference.global_scales(amax)
    # block scales: own rounding, then the cheapest LSB flips that explain each segment's syndrome
    s = _unrounded_scales(xb, g_enc)
    byte, value = reference.round_to_e4m3(s)
    byte = byte.to(torch.int64)
    other, cost = _scale_flip_costs(s, byte, value)
    scale_unresolved = torch.zeros(R, dtype=torch.int64, device=dev)
    if m_s == bps:  # every LSB was sent: take whichever neighbour has it
        flips = ((byte & 1).reshape(R * S, bps) != ssyn).reshape(R, nb)
        scost = torch.where(flips, cost, 0.0).sum(-1)
        if rates.check:  # a check-only site: a disagreeing LSB is counted, not followed
            scale_unresolved = flips.reshape(R, S, bps).any(-1).sum(-1)
            flips = torch.zeros_like(flips)
    elif m_s == 0:
        flips = torch.zeros(R, nb, dtype=torch.bool, device=dev)
        scost = torch.zeros(R, device=dev)
    else:
        cols = _columns(m_s, bps, 1, dev)
        residual = _bits_to_int(ssyn[:, :m_s]) ^ _syndrome((byte & 1).reshape(R * S, bps), m_s, 1)
        flips, ok, total = _decode_bits(residual, cols.expand(R * S, bps), cost.reshape(R * S, bps), wide, rates.check)
        flips = flips.reshape(R, nb)
        scale_unresolved = (~ok).reshape(R, S).sum(-1)
        scost = torch.where(ok, total, 0.0).reshape(R, S).sum(-1)
    byte = torch.where(flips, other, byte)
    scales = byte.to(torch.uint8)
    # codes: own rounding with those scales, then the cheapest mantissa-bit flips
    y = reference._scaled(xb, reference.decode_e4m3(scales), g_dec).reshape(R * S, seg)
    a = y.abs()
    own_bits = (reference.e2m1_index(a) & 1).to(torch.int64)
    cols = _columns(m_c, seg, 2, dev)
    residual = mbits ^ _syndrome(own_bits, m_c, 2)
    cflips, ok, total = _decode_bits(residual, cols.expand(R * S, seg), _code_flip_costs(a), wide, rates.check)
    code_unresolved = (~ok).reshape(R, S).sum(-1)
    ccost = torch.where(ok, total, 0.0).reshape(R, S).sum(-1)
    cost = torch.where((code_unresolved + scale_unresolved) > 0, torch.inf, scost + ccost)
    return _Hypothesis(scales, (own_bits ^ cflips.to(torch.int64)).reshape(R, K), cost, code_unresolved,
                       scale_unresolved, cflips.reshape(R, K).sum(-1), flips.sum(-1))


def _pick(best: _Hypothesis, other: _Hypothesis, rows: torch.Tensor, take: torch.Tensor) -> None:
    """Replace, in place, best's rows `rows[take]` with other's rows `take` (other covers `rows` only)."""
    idx = rows[take]
    for name in best.__dataclass_fields__:
        getattr(best, name)[idx] = getattr(other, name)[take]


def decode(guide: SparseGuide, x: torch.Tensor, report: DecodeReport | None = None) -> NVFP4Tensor:
    """The rollout's NVFP4 rows as far as `x` (the trainer's values, shape `guide.shape`) and the sparse
    guide determine them. Segments the search cannot resolve keep the trainer's own rounding (counted
    in `report`). Vectorized over rows and segments; no per-element Python loops.

    The row amax is list-decoded: the member of the sent coset nearest the trainer's own amax, and the
    AMAX_LIST next members on either side, each decoded in full; a row takes the one whose scales and
    codes need the cheapest flips (plus AMAX_PRIOR per ulp from its own amax). A wrong amax moves every
    value of the row by a percent or more, so its syndromes need many costly flips or none fits: that is
    what tells them apart, and it lets a few coset bits cover amax moves well beyond their window."""
    if not isinstance(guide, SparseGuide):
        raise TypeError(f"guide must be a SparseGuide, got {type(guide).__name__}")
    if tuple(guide.shape) != tuple(x.shape):
        raise ValueError(f"sparse guide covers shape {tuple(guide.shape)} but x has shape {tuple(x.shape)}")
    report = report if report is not None else DecodeReport()
    lead, K = x.shape[:-1], x.shape[-1]
    R, nb, dev = math.prod(lead), K // BLOCK_SIZE, x.device
    seg = segment(K)
    S, bps = K // seg, seg // BLOCK_SIZE
    if R == 0:
        z = torch.zeros(*lead, K // 2, dtype=torch.uint8, device=dev)
        return NVFP4Tensor(z, torch.zeros(*lead, nb, dtype=torch.uint8, device=dev), torch.zeros(lead, device=dev))
    header = guide.global_amax.reshape(R).to(torch.int64)
    shift, rates, static = _check_header(header, K)
    xb = x.detach().reshape(R, nb, BLOCK_SIZE).to(torch.float32)
    mbits = guide.mbits.reshape(R * S).to(torch.int64)
    ssyn = guide.scales.reshape(R * S, bps).to(torch.int64)
    report.rows += R
    report.segments += R * S
    to_float = lambda k: (k << shift).to(torch.int32).view(torch.float32)  # noqa: E731
    if static:  # one amax, sent
        shift = 0
        key = header & 0xFFFFFFFF
        best = _decode_rows(xb, to_float(key), mbits, ssyn, rates, seg)
    else:  # the member of its coset nearest the trainer's own amax, then its neighbours in the coset
        key_t = _amax_key(xb.abs().amax(dim=(-1, -2)), shift)
        mod = 1 << rates.amax_bits
        diff = ((header & (mod - 1)) - key_t) % mod
        diff = torch.where(diff >= (mod + 1) // 2, diff - mod, diff)
        key = torch.clamp(key_t + diff, min=0)
        best = _decode_rows(xb, to_float(key), mbits, ssyn, rates, seg)
        score = best.cost + AMAX_PRIOR * diff.abs()
        # Only rows whose nearest member lies at the window's edge (offset -mod/2, -mod/2 + 1 or
        # mod/2 - 1: -4, -3, +3 ulps at 3 bits) can have their amax in the next member: the others would
        # need a move of mod - 2 ulps or more (6 at 3 bits; measured moves stay within 4). A row whose
        # nearest member needed no flip at all cannot do better elsewhere (the prior grows). Check-only
        # sites take the trainer's own amax or nothing (a checksum cannot rank alternatives).
        edge = (diff <= -(mod // 2) + 1) | (diff >= mod // 2 - 1)
        rows = torch.nonzero((best.cost > 0) & edge).flatten() if not rates.check else key.new_zeros(0)
        for j in [j for k in range(1, AMAX_LIST + 1) for j in (-k, k)] if rows.numel() else []:
            cand_diff = diff[rows] + j * mod
            cand = key_t[rows] + cand_diff
            valid = (cand >= 0) & (cand <= 0x7F7FFFFF >> shift)  # a finite float32 / bf16 amax
            seg_rows = (rows[:, None] * S + torch.arange(S, device=dev)).reshape(-1)
            h = _decode_rows(xb[rows], to_float(torch.where(valid, cand, key[rows])), mbits[seg_rows], ssyn[seg_rows],
                             rates, seg, wide=False)
            cand_score = h.cost + AMAX_PRIOR * cand_diff.abs()
            take = valid & (cand_score < score[rows])
            if bool(take.any()):
                _pick(best, h, rows, take)
                key[rows[take]] = cand[take]
                score[rows[take]] = cand_score[take]
                report.amax_list_rows += int(take.sum())
    report.unresolved_code_segments += int(best.code_unresolved.sum())
    report.unresolved_scale_segments += int(best.scale_unresolved.sum())
    report.code_flips += int(best.code_flips.sum())
    report.scale_flips += int(best.scale_flips.sum())
    amax = to_float(key)
    codes, _ = reference.quantize_guided(x.detach().reshape(R, K).to(torch.float32), best.scales, amax, mbits=best.bits)
    return NVFP4Tensor(codes.reshape(*lead, K // 2), best.scales.reshape(*lead, nb), amax.reshape(lead))


# ---- bits on disk ----------------------------------------------------------------------------------
_HEADER = 3  # version << 4 | amax bits; m_s | static << 3 | (shift == 16) << 4 | check << 5; m_c
_STATIC = 4  # float32 amax after the header when static


def row_bits(K: int, rates: Rates) -> int:
    return rates.amax_bits + (K // segment(K)) * (rates.scale_bits + rates.code_bits)


def payload_bits(guide: SparseGuide) -> int:
    R, K = math.prod(guide.shape[:-1]), guide.shape[-1]
    if R == 0:
        return 8 * _HEADER
    _, rates, static = _parse_header(int(guide.global_amax.reshape(-1)[0]))
    return 8 * (_HEADER + _STATIC * static) + R * row_bits(K, rates)


def pack(guide: SparseGuide) -> torch.Tensor:
    """uint8 [n]: the header (and a static amax), then per row amax bits + segments x (m_s + m_c) bits,
    LSB first."""
    K = guide.shape[-1]
    R, seg = math.prod(guide.shape[:-1]), segment(K)
    S, bps = K // seg, seg // BLOCK_SIZE
    header = guide.global_amax.reshape(R).to(torch.int64).cpu()
    if R == 0:
        return torch.tensor([VERSION << 4, 1 << 4, 0], dtype=torch.uint8)
    shift, rates, static = _check_header(header, K)
    ssyn = guide.scales.reshape(R, S, bps)[..., : rates.scale_bits].to(torch.int64).cpu()
    csyn = _int_to_bits(guide.mbits.reshape(R, S).to(torch.int64).cpu(), rates.code_bits)
    fields = torch.cat(
        [_int_to_bits(header & ((1 << rates.amax_bits) - 1), rates.amax_bits), torch.cat([ssyn, csyn], -1).reshape(R, -1)],
        dim=1,
    ).reshape(-1)
    fields = torch.cat([fields, torch.zeros((-fields.numel()) % 8, dtype=torch.int64)]).reshape(-1, 8)
    head = [VERSION << 4 | rates.amax_bits, rates.scale_bits | int(static) << 3 | int(shift == 16) << 4 | int(rates.check) << 5,
            rates.code_bits]
    parts = [torch.tensor(head, dtype=torch.uint8)]
    if static:
        parts.append(torch.tensor([int(header[0]) & 0xFFFFFFFF], dtype=torch.int64).to(torch.int32).view(torch.uint8))
    parts.append(_bits_to_int(fields).to(torch.uint8))
    return torch.cat(parts)


def unpack(blob: torch.Tensor, lead: tuple, K: int) -> SparseGuide:
    """Inverse of `pack` for rows of shape `lead` x K; SparseError names what does not fit."""
    if not isinstance(blob, torch.Tensor) or blob.dtype != torch.uint8 or blob.dim() != 1:
        raise SparseError(f"sparse payload must be a 1-D uint8 tensor, got {getattr(blob, 'dtype', type(blob))}")
    R, seg, nb = math.prod(lead), segment(K), K // BLOCK_SIZE
    S, bps = K // seg, seg // BLOCK_SIZE
    if blob.numel() < _HEADER:
        raise SparseError(f"sparse payload of {blob.numel()} bytes is shorter than its {_HEADER}-byte header")
    head = blob[:_HEADER].tolist()
    version, amax_bits = head[0] >> 4, head[0] & 0xF
    m_s, static, shift, m_c = head[1] & 0x7, (head[1] >> 3) & 1, 16 * ((head[1] >> 4) & 1), head[2]
    check = bool((head[1] >> 5) & 1)
    if version not in READABLE_VERSIONS or head[1] >> 6 or (check and version < 3):
        raise SparseError(f"sparse payload header {head}: version {version}, this trace-fp4 reads versions {READABLE_VERSIONS}")
    rates = Rates(amax_bits, m_s, m_c, check)  # raises SparseError when out of range
    if m_s > bps or (static and amax_bits):
        raise SparseError(f"sparse payload header {head}: rates do not fit segments of {seg}")
    off = _HEADER + _STATIC * static
    need = off + (R * row_bits(K, rates) + 7) // 8
    if blob.numel() != need:
        raise SparseError(f"sparse payload has {blob.numel()} bytes; {R} rows of K={K} need {need}")
    nbits = row_bits(K, rates)
    bits = _int_to_bits(blob[off:].to(torch.int64), 8).reshape(-1)[: R * nbits].reshape(R, nbits)
    if static:
        low = blob[_HEADER:off].clone().view(torch.int32).to(torch.int64).expand(R) & 0xFFFFFFFF
    else:
        low = _bits_to_int(bits[:, :amax_bits])
    per_seg = bits[:, amax_bits:].reshape(R, S, m_s + m_c)
    ssyn = torch.zeros(R, S, bps, dtype=torch.uint8)
    ssyn[..., :m_s] = per_seg[..., :m_s].to(torch.uint8)
    csyn = _bits_to_int(per_seg[..., m_s:])
    header = _header(low, shift, rates, bool(static))
    return SparseGuide(csyn.reshape(*lead, S), ssyn.reshape(*lead, nb), header.reshape(lead))

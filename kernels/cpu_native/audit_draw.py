"""The audit draw of every site of every record of a take at once: Python's Mersenne Twister, seeded as
`random.Random(seed)` seeds it, in one numba kernel over all the take's seeds.

Why: `guides/sparse/audit.audit_row_list` seeds a `random.Random` per record and site (a take of 16
records on the tiny model: 256 seeds). Seeding is CPython's init_by_array, ~1,250 dependent steps over
the 624-word state, ~4 us per seed; at the default fraction (0.25%) most sites draw no row at all, and
whether they do is decided by the generator's first `random()` alone. The kernel runs those steps for
all seeds side by side (the inner loop over seeds vectorises) and returns each seed's first
`random()`, bit for bit CPython's (tests/kernels/test_audit_draw.py compares it with `random.Random`
over many seeds, short keys included). A site whose count is not 0 is drawn by `audit_row_list` itself
(the reference: its rows need more of the generator and `random.sample`'s algorithm), so only the count
0 decision comes from the kernel.
"""

import hashlib
import math

import numpy as np

from . import njit

N, M = 624, 397
_KERNEL = None


def _genrand_base() -> np.ndarray:
    """CPython's init_genrand(19650218): the state init_by_array starts from, the same for every seed."""
    mt = np.zeros(N, dtype=np.uint64)
    mt[0] = 19650218
    for i in range(1, N):
        prev = int(mt[i - 1])
        mt[i] = (1812433253 * (prev ^ (prev >> 30)) + i) & 0xFFFFFFFF
    return mt


def _build():
    @njit
    def first_uniforms(base, add0, add1, words):
        """float64 [S]: the first random() of random.Random(seed) for S seeds whose 32-bit key words,
        with init_by_array's `+ j`, are add0[s] at even steps of its first loop and add1[s] at odd ones
        (a one-word key: add1 = add0). words uint64 [S, W] (2 <= W <= 227): each seed's first W outputs
        of genrand_uint32 written there (random() is made of the first two)."""
        S = add0.shape[0]
        mask = np.uint64(0xFFFFFFFF)
        mt = np.empty((624, S), dtype=np.uint64)
        for i in range(624):
            for s in range(S):
                mt[i, s] = base[i]
        # init_by_array, first loop: max(N, key length) = N steps
        i = 1
        for k in range(624):
            if k % 2 == 0:
                for s in range(S):
                    p = mt[i - 1, s]
                    mt[i, s] = ((mt[i, s] ^ (((p ^ (p >> np.uint64(30))) * np.uint64(1664525)) & mask)) + add0[s]) & mask
            else:
                for s in range(S):
                    p = mt[i - 1, s]
                    mt[i, s] = ((mt[i, s] ^ (((p ^ (p >> np.uint64(30))) * np.uint64(1664525)) & mask)) + add1[s]) & mask
            i += 1
            if i >= 624:
                for s in range(S):
                    mt[0, s] = mt[623, s]
                i = 1
        # second loop: N - 1 steps
        for k in range(623):
            sub = np.uint64(i)
            for s in range(S):
                p = mt[i - 1, s]
                mt[i, s] = ((mt[i, s] ^ (((p ^ (p >> np.uint64(30))) * np.uint64(1566083941)) & mask)) - sub) & mask
            i += 1
            if i >= 624:
                for s in range(S):
                    mt[0, s] = mt[623, s]
                i = 1
        out = np.empty(S, dtype=np.float64)
        upper = np.uint64(0x80000000)
        lower = np.uint64(0x7FFFFFFF)
        matrix = np.uint64(0x9908B0DF)
        W = words.shape[1]
        for s in range(S):
            mt0 = upper  # init_by_array ends with mt[0] = 0x80000000
            for kk in range(W):  # the first twist's words 0 .. W-1 (each from the seeded state: kk + 397 < 624), tempered
                a = mt0 if kk == 0 else mt[kk, s]
                y = (a & upper) | (mt[kk + 1, s] & lower)
                w = mt[kk + 397, s] ^ (y >> np.uint64(1))
                if y & np.uint64(1):
                    w ^= matrix
                w ^= w >> np.uint64(11)
                w ^= (w << np.uint64(7)) & np.uint64(0x9D2C5680)
                w ^= (w << np.uint64(15)) & np.uint64(0xEFC60000)
                w ^= w >> np.uint64(18)
                words[s, kk] = w & mask
            a = np.float64(words[s, 0] >> np.uint64(5))
            b = np.float64(words[s, 1] >> np.uint64(6))
            out[s] = (a * 67108864.0 + b) * (1.0 / 9007199254740992.0)
        return out

    return first_uniforms


def kernel():
    """The jitted kernel (compiled, or loaded from numba's disk cache, on first use)."""
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _build()
    return _KERNEL


_BASE = None


def first_uniforms(seeds: list[int]) -> np.ndarray:
    """float64 [len(seeds)]: `random.Random(seed).random()` of each seed (0 <= seed < 2**64)."""
    if not len(seeds):
        return np.zeros(0, dtype=np.float64)
    bad = [seed for seed in seeds if not 0 <= seed < 1 << 64]
    if bad:
        raise ValueError(f"audit seed {bad[0]} outside [0, 2**64): the kernel takes keys of one or two words")
    return _uniforms(np.array(seeds, dtype=np.uint64))


def _uniforms(words: np.ndarray, outputs: int = 2) -> np.ndarray:
    """`first_uniforms` of uint64 seeds [S] (S > 0); with `outputs` > 2, (that, uint64 [S, outputs]: each
    seed's first `outputs` genrand_uint32 words)."""
    global _BASE
    if _BASE is None:
        _BASE = _genrand_base()
    # CPython's key: the seed's 32-bit words, as many as its bits need (one for a seed below 2**32); the
    # words of every seed split by numpy at once (a take draws ~256)
    lo, hi = words & np.uint64(0xFFFFFFFF), words >> np.uint64(32)
    add0 = lo
    add1 = np.where(hi != 0, hi + np.uint64(1), lo)
    out = np.empty((len(words), outputs), dtype=np.uint64)
    u = kernel()(_BASE, add0, add1, out)
    return (u, out) if outputs > 2 else u


def seeds(draws: list) -> np.ndarray:
    """uint64 [len(draws)]: `audit.audit_seed(T, layer, site, token_digest)` of every draw, the same
    numbers: each text's SHA-256, its first 8 bytes read as one little-endian array, the top bit
    cleared (not an int.from_bytes and a mask per seed: a take makes ~256)."""
    sha = hashlib.sha256
    raw = b"".join([sha(f"trace-fp4 audit|{T}|{layer}|{site}|{digest or ''}".encode()).digest()[:8]
                    for T, layer, site, digest in draws])
    return np.frombuffer(raw, dtype="<u8") & np.uint64((1 << 63) - 1)


# genrand_uint32 outputs the kernel hands back per seed: random() takes 2, a one-row sample's randbelow the
# next (each try below the row count accepted; a try is rejected with probability < 1/2)
OUTPUTS = 12


def _one_row(T: int, words) -> int | None:
    """`random.sample(range(T), 1)[0]` of a generator whose next outputs are `words` (after the random()
    that drew the count): CPython's _randbelow_with_getrandbits(T), getrandbits(k) of a k <= 32 being one
    output >> (32 - k), tried until below T. None when these words run out (then the reference draws)."""
    k = T.bit_length()
    if k > 32:
        return None
    for w in words:
        r = w >> (32 - k)
        if r < T:
            return r
    return None


def row_lists(draws: list, fraction: float) -> list[list[int]]:
    """`audit_row_list(T, layer, site, fraction, token_digest)` of every (T, layer, site, token_digest) in
    `draws`, the same lists: the count decided from each seed's first random() (the kernel), a count of 1
    (nearly every drawing site at the default fraction) its row from the kernel's next outputs
    (`_one_row`: random.sample's draw of one row), larger counts drawn by audit_row_list itself (a
    random.Random seeded again, ~7 us each)."""
    from ..guides.sparse.audit import seeded_row_list

    if fraction <= 0:
        return [[] for _ in draws]
    live = [i for i, draw in enumerate(draws) if draw[0]]
    out: list = [[] for _ in draws]
    if not live:
        return out
    words = seeds([draws[i] for i in live])
    u, outputs = _uniforms(words, OUTPUTS)
    for j, (i, ui) in enumerate(zip(live, u.tolist())):
        T = draws[i][0]
        n = min(T, math.floor(fraction * T + ui))
        if not n:
            continue
        row = _one_row(T, outputs[j, 2:].tolist()) if n == 1 else None
        out[i] = [row] if row is not None else seeded_row_list(T, fraction, int(words[j]))
    return out

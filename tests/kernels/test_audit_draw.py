"""The take's batched audit draw (cpu_native.audit_draw) equals the per-site reference: each seed's first
random() bit for bit CPython's `random.Random(seed).random()` (one- and two-word keys, the edges of the
64-bit range), and the drawn rows `audit_row_list`'s for any token count and fraction."""

import random

import pytest

pytest.importorskip("numba")

from trace_kernels.cpu_native import audit_draw  # noqa: E402
from trace_kernels.guides.sparse.audit import audit_row_list  # noqa: E402


def test_first_uniform_is_cpythons():
    rng = random.Random(7)
    seeds = [0, 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**63 - 1, 2**64 - 1]
    seeds += [rng.getrandbits(63) for _ in range(600)] + [rng.getrandbits(32) for _ in range(100)]
    got = audit_draw.first_uniforms(seeds).tolist()
    assert got == [random.Random(s).random() for s in seeds]


def test_first_uniform_refuses_a_seed_it_cannot_key():
    with pytest.raises(ValueError, match="outside"):
        audit_draw.first_uniforms([2**64])
    assert audit_draw.first_uniforms([]).shape == (0,)


@pytest.mark.parametrize("fraction", [0.0025, 0.01, 0.3, 1.0, 0.0])
def test_row_lists_equal_audit_row_list(fraction):
    draws = [(T, layer, site, digest) for T in (0, 1, 2, 7, 70, 513) for layer in range(3)
             for site in ("k", "moe_fc1_in") for digest in (None, "ab" * 32)]
    want = [audit_row_list(T, layer, site, fraction, digest) for T, layer, site, digest in draws]
    assert audit_draw.row_lists(draws, fraction) == want


def test_seeds_are_audit_seeds():
    # the take's seeds made together (one SHA-256 comprehension, one little-endian array) are audit_seed's:
    # token counts of one and more digits, digests None / empty / hex / non-ASCII, sites with odd text
    from trace_kernels.guides.sparse.audit import audit_seed

    rng = random.Random(3)
    draws = [(T, layer, site, digest) for T in (1, 9, 10, 70, 100000) for layer in (0, 7, 63)
             for site in ("k", "moe_fc1_in", "q\u00e9|x") for digest in (None, "", "ab" * 32, "\u2603")]
    draws += [(rng.randint(1, 10**6), rng.randrange(100), "v", f"{rng.getrandbits(256):064x}") for _ in range(500)]
    got = audit_draw.seeds(draws).tolist()
    want = [audit_seed(*d) for d in draws]
    assert got == want and max(want) >= 2**62  # seeds with their 63rd bit set are kept whole


def test_one_row_draws_from_the_kernels_outputs_are_random_samples():
    # the draws of count 1 come from the kernel's outputs after random() (`_one_row`: random.sample's
    # randbelow), not a seeded random.Random: equal to the reference on many seeds and token counts (powers
    # of two and their neighbours, where getrandbits rejects up to half the tries), and the outputs are
    # genrand_uint32's
    rng = random.Random(11)
    Ts = [1, 2, 3, 4, 5, 31, 32, 33, 63, 64, 65, 70, 127, 128, 129, 1000, 4096, 4097]
    draws = [(T, rng.randrange(4), rng.choice(["k", "v", "moe_fc2_in"]), f"{rng.getrandbits(256):064x}")
             for T in Ts for _ in range(150)]
    for fraction in (0.0025, 0.02):
        got = audit_draw.row_lists(draws, fraction)
        assert got == [audit_row_list(*d[:3], fraction, d[3]) for d in draws]
        assert sum(len(r) == 1 for r in got) > 200
    seeds = audit_draw.seeds(draws[:300])
    _, outputs = audit_draw._uniforms(seeds, audit_draw.OUTPUTS)
    for s, words in zip(seeds.tolist(), outputs.tolist()):
        r = random.Random(s)
        assert words == [r.getrandbits(32) for _ in range(audit_draw.OUTPUTS)]

"""The wide flip-pattern search widens with a segment's code bits (search.wide_search_for): its pattern
table grows no faster than the syndrome space past the rate today's search was measured at, never
narrower than before, today's search at today's rates,
and a segment with more flips than the old search reaches resolves where the code bits have risen."""

import math

import pytest
import torch

from trace_kernels.guides.sparse import decoder, parity, search
from trace_kernels.guides.sparse.rates import DEFAULT_RATES, SITE_RATES


@pytest.mark.parametrize("seg", [16, 32, 64])
def test_wide_search_respects_the_capacity_and_grows_with_the_code_bits(seg):
    prev = None
    grew = False
    for bits in range(0, 63):
        flips, cands = search.wide_search_for(bits, seg)
        if (flips, cands) != search.WIDE_STEPS[0]:  # widened: the table grew by no more than the syndromes
            grown = math.log2(search.patterns_searched(flips, min(cands, seg)) /
                              search.patterns_searched(search.WIDE_FLIPS, min(search.WIDE_CANDIDATES, seg)))
            assert 0 < grown <= bits - search.REFERENCE_CODE_BITS[seg]
        assert flips >= search.WIDE_FLIPS and cands >= search.WIDE_CANDIDATES  # never narrower than before
        if prev is not None:
            assert flips >= prev[0] and cands >= prev[1]
            grew |= (flips, cands) != prev
        prev = (flips, cands)
    assert grew and prev == search.WIDE_STEPS[-1]


def test_todays_rates_keep_todays_wide_search():
    """Every built-in rate (the records an unraised align or RL run writes) gets the old 6 / 20, so its
    decode is the same as before this search could widen."""
    for (site, seg), r in list(SITE_RATES.items()) + [(("default", s), r) for s, r in DEFAULT_RATES.items()]:
        assert search.wide_search_for(r.code_bits, seg) == (search.WIDE_FLIPS, search.WIDE_CANDIDATES), site
    with pytest.raises(ValueError, match="code_bits"):
        search.wide_search_for(-1, 64)
    with pytest.raises(ValueError, match="seg=48"):
        search.wide_search_for(20, 48)


def _segments_with_flips(n: int, m: int, flips: list[int], seed: int):
    """Residual syndromes of `flips[i]` true flips in segment i, at its cheapest positions (the trainer's
    values nearest their midpoints), so the cheapest explanation is the true one where the search reaches."""
    g = torch.Generator().manual_seed(seed)
    R = len(flips)
    cost = torch.rand(R, n, generator=g) * 0.3 + 0.05
    true = torch.zeros(R, n, dtype=torch.bool)
    for i, k in enumerate(flips):
        pos = torch.randperm(n, generator=g)[:k]
        cost[i, pos] = decoder.FLIP_OFFSET + torch.rand(k, generator=g) * 0.01
        true[i, pos] = True
    cols = parity.columns(m, n, 2, "cpu").expand(R, n)
    return parity.syndrome(true.long(), m, 2), cols, cost, true


def test_a_segment_with_more_than_six_flips_resolves_at_raised_code_bits():
    """7 and 8 flips in a 64-value segment: beyond the old 6-flip search, found at 22 code bits (8 / 24)."""
    n, m = 64, 22
    residual, cols, cost, true = _segments_with_flips(n, m, [2, 7, 8, 8], seed=3)
    widths = search.wide_search_for(m, n)
    assert widths == (8, 24)
    old = search.decode_bits(residual, cols, cost)
    assert not bool(old[1][1:].any())  # the old search leaves them unresolved
    flips, ok, _ = search.decode_bits(residual, cols, cost, widths=widths)
    assert bool(ok.all()) and torch.equal(flips, true)
    # the segment the first search resolves takes the same pattern either way
    assert torch.equal(flips[0], old[0][0])


@pytest.mark.parametrize("n,w", [(12, 4), (20, 6), (16, 8)])
def test_the_pattern_table_is_every_subset_by_size_in_combinations_order(n, w):
    """The staged search's ties go to the earlier pattern, so the table's order is part of the numerics:
    the vectorised builder must give itertools.combinations' order, size by size."""
    import itertools

    want = [c for k in range(1, w + 1) for c in itertools.combinations(range(n), k)]
    got = search._patterns_cpu(n, w)
    assert got.shape == (len(want), n)
    assert [tuple(torch.nonzero(r).flatten().tolist()) for r in got] == want

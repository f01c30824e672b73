"""header.uniform_header, the decoder's one pass over the row headers, gives check_header's answer where
header_groups finds one group and None where it finds several, for uniform, mixed, static and malformed
headers; a malformed header raises check_header's error on every call (a refusal is never cached), and a
word seen once (its parse cached) still refuses rows that disagree with it."""

import random

import pytest
import torch

from trace_kernels.errors import SparseError
from trace_kernels.guides.sparse.header import check_header, header_groups, make_header, uniform_header
from trace_kernels.guides.sparse.rates import Rates


def _answer(f, *a):
    try:
        return ("ok", f(*a))
    except SparseError as e:
        return ("refused", str(e))


def _word(rng, low=None, *, shift=None, rates=None, static=None):
    rates = rates or Rates(rng.choice([0, 3, 5]), rng.choice([0, 1, 3, 4]), rng.choice([4, 11, 16]),
                           rng.random() < 0.2)
    static = rng.random() < 0.3 if static is None else static
    low = rng.getrandbits(32) if low is None else low
    return make_header(low, rng.choice([0, 16, 8]) if shift is None else shift, rates, static)


def _cases():
    rng = random.Random(27)
    for _ in range(300):
        base = _word(rng)
        n = rng.choice([1, 2, 5, 17])
        kind = rng.choice(["same_high", "same_word", "one_differs", "random"])
        if kind == "same_high":  # the coset bits (or a static amax) vary, the rest agrees
            words = [(base >> 32 << 32) | rng.getrandbits(32) for _ in range(n)]
        elif kind == "same_word":
            words = [base] * n
        elif kind == "one_differs":
            words = [base] * n
            words[rng.randrange(n)] = _word(rng)
        else:
            words = [_word(rng) for _ in range(n)]
        yield torch.tensor(words, dtype=torch.int64), rng.choice([32, 64, 128, 48])


def test_uniform_header_is_check_header_where_header_groups_finds_one_group():
    seen = {"one group": 0, "groups": 0, "refused": 0}
    for header, K in _cases():
        groups = header_groups(header)
        for _ in range(2):  # the second call reads the cached parse of the first word
            got = _answer(uniform_header, header, K)
            if groups is not None:
                assert got == ("ok", None), (header, K)
            else:
                assert got == _answer(check_header, header, K), (header, K)
        seen["groups" if groups is not None else "refused" if got[0] == "refused" else "one group"] += 1
    assert min(seen.values()) >= 20, seen  # every outcome exercised


def test_a_cached_word_does_not_admit_rows_that_disagree():
    r = Rates(3, 3, 16)
    word = make_header(5, 16, r, False)
    assert uniform_header(torch.tensor([word, word ^ 7]), 128) == check_header(torch.tensor([word]), 128)
    assert uniform_header(torch.tensor([word, word ^ (1 << 41)]), 128) is None  # other scale bits: two groups
    static = make_header(0x3F800000, 0, Rates(0, 3, 16), True)
    assert uniform_header(torch.tensor([static]), 128) is not None
    assert uniform_header(torch.tensor([static, static + 1]), 128) is None  # two static amaxes
    bad = make_header(0, 8, r, False)  # shift 8: not a header the encoder writes
    for _ in range(2):
        with pytest.raises(SparseError, match="inconsistent row headers"):
            uniform_header(torch.tensor([bad, bad]), 128)

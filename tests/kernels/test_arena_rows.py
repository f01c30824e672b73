"""host_arena.arena_rows (where each request's rows of a take lie) reads every distinct step once: its answer is
the per-(request, step) reading's (the reference below, arena_rows as it was before lane cap14), on takes whose
requests share steps (a decode run), hold steps of their own, span several chunks, and on the layouts it refuses
(a step not the arena's, other keys, a range outside its step's rows, ranges not one per step)."""

import random

import numpy as np
import pytest

from trace_kernels.engine.captured_rows import StepCapture, StepChunks
from trace_kernels.engine.host_arena import ArenaChunk, ArenaStep, arena_rows

KEYS = [("routing", 0), (0, "k")]


def _reference(chunks):
    steps = [st for c in chunks for st in c.steps]
    if not steps or any(type(st) is not ArenaStep for st in steps):
        return None
    keys = steps[0].keys
    if any(st.keys is not keys and st.keys != keys for st in steps):
        return None
    spans = np.array([r for c in chunks for r in c.ranges], dtype=np.int64).reshape(-1, 2)
    lo, hi = spans[:, 0], spans[:, 1]
    lengths = hi - lo
    n_rows = np.fromiter((st.rows for st in steps), dtype=np.int64, count=len(steps))
    if (lengths < 0).any() or (lo < 0).any() or (hi > n_rows).any():
        return None
    offsets = np.fromiter((st.offset for st in steps), dtype=np.int64, count=len(steps))
    total = int(lengths.sum())
    begins = np.cumsum(lengths) - lengths
    src = np.repeat(offsets + lo - begins, lengths) + np.arange(total, dtype=np.int64)
    chunk_of = {}
    for st in steps:
        chunk_of.setdefault(id(st.chunk), st.chunk)
    if len(chunk_of) == 1:
        cid = np.zeros(total, dtype=np.int64)
    else:
        order = list(chunk_of)
        cid = np.repeat(np.fromiter((order.index(id(st.chunk)) for st in steps), dtype=np.int64, count=len(steps)),
                        lengths)
    return keys, list(chunk_of.values()), cid, src


def _same(got, want):
    if want is None:
        return got is None
    return (got is not None and got[0] == want[0] and len(got[1]) == len(want[1])
            and all(a is b for a, b in zip(got[1], want[1])) and np.array_equal(got[2], want[2])
            and np.array_equal(got[3], want[3]) and got[2].dtype == want[2].dtype == got[3].dtype == np.int64)


def _take(rng, n_chunks, n_requests, n_steps, shared):
    """A take's StepChunks: a run of steps every request shares (each its own row of each), then per request
    steps of its own; steps spread over `n_chunks` chunks at growing offsets."""
    chunks = [ArenaChunk(10_000) for _ in range(n_chunks)]

    def step(rows):
        ch = rng.choice(chunks)
        st = ArenaStep(ch, ch.used, rows, KEYS, 8, 4)
        ch.used += rows
        return st

    run = [step(n_requests) for _ in range(shared)]
    out = []
    for i in range(n_requests):
        own = [step(rng.randint(1, 6)) for _ in range(rng.randint(0, n_steps))]
        ranges = [(i, i + 1) for _ in run] + [(a, rng.randint(a, st.rows)) for st in own for a in [rng.randint(0, st.rows)]]
        steps = run + own
        order = list(range(len(steps)))
        if rng.random() < 0.3:
            rng.shuffle(order)  # steps need not be in chunk order
        out.append(StepChunks([steps[j] for j in order], [ranges[j] for j in order],
                              sum(b - a for a, b in ranges)))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_the_answer_is_the_per_step_readings(seed):
    rng = random.Random(seed)
    take = _take(rng, rng.randint(1, 3), rng.randint(1, 16), rng.randint(0, 5), rng.randint(0, 40))
    if not any(c.steps for c in take):
        take[0] = _take(rng, 1, 1, 0, 1)[0]
    want = _reference(take)
    assert want is not None
    assert _same(arena_rows(take), want)


def test_refusals_are_the_per_step_readings():
    rng = random.Random(5)
    base = _take(rng, 2, 4, 3, 6)
    assert _same(arena_rows(base), _reference(base))
    # a range past its step's rows, a negative start, a backwards range
    for bad in [(0, 99), (-1, 1), (1, 0)]:
        c = base[2]
        take = base[:2] + [StepChunks(c.steps, [bad] + c.ranges[1:], c.rows())] + base[3:]
        assert _reference(take) is None and arena_rows(take) is None
    # a step that is not the arena's (a StepCapture, unhashable or not), and one of other keys
    c = base[1]
    other = StepCapture({}, {}, 8, 4)
    take = base[:1] + [StepChunks([other] + c.steps[1:], c.ranges, c.rows())] + base[2:]
    assert _reference(take) is None and arena_rows(take) is None
    st = c.steps[0]
    odd = ArenaStep(st.chunk, st.offset, st.rows, [("routing", 0)], 8, 4)
    take = base[:1] + [StepChunks([odd] + c.steps[1:], c.ranges, c.rows())] + base[2:]
    assert _reference(take) is None and arena_rows(take) is None
    # equal keys in another list object: accepted by both
    same = ArenaStep(st.chunk, st.offset, st.rows, list(KEYS), 8, 4)
    take = base[:1] + [StepChunks([same] + c.steps[1:], c.ranges, c.rows())] + base[2:]
    assert _same(arena_rows(take), _reference(take))
    # ranges not one per step: refused (read flat, they would shift every later request's rows)
    take = base[:1] + [StepChunks(c.steps, c.ranges + [(0, 1)], c.rows())] + base[2:]
    assert arena_rows(take) is None
    assert arena_rows([StepChunks([], [], 0)]) is None

"""A take's rows of requests that ran in different forward steps, gathered per key in one concatenation
and one index: what `ChunkJoiner.gather_layouts` does for requests that ran in the same steps.

Why: under continuous batching the requests of a take end at different lengths (an RL rollout's
samples stop at their own EOS), so their step lists differ and `gather_layouts` (which needs one
shared step list) returns None. The take then joined each request on its own: per request and key a
slice of every step's rows (`NVFP4Tensor.__getitem__`, ~13,000 calls a 16-request take of the tiny
model) and a concatenation, about 20 ms of the take's 40. Here every step any of the requests ran in
is concatenated once per key, and each request's rows are picked out of it by their positions: the
same rows, in the same order, as each request's own join, so the records are byte for byte the same.
"""

import numpy as np
import torch

from .captured_rows import StepChunks, _cat, _nrows, _take


def gather_step_chunks(chunks: list) -> tuple[dict, dict] | None:
    """({layer: ids}, {(layer, site): rows}) of every request's rows back to back, in request order
    (`chunks`: each request's StepChunks), or None where this does not apply: not all StepChunks, a
    step without a key of the first step, rows that do not join (`_cat`), a range outside its step's
    rows (the per-request join names what is wrong), or a take that would concatenate more than twice
    the rows it hands out (few requests of many running: each request's own join is cheaper)."""
    if not chunks or not all(isinstance(c, StepChunks) and len(c) for c in chunks):
        return None
    ids = [id(st) for c in chunks for st in c.steps]
    union = {}  # id -> step, in first appearance (the step objects stay alive: the chunks hold them)
    for c in chunks:
        for st in c.steps:
            union.setdefault(id(st), st)
    order = {k: i for i, k in enumerate(union)}
    steps = list(union.values())
    which = np.fromiter(map(order.__getitem__, ids), dtype=np.int64, count=len(ids))  # union step of each range
    spans = np.array([r for c in chunks for r in c.ranges], dtype=np.int64).reshape(-1, 2)
    lo, hi = spans[:, 0], spans[:, 1]
    lengths = hi - lo
    first = steps[0]
    if (not first.routing or not first.sites or any(len(st.routing) != len(first.routing)
                                                    or len(st.sites) != len(first.sites) for st in steps)):
        return None
    key = next(iter(first.routing))
    try:
        total = sum(_nrows(st.routing[key]) for st in steps)
    except KeyError:
        return None
    if (lengths < 0).any() or (lo < 0).any() or 2 * int(lengths.sum()) < total:
        return None
    index: dict = {}  # rows per step -> the positions of every request's rows in their concatenation

    def positions(rows: tuple):
        if rows not in index:
            n = np.asarray(rows, dtype=np.int64)
            if (hi > n[which]).any():  # a range past its step's rows
                index[rows] = None
            else:
                # each (request, step) range is a run of consecutive positions from its step's base + lo
                starts = (np.cumsum(n) - n)[which] + lo
                begins = np.cumsum(lengths) - lengths
                index[rows] = torch.from_numpy(np.repeat(starts - begins, lengths)
                                               + np.arange(int(lengths.sum()), dtype=np.int64))
        return index[rows]

    out = []
    for part in ("routing", "sites"):
        got = {}
        for k in getattr(first, part):
            try:
                cat = _cat([getattr(st, part)[k] for st in steps])
            except KeyError:  # a step without this key
                return None
            if cat is None:
                return None
            where = positions(tuple(cat[1]))
            if where is None:
                return None
            got[k] = _take(cat[0], where)
        out.append(got)
    return out[0], out[1]

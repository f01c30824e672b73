"""The flip-pattern search: the cheapest set of bit flips whose parity-check columns explain a residual
syndrome (exact branch-and-bound in stages of 1, 2, ... flips; a wider second search for what the first
leaves unresolved).
"""

import math

import torch

MAX_FLIPS = 4  # error patterns searched per segment: up to this many flips ...
CANDIDATES = 12  # ... among the elements (or blocks) of the segment nearest a rounding boundary
WIDE_FLIPS, WIDE_CANDIDATES = 6, 20  # a second, wider search for the segments the first leaves unresolved
# ... widened where a segment's code bits can tell more patterns apart (wide_search_for): each step adds a
# flip and two candidates. The last, 1.27 M patterns, is where measured gains end: a (9, 26) step (5.7 M
# patterns, from 23 code bits) left the Qwen2-MoE's residual exactly as it was (129 values, its last
# unresolved fc1 segments need more flips, or flips beyond the 26 nearest) at twice the decode time.
WIDE_STEPS = ((6, 20), (7, 22), (8, 24))
# The capacity bound is relative to where today's search is measured to work: the built-in code rates of
# the guided sites per segment size (rates.SITE_RATES: 16 bits per 64 values, 11 per 32, 6 per 16 under
# DEFAULT_RATES), at which the 6 / 20 search's patterns outnumber the syndromes by 2^-0.1, 2^4.9 and 2^7.9
# and the tiny models remove 99.8-99.9% of RTN mismatches (the cheapest-first order beats most wrong patterns
# that share a syndrome). Each code bit above that halves the wrong patterns per syndrome, so the table
# may double: a step is taken when log2(patterns) <= log2(6 / 20's patterns) + (code_bits - reference).
# Measured (docs/measurements.md, held-out models): 8 / 24 everywhere at the default rates (4.4 bits past
# this bound at fc1) took the Qwen2-MoE from 88.5% down to 86.8% removed.
REFERENCE_CODE_BITS = {64: 16, 32: 11, 16: 6}
_CHUNK = 4096  # segments searched at once (bounds the [segments, patterns] work tensors)


def patterns_searched(flips: int, candidates: int) -> int:
    """Flip patterns a search of <= `flips` among `candidates` positions tries (the empty one included)."""
    return sum(math.comb(candidates, j) for j in range(min(flips, candidates) + 1))


def wide_search_for(code_bits: int, seg: int) -> tuple[int, int]:
    """(flips, candidates) of the wide search for a segment of `seg` values with `code_bits` syndrome
    bits: the widest of WIDE_STEPS whose pattern table grows past the first step's by no more than the
    code bits grew past REFERENCE_CODE_BITS[seg] (each bit halves the syndromes a wrong pattern shares);
    the first step (today's 6 / 20) at or below the reference, so records at the built-in rates decode as
    before. A segment shorter than the candidates offers only `seg` of them."""
    if code_bits < 0 or seg not in REFERENCE_CODE_BITS:
        raise ValueError(f"wide_search_for: code_bits={code_bits} (>= 0), seg={seg} (one of {sorted(REFERENCE_CODE_BITS)})")
    base = math.log2(patterns_searched(WIDE_STEPS[0][0], min(WIDE_STEPS[0][1], seg)))
    budget = base + (code_bits - REFERENCE_CODE_BITS[seg])
    best = WIDE_STEPS[0]
    for flips, cands in WIDE_STEPS[1:]:
        if math.log2(patterns_searched(flips, min(cands, seg))) <= budget:
            best = (flips, cands)
    return best


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
        step = _pattern_step
        if dev.type == "cpu":
            from ... import cpu_compiled

            if cpu_compiled.enabled():
                # One graph per (candidates, pattern table) pair: its loop runs over the candidates.
                step = cpu_compiled.piece("sparse_pattern_step", _pattern_step, recompile_limit=64)
        choice, best = step(residual, cols, cost, P, best, choice)
    return choice, torch.isfinite(best), best


def _pattern_step(residual, cols, cost, P, best, choice):
    """Every pattern of table P against each row: the cheapest whose columns XOR to `residual` where it
    beats `best` (ties: the earlier pattern, as `min` returns the first). Returns (choice, best)."""
    R, C = cost.shape
    syn = torch.zeros(R, P.shape[0], dtype=torch.int64, device=cost.device)
    tot = torch.zeros(R, P.shape[0], dtype=torch.float32, device=cost.device)
    for j in range(C):
        sel = P[:, j][None]
        syn = torch.where(sel, syn ^ cols[:, j : j + 1], syn)
        tot = torch.where(sel, tot + cost[:, j : j + 1], tot)
    tot = torch.where(syn == residual[:, None], tot, torch.inf)
    cmin, arg = tot.min(-1)
    better = cmin < best
    best = torch.where(better, cmin, best)
    choice = torch.where(better[:, None], P[arg], choice)
    return choice, best


def _extend(idx: torch.Tensor, n: int) -> torch.Tensor:
    """The (k + 1)-subsets of range(n) from the k-subsets `idx` [C(n, k), k] (ascending rows, in
    itertools.combinations order): each extended by every larger position, in order, which keeps that
    order. No Python tuple per subset (millions at 9 of 26), no n**k grid (torch.combinations)."""
    last = idx[:, -1] if idx.shape[1] else torch.full((idx.shape[0],), -1, dtype=torch.int64)
    more = (n - 1 - last).clamp(min=0)  # positions after each subset's last
    rows = torch.repeat_interleave(torch.arange(idx.shape[0]), more)
    start = torch.repeat_interleave(torch.cumsum(more, 0) - more, more)
    nxt = last[rows] + 1 + (torch.arange(rows.numel()) - start)
    return torch.cat([idx[rows], nxt[:, None]], dim=1)


def _patterns_cpu(n: int, w: int) -> torch.Tensor:
    """bool [patterns, n]: every set of 1..w of n positions, by size, then in combinations order (so
    the table of w - 1 flips is this table's prefix)."""
    parts = [torch.zeros(0, n, dtype=torch.bool)]
    idx = torch.zeros(1, 0, dtype=torch.int64)
    for _ in range(w):
        idx = _extend(idx, n)
        parts.append(torch.zeros(idx.shape[0], n, dtype=torch.bool).scatter_(1, idx, True))
    return torch.cat(parts)


_PATTERNS: dict = {}


def _patterns(n: int, w: int, device) -> torch.Tensor:
    """The patterns of 1..w flips of n positions on `device`: the prefix of one table per (n, device)
    built at the widest search's size, so the staged searches neither rebuild nor copy it."""
    width = min(n, max(w, MAX_FLIPS, WIDE_FLIPS))  # (a wider wide search builds its own wider table)
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
    if todo.numel() and W and dev.type == "cpu":
        from ... import cpu_compiled

        if cpu_compiled.enabled():
            cpu_compiled.count_eager("sparse_search_staging")
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


def _torch_search(residual, cols, cost, candidates, max_flips, wide_stage: bool = False):
    # the wide stage's larger pattern table goes in smaller chunks (bounded memory: 32 segments up to
    # 8 of 24's 1.27 M patterns, fewer beyond, about 2^26 [segment, pattern] entries)
    P = patterns_searched(max_flips, min(candidates, cost.shape[-1]))
    return _search(residual, cols, cost, candidates, max_flips, chunk=max(1, min(32, (1 << 26) // P)) if wide_stage else _CHUNK)


def decode_bits(residual, cols, cost, wide: bool = True, check: bool = False, search_fn=None, widths=None):
    """Flip mask [R, n] of the cheapest pattern among the CANDIDATES lowest-cost positions; segments it
    cannot explain get a wider search of `widths` = (flips, candidates) (wide_search_for; default
    WIDE_FLIPS, WIDE_CANDIDATES; few segments, so its larger pattern table stays cheap). Returns
    (flips, resolved, cost of the chosen pattern: inf where unresolved). `check`: no search, a
    segment is resolved only when its syndrome already agrees (check-only sites). `search_fn`: the
    pattern search, `_search` by default (the Triton launcher passes its kernel's, same results)."""
    if check:
        ok = residual == 0
        return torch.zeros_like(cost, dtype=torch.bool), ok, torch.where(ok, 0.0, torch.inf).to(torch.float32)
    search_fn = search_fn or _torch_search
    flips, ok, total = search_fn(residual, cols, cost, CANDIDATES, MAX_FLIPS)
    wide_flips, wide_cands = widths or (WIDE_FLIPS, WIDE_CANDIDATES)
    redo = torch.nonzero(~ok).flatten()
    if wide and redo.numel() and wide_flips > MAX_FLIPS:
        f2, ok2, t2 = search_fn(residual[redo], cols[redo], cost[redo], wide_cands, wide_flips, wide_stage=True)
        flips[redo] = f2
        ok, total = ok.clone(), total.clone()
        ok[redo], total[redo] = ok2, t2
    return flips, ok, total


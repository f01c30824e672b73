"""The whole sparse decode of one site as one numba call (the native CPU path of guides/sparse/decoder.py).

Per row: the trainer's block scales, the cheapest scale-LSB flips that explain the scale syndromes, its
own mantissa bits under those scales, the cheapest code flips (staged search, then the wide search for
what it leaves unresolved), the amax list (the coset members either side of the nearest, where the
nearest needs flips), and the guided codes of the winner; the report counters summed on the way.

Bit-identical to the torch reference (decoder.py, search.py), which this code mirrors step by step. What
the reference leaves to torch's CPU kernels is reproduced here as those kernels compute it, because the
decode's choices depend on it (tests/kernels/test_cpu_native_sparse_decode.py checks each against torch):
- candidate selection is `torch.topk(cost, C, largest=False)`: libstdc++'s `std::nth_element` on
  (value, index) pairs followed by `std::sort` of the first C - 1 (ATen's topk_impl_loop, k * 64 > n),
  so equal costs come out in that algorithm's order, not by index;
- the bounds are `torch.cumsum` of float32 costs, which ATen accumulates in float64;
- the per-row cost totals are float32 `sum(-1)` over a few values: ATen's cascade sum (4 scalar
  accumulators below one vector width, vector lanes above it), whose order changes the last bit.
A pattern's cost is summed in candidate order from 0, as the reference's pattern step does; the pattern
search visits patterns in the reference's table order (by size, then combinations order) and keeps the
first of equal costs, pruning only patterns that cannot be strictly cheaper.

Threads: a site's rows are split into contiguous ranges, one per thread of torch's intra-op count
(decode_site_chunks, numba.prange); each row is decoded by one thread exactly as on one, so the split
never changes a bit, and the decode runs between torch ops, so the two pools never compete.

Not covered (the caller runs the torch reference, counted): trainer values or amaxes that are not finite
(the reference's NaN propagation through min/topk is not reproduced), and a selection that would reach
libstdc++'s heap fallback (recursion depth limit; never seen at these sizes).
"""

import math
from contextlib import nullcontext

import numpy as np
import torch
from numba import prange

from . import njit, parallel_launch
from .borrow import borrow
from .quantize import block_scale_enc, global_dec, round_e4m3
from .decode16 import decode16_row
from .rtn16 import absmax16, rtn_codes16
from .own_codes16 import own_codes16
from .values16 import values16_bf16

_INF = np.float32(np.inf)
_FLT_MAX = np.float32(3.4028234663852886e38)
_SIXTH = np.float32(1.0 / 6.0)


def e4m3_table() -> np.ndarray:
    """float32 [256]: the value of every E4M3 byte, from the reference's own decode (NaN at 0x7F, 0xFF)."""
    from .. import reference

    return reference.decode_e4m3(torch.arange(256, dtype=torch.int32)).numpy().astype(np.float32)


def e2m1_tables():
    from ..format import E2M1_GRID, E2M1_MIDPOINTS

    return np.array(E2M1_GRID, dtype=np.float32), np.array(E2M1_MIDPOINTS, dtype=np.float32)


# constants of the kernels (numba freezes global arrays into the machine code)
_E4 = e4m3_table()
_GRID, _MIDS = e2m1_tables()  # (_GRID: the scalar loops own_codes16 / values16 replaced, in their tests)


# ---------------------------------------------------------------------------------------------------
# torch's CPU reductions, reproduced


@njit
def _row_sum_scalar(v, start, n):
    """ATen row_sum over n scalars (ilp 4: four accumulators over (-1, 4), tail into the first, then
    combined in order) for n < 16 * 4 rows; the multi-level cascade is not needed below that."""
    size_ilp = n // 4
    p0 = np.float32(0.0)
    p1 = np.float32(0.0)
    p2 = np.float32(0.0)
    p3 = np.float32(0.0)
    for i in range(size_ilp):
        p0 = p0 + v[start + 4 * i]
        p1 = p1 + v[start + 4 * i + 1]
        p2 = p2 + v[start + 4 * i + 2]
        p3 = p3 + v[start + 4 * i + 3]
    for i in range(size_ilp * 4, n):
        p0 = p0 + v[start + i]
    p0 = p0 + p1
    p0 = p0 + p2
    p0 = p0 + p3
    return p0


@njit
def torch_sum(v, n, vec, acc):
    """float32 sum of v[:n] in the order of ATen's cascade_sum for a contiguous inner reduction.
    `vec`: floats per vector (16 AVX-512, 8 AVX2); `acc`: float32 scratch of >= 4 * 4 * vec."""
    if n < vec:
        if n >= 64:  # the multi-level cascade (not reached at the sizes the decoder sums)
            return _cascade_scalar(v, n)
        return _row_sum_scalar(v, 0, n)
    nvec = n // vec
    size_ilp = nvec // 4
    # multi_row_sum over rows of 4 vectors: levels of 2**level_power rows
    num_levels = 4
    lg = 1  # ATen's CeilLog2: 1 up to 2, else the bit length of size_ilp - 1
    if size_ilp > 2:
        lg = 0
        t = size_ilp - 1
        while t > 0:
            lg += 1
            t >>= 1
    level_power = max(4, lg // num_levels)
    level_step = 1 << level_power
    level_mask = level_step - 1
    for i in range(num_levels * 4 * vec):
        acc[i] = np.float32(0.0)
    i = 0
    while i + level_step <= size_ilp:
        for _ in range(level_step):
            for k in range(4):
                base = (4 * i + k) * vec
                for lane in range(vec):
                    acc[k * vec + lane] = acc[k * vec + lane] + v[base + lane]
            i += 1
        for j in range(1, num_levels):
            for k in range(4):
                for lane in range(vec):
                    acc[(j * 4 + k) * vec + lane] = acc[(j * 4 + k) * vec + lane] + acc[((j - 1) * 4 + k) * vec + lane]
                    acc[((j - 1) * 4 + k) * vec + lane] = np.float32(0.0)
            mask = level_mask << (j * level_power)
            if (i & mask) != 0:
                break
    while i < size_ilp:
        for k in range(4):
            base = (4 * i + k) * vec
            for lane in range(vec):
                acc[k * vec + lane] = acc[k * vec + lane] + v[base + lane]
        i += 1
    for j in range(1, num_levels):
        for k in range(4):
            for lane in range(vec):
                acc[k * vec + lane] = acc[k * vec + lane] + acc[(j * 4 + k) * vec + lane]
    # row_sum: leftover vectors into partial 0, then partials combined
    for r in range(size_ilp * 4, nvec):
        for lane in range(vec):
            acc[lane] = acc[lane] + v[r * vec + lane]
    for k in range(1, 4):
        for lane in range(vec):
            acc[lane] = acc[lane] + acc[k * vec + lane]
    final = np.float32(0.0)
    for t in range(nvec * vec, n):
        final = final + v[t]
    for lane in range(vec):
        final = final + acc[lane]
    return final


@njit
def _cascade_scalar(v, n):
    """Scalar multi_row_sum with levels (n >= 64 below one vector width: not reached; kept exact)."""
    size_ilp = n // 4
    lg = 0
    t = size_ilp - 1
    while t > 0:
        lg += 1
        t >>= 1
    if size_ilp <= 2:
        lg = 1
    level_power = max(4, lg // 4)
    level_step = 1 << level_power
    level_mask = level_step - 1
    acc = np.zeros(16, dtype=np.float32)
    i = 0
    while i + level_step <= size_ilp:
        for _ in range(level_step):
            for k in range(4):
                acc[k] = acc[k] + v[4 * i + k]
            i += 1
        for j in range(1, 4):
            for k in range(4):
                acc[j * 4 + k] = acc[j * 4 + k] + acc[(j - 1) * 4 + k]
                acc[(j - 1) * 4 + k] = np.float32(0.0)
            if (i & (level_mask << (j * level_power))) != 0:
                break
    while i < size_ilp:
        for k in range(4):
            acc[k] = acc[k] + v[4 * i + k]
        i += 1
    for j in range(1, 4):
        for k in range(4):
            acc[k] = acc[k] + acc[j * 4 + k]
    p0 = acc[0]
    for i in range(size_ilp * 4, n):
        p0 = p0 + v[i]
    p0 = p0 + acc[1]
    p0 = p0 + acc[2]
    p0 = p0 + acc[3]
    return p0


# libstdc++'s selection and sort on (value, index) pairs with comp = value < value (no NaN here)


@njit
def _swap(val, idx, a, b):
    tv = val[a]
    val[a] = val[b]
    val[b] = tv
    ti = idx[a]
    idx[a] = idx[b]
    idx[b] = ti


@njit
def _move_median_to_first(val, idx, result, a, b, c):
    if val[a] < val[b]:
        if val[b] < val[c]:
            _swap(val, idx, result, b)
        elif val[a] < val[c]:
            _swap(val, idx, result, c)
        else:
            _swap(val, idx, result, a)
    elif val[a] < val[c]:
        _swap(val, idx, result, a)
    elif val[b] < val[c]:
        _swap(val, idx, result, c)
    else:
        _swap(val, idx, result, b)


@njit
def _unguarded_partition(val, idx, first, last, pivot):
    while True:
        while val[first] < val[pivot]:
            first += 1
        last -= 1
        while val[pivot] < val[last]:
            last -= 1
        if not first < last:
            return first
        _swap(val, idx, first, last)
        first += 1


@njit
def _partition_pivot(val, idx, first, last):
    mid = first + (last - first) // 2
    _move_median_to_first(val, idx, first, first + 1, mid, last - 1)
    return _unguarded_partition(val, idx, first + 1, last, first)


@njit
def _unguarded_linear_insert(val, idx, last):
    v = val[last]
    ix = idx[last]
    nxt = last - 1
    while v < val[nxt]:
        val[last] = val[nxt]
        idx[last] = idx[nxt]
        last = nxt
        nxt -= 1
    val[last] = v
    idx[last] = ix


@njit
def _insertion_sort(val, idx, first, last):
    if first == last:
        return
    for i in range(first + 1, last):
        if val[i] < val[first]:
            v = val[i]
            ix = idx[i]
            for j in range(i, first, -1):
                val[j] = val[j - 1]
                idx[j] = idx[j - 1]
            val[first] = v
            idx[first] = ix
        else:
            _unguarded_linear_insert(val, idx, i)


@njit
def _push_heap(val, idx, first, hole, top, v, ix):
    parent = (hole - 1) // 2
    while hole > top and val[first + parent] < v:
        val[first + hole] = val[first + parent]
        idx[first + hole] = idx[first + parent]
        hole = parent
        parent = (hole - 1) // 2
    val[first + hole] = v
    idx[first + hole] = ix


@njit
def _adjust_heap(val, idx, first, hole, n, v, ix):
    top = hole
    child = hole
    while child < (n - 1) // 2:
        child = 2 * (child + 1)
        if val[first + child] < val[first + child - 1]:
            child -= 1
        val[first + hole] = val[first + child]
        idx[first + hole] = idx[first + child]
        hole = child
    if (n & 1) == 0 and child == (n - 2) // 2:
        child = 2 * (child + 1)
        val[first + hole] = val[first + child - 1]
        idx[first + hole] = idx[first + child - 1]
        hole = child - 1
    _push_heap(val, idx, first, hole, top, v, ix)


@njit
def _heap_select(val, idx, first, middle, last):
    """libstdc++ __heap_select: __make_heap on [first, middle), then each later element smaller than the
    top replaces it (__pop_heap)."""
    n = middle - first
    if n >= 2:
        parent = (n - 2) // 2
        while True:
            _adjust_heap(val, idx, first, parent, n, val[first + parent], idx[first + parent])
            if parent == 0:
                break
            parent -= 1
    for i in range(middle, last):
        if val[i] < val[first]:
            v = val[i]
            ix = idx[i]
            val[i] = val[first]
            idx[i] = idx[first]
            _adjust_heap(val, idx, first, 0, n, v, ix)


@njit
def _sort_heap(val, idx, first, last):
    while last - first > 1:
        last -= 1
        v = val[last]
        ix = idx[last]
        val[last] = val[first]
        idx[last] = idx[first]
        _adjust_heap(val, idx, first, 0, last - first, v, ix)


@njit
def _partial_sort(val, idx, first, middle, last):
    _heap_select(val, idx, first, middle, last)
    _sort_heap(val, idx, first, middle)


@njit
def _lg(n):
    r = -1
    while n > 0:
        r += 1
        n >>= 1
    return r


@njit
def _nth_element(val, idx, first, nth, last):
    """std::nth_element (libstdc++ __introselect, its heap selection past the depth limit included)."""
    if first == last or nth == last:
        return True
    depth = _lg(last - first) * 2
    while last - first > 3:
        if depth == 0:
            _heap_select(val, idx, first, nth + 1, last)
            _swap(val, idx, first, nth)
            return True
        depth -= 1
        cut = _partition_pivot(val, idx, first, last)
        if cut <= nth:
            first = cut
        else:
            last = cut
    _insertion_sort(val, idx, first, last)
    return True


@njit
def _introsort_loop(val, idx, first, last, depth):
    """libstdc++'s __introsort_loop with its recursion on the right part as an explicit stack (the parts
    are disjoint, so the order they are partitioned in does not change the result; numba cannot cache
    recursive functions)."""
    stack = np.empty((64, 3), np.int64)
    top = 0
    stack[0, 0], stack[0, 1], stack[0, 2] = first, last, depth
    top = 1
    while top > 0:
        top -= 1
        first, last, depth = stack[top, 0], stack[top, 1], stack[top, 2]
        while last - first > 16:
            if depth == 0:
                _partial_sort(val, idx, first, last, last)
                break
            depth -= 1
            cut = _partition_pivot(val, idx, first, last)
            if top >= 64:
                return False
            stack[top, 0], stack[top, 1], stack[top, 2] = cut, last, depth
            top += 1
            last = cut
    return True


@njit
def _sort(val, idx, first, last):
    """std::sort (libstdc++: introsort loop, then the final insertion sort)."""
    if first == last:
        return True
    if not _introsort_loop(val, idx, first, last, _lg(last - first) * 2):
        return False
    if last - first > 16:
        _insertion_sort(val, idx, first, first + 16)
        for i in range(first + 16, last):
            _unguarded_linear_insert(val, idx, i)
    else:
        _insertion_sort(val, idx, first, last)
    return True


@njit
def topk_smallest(cost, off, n, k, val, idx):
    """torch.topk(cost[off:off + n], k, largest=False) on a CPU: writes the k values (ascending) and
    indices to val[:k], idx[:k] (scratch of >= n), heap paths included. False only if the sort's
    explicit stack overflowed (cannot happen within its depth limit)."""
    for j in range(n):
        val[j] = np.float64(cost[off + j])
        idx[j] = j
    if k == 0:
        return True
    if k * 64 <= n:  # ATen takes std::partial_sort here
        _partial_sort(val, idx, 0, k, n)
        return True
    if not _nth_element(val, idx, 0, k - 1, n):
        return False
    return _sort(val, idx, 0, k - 1)


# ---------------------------------------------------------------------------------------------------
# the flip-pattern search (search.py)


@njit
def _stage_search(residual, c_cols, c_cost, C, w, best, choice, stk_i, pre_c, pre_s):
    """Patterns of exactly w of the C candidates, in combinations order, against `best` (strictly
    cheaper replaces; the earlier pattern keeps a tie, as the reference's `min` over its table does).
    `choice` receives the winner's candidate indices. Returns (best, w if a pattern won here else -1)."""
    found = -1
    d = 0
    stk_i[0] = -1
    pre_c[0] = np.float32(0.0)
    pre_s[0] = 0
    while d >= 0:
        stk_i[d] += 1
        i = stk_i[d]
        r = w - d  # picks left, this one included
        if i > C - r:
            d -= 1
            continue
        p = pre_c[d]
        # lower bound of every pattern from here on: the next r candidates (costs ascend)
        lb = p
        for t in range(r):
            lb = lb + c_cost[i + t]
        if not lb < best:
            d -= 1  # siblings further right cost at least as much
            continue
        tot = p + c_cost[i]
        syn = pre_s[d] ^ c_cols[i]
        if r == 1:
            if syn == residual and tot < best:
                best = tot
                for t in range(d):
                    choice[t] = stk_i[t]
                choice[d] = i
                found = w
            continue
        pre_c[d + 1] = tot
        pre_s[d + 1] = syn
        stk_i[d + 1] = i
        d += 1
    return best, found


@njit
def search_segment(residual, cols, col_off, cost, off, n, candidates, max_flips, flips, fl_off, scr_v, scr_i,
                   c_cols, c_cost, bound, choice, stk_i, pre_c, pre_s):
    """search._search for one segment: flips[fl_off:fl_off + n] set to the chosen pattern (cleared
    first). Returns (status, ok, total); status False: the selection left the reproduced path."""
    for j in range(n):
        flips[fl_off + j] = False
    if residual == 0:
        return True, True, np.float32(0.0)
    C = min(candidates, n)
    W = min(max_flips, C)
    if W == 0:
        return True, False, _INF
    if not topk_smallest(cost, off, n, C, scr_v, scr_i):
        return False, False, _INF
    acc = np.float64(0.0)
    for j in range(C):
        c_cost[j] = np.float32(scr_v[j])
        c_cols[j] = cols[col_off + scr_i[j]]
        acc += np.float64(c_cost[j])
        bound[j] = np.float32(acc)
    best = _INF
    best_n = 0
    for w in range(1, W + 1):
        best, found = _stage_search(residual, c_cols, c_cost, C, w, best, choice, stk_i, pre_c, pre_s)
        if found > 0:
            best_n = found
        ok = best < _INF
        if w == W or (ok and best <= bound[w]):
            break
    if not best < _INF:
        return True, False, _INF
    for t in range(best_n):
        flips[fl_off + scr_i[choice[t]]] = True
    return True, True, best


@njit
def own_parity(values, start, n, cols):
    """The syndrome of the trainer's own low bits: XOR of cols[j] over the n values from `start` whose
    bit 0 is set (the scale stage's E4M3 bytes, the code stage's mantissa bits)."""
    own = np.int64(0)
    for j in range(n):
        if values[start + j] & 1:
            own ^= cols[j]
    return own


@njit
def decode_bits_segment(residual, cols, col_off, cost, off, n, wide, check, max_flips, candidates, wide_flips,
                        wide_candidates, flips, fl_off, scr):
    """search.decode_bits for one segment. Returns (status, ok, total)."""
    if check:
        for j in range(n):
            flips[fl_off + j] = False
        if residual == 0:
            return True, True, np.float32(0.0)
        return True, False, _INF
    scr_v, scr_i, c_cols, c_cost, bound, choice, stk_i, pre_c, pre_s = scr
    st, ok, total = search_segment(residual, cols, col_off, cost, off, n, candidates, max_flips, flips, fl_off,
                                   scr_v, scr_i, c_cols, c_cost, bound, choice, stk_i, pre_c, pre_s)
    if not st:
        return False, False, _INF
    if wide and not ok and wide_flips > max_flips:
        st, ok, total = search_segment(residual, cols, col_off, cost, off, n, wide_candidates, wide_flips, flips,
                                       fl_off, scr_v, scr_i, c_cols, c_cost, bound, choice, stk_i, pre_c, pre_s)
        if not st:
            return False, False, _INF
    return True, ok, total


# ---------------------------------------------------------------------------------------------------
# one row under one amax (decoder._decode_rows), the amax list and the guided codes (decoder.decode)


@njit
def _no_flips(flips, off, n):
    """What decode_bits_segment does to a segment it need not search (its residual is 0, or a check-only
    site: resolved or not, nothing flipped); called instead of it, whose ~40 arguments cost more than that."""
    for j in range(off, off + n):
        flips[j] = False


@njit
def _flip_costs(cc_cost, nbr, off, n, flip_offset):
    """The code stage's flip costs of values off .. off + n, in place: each value off the grid holds its |y|
    (an on-grid one holds inf and keeps it), and gets its distance to the nearest E2M1 midpoint plus
    flip_offset. Computed only for segments the search visits (the others never read them)."""
    for t in range(off, off + n):
        a = cc_cost[t]
        if a == _INF:
            continue
        k = nbr[t] & 7
        # the reference's min over all 7 midpoints: a lies in (GRID[k], GRID[k + 1]) and the grid's gaps
        # never shrink, so the nearest midpoint is _MIDS[k - 1] or _MIDS[k]; float subtraction is monotone,
        # so the min of the rounded distances is the same float
        dmin = abs(a - _MIDS[k])
        if k > 0:
            dd = abs(a - _MIDS[k - 1])
            if dd < dmin:
                dmin = dd
        cc_cost[t] = dmin + flip_offset


@njit
def _hypothesis(xr, r, K, A, num, sy, has_four, m_s, m_c, check, seg, bps, S, nb, cols_s, cols_c, mbits, wide,
                max_flips, candidates, wide_flips, wide_candidates, cw_flips, cw_cands, flip_offset, vec, byte, other,
                s_arr, s_bits, sc_cost, sc_vals, sflips, bits, nbr, cc_cost, cflips, seg_tot, acc, scr):
    """decoder._decode_rows for row r (its float32 values xr [K]) under float32 amax A: writes the row's
    scale bytes to `byte`, its mantissa bits to `bits` and, per value, its grid neighbours and sign
    (k | k_up << 3 | negative << 6) to `nbr` for the guided codes. Returns (status, cost, code_unresolved,
    scale_unresolved, code_flips, scale_flips); status False: the row left the reproduced path."""
    g_enc, g_dec = global_dec(A, num)
    gs = g_enc * _SIXTH
    # block scales: the trainer's own, and the byte across the nearest E4M3 boundary with its cost
    for b in range(nb):
        # the block's largest |value| in 16 lanes (rtn16.py: the same float as the scalar max chain for values
        # that are not NaN; the row loop refused any row that is not finite before this)
        s = absmax16(xr, b * 16) * gs
        if s > _FLT_MAX:
            s = _FLT_MAX
        if s > np.float32(448.0):
            s = np.float32(448.0)
        if has_four and (sy[r * nb + b] >> 1) & 1:
            s = s * np.float32(1.5)
            if s > _FLT_MAX:
                s = _FLT_MAX
            if s > np.float32(448.0):
                s = np.float32(448.0)
        s_arr[b] = s
    for b in range(nb):
        s = s_arr[b]
        by, value = round_e4m3(s, np.int64(s_bits[b]), _E4)
        up = min(by + 1, 0x7E)
        down = max(by - 1, 0)
        d_up = _INF
        d_down = _INF
        if up != by:
            d_up = abs((value + _E4[up]) / np.float32(2.0) - s)
        if down != by:
            d_down = abs(s - (value + _E4[down]) / np.float32(2.0))
        other[b] = up if d_up <= d_down else down
        sc_cost[b] = min(d_up, d_down) / max(s, np.float32(1e-30))
        byte[b] = by
    scale_unres = 0
    scost = np.float32(0.0)
    if m_s == bps:  # every LSB sent
        for b in range(nb):
            f = (byte[b] & 1) != (sy[r * nb + b] & 1)
            sflips[b] = f
            sc_vals[b] = sc_cost[b] if f else np.float32(0.0)
        scost = torch_sum(sc_vals, nb, vec, acc)
        if check:
            for sg in range(S):
                anyf = False
                for j in range(bps):
                    anyf = anyf or sflips[sg * bps + j]
                if anyf:
                    scale_unres += 1
            for b in range(nb):
                sflips[b] = False
    elif m_s == 0:
        for b in range(nb):
            sflips[b] = False
    else:
        for sg in range(S):
            res = np.int64(0)
            for j in range(m_s):
                res |= np.int64(sy[r * nb + sg * bps + j] & 1) << j
            own = own_parity(byte, sg * bps, bps, cols_s)
            if res == own or check:  # decode_bits_segment's answer without its call (no search to run)
                _no_flips(sflips, sg * bps, bps)
                ok, total = res == own, np.float32(0.0)
            else:
                st, ok, total = decode_bits_segment(res ^ own, cols_s, 0, sc_cost, sg * bps, bps, wide, check,
                                                    max_flips, candidates, wide_flips, wide_candidates, sflips, sg * bps,
                                                    scr)
                if not st:
                    return False, _INF, 0, 0, 0, 0
            if not ok:
                scale_unres += 1
            seg_tot[sg] = total if ok else np.float32(0.0)
        scost = torch_sum(seg_tot, S, vec, acc)
    scale_flips = 0
    for b in range(nb):
        if sflips[b]:
            byte[b] = other[b]
            scale_flips += 1
    # codes: the trainer's own mantissa bits under those scales, their flip costs, then the search
    for b in range(nb):
        enc = np.float32(1.0) / (_E4[byte[b]] * g_dec)
        if enc > _FLT_MAX:
            enc = _FLT_MAX
        # the trainer's own mantissa bits, grid neighbours and sign, and |y| (or inf on the grid) of the block's
        # 16 values in registers (own_codes16.py: why the same bits). |y| stays until the segment's search
        # needs its flip cost (_flip_costs): a segment whose syndrome matches the trainer's own bits, and a
        # check-only site, never read it
        own_codes16(bits, nbr, cc_cost, b * 16, xr, enc)
    code_unres = 0
    for sg in range(S):
        own = own_parity(bits, sg * seg, seg, cols_c)
        if mbits[r * S + sg] == own or check:  # decode_bits_segment's answer without its call (no search)
            _no_flips(cflips, sg * seg, seg)
            ok, total = mbits[r * S + sg] == own, np.float32(0.0)
        else:
            _flip_costs(cc_cost, nbr, sg * seg, seg, flip_offset)
            st, ok, total = decode_bits_segment(mbits[r * S + sg] ^ own, cols_c, 0, cc_cost, sg * seg, seg, wide, check,
                                                max_flips, candidates, cw_flips, cw_cands, cflips, sg * seg, scr)
            if not st:
                return False, _INF, 0, 0, 0, 0
        if not ok:
            code_unres += 1
        seg_tot[sg] = total if ok else np.float32(0.0)
    ccost = torch_sum(seg_tot, S, vec, acc)
    code_flips = 0
    for t in range(K):
        if cflips[t]:
            bits[t] ^= 1
            code_flips += 1
    cost = _INF if code_unres + scale_unres > 0 else scost + ccost
    return True, cost, code_unres, scale_unres, code_flips, scale_flips


@njit(parallel=True)
def decode_site_chunks(chunks, x32, x16, use16, R, K, header, static, shift, amax_bits, m_s, m_c, check, seg, cols_s,
                       cols_c, mbits, sy, has_four, num, flip_offset, amax_prior, amax_list, max_flips, candidates,
                       wide_flips, wide_candidates, cw_flips, cw_cands, vec, codes_out, scales_out, amax_out, counts, why,
                       with_values, vals32, vals16, with_rtn, rtn_codes, rtn_scales, rtn_amax):
    """decoder.decode's work for R rows of K: the trainer's values as float32 `x32` or bf16 bits `x16`
    (`use16`), the guide's row headers, code syndromes `mbits` [R * S] and scale syndromes `sy`
    [R * K / 16] (bit 0, and 4over6's choice in bit 1) as they are stored. Writes packed codes, scale
    bytes and amaxes; adds (unresolved code segments, unresolved scale segments, code flips, scale
    flips, amax list rows) to counts. `with_values`: also the dequantized codes (backend.dequantize's
    values: signed E2M1 value times e4m3(scale) * g_dec, in that order) as float32 `vals32` [R, K] or,
    `use16`, rounded to bf16 (nearest even, as torch casts) as bits `vals16`. Returns the first row that
    left the reproduced path, or -1; why[0] says why (1: its amax is not a finite float32, 2: a selection
    off the reproduced path, 3: a trainer value is not finite).

    The rows are split into `chunks` contiguous ranges, one thread each (numba.prange); chunks == 1 runs
    them on this thread, no parallel launch. Every row is computed by one thread in the same order of
    operations and writes only its own outputs, so any split gives the same bits; the counters are integer
    sums (order-free), and the first row that left the reproduced path is the smallest over the chunks.
    `with_rtn`: also the trainer's own round-to-nearest of each row under its own amax (max |value|), as
    `quantize(x, row_amax(x))` under the "6" block scale computes it, into rtn_codes / rtn_scales / rtn_amax
    (the rows are read here anyway: one pass instead of a second call; `num` must then be the "6" numerator).
    The one entry point for both (a second, serial one compiled the whole body again: ~15 s cold)."""
    if chunks == 1:
        return _decode_row_range(0, R, x32, x16, use16, K, header, static, shift, amax_bits, m_s, m_c, check, seg,
                                 cols_s, cols_c, mbits, sy, has_four, num, flip_offset, amax_prior, amax_list, max_flips,
                                 candidates, wide_flips, wide_candidates, cw_flips, cw_cands, vec, codes_out, scales_out,
                                 amax_out, counts, why, with_values, vals32, vals16, with_rtn, rtn_codes, rtn_scales,
                                 rtn_amax)
    bad = np.full(chunks, -1, np.int64)
    whys = np.zeros(chunks, np.int64)
    cnt = np.zeros((chunks, 5), np.int64)
    for c in prange(chunks):
        r0 = c * R // chunks
        r1 = (c + 1) * R // chunks
        bad[c] = _decode_row_range(r0, r1, x32, x16, use16, K, header, static, shift, amax_bits, m_s, m_c, check, seg,
                                   cols_s, cols_c, mbits, sy, has_four, num, flip_offset, amax_prior, amax_list, max_flips,
                                   candidates, wide_flips, wide_candidates, cw_flips, cw_cands, vec, codes_out,
                                   scales_out, amax_out, cnt[c], whys[c:c + 1], with_values, vals32, vals16, with_rtn,
                                   rtn_codes, rtn_scales, rtn_amax)
    first = -1
    for c in range(chunks):
        if bad[c] >= 0 and (first < 0 or bad[c] < first):
            first = bad[c]
            why[0] = whys[c]
    for c in range(chunks):
        for j in range(5):
            counts[j] += cnt[c, j]
    return first


@njit
def _decode_row_range(r0, r1, x32, x16, use16, K, header, static, shift, amax_bits, m_s, m_c, check, seg, cols_s, cols_c,
                      mbits, sy, has_four, num, flip_offset, amax_prior, amax_list, max_flips, candidates, wide_flips,
                      wide_candidates, cw_flips, cw_cands, vec, codes_out, scales_out, amax_out, counts, why, with_values,
                      vals32, vals16, with_rtn, rtn_codes, rtn_scales, rtn_amax):
    """decode_site_chunks's rows [r0, r1) with their own scratch (one thread's share). The scratch is allocated
    here and handed to _decode_rows, which borrows every array (borrow.py): the arrays live until this
    call returns, so the borrowed views never outlive them."""
    nb = K // 16
    S = K // seg
    bps = seg // 16
    n_max = max(seg, bps)
    wmax = max(max_flips, wide_flips, cw_flips) + 1
    return _decode_rows(
        r0, r1, x32, x16, use16, K, header, static, shift, amax_bits, m_s, m_c, check, seg, cols_s, cols_c,
        mbits, sy, has_four, num, flip_offset, amax_prior, amax_list, max_flips, candidates, wide_flips,
        wide_candidates, cw_flips, cw_cands, vec, codes_out, scales_out, amax_out, counts, why, with_values,
        vals32, vals16, with_rtn, rtn_codes, rtn_scales, rtn_amax,
        np.empty(K, np.float32), np.empty(nb, np.int64), np.empty(nb, np.int64), np.empty(nb, np.float32),
        np.empty(nb, np.float32), np.empty(nb, np.float32), np.empty(nb, np.bool_), np.empty(K, np.int64),
        np.empty(K, np.int64), np.empty(K, np.float32), np.empty(K, np.bool_), np.empty(max(S, 1), np.float32),
        np.empty(16 * vec + 16, np.float32),
        np.empty(n_max, np.float64), np.empty(n_max, np.int64), np.empty(n_max, np.int64), np.empty(n_max, np.float32),
        np.empty(n_max, np.float32), np.empty(wmax, np.int64), np.empty(wmax, np.int64), np.empty(wmax, np.float32),
        np.empty(wmax, np.int64),
        np.empty(nb, np.int64), np.empty(K, np.int64), np.empty(K, np.int64), np.empty(1, np.float32),
        np.empty(K, np.int64))


@njit
def _decode_rows(r0, r1, x32, x16, use16, K, header, static, shift, amax_bits, m_s, m_c, check, seg, cols_s, cols_c,
                      mbits, sy, has_four, num, flip_offset, amax_prior, amax_list, max_flips, candidates, wide_flips,
                      wide_candidates, cw_flips, cw_cands, vec, codes_out, scales_out, amax_out, counts, why, with_values,
                      vals32, vals16, with_rtn, rtn_codes, rtn_scales, rtn_amax,
                 xr, byte, other, s_arr, sc_cost, sc_vals, sflips, bits, nbr, cc_cost, cflips, seg_tot, acc,
                 scr_v, scr_i, c_cols, c_cost, bound, choice, stk_i, pre_c, pre_s, byte2, bits2, nbr2, fbuf, cbuf):
    """_decode_row_range's work on its scratch (xr ... acc: one row's, scr_v ... pre_s: the flip search's,
    byte2 ... nbr2: an amax-list candidate's, fbuf: a float32 bit cast). Every array is borrowed first
    (no reference count: the per-row and per-segment helpers below take 5-20 arrays per call)."""
    nb = K // 16
    S = K // seg
    bps = seg // 16
    x32, x16, header, cols_s, cols_c = borrow(x32), borrow(x16), borrow(header), borrow(cols_s), borrow(cols_c)
    mbits, sy, codes_out, scales_out = borrow(mbits), borrow(sy), borrow(codes_out), borrow(scales_out)
    amax_out, counts, why, vals32, vals16 = borrow(amax_out), borrow(counts), borrow(why), borrow(vals32), borrow(vals16)
    xr, byte, other, s_arr, sc_cost = borrow(xr), borrow(byte), borrow(other), borrow(s_arr), borrow(sc_cost)
    sc_vals, sflips, bits, nbr, cc_cost = borrow(sc_vals), borrow(sflips), borrow(bits), borrow(nbr), borrow(cc_cost)
    cflips, seg_tot, acc = borrow(cflips), borrow(seg_tot), borrow(acc)
    scr = (borrow(scr_v), borrow(scr_i), borrow(c_cols), borrow(c_cost), borrow(bound), borrow(choice), borrow(stk_i),
           borrow(pre_c), borrow(pre_s))
    byte2, bits2, nbr2, fbuf, cbuf = borrow(byte2), borrow(bits2), borrow(nbr2), borrow(fbuf), borrow(cbuf)
    rtn_codes, rtn_scales, rtn_amax = borrow(rtn_codes), borrow(rtn_scales), borrow(rtn_amax)
    s_bits = s_arr.view(np.int32)
    ibuf = fbuf.view(np.int32)
    xi = xr.view(np.int32)  # the row's float32 bits (its largest |value| below)
    mod = 1 << amax_bits
    key_max = 0x7F7FFFFF >> shift
    static_amax = np.float32(0.0)
    if static and r1 > r0:
        sb = header[0] & 0xFFFFFFFF
        ibuf[0] = np.int32(sb - (1 << 32) if sb >= (1 << 31) else sb)
        static_amax = fbuf[0]
    for r in range(r0, r1):
        # the row as float32 (bf16 bits moved to the high half: exact), then its largest |value|; the dtype
        # branch is taken once per row, not per value, and the bit cast stays in registers
        base = r * K
        if use16:
            for t in range(K):
                v16 = np.int64(x16[base + t]) << 16
                xr[t] = np.int32(v16 - (1 << 32) if v16 >= (1 << 31) else v16).view(np.float32)
        else:
            for t in range(K):
                xr[t] = x32[base + t]
        # the row's largest |value| and whether every value is finite, from one integer max over the values'
        # bits with the sign cleared (a reduction LLVM vectorises, where it keeps a float max chain serial):
        # for floats >= 0 that are not NaN the order of the bits as integers is the order of the values, and
        # +-0 both clear to 0, so the largest is the float the scalar `if |x| > m: m = |x|` from +0 keeps;
        # every inf or NaN clears to bits above FLT_MAX's 0x7F7FFFFF and every finite value to bits at most
        # that, so the row is finite exactly when the largest is at most 0x7F7FFFFF
        mi = np.int64(0)
        for t in range(K):
            a = np.int64(xi[t]) & 0x7FFFFFFF
            if a > mi:
                mi = a
        if mi > 0x7F7FFFFF:
            why[0] = 3
            return r
        ibuf[0] = np.int32(mi)
        m = fbuf[0]
        if with_rtn:  # the trainer's own rounding under the row's own amax (fbuf is free until below)
            _rtn_row(xr, r, nb, m, num, rtn_codes, rtn_scales, fbuf, ibuf)
            rtn_amax[r] = m
        if static:
            A = static_amax
            diff = 0
            key_t = 0
            key = 0
        else:
            fbuf[0] = m
            key_t = (np.int64(ibuf[0]) & 0x7FFFFFFF) >> shift
            diff = ((header[r] & 0xFFFFFFFF & (mod - 1)) - key_t) % mod
            if diff >= (mod + 1) // 2:
                diff -= mod
            key = max(key_t + diff, 0)
            kb = key << shift
            if kb > 0x7FFFFFFF:
                why[0] = 1
                return r
            ibuf[0] = np.int32(kb)
            A = fbuf[0]
        if not np.isfinite(A):
            why[0] = 1
            return r
        st, cost, cu, su, cf, sf = _hypothesis(
            xr, r, K, A, num, sy, has_four, m_s, m_c, check, seg, bps, S, nb, cols_s, cols_c, mbits, True,
            max_flips, candidates, wide_flips, wide_candidates, cw_flips, cw_cands, flip_offset, vec, byte, other,
            s_arr, s_bits,
            sc_cost, sc_vals, sflips, bits, nbr, cc_cost, cflips, seg_tot, acc, scr)
        if not st:
            why[0] = 2
            return r
        if not static:
            score = cost + amax_prior * np.float32(abs(diff))
            edge = diff <= -(mod // 2) + 1 or diff >= mod // 2 - 1
            if edge and cost > 0 and not check:
                for kk in range(1, amax_list + 1):
                    for sgn in (-1, 1):
                        cand_diff = diff + sgn * kk * mod
                        cand = key_t + cand_diff
                        if cand < 0 or cand > key_max:
                            continue
                        ibuf[0] = np.int32(cand << shift)
                        st, c2, cu2, su2, cf2, sf2 = _hypothesis(
                            xr, r, K, fbuf[0], num, sy, has_four, m_s, m_c, check, seg, bps, S, nb, cols_s, cols_c,
                            mbits, False, max_flips, candidates, wide_flips, wide_candidates, cw_flips, cw_cands,
                            flip_offset, vec, byte2,
                            other, s_arr, s_bits, sc_cost, sc_vals, sflips, bits2, nbr2, cc_cost, cflips, seg_tot,
                            acc, scr)
                        if not st:
                            why[0] = 2
                            return r
                        cand_score = c2 + amax_prior * np.float32(abs(cand_diff))
                        if cand_score < score:
                            byte[:] = byte2
                            bits[:] = bits2
                            nbr[:] = nbr2
                            cu, su, cf, sf = cu2, su2, cf2, sf2
                            key = cand
                            score = cand_score
                            counts[4] += 1
            ibuf[0] = np.int32(key << shift)
            A = fbuf[0]
        counts[0] += cu
        counts[1] += su
        counts[2] += cf
        counts[3] += sf
        amax_out[r] = A
        # the guided codes (reference.quantize_guided toward the decoded mantissa bits): of the value's two
        # grid neighbours under the winner's scales and amax, the one whose mantissa bit was decoded
        for b in range(nb):
            scales_out[r, b] = np.uint8(byte[b])
        for t in range(K):
            n0 = nbr[t]
            k0 = n0 & 7
            cbuf[t] = (k0 if (k0 & 1) == bits[t] else (n0 >> 3) & 7) | ((n0 >> 3) & 8)
        for t in range(K // 2):
            codes_out[r, t] = np.uint8(cbuf[2 * t] | (cbuf[2 * t + 1] << 4))
        if with_values:
            # backend.dequantize's values: the signed E2M1 value times (e4m3(scale) * g_dec), per block, then
            # (bf16) rounded to nearest even on the float32 bits as torch casts; from the packed codes just
            # written, 16 values a block in registers (decode16.py, values16.py: why the same bits)
            _, g_dec = global_dec(A, num)
            row = r * (K // 2)
            for b in range(nb):
                mult = _E4[byte[b]] * g_dec
                if use16:
                    values16_bf16(vals16, base + b * 16, codes_out, row + b * 8, mult)
                else:
                    decode16_row(vals32, base + b * 16, codes_out, row + b * 8, mult)
    return -1


@njit
def _rtn_row(xr, r, nb, amax, num, rtn_codes, rtn_scales, fbuf, ibuf):
    """Row r's round-to-nearest under `amax` (its float32 values `xr`, all finite): quantize.quantize_kernel's
    steps for a finite row, the same float32 operations in the same order (its helpers), so the same bytes.
    Each block's largest |value| and its codes in 16-lane registers (rtn16.py: why, and why the same bits);
    the scale byte and encode factor between them as quantize does."""
    g_enc, g_dec = global_dec(amax, num)
    g6 = g_enc * _SIXTH
    row = r * nb * 8  # rtn_codes is C-contiguous [R, nb * 8]: the row's first code byte
    for b in range(nb):
        byte, enc = block_scale_enc(absmax16(xr, b * 16), g6, g_dec, fbuf, ibuf, _E4)
        rtn_scales[r, b] = np.uint8(byte)
        rtn_codes16(rtn_codes, row + b * 8, xr, b * 16, enc)


# ---------------------------------------------------------------------------------------------------
# the entry point decoder.decode calls on the native path

_TABLES: dict = {}


def _tables():
    if not _TABLES:
        _TABLES.update(vec=_sum_vector_width())
    return _TABLES


def _sum_vector_width() -> int:
    """Floats per vector in this torch build's float32 sum kernel, found by asking it: rows whose sum
    depends on the order, summed by torch and by the emulation at each width. (8 on the AVX2 and the
    AVX-512 machine here: ATen's sum kernel has no AVX-512 variant.) 0 if none agrees: the decode then
    falls back, counted."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.rand(4, n, generator=g) * torch.logspace(-4, 4, n)[torch.randperm(n, generator=g)]
            for n in (5, 7, 8, 9, 12, 16, 17, 24, 31, 32, 33, 40, 48, 64, 100, 130)]
    for vec in (8, 16, 4, 32):
        acc = np.empty(16 * vec + 16, np.float32)
        if all(np.float32(torch_sum(r[i].numpy(), r.shape[1], vec, acc)) == r.sum(-1)[i].item()
               for r in rows for i in range(r.shape[0])):
            return vec
    return 0


def decode(guide, x: torch.Tensor, report, rates, shift: int, static: bool, header: torch.Tensor,
           block_scale: str, with_values: bool = False, with_rtn: bool = False):
    """The native decode of one site: ((codes, scales, amax) of rows [R, K], None), or (None, why) where it
    does not cover the input (non-finite values or amaxes, or a selection off the reproduced path): the
    caller then runs the torch reference and counts it. `with_values`: the first item also holds the
    decode dequantized in x's dtype (bit-identical to `dequantize(q, x.dtype)`), computed in the same
    pass. `with_rtn` (the "6" block scale only): a last item, the round-to-nearest (codes, scales, amax)
    of the rows under each row's own amax, `quantize(x, row_amax(x))`'s bytes, also from the same pass
    (else None). `report` is only updated on success. Few torch
    ops here on purpose: on a loaded two-core machine each costs more than the decode of a small site
    (the site's constant arguments are made once per rates, K and block scale: _site_args)."""
    lead, K = x.shape[:-1], x.shape[-1]
    R = math.prod(lead)
    site = _site_args(rates, K, block_scale)
    if site is None:
        return None, "no vector width reproduces this torch build's float32 sum"
    nb, S = site[0], site[1]
    xd = x.detach()
    if xd.dtype not in (torch.bfloat16, torch.float32):
        xd = xd.to(torch.float32)
    xd = xd.contiguous()
    use16 = xd.dtype == torch.bfloat16
    # flattened as numpy arrays: numpy's reshape and view cost a fraction of torch's (16 calls a step)
    x16 = xd.view(torch.int16).numpy().reshape(R * K).view(np.uint16) if use16 else _EMPTY16
    x32 = _EMPTY32 if use16 else xd.numpy().reshape(R * K)
    codes = np.empty((R, K // 2), np.uint8)
    scales = np.empty((R, nb), np.uint8)
    amax = np.empty(R, np.float32)
    counts = np.zeros(5, dtype=np.int64)
    why = np.zeros(1, dtype=np.int64)
    vn = np.empty(R * K, np.uint16 if use16 else np.float32) if with_values else None  # the values' memory
    v32 = vn if with_values and not use16 else _EMPTY32
    v16 = vn if with_values and use16 else _EMPTY16
    if with_rtn and block_scale != "6":
        raise ValueError(f"the decode's round-to-nearest is the '6' block scale's; got {block_scale!r}")
    rtn = (np.empty((R, K // 2), np.uint8), np.empty((R, nb), np.uint8), np.empty(R, np.float32)) if with_rtn else _NO_RTN
    chunks = _chunks(R, K)
    # A parallel launch goes through parallel_launch (numba's thread count = torch's, torch's count kept:
    # numba's OpenMP layer shares libgomp with torch), as the grouped GEMM's does.
    with parallel_launch() if chunks > 1 else nullcontext():
        bad = decode_site_chunks(
            chunks, x32, x16, use16, R, K, header.contiguous().numpy(), static, shift, *site[2:9],
            guide.syndromes.contiguous().numpy().reshape(R * S), guide.scale_syndromes.contiguous().numpy().reshape(R * nb),
            *site[9:], codes, scales, amax, counts, why, with_values, v32, v16, with_rtn, *rtn)
    if bad >= 0:
        return None, {1: f"row {bad}: its amax is not a finite float32", 3: f"row {bad}: trainer values not finite"}.get(
            int(why[0]), f"row {bad}: a candidate selection off the reproduced libstdc++ path")
    c = counts.tolist()
    report.unresolved_code_segments += c[0]
    report.unresolved_scale_segments += c[1]
    report.code_flips += c[2]
    report.scale_flips += c[3]
    report.amax_list_rows += c[4]
    codes, scales, amax = torch.from_numpy(codes), torch.from_numpy(scales), torch.from_numpy(amax)
    if with_values:
        vals = torch.from_numpy(vn.reshape(R, K))
        if use16:
            vals = vals.view(torch.bfloat16)
    if with_values and vals.dtype != x.dtype:  # float16 rows ran as float32: torch's cast, as dequantize(q, dtype) does
        vals = vals.to(x.dtype)
    out = (codes, scales, amax) + ((vals,) if with_values else ())
    return (out + (tuple(torch.from_numpy(a) for a in rtn),) if with_rtn else out), None


_SITE_ARGS: dict = {}


def _site_args(rates, K: int, block_scale: str):
    """(nb, S, then decode_site_chunks's constant arguments around the syndromes: (amax_bits ... cols_c), then
    (has_four ... vec)) for rows of K at `rates`, or None where no sum width reproduces torch's. Cached by
    everything they depend on, the decoder's and search's module constants included (tests change them)."""
    from ..guides.sparse import decoder as ref
    from ..guides.sparse import search

    key = (rates, K, block_scale, ref.FLIP_OFFSET, ref.AMAX_PRIOR, ref.AMAX_LIST, search.MAX_FLIPS,
           search.CANDIDATES, search.WIDE_FLIPS, search.WIDE_CANDIDATES, tuple(search.WIDE_STEPS))
    hit = _SITE_ARGS.get(key)
    if hit is None:
        from ..format import BLOCK_SIZE, global_enc_numerator
        from ..guides.sparse.rates import segment

        vec = _tables()["vec"]
        if not vec:
            return None
        nb, seg = K // BLOCK_SIZE, segment(K)
        S, bps = K // seg, seg // BLOCK_SIZE
        hit = _SITE_ARGS[key] = (
            nb, S, rates.amax_bits, rates.scale_bits, rates.code_bits,
            rates.check, seg, _columns(rates.scale_bits, bps, 1), _columns(rates.code_bits, seg, 2),
            # (mbits, sy) go here
            rates.choice, np.float32(global_enc_numerator(block_scale)), np.float32(ref.FLIP_OFFSET),
            np.float32(ref.AMAX_PRIOR), ref.AMAX_LIST, search.MAX_FLIPS, search.CANDIDATES, search.WIDE_FLIPS,
            search.WIDE_CANDIDATES, *search.wide_search_for(rates.code_bits, seg), vec)
    return hit


# Values per thread below which a site decodes on one thread: a parallel launch costs ~10-20 us, a
# value ~50 ns.
MIN_VALUES_PER_THREAD = 2048


def _chunks(R: int, K: int) -> int:
    """Threads for a site of R rows of K: torch's intra-op thread count (the budget the trainer's torch ops
    use, and they are idle while the decode runs: no oversubscription), capped by numba's pool and by
    MIN_VALUES_PER_THREAD."""
    import numba

    n = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS, R, max(1, R * K // MIN_VALUES_PER_THREAD))
    return max(1, n)


_EMPTY16 = np.zeros(0, np.uint16)
_NO_RTN = (np.zeros((0, 0), np.uint8), np.zeros((0, 0), np.uint8), np.zeros(0, np.float32))
_EMPTY32 = np.zeros(0, np.float32)
_COLUMNS: dict = {}


def _columns(m: int, n: int, salt: int) -> np.ndarray:
    """parity.columns as a numpy int64 array, once per (m, n, salt)."""
    key = (m, n, salt)
    if key not in _COLUMNS:
        from ..guides.sparse.parity import columns

        _COLUMNS[key] = columns(m, n, salt, "cpu").contiguous().numpy()
    return _COLUMNS[key]


@njit
def _decode_bits_rows(residual, cols, cost, n, wide, check, max_flips, candidates, wide_flips, wide_candidates,
                      flips, ok, total):
    N = residual.shape[0]
    n_max = n
    wmax = max(max_flips, wide_flips) + 1
    scr = (np.empty(n_max, np.float64), np.empty(n_max, np.int64), np.empty(n_max, np.int64),
           np.empty(n_max, np.float32), np.empty(n_max, np.float32), np.empty(wmax, np.int64),
           np.empty(wmax, np.int64), np.empty(wmax, np.float32), np.empty(wmax, np.int64))
    for i in range(N):
        st, o, t = decode_bits_segment(residual[i], cols, i * n, cost, i * n, n, wide, check, max_flips, candidates,
                                       wide_flips, wide_candidates, flips, i * n, scr)
        if not st:
            return i
        ok[i] = o
        total[i] = t
    return -1


def decode_bits(residual: torch.Tensor, cols: torch.Tensor, cost: torch.Tensor, wide: bool = True, check: bool = False,
                widths=None):
    """search.decode_bits on the native kernels (rows of residual int64 [N], cols int64 [N, n], cost
    float32 [N, n]; `widths`: the wide search's (flips, candidates), as search.decode_bits): (flips,
    resolved, cost). For tests; the decoder calls the site kernel."""
    from ..guides.sparse import search

    N, n = cost.shape
    flips = np.zeros(N * n, np.bool_)
    ok = np.zeros(N, np.bool_)
    total = np.zeros(N, np.float32)
    bad = _decode_bits_rows(residual.contiguous().numpy(), cols.contiguous().reshape(-1).numpy(),
                            cost.contiguous().reshape(-1).numpy(), n, wide, check, search.MAX_FLIPS, search.CANDIDATES,
                            *(widths or (search.WIDE_FLIPS, search.WIDE_CANDIDATES)), flips, ok, total)
    if bad >= 0:
        raise RuntimeError(f"row {bad}: the selection left the reproduced path")
    return torch.from_numpy(flips).reshape(N, n), torch.from_numpy(ok), torch.from_numpy(total)

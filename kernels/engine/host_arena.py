"""The native CPU engine's capture rows written straight into growing host arenas (one per key), and a
step recorded as (chunk, offset, rows) instead of per-key tensors.

Why: on the native engine every layer call handed the capture store fresh tensors (the KV write six numpy
outputs, six torch.from_numpy and two NVFP4Tensor; the MoE call five np.empty, six from_numpy and two
NVFP4Tensor; a put_owned with its checks per site; an int16 copy of the routing ids), ~10 ms of Python a
16 x 64-token generate of the tiny model, and the take joined each key's rows with a torch.cat over every
step. Here the store holds a chunk of rows per key (codes, scales, amax numpy arrays; routing ids int16);
the step's first write reserves its rows at one offset for every key, the kernels write their capture
outputs into scratch arrays the arena hands out (reused step after step, so in cache: see `_scratch`), the
step's end copies them into the chunk's rows by one kernel call (`commit`), and the step is one `ArenaStep`. The
take finds where each request's rows lie (`arena_rows`: (chunk, row) per token) and its encoder reads the
site rows there (cpu_native.take_encode); the routing ids, and any other reader of many requests, are
gathered with one index per key and chunk (`gather_rows`, `gather_arena_chunks`): the same rows in the
same order as the torch.cat + index_select it replaces, so the records are the same bytes. Anything that reads a step as {key: tensor} rows (the per-request join, truncation, prefix rows,
rank parts) gets views of the arena rows (`ArenaStep.sites` / `.routing`, made once when first read).

A chunk is freed by reference counting: the store drops it when a step does not fit, and every step
written into it holds it, so it goes with the last step that refers to it (taken, evicted, dropped).
Its arrays then go back to the arena's pool (at most POOL_CHUNKS) and the next chunk reuses them: fresh
arrays cost a page fault per 4 KiB at the kernels' first write into them, inside the forward (measured:
the native KV write's kernel ~2 ms slower a 16 x 64 generate on fresh chunks than on recycled memory).
The capture budget counts the rows' bytes as before (a step's row bytes times each request's rows); the
pool holds at most POOL_CHUNKS chunks' arrays besides (with the current chunk and the scratch: `held_bytes`,
reported as the store's `host_arena_bytes`).
"""

from itertools import chain

import numpy as np
import torch

from ..tensor import NVFP4Tensor
from .step_buffers import ROUTING

# Rows of a chunk: about CHUNK_BYTES of every key's rows, at least MIN_ROWS, at least the step's rows.
CHUNK_BYTES = 4 << 20
MIN_ROWS = 64
SCRATCH_SIZES = 16  # row counts whose scratch arrays and copy plans are kept
POOL_CHUNKS = 2  # freed chunks' arrays kept for reuse (their pages already faulted in)


class ArenaChunk:
    """`capacity` rows of every key written so far: key -> (codes, scales, amax) or (ids,) numpy arrays,
    each made at the key's first write into this chunk (np.empty: its pages cost nothing until written)."""

    __slots__ = ("capacity", "used", "arrays", "pool", "__weakref__")

    def __init__(self, capacity: int, arrays: dict | None = None, pool: list | None = None):
        self.capacity, self.used = capacity, 0
        self.arrays: dict = {} if arrays is None else arrays
        self.pool = pool  # where its arrays go when no step refers to it any more (HostArena._pool)

    def __del__(self, _keep=POOL_CHUNKS):  # bound here: module globals may be gone at interpreter exit
        pool = self.pool
        if pool is not None and len(pool) < _keep:
            pool.append((self.capacity, self.arrays))

    def row_bytes(self) -> int:
        return sum(a.itemsize * (a.size // self.capacity) for arrs in self.arrays.values() for a in arrs)


class HostArena:
    """The store's current chunk and this step's reservation (`rows` at `offset`), and which keys the
    step's forward wrote into it (`written`). One per capture store; the engine's forward is one thread."""

    __slots__ = ("chunk", "offset", "rows", "written", "_row_bytes", "_pool", "_scratch", "_scratch_rows", "_scratch_held",
                 "_plans")

    def __init__(self):
        self.chunk: ArenaChunk | None = None
        self.offset = 0
        self.rows = -1  # this step's rows, fixed by its first write (-1: none yet)
        self.written: set = set()
        self._row_bytes = 0  # of the last chunk (sizes the next one)
        self._pool: list = []  # (capacity, arrays) of freed chunks (ArenaChunk.__del__)
        # The kernels write a step's rows here (key -> arrays of `_scratch_rows` rows, reused step after step,
        # so in cache) and `commit` copies them into the chunk at the step's end, one block copy per array:
        # written there by the kernels directly, the rows went to memory not touched since the chunk's last
        # use, and the kernels' byte stores stalled on it (measured: each of the KV write and the MoE call
        # ~2 ms slower a 16 x 64 generate than on the fresh, recently freed, arrays put_owned kept).
        self._scratch: dict = {}
        self._scratch_rows = -1
        self._scratch_held: dict = {}  # rows -> that row count's scratch
        # What `commit` copies, per row count: (chunk, scratch, written keys, source addresses, chunk
        # addresses, row bytes), made again when one of the first three changes (a new chunk, scratch, keys).
        self._plans: dict = {}

    @property
    def scratch(self) -> dict:
        """This row count's scratch: key -> arrays, and the store's tuples made of them (CaptureStore.host_kv_rows,
        host_moe_rows: tagged keys, never copied, as `commit` copies the written keys only)."""
        return self._scratch

    def begin(self) -> None:
        self.rows = -1
        self.written.clear()

    def _reserve(self, T: int) -> None:
        chunk = self.chunk
        if chunk is None or chunk.used + T > chunk.capacity:
            if chunk is not None:
                self._row_bytes = chunk.row_bytes()
            per = self._row_bytes  # unknown before the first chunk is full: that one is MIN_ROWS rows
            pool = self._pool
            while pool and pool[-1][0] < T:  # too small for this step: let it go
                pool.pop()
            self._plans.clear()  # they name the old chunk (and would keep it alive)
            if pool:
                capacity, arrays = pool.pop()
                self.chunk = chunk = ArenaChunk(capacity, arrays, pool)
            else:
                self.chunk = chunk = ArenaChunk(max(T, MIN_ROWS, CHUNK_BYTES // per if per else 0), None, pool)
        self.offset = chunk.used
        chunk.used += T
        self.rows = T
        if T != self._scratch_rows:
            # Each row count's scratch kept (a ragged batch changes T every few steps; a prefill's T may recur);
            # at most SCRATCH_SIZES of them.
            held = self._scratch_held
            scratch = held.get(T)
            if scratch is None:
                if len(held) >= SCRATCH_SIZES:
                    held.clear()
                scratch = held[T] = {}
            self._scratch, self._scratch_rows = scratch, T

    def _first_write(self, T: int) -> bool:
        """A write of T rows where the step's rows are not T: the step's first write reserves them (True);
        a later one of another T (rows fixed by an earlier write) or an empty one gets no arena rows (False)."""
        if self.rows >= 0 or T <= 0:
            return False
        self._reserve(T)
        return True

    def site_rows(self, key, T: int, codes_row: tuple, scales_row: tuple, amax_row: tuple):
        """(codes, scales, amax) scratch arrays of T rows for site `key`'s rows of this step, for the kernel to
        write (`commit` copies them into the chunk);
        None when the step's rows were fixed at another T by an earlier write (the caller keeps today's
        fresh outputs). Not marked written: the caller marks it in `written` once the kernel succeeded;
        `commit` copies the written keys' rows into the chunk."""
        if T != self.rows and not self._first_write(T):
            return None
        arrs = self._scratch.get(key)
        if arrs is None:
            arrs = self._scratch[key] = (np.empty((T, *codes_row), dtype=np.uint8),
                                         np.empty((T, *scales_row), dtype=np.uint8),
                                         np.empty((T, *amax_row), dtype=np.float32))
        return arrs

    def routing_rows(self, key, T: int, k: int):
        """The int16 [T, k] scratch array for this step's rows of routing `key` (as site_rows)."""
        if T != self.rows and not self._first_write(T):
            return None
        arrs = self._scratch.get(key)
        if arrs is None:
            arrs = self._scratch[key] = (np.empty((T, k), dtype=np.int16),)
        return arrs[0]

    def commit(self) -> None:
        """Copy the written keys' rows of this step from the scratch into the chunk's rows [offset, offset
        + rows) (the chunk's arrays of a key made at its first commit there)."""
        plan = self._plan()
        _copy_rows()(plan[3], plan[4], plan[5], self.rows, self.offset)

    def commit_covers(self, keys: list, stop: int) -> bool:
        """`commit`, then `covers(keys, stop)`: what end_step asks every step. The answer for the plan's keys
        (the same set of written keys every step of a batch) is kept on the plan with the `keys` list it was
        checked against (the store's expected keys, the same list object while they do not change), so a
        step checks one identity and its row count instead of every key (~2 us a step in the engine)."""
        plan = self._plan()
        _copy_rows()(plan[3], plan[4], plan[5], self.rows, self.offset)
        if self.rows < stop:
            return False
        held = plan[6]
        if held[0] is not keys:
            held[0], held[1] = keys, self.covers(keys, stop)
        return held[1]

    def _plan(self) -> tuple:
        """This step's copy plan (see _plans), made again when the chunk, the scratch or the written keys changed."""
        chunk, scratch, written = self.chunk, self._scratch, self.written
        plan = self._plans.get(self.rows)
        if plan is None or plan[0] is not chunk or plan[1] is not scratch or plan[2] != written:
            if len(self._plans) >= SCRATCH_SIZES:
                self._plans.clear()
            plan = self._plans[self.rows] = self._make_plan(chunk, scratch, written)
        return plan

    @staticmethod
    def _make_plan(chunk, scratch, written) -> tuple:
        arrays = chunk.arrays
        src, dst, row = [], [], []
        for k in written:
            s = scratch[k]
            d = arrays.get(k)
            if d is None:
                n = chunk.capacity
                d = arrays[k] = tuple(np.empty((n, *a.shape[1:]), dtype=a.dtype) for a in s)
            for a, b in zip(s, d):
                if a.shape[1:] != b.shape[1:] or a.dtype != b.dtype or not (a.flags.c_contiguous and b.flags.c_contiguous):
                    raise ValueError(f"trace_fp4: the host arena's rows of {k} changed shape: {a.shape} {a.dtype} "
                                     f"against the chunk's {b.shape} {b.dtype}")
                src.append(a.ctypes.data)
                dst.append(b.ctypes.data)
                row.append(a.itemsize * (a.size // a.shape[0]) if a.shape[0] else 0)
        # the last entry: [keys list, whether the written keys are exactly those keys] (commit_covers)
        return (chunk, scratch, set(written), np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64),
                np.array(row, dtype=np.int64), [None, False])

    def covers(self, keys: list, stop: int) -> bool:
        """Whether this step wrote every key of `keys` into the arena and nothing else, with at least
        `stop` rows (what end_step's arena step needs)."""
        w = self.written
        return len(w) == len(keys) and self.rows >= stop and all(k in w for k in keys)

    def step(self, keys: list, start: int, stop: int, site_bytes: int, route_bytes: int) -> "ArenaStep":
        return ArenaStep(self.chunk, self.offset + start, stop - start, keys, site_bytes, route_bytes)

    def views(self) -> dict:
        """{key: this step's rows as tensors} of every key written (NVFP4Tensor views, int16 ids):
        what the host-rows path keeps, for a step that does not take the arena step (end_step's general path)."""
        chunk, o = self.chunk, self.offset
        return {k: _view(k, chunk.arrays[k], o, o + self.rows) for k in self.written}

    def held_bytes(self) -> int:
        """Host bytes of the arrays the arena holds itself, outside the capture budget (which counts the steps'
        rows): the current chunk (every row, used or not), the pool's freed chunks, each kept row count's
        scratch. np.empty pages cost memory once written, so this is an upper bound of what is resident."""
        seen, total = set(), 0
        groups = [] if self.chunk is None else [self.chunk.arrays]
        groups += [arrays for _, arrays in self._pool]
        groups += list(self._scratch_held.values())
        for arrays in groups:
            for arrs in arrays.values():  # scratch's tagged entries name the same arrays again: counted once
                for a in arrs if isinstance(arrs, tuple) else ():
                    if isinstance(a, np.ndarray) and id(a) not in seen:
                        seen.add(id(a))
                        total += a.nbytes
        return total

    def row_bytes(self, keys: list) -> tuple[int, int]:
        """(bytes of one row of every site key, of every routing key) of `keys`: StepRows.row_bytes of the
        step's rows (codes + scales + 4 x amax per row; 2 x top_k per routing row)."""
        arrays = self.chunk.arrays
        n = self.chunk.capacity
        site = route = 0
        for k in keys:
            b = sum(a.itemsize * (a.size // n) for a in arrays[k])
            if k[0] == ROUTING:
                route += b
            else:
                site += b
        return site, route


def _copy_rows():
    """cpu_native.row_copy's kernel, imported at the first commit (numba's import: not on other paths)."""
    global _COPY
    if _COPY is None:
        from ..cpu_native.row_copy import copy_rows_kernel

        _COPY = copy_rows_kernel
    return _COPY


_COPY = None


def _view(key, arrs, a: int, b: int):
    if key[0] == ROUTING:
        return torch.from_numpy(arrs[0][a:b])
    return NVFP4Tensor(torch.from_numpy(arrs[0][a:b]), torch.from_numpy(arrs[1][a:b]), torch.from_numpy(arrs[2][a:b]))


class ArenaStep:
    """One forward step's rows [offset, offset + rows) of every key of `chunk`, in `keys`' order (the
    store's expected keys: routing keys (ROUTING, layer), site keys (layer, site)): what a StepCapture is,
    with its `sites` / `routing` dicts made as views only when something reads them."""

    __slots__ = ("chunk", "offset", "rows", "keys", "site_bytes", "route_bytes", "_sites", "_routing")

    def __init__(self, chunk: ArenaChunk, offset: int, rows: int, keys: list, site_bytes: int, route_bytes: int):
        self.chunk, self.offset, self.rows, self.keys = chunk, offset, rows, keys
        self.site_bytes, self.route_bytes = site_bytes, route_bytes
        self._sites = self._routing = None

    def _make(self) -> None:
        a, b = self.offset, self.offset + self.rows
        arrays = self.chunk.arrays
        sites, routing = {}, {}
        for k in self.keys:
            if k[0] == ROUTING:
                routing[k[1]] = _view(k, arrays[k], a, b)
            else:
                sites[k] = _view(k, arrays[k], a, b)
        self._sites, self._routing = sites, routing

    @property
    def sites(self) -> dict:
        if self._sites is None:
            self._make()
        return self._sites

    @property
    def routing(self) -> dict:
        if self._routing is None:
            self._make()
        return self._routing


def arena_rows(chunks: list):
    """(keys, [chunk], row_chunk, row_index): where every request's rows lie, in request order (`chunks`:
    each request's StepChunks whose every step is an ArenaStep with the same keys): token t of all requests
    back to back is row row_index[t] of the arrays of chunk row_chunk[t]. None where this does not apply
    (another step, other keys, a range outside its step's rows: the general gather or the per-request join
    then runs, and names what is wrong). The rows of `gather_step_chunks` (each request's ranges of each
    step, in order). The engine's take reads the site rows and the packed layers' routing ids from there
    (cpu_native.take_encode, cpu_native.take_routing), not from a gathered copy.

    The requests of a take share their steps (a decode run's steps are the same objects in every member's
    list: 16 requests x 64 steps name 64 steps): each check and attribute read runs once per distinct
    step, and the (request, step) pairs index those by one C-level map (no Python loop per pair)."""
    if any(len(c.ranges) != len(c.steps) for c in chunks):  # a range per step (read flat below)
        return None
    steps = list(chain.from_iterable([c.steps for c in chunks]))
    # every step an ArenaStep (checked first: another step type may not hash by identity)
    if not steps or set(map(type, steps)) != {ArenaStep}:
        return None
    distinct = list(dict.fromkeys(steps))  # first-appearance order (so the chunks' order is as before)
    keys = distinct[0].keys
    if any(st.keys is not keys and st.keys != keys for st in distinct):
        return None
    at = {st: i for i, st in enumerate(distinct)}
    which = np.fromiter(map(at.__getitem__, steps), dtype=np.int64, count=len(steps))
    spans = np.fromiter(chain.from_iterable(chain.from_iterable([c.ranges for c in chunks])), dtype=np.int64,
                        count=2 * len(steps)).reshape(-1, 2)
    lo, hi = spans[:, 0], spans[:, 1]
    lengths = hi - lo
    n_rows = np.fromiter([st.rows for st in distinct], dtype=np.int64, count=len(distinct))[which]
    if (lengths < 0).any() or (lo < 0).any() or (hi > n_rows).any():
        return None
    offsets = np.fromiter([st.offset for st in distinct], dtype=np.int64, count=len(distinct))[which]
    total = int(lengths.sum())
    # each (request, step) range is a run of consecutive rows of its chunk from its step's offset + lo
    begins = np.cumsum(lengths) - lengths
    src = np.repeat(offsets + lo - begins, lengths) + np.arange(total, dtype=np.int64)
    chunk_of = {}
    for st in distinct:
        chunk_of.setdefault(id(st.chunk), st.chunk)
    if len(chunk_of) == 1:
        cid = np.zeros(total, dtype=np.int64)
    else:
        order = list(chunk_of)
        cid = np.repeat(np.fromiter((order.index(id(st.chunk)) for st in distinct), dtype=np.int64,
                                    count=len(distinct))[which], lengths)
    return keys, list(chunk_of.values()), cid, src


def gather_rows(rows, keys) -> dict:
    """{key: tuple of tensors} of `keys`' rows at `rows` (`arena_rows`' answer) back to back: one numpy
    index per key and chunk."""
    _, chunks, cid, src = rows
    if len(chunks) == 1:
        parts = [(chunks[0], None, src)]
    else:
        parts = []
        for j, ch in enumerate(chunks):
            dst = np.flatnonzero(cid == j)
            parts.append((ch, dst, src[dst]))
    got = {}
    for k in keys:
        first = parts[0][0].arrays[k]
        if len(parts) == 1:
            got[k] = tuple(torch.from_numpy(a[src]) for a in first)
        else:
            out = [np.empty((len(src), *a.shape[1:]), dtype=a.dtype) for a in first]
            for ch, dst, s in parts:
                for o, a in zip(out, ch.arrays[k]):
                    o[dst] = a[s]
            got[k] = tuple(map(torch.from_numpy, out))
    return got


def gather_arena_chunks(chunks: list):
    """({layer: ids}, {(layer, site): rows}) of every request's rows back to back, in request order
    (`chunks`: each request's StepChunks whose every step is an ArenaStep with the same keys), or None
    where `arena_rows` does not apply. The rows are those of `gather_step_chunks` (each request's ranges
    of each step, in order), read by one numpy index per key and chunk instead of a torch.cat of every
    step and an index_select."""
    rows = arena_rows(chunks)
    if rows is None:
        return None
    routing, sites = {}, {}
    for k, got in gather_rows(rows, rows[0]).items():
        if k[0] == ROUTING:
            routing[k[1]] = got[0]
        else:
            sites[k] = NVFP4Tensor(*got)
    return routing, sites

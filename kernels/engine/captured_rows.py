"""One request's captured rows, appended chunk by chunk, and the row helpers the capture needs.

A chunk is what one forward step computed for the request: (num_rows, {(layer, site): NVFP4Tensor
rows}, {layer: routed expert ids [n, top_k] int16}). Site tensors carry a per-row amax (a scalar amax
is expanded), so rows can be cut and joined freely.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..tensor import NVFP4Tensor
from .host_arena import ArenaStep


def site_nbytes(q: NVFP4Tensor) -> int:
    return q.codes.numel() + q.scales.numel() + 4 * q.global_amax.numel()


def chunk_nbytes(sites, routing) -> int:
    if isinstance(sites, StepRows) and isinstance(routing, StepRows):
        return sites.nbytes + routing.nbytes
    return sum(site_nbytes(q) for q in sites.values()) + sum(t.numel() * t.element_size() for t in routing.values())


def _nrows(v) -> int:
    return (v.codes if isinstance(v, NVFP4Tensor) else v).shape[0]


class StepRows(Mapping):
    """One request's rows [start, stop) of every key of one forward step's host copy (NVFP4Tensor
    rows with one amax per row, or routing ids), sliced when read.

    Why: a step is one row per running request; splitting every key's three tensors into per-request
    views at every step costs a few milliseconds of Python per step (16 keys x 3 tensors x requests
    views), a tenth of a decode step on a CPU. The chunk instead names the step's rows; a record joins
    a request's chunks with one concatenation and one index per key (`join_chunks`), and everything
    else reads it as the {key: rows} dict it stands for (the views keep the step's storage alive, as
    the split views did)."""

    __slots__ = ("step", "start", "stop", "nbytes")

    def __init__(self, step: dict, start: int, stop: int, row_bytes: int):
        self.step, self.start, self.stop = step, start, stop
        self.nbytes = row_bytes * (stop - start)

    @staticmethod
    def row_bytes(step: dict) -> int:
        """Bytes of one row of every key of `step` (what a chunk of n rows counts: n times this)."""
        total = 0
        for v in step.values():
            n = _nrows(v)
            if n:
                total += (site_nbytes(v) if isinstance(v, NVFP4Tensor) else v.numel() * v.element_size()) // n
        return total

    def __getitem__(self, key):
        return self.step[key][self.start : self.stop]

    def __iter__(self):
        return iter(self.step)

    def __len__(self) -> int:
        return len(self.step)


def _cat(src: list):
    """The rows of `src` (NVFP4Tensors with one float32 amax per row, or plain tensors) concatenated:
    (tensors, rows per source), or None where they do not join (shapes or dtypes differ, an amax that
    is not per row)."""
    try:
        if all(isinstance(v, NVFP4Tensor) for v in src):
            amax = [v.global_amax for v in src]
            codes = [v.codes for v in src]
            c, s, a = torch.cat(codes), torch.cat([v.scales for v in src]), torch.cat(amax)
            rows = [x.shape[0] for x in codes]
            if (c.dim() < 2 or s.shape[:-1] != c.shape[:-1] or a.shape != c.shape[:-1] or a.dtype != torch.float32
                    or [x.shape[0] for x in amax] != rows):
                return None
            return (c, s, a), rows
        if not any(isinstance(v, NVFP4Tensor) for v in src):
            return (torch.cat(src),), [x.shape[0] for x in src]
    except (RuntimeError, IndexError):
        pass
    return None


def _index(ranges, rows) -> torch.Tensor | None:
    """int64 row positions of `ranges` [(start, stop or None for all)] in the concatenation of sources of
    `rows` rows each; None when that is every row in order (nothing to select)."""
    idx, base = [], 0
    for (a, b), n in zip(ranges, rows):
        idx.extend(range(base + a, base + (n if b is None else b)))
        base += n
    return None if len(idx) == base else torch.tensor(idx, dtype=torch.int64)


def _positions(requests: list, rows: tuple) -> torch.Tensor:
    """int64 positions, in the concatenation of steps of `rows` rows each, of every request's row ranges
    (per step (start, stop)) in request order."""
    # numpy instead of a Python list of every position (~1,000 a take): each (request, step) range is a
    # run of consecutive positions, laid out request by request, steps in order.
    n = np.asarray(rows, dtype=np.int64)
    a = np.array([[r[0] for r in ranges] for ranges in requests], dtype=np.int64)  # [request, step]
    b = np.array([[n[s] if r[1] is None else r[1] for s, r in enumerate(ranges)] for ranges in requests],
                 dtype=np.int64)
    first = (np.cumsum(n) - n)[None, :] + a  # each range's first position
    lengths = np.maximum(b - a, 0).reshape(-1)  # a range that ends before it starts is empty (as range())
    starts = first.reshape(-1)
    # position j of the output = starts[run] + (j - where that run begins in the output)
    begins = np.cumsum(lengths) - lengths
    out = np.repeat(starts - begins, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)
    return torch.from_numpy(out)


def _take(joined: tuple, index):
    out = joined if index is None else tuple(t.index_select(0, index) for t in joined)
    return NVFP4Tensor(*out) if len(out) == 3 else out[0]


def _layout(maps: list):
    """(steps, row ranges) of chunk mappings: a StepRows' step and (start, stop); a plain {key: rows}
    chunk (a truncated or prefix-served one) is a step of its own, all its rows: (0, None)."""
    steps = [m.step if type(m) is StepRows else m for m in maps]
    return steps, [(m.start, m.stop) if type(m) is StepRows else (0, None) for m in maps]


def _rows_of(steps: list, ranges: list) -> tuple[int, int]:
    """(the request's rows, all rows of its steps)."""
    first = next(iter(steps[0]), None)
    step_rows = [_nrows(st[first]) if first in st else 0 for st in steps] if first is not None else [0] * len(steps)
    return sum((n if b is None else b) - a for (a, b), n in zip(ranges, step_rows)), sum(step_rows)


def _own_rows(steps: list, ranges: list) -> int:
    """`_rows_of(steps, ranges)[0]` without reading the steps' row counts when no range needs them (a
    request's StepRows chunks: every range has its stop)."""
    if all(b is not None for _, b in ranges):
        return sum(b - a for a, b in ranges)
    return _rows_of(steps, ranges)[0]


class ChunkJoiner:
    """Joins requests' chunks into one tensor per key (`join`). Requests that ran in the same forward
    steps (a batch taken together) share the concatenation of each key's step rows: it is made once,
    kept while this joiner lives (hold one for one take, not longer), and each request takes its rows
    out with one index per key.

    Memory: the whole steps' rows are joined only once the requests seen with those steps hold at least
    half of them (so the joiner never holds more than twice the rows it has handed out); until then,
    and for a request whose steps no other shares (continuous batching), only its own rows are joined.
    Requests announced with `expect` are then gathered per key in one index (a request is a slice of
    it): that gathered copy holds the announced requests' rows, what the take hands out anyway."""

    def __init__(self):
        self._steps: dict = {}  # ids of the steps -> (the steps, kept so the ids stay theirs; {key: joined})
        self._seen: dict = {}  # ids of the steps -> rows handed out from them so far, or announced
        self._expected: set = set()  # ids of steps that `expect` announced
        self._announced: dict = {}  # ids of the steps -> the row ranges of each request announced on them
        self._batched: dict = {}  # (ids of the steps, rows per step) -> (index of every announced request, offsets)

    def expect(self, maps) -> None:
        """Announce a request this joiner will join (its chunk mappings): a take that announces all its
        requests first lets the first of those sharing steps join them whole already."""
        self.expect_layout(*_layout(list(maps)))

    def expect_chunks(self, chunks) -> None:
        """`expect` of a request's record chunks (routing and sites): a StepChunks by its layout."""
        if isinstance(chunks, StepChunks) and chunks.in_arena():
            # The take reads a host arena's steps by gather_arena_chunks; announcing them would make every
            # step's {key: rows} views. Where that gather does not apply, the joins still give the same rows.
            return
        if isinstance(chunks, StepChunks):  # its rows known: not summed from its ranges twice
            self.expect_layout(chunks.sites, chunks.ranges, chunks.rows())
            self.expect_layout(chunks.routing, chunks.ranges, chunks.rows())
        else:
            self.expect(m for _, m in chunks)
            self.expect(r for r, _ in chunks)

    def expect_layout(self, steps: list, ranges: list, rows: int | None = None) -> None:
        """`expect` of a request by its layout (`_layout`: the steps' rows, its (start, stop) of each);
        `rows`: its rows when the caller knows them (`_own_rows(steps, ranges)`)."""
        if steps:
            sig = tuple(map(id, steps))
            self._seen[sig] = self._seen.get(sig, 0) + (_own_rows(steps, ranges) if rows is None else rows)
            self._expected.add(sig)
            self._announced.setdefault(sig, []).append(tuple(ranges))

    def join(self, maps) -> dict:
        """{key: the rows of every chunk mapping in `maps` (StepRows or {key: rows}), in order, joined};
        a key whose rows do not join maps to the list of its parts as they are (the builder names what
        is wrong with them)."""
        maps = list(maps)
        if len(maps) == 1 and type(maps[0]) is not StepRows:  # one chunk of whole rows (SGLang, rank parts)
            return dict(maps[0])
        steps, ranges = _layout(maps)
        if steps and all(len(st) == len(steps[0]) for st in steps):
            try:  # every step with the first one's keys (as many, and each found: a KeyError otherwise)
                return self._join_steps(maps, steps, ranges)
            except KeyError:
                pass
        per_key: dict = {}
        for m in maps:
            if isinstance(m, StepRows):
                a, b = m.start, m.stop
                for k, v in m.step.items():
                    per_key.setdefault(k, []).append((v, a, b))
            else:
                for k, v in m.items():
                    per_key.setdefault(k, []).append((v, 0, None))
        out = {}
        for k, parts in per_key.items():
            if len(parts) == 1 and parts[0][2] is None:
                out[k] = parts[0][0]
                continue
            cat = _cat([v for v, _, _ in parts])
            if cat is None:
                out[k] = [v if b is None else v[a:b] for v, a, b in parts]
            else:
                out[k] = _take(cat[0], _index([(a, b) for _, a, b in parts], cat[1]))
        return out

    def _join_steps(self, maps: list, steps: list, ranges: list) -> dict:
        sig = tuple(map(id, steps))
        entry = self._steps.get(sig)
        if entry is None:
            own, total = _rows_of(steps, ranges)
            seen = self._seen.get(sig, 0) if sig in self._expected else self._seen.get(sig, 0) + own
            self._seen[sig] = seen
            if 2 * seen < total:  # not shared enough (yet): this request's rows alone
                return self._join_own(maps, steps, ranges)
            entry = self._steps[sig] = (steps, {})
        cache = entry[1]
        index, rows, place = None, None, None
        mine = tuple(ranges)
        out = {}
        for k in steps[0]:
            cat = cache.get(k, False)
            if cat is False:
                cat = cache[k] = _cat([st[k] for st in steps])
            if cat is None:
                out[k] = [m[k] for m in maps]
                continue
            if cat[1] != rows:
                rows = cat[1]
                place = self._batch(sig, rows, mine)
                index = None if place is not None else _index(ranges, rows)
            if place is None:
                out[k] = _take(cat[0], index)
                continue
            # Every announced request's rows of this key gathered by one index_select (not one per
            # request): the requests of a take are each a slice of it, the same rows in the same order.
            gathered = cache.get((k, "batched"))
            if gathered is None:
                gathered = cache[(k, "batched")] = tuple(t.index_select(0, place[0]) for t in cat[0])
            a, b = place[1]
            out[k] = NVFP4Tensor(*(t[a:b] for t in gathered)) if len(gathered) == 3 else gathered[0][a:b]
        return out

    def _batch(self, sig, rows: list, mine: tuple):
        """(the index of every announced request's rows of steps `sig` with `rows` rows per step, in
        announcement order; this request's (start, stop) in it), or None when this request was not
        announced on those steps (it is indexed on its own)."""
        key = (sig, tuple(rows))
        batch = self._batched.get(key)
        if batch is None:
            announced = self._announced.get(sig, [])
            idx, offsets = [], {}
            for r in announced:
                i = _index(list(r), rows)
                if i is None or r in offsets:  # every row in order, or a request announced twice: not batched
                    return None
                offsets[r] = (len(idx), len(idx) + i.numel())
                idx.extend(i.tolist())
            batch = self._batched[key] = (torch.tensor(idx, dtype=torch.int64), offsets)
        off = batch[1].get(mine)
        return None if off is None else (batch[0], off)


    def gather(self, requests: list) -> dict | None:
        """{key: rows of every request in `requests` (each a list of chunk mappings) back to back} when
        they are all StepRows of the same steps, announced with `expect` in this order and nothing else
        (a take of requests that ran together), else None. One concatenation and one index per key for
        all of them, and no per-request slices: a take that builds its records together (take.py) reads
        each request's rows by offsets. Keys whose rows do not join make it None too."""
        if not requests or any(type(m) is not StepRows for maps in requests for m in maps):
            return None
        return self.gather_layouts([_layout(maps) for maps in requests])

    def gather_layouts(self, layouts: list) -> dict | None:
        """`gather` of requests by their layouts [(the steps' rows, the request's (start, stop) of each)]
        (a StepChunks' `routing` or `sites`, and `ranges`)."""
        if not layouts:
            return None
        steps = layouts[0][0]
        sig = tuple(map(id, steps))
        if not steps or any(tuple(map(id, st)) != sig for st, _ in layouts):
            return None
        if self._announced.get(sig) != [tuple(r) for _, r in layouts]:
            return None
        entry = self._steps.setdefault(sig, (steps, {}))
        cache = entry[1]
        out, index = {}, {}
        for k in steps[0]:
            cat = cache.get(k, False)
            if cat is False:
                try:
                    cat = cache[k] = _cat([st[k] for st in steps])
                except KeyError:  # a step without this key
                    return None
            if cat is None:
                return None
            rows = tuple(cat[1])
            if rows not in index:
                index[rows] = _positions([r for _, r in layouts], rows)
            out[k] = _take(cat[0], index[rows])
        return out

    @staticmethod
    def _join_own(maps: list, steps: list, ranges: list) -> dict:
        out = {}
        for k in steps[0]:
            parts = [st[k] if b is None else st[k][a:b] for st, (a, b) in zip(steps, ranges)]
            cat = _cat(parts)
            out[k] = parts if cat is None else _take(cat[0], None)
        return out


def join_chunks(maps) -> dict:
    """`ChunkJoiner().join(maps)`: one request's chunks joined."""
    return ChunkJoiner().join(maps)


def _row_amax(q: NVFP4Tensor) -> torch.Tensor:
    amax = q.global_amax
    return amax.reshape(1).expand(q.codes.shape[:-1]) if amax.numel() == 1 else amax


def copy_rows(q: NVFP4Tensor, start: int, stop: int) -> NVFP4Tensor:
    """Rows [start, stop), copied so the batch's storage can be freed."""
    amax = _row_amax(q)
    return NVFP4Tensor(q.codes[start:stop].clone(), q.scales[start:stop].clone(), amax[start:stop].clone())


def to_host(q: NVFP4Tensor) -> NVFP4Tensor:
    # One device-to-host copy per site and step (seam: pinned buffers + a side stream on GPU).
    return NVFP4Tensor(q.codes.to("cpu"), q.scales.to("cpu"), q.global_amax.to("cpu"))


def concat_chunks(chunks, rows: int) -> tuple[dict, dict]:
    """The first `rows` rows of a capture's chunks as one (sites, routing) pair (copies)."""
    sites: dict = {}
    routing: dict = {}
    for _, s, r in chunks:
        for k, q in s.items():
            sites.setdefault(k, []).append(q)
        for k, t in r.items():
            routing.setdefault(k, []).append(t)
    cat = {}
    for k, parts in sites.items():
        amax = [_row_amax(p) for p in parts]
        cat[k] = NVFP4Tensor(torch.cat([p.codes for p in parts])[:rows].clone(),
                             torch.cat([p.scales for p in parts])[:rows].clone(), torch.cat(amax)[:rows].clone())
    return cat, {k: torch.cat(parts)[:rows].clone() for k, parts in routing.items()}


class StepCapture:
    """One forward step's host rows of every key, shared by the requests of the step: what a request's
    step is recorded as (`RequestCapture.append_step`), a reference and its row range, no object of
    its own."""

    __slots__ = ("sites", "routing", "site_bytes", "route_bytes")

    def __init__(self, sites: dict, routing: dict, site_bytes: int, route_bytes: int):
        self.sites, self.routing = sites, routing
        self.site_bytes, self.route_bytes = site_bytes, route_bytes  # bytes of one row of every key


class StepChunks(Sequence):
    """`RequestCapture.record_chunks()` of a capture whose every chunk is an appended step: the
    (routing, sites) StepRows pairs, made only if something reads them as a sequence. The take and its
    ChunkJoiner read the layout instead (`routing`, `sites`: each step's shared rows; `ranges`: the
    request's (start, stop) of each step), the same layout `_layout` makes of the StepRows pairs."""

    __slots__ = ("steps", "ranges", "_routing", "_sites", "_rows", "_pairs")

    def __init__(self, steps: list, ranges: list, rows: int):
        self.steps, self.ranges, self._rows = steps, ranges, rows
        # Made when read: a host arena's steps (host_arena.ArenaStep) make their {key: rows} views only
        # then, and the take gathers them from the arena without (gather_arena_chunks).
        self._routing = self._sites = None
        self._pairs = None

    @property
    def routing(self) -> list:
        if self._routing is None:
            self._routing = [st.routing for st in self.steps]
        return self._routing

    @property
    def sites(self) -> list:
        if self._sites is None:
            self._sites = [st.sites for st in self.steps]
        return self._sites

    def in_arena(self) -> bool:
        """Whether every step is a host arena's (read by gather_arena_chunks, no per-step dicts)."""
        return all(type(st) is ArenaStep for st in self.steps)

    def rows(self) -> int:
        """The request's rows: the sum of its ranges' lengths."""
        return self._rows

    def _made(self) -> list:
        if self._pairs is None:
            self._pairs = [(StepRows(st.routing, a, b, st.route_bytes), StepRows(st.sites, a, b, st.site_bytes))
                           for st, (a, b) in zip(self.steps, self.ranges)]
        return self._pairs

    def __getitem__(self, i):
        return self._made()[i]

    def __len__(self) -> int:
        return len(self.steps)

    def __iter__(self):
        return iter(self._made())


@dataclass
class RequestCapture:
    # (num_rows, sites, routing) chunks made so far; `chunks` adds the steps appended since (below)
    _chunks: list[tuple[int, dict, dict]] = field(default_factory=list)
    _num_rows: int = 0  # `num_rows` / `nbytes` without the steps of a run not counted yet (see _settle)
    _nbytes: int = 0
    error: str | None = None  # set when the capture cannot be a complete record
    weights: tuple = (None, None)  # (weights version, expert-weights digest) at the first captured rows
    # A weight update while the request ran (its rows from then on made by the new weights): the first
    # row and weights of each later version, in row order. The record says which version made which rows.
    weight_changes: list = field(default_factory=list)
    prompt_registered: bool = False  # its prompt rows are in the prefix-rows cache
    prompt_ids: list | None = None  # its prompt token ids (when serving prefix-cache hits)
    # Steps appended since the last chunk was made, after `_chunks` in token order: each step's shared
    # StepCapture and the request's rows of it, [_spans[2j], _spans[2j + 1]). Why not a StepRows pair
    # per step: that was ~3,000 objects a 16 x 64-token generate, made in the capture's per-step loop and
    # then scanned by Python's garbage collector for as long as the request lived; a list entry and two
    # ints are no objects to collect. The chunks are made from them only when read (`chunks`).
    _steps: list = field(default_factory=list)
    _spans: list = field(default_factory=list)
    # The capture store's run this request is in (step_run.StepRun: steps the same requests ran with the
    # same rows, appended once for all of them), the request's rows [lo, hi) of each of its steps, and
    # the first of its steps not yet in `_steps` / the counters: (run, lo, hi, k), or None.
    _run: tuple | None = None

    def _settle(self) -> None:
        """Bring `_steps`, `_spans` and the counters up to date with the run's steps appended since the
        last call: what one `append_step` per step gave (the same list entries, the same integers)."""
        run, lo, hi, k = self._run
        n = len(run.steps)
        if n > k:
            self._steps += run.steps[k:]
            self._spans += (lo, hi) * (n - k)
            self._num_rows += (hi - lo) * (n - k)
            self._nbytes += (hi - lo) * (run.row_bytes[n] - run.row_bytes[k])
            self._run = (run, lo, hi, n)

    def join_run(self, run, lo: int, hi: int, first: int) -> None:
        """The request's rows [lo, hi) of `run.steps[first:]` (`StepRun`) and of every step appended to the
        run later are its next rows, counted when read (the capture store's run of an unchanged batch)."""
        if self._run is not None:
            self._settle()
        self._run = (run, lo, hi, first)

    def leave_run(self) -> None:
        """No later step of its run is the request's (what it has of the run so far stays)."""
        if self._run is not None:
            self._settle()
            self._run = None

    @property
    def num_rows(self) -> int:
        if self._run is not None:
            self._settle()
        return self._num_rows

    @num_rows.setter
    def num_rows(self, value: int) -> None:
        if self._run is not None:
            self._settle()
        self._num_rows = value

    @property
    def nbytes(self) -> int:
        if self._run is not None:
            self._settle()
        return self._nbytes

    @nbytes.setter
    def nbytes(self, value: int) -> None:
        if self._run is not None:
            self._settle()
        self._nbytes = value

    @property
    def chunks(self) -> list[tuple[int, dict, dict]]:
        """Every chunk in token order: (num_rows, sites, routing), a step's as a StepRows pair."""
        if self._run is not None:
            self._settle()
        if self._steps:
            spans, chunks = self._spans, self._chunks
            for j, st in enumerate(self._steps):
                lo, hi = spans[2 * j], spans[2 * j + 1]
                chunks.append((hi - lo, StepRows(st.sites, lo, hi, st.site_bytes), StepRows(st.routing, lo, hi, st.route_bytes)))
            self._steps, self._spans = [], []
        return self._chunks

    def append(self, num_rows: int, sites: dict, routing: dict) -> None:
        self.chunks.append((num_rows, sites, routing))
        self.num_rows += num_rows
        self.nbytes += chunk_nbytes(sites, routing)

    def append_step(self, step: StepCapture, lo: int, hi: int) -> None:
        """The request's rows [lo, hi) of `step` (the capture store's per-request, per-step call: a
        reference and two ints, their bytes counted from the step's row sizes)."""
        if self._run is not None:  # the run's steps first (token order); later steps of the run are not its
            self.leave_run()
        self._steps.append(step)
        self._spans += (lo, hi)
        self._num_rows += hi - lo
        self._nbytes += (step.site_bytes + step.route_bytes) * (hi - lo)

    def weights_at(self, row: int, weights: tuple) -> None:
        """Rows from `row` on are made by `weights` (a weight update since the request started)."""
        latest = self.weight_changes[-1][1] if self.weight_changes else self.weights
        if weights != latest:
            self.weight_changes.append((row, weights))

    def newest_weights(self) -> tuple:
        return self.weight_changes[-1][1] if self.weight_changes else self.weights

    def version_ranges(self) -> tuple | None:
        """((first row, weights version), ...) when more than one version made the rows, else None."""
        if not self.weight_changes:
            return None
        ranges = [(0, self.weights[0])] + [(row, w[0]) for row, w in self.weight_changes]
        merged = [r for i, r in enumerate(ranges) if i == 0 or r[1] != ranges[i - 1][1]]
        return tuple(merged) if len(merged) > 1 else None

    def truncate(self, rows: int) -> None:
        """Keep the first `rows` rows (a preempted request is recomputed from `rows` on)."""
        self.leave_run()  # its later rows are recomputed: no step of its run is its any more
        self.weight_changes = [(r, w) for r, w in self.weight_changes if r < rows]
        while self.num_rows > rows:
            n, sites, routing = self.chunks[-1]
            keep = n - (self.num_rows - rows)
            if keep <= 0:
                self.chunks.pop()
                self.num_rows -= n
                self.nbytes -= chunk_nbytes(sites, routing)
                continue
            sites = {k: copy_rows(q, 0, keep) for k, q in sites.items()}
            routing = {k: t[:keep].clone() for k, t in routing.items()}
            self.chunks[-1] = (keep, sites, routing)
            self.num_rows = rows
            self.nbytes = sum(chunk_nbytes(s, r) for _, s, r in self.chunks)

    def record_chunks(self):
        """The chunks as `assemble_record` takes them: (routing, sites) in token order; a StepChunks when
        every chunk is an appended step not read as chunks yet (the take's common case: its layout read
        without a StepRows pair per step)."""
        if self._run is not None:
            self._settle()
        if self._steps and not self._chunks:
            sp = self._spans
            starts, stops = sp[::2], sp[1::2]
            return StepChunks(list(self._steps), list(zip(starts, stops)), sum(stops) - sum(starts))
        return [(routing, sites) for _, sites, routing in self.chunks]

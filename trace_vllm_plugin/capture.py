"""Worker-side capture store: which captured rows belong to which request, and for how long.

The quantized layers call `STORE.put(...)` during a forward pass with rows of the whole flattened
batch. The model-runner hook (patches/vllm_v1_runner.py) opens a step with the batch layout (request ids in batch
order, `query_start_loc`, each request's first position) before the forward and closes it after; the
close splits every captured tensor by request and appends the rows to that request's capture.

Lifecycle of one request's capture:
  live    rows are appended step by step (prefill chunks, then one row per decode step)
  done    the runner removed the finished request; waits to be taken (an aborted one is dropped)
  taken   `take()` encodes it into a GuidanceRecord and frees it

Memory is bounded by `TRACE_FP4_CAPTURE_MAX_BYTES` (default 2 GiB): when over budget, the oldest
`done` captures are dropped first, then the largest `live` one; every drop is counted and a later
`take()` of a dropped request raises with the reason. Nothing is dropped silently.

Forward passes without an open step (vLLM's profiling / warm-up dummy runs) quantize as usual and are
counted (`unattributed_forwards`); their rows belong to no request.
"""

import os
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import torch

from trace_kernels import NVFP4Tensor, SaturationCounter

DEFAULT_MAX_BYTES = 2 << 30


def _nbytes(q: NVFP4Tensor) -> int:
    return q.codes.numel() + q.scales.numel() + 4 * q.global_amax.numel()


def _rows(q: NVFP4Tensor, start: int, stop: int) -> NVFP4Tensor:
    """Rows [start, stop) of a per-row-amax tensor, copied so the batch's storage can be freed."""
    amax = q.global_amax
    amax = amax.reshape(1).expand(q.codes.shape[:-1]) if amax.numel() == 1 else amax
    return NVFP4Tensor(
        q.codes[start:stop].clone(), q.scales[start:stop].clone(), amax[start:stop].clone()
    )


@dataclass
class StepLayout:
    """Which rows of the flattened batch belong to which request (batch order)."""

    req_ids: list[str]
    query_start_loc: list[int]  # len(req_ids) + 1
    start_positions: list[int]  # first position (num computed tokens) of each request's rows


@dataclass
class RequestCapture:
    # One entry per appended chunk: {(layer, site): NVFP4Tensor rows} and {layer: ids rows}.
    chunks: list[tuple[int, dict, dict]] = field(default_factory=list)  # (num_rows, sites, routing)
    num_rows: int = 0
    nbytes: int = 0
    error: str | None = None  # set when the capture cannot be a complete record

    def truncate(self, rows: int) -> None:
        """Keep the first `rows` rows (a preempted request is recomputed from `rows` on)."""
        while self.num_rows > rows:
            n, sites, routing = self.chunks[-1]
            keep = n - (self.num_rows - rows)
            if keep <= 0:
                self.chunks.pop()
                self.num_rows -= n
                self.nbytes -= sum(_nbytes(q) for q in sites.values()) + sum(
                    t.numel() * t.element_size() for t in routing.values()
                )
                continue
            sites = {k: _rows(q, 0, keep) for k, q in sites.items()}
            routing = {k: t[:keep].clone() for k, t in routing.items()}
            self.chunks[-1] = (keep, sites, routing)
            self.num_rows = rows
            self.nbytes = sum(
                sum(_nbytes(q) for q in s.values()) + sum(t.numel() * t.element_size() for t in r.values())
                for _, s, r in self.chunks
            )


class CaptureStore:
    def __init__(self):
        self.lock = threading.Lock()
        self.max_bytes = int(os.environ.get("TRACE_FP4_CAPTURE_MAX_BYTES", DEFAULT_MAX_BYTES))
        self.shape = None  # trace_kernels.ModelShape, set by configure()
        self.owner = None
        self.config = None  # trace_kernels.TraceConfig
        self.capture_layers: set[int] = set()
        self.step: StepLayout | None = None
        self._step_sites: dict[tuple[int, str], NVFP4Tensor] = {}
        self._step_routing: dict[int, torch.Tensor] = {}
        self.live: dict[str, RequestCapture] = {}
        self.done: OrderedDict[str, RequestCapture] = OrderedDict()
        self.dropped: OrderedDict[str, str] = OrderedDict()  # req_id -> reason (kept for a while)
        self.taken: set[str] = set()  # taken before the runner saw them finish
        self.counters: Counter = Counter()
        self.saturation = SaturationCounter()  # values above a static amax, per "<layer>.<site>"

    # ---- setup (model build, in the worker) ------------------------------------------------------
    def configure(self, shape, config, owner=None) -> None:
        """Start over for a newly built model (one trace_fp4 engine per process at a time).

        `owner`: the engine's quantization config object; the runner hook captures only for the
        engine whose config owns the store (another engine in this process runs untouched)."""
        self.__init__()
        self.shape, self.config, self.owner = shape, config, owner
        self.capture_layers = {
            i for i, mode in enumerate(config.layer_modes(shape.num_layers)) if mode is not None
        }

    @property
    def capturing(self) -> bool:
        return self.config is not None and self.config.capture

    def wants(self, layer: int) -> bool:
        """Whether codes of `layer` are captured (routing ids are captured for every layer)."""
        return self.capturing and layer in self.capture_layers

    # ---- during a forward pass -------------------------------------------------------------------
    def count(self, key: str, n: int = 1) -> None:
        self.counters[key] += n

    def put(self, layer: int, site: str, q: NVFP4Tensor) -> None:
        if self.step is None:
            return
        self._step_sites[(layer, site)] = q

    def put_routing(self, layer: int, topk_ids: torch.Tensor) -> None:
        if self.step is None:
            self.counters["unattributed_layer_calls"] += 1
            return
        self._step_routing[layer] = topk_ids

    def begin_step(self, layout: StepLayout) -> None:
        self.step = layout
        self._step_sites.clear()
        self._step_routing.clear()

    def end_step(self) -> None:
        """Split the step's captures by request and append them (called after the forward)."""
        layout, self.step = self.step, None
        sites, routing = dict(self._step_sites), dict(self._step_routing)
        self._step_sites.clear()
        self._step_routing.clear()
        if layout is None or not self.capturing:
            return
        num_layers = self.shape.num_layers
        if len(routing) != num_layers:
            # Every layer is an MoE layer (checked at model build), so a missing one is a bug.
            raise RuntimeError(
                f"trace_fp4: the forward captured routing of {len(routing)} of {num_layers} layers"
            )
        qsl = layout.query_start_loc
        sizes = [qsl[i + 1] - qsl[i] for i in range(len(layout.req_ids))]
        # One split per tensor: each request's rows are views of the step's host copy (no per-request
        # copies on the hot path; `take` concatenates them into the record and releases the views).
        site_rows = {k: _split(_to_host(q), qsl[0], sizes) for k, q in sites.items()}
        route_rows = {k: t[qsl[0] : qsl[-1]].to("cpu", torch.int16).split(sizes) for k, t in routing.items()}
        with self.lock:
            for i, req_id in enumerate(layout.req_ids):
                a, b = qsl[i], qsl[i + 1]
                if b <= a or req_id in self.taken:
                    continue
                cap = self.live.get(req_id)
                if cap is None:
                    cap = self.live[req_id] = RequestCapture()
                    self.counters["requests_started"] += 1
                start = layout.start_positions[i]
                if cap.num_rows > start:
                    # Preempted and recomputed: the recomputed rows replace the old ones.
                    self.counters["recomputed_rows"] += cap.num_rows - start
                    cap.truncate(start)
                elif cap.num_rows < start and cap.error is None:
                    cap.error = (
                        f"rows {cap.num_rows}..{start - 1} were never computed by the model (a prefix "
                        "cache hit?); run with enable_prefix_caching=False to capture every token"
                    )
                    self.counters["incomplete_requests"] += 1
                chunk_sites = {k: v[i] for k, v in site_rows.items()}
                chunk_routing = {k: v[i] for k, v in route_rows.items()}
                nbytes = sum(_nbytes(q) for q in chunk_sites.values()) + sum(
                    t.numel() * t.element_size() for t in chunk_routing.values()
                )
                cap.chunks.append((b - a, chunk_sites, chunk_routing))
                cap.num_rows += b - a
                cap.nbytes += nbytes
                self.counters["captured_rows"] += b - a
            self._enforce_budget()

    # ---- request lifecycle -----------------------------------------------------------------------
    def finish(self, req_id: str, aborted: bool = False) -> None:
        """The runner removed the request: keep its capture to be taken, or drop it if aborted."""
        with self.lock:
            self.taken.discard(req_id)
            cap = self.live.pop(req_id, None)
            if cap is None:
                return
            if aborted:
                self.counters["aborted_records_dropped"] += 1
                self._drop(req_id, "the request was aborted")
                return
            self.done[req_id] = cap
            self.counters["requests_finished"] += 1

    def _drop(self, req_id: str, reason: str) -> None:
        self.dropped[req_id] = reason
        while len(self.dropped) > 4096:
            self.dropped.popitem(last=False)

    def _total_bytes(self) -> int:
        return sum(c.nbytes for c in self.live.values()) + sum(c.nbytes for c in self.done.values())

    def _enforce_budget(self) -> None:
        total = self._total_bytes()
        while total > self.max_bytes and self.done:
            req_id, cap = self.done.popitem(last=False)
            total -= cap.nbytes
            self.counters["evicted_done_records"] += 1
            self._drop(req_id, f"evicted: capture memory over TRACE_FP4_CAPTURE_MAX_BYTES={self.max_bytes}")
        while total > self.max_bytes and self.live:
            req_id = max(self.live, key=lambda r: self.live[r].nbytes)
            cap = self.live.pop(req_id)
            total -= cap.nbytes
            self.counters["evicted_live_records"] += 1
            self._drop(req_id, f"evicted while running: capture memory over {self.max_bytes} bytes")

    def take(self, req_id: str, num_rows: int | None = None) -> RequestCapture:
        """Remove and return a finished request's capture; raises KeyError with the reason if none.

        The caller vouches that the request finished (its RequestOutput says so): the runner only
        learns that at the next engine step, so the capture may still be `live` here. `num_rows`
        (prompt + generated - 1) trims rows of a step that async scheduling ran past the end.
        """
        with self.lock:
            if req_id in self.dropped:
                raise KeyError(f"request {req_id}: record dropped ({self.dropped.pop(req_id)})")
            cap = self.done.pop(req_id, None)
            if cap is None:
                cap = self.live.pop(req_id, None)
                if cap is not None:
                    self.taken.add(req_id)
            if cap is None:
                raise KeyError(f"request {req_id}: no record (unknown request, or already taken)")
            if num_rows is not None and cap.error is None:
                if cap.num_rows < num_rows:
                    cap.error = f"captured {cap.num_rows} token rows, the output implies {num_rows}"
                elif cap.num_rows > num_rows:
                    self.counters["trimmed_rows"] += cap.num_rows - num_rows
                    cap.truncate(num_rows)
            return cap

    def find(self, external_id: str) -> list[str]:
        """Internal request ids (`<external>-<8 random chars>`, or the id itself) for an external id."""
        with self.lock:
            known = list(self.done) + list(self.live) + list(self.dropped)
        return [r for r in known if r == external_id or (r.rsplit("-", 1)[0] == external_id and len(r.rsplit("-", 1)[1]) == 8)]

    def discard(self, req_ids=None) -> int:
        """Drop finished captures (all, or the given ids); returns how many were dropped."""
        with self.lock:
            ids = list(self.done) if req_ids is None else [r for r in req_ids if r in self.done]
            for r in ids:
                del self.done[r]
            self.counters["discarded_records"] += len(ids)
            return len(ids)

    def stats(self) -> dict:
        with self.lock:
            return {
                "counters": dict(self.counters),
                "saturated_values": self.saturation.counts(),
                "live_requests": len(self.live),
                "done_requests": len(self.done),
                "capture_bytes": self._total_bytes(),
                "max_bytes": self.max_bytes,
            }


def _split(q: NVFP4Tensor, start: int, sizes: list[int]) -> list[NVFP4Tensor]:
    """Per-request row views of a step tensor whose request rows start at `start`."""
    stop = start + sum(sizes)
    amax = q.global_amax
    amax = amax.reshape(1).expand(q.codes.shape[:-1]) if amax.numel() == 1 else amax
    parts = (t[start:stop].split(sizes) for t in (q.codes, q.scales, amax))
    return [NVFP4Tensor(c, s, a) for c, s, a in zip(*parts)]


def _to_host(q: NVFP4Tensor) -> NVFP4Tensor:
    # One device-to-host copy per site and step (seam: pinned buffers + a side stream on GPU).
    return NVFP4Tensor(q.codes.to("cpu"), q.scales.to("cpu"), q.global_amax.to("cpu"))


STORE = CaptureStore()

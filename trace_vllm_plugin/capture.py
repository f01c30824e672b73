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

Prefix caching: a prefix-cache hit skips the forward of the cached tokens, so their rows are not
computed for the request. With `TRACE_FP4_PREFIX_CACHING=1` (in the worker's environment) the plugin
keeps vLLM's prefix caching on and serves such a hit from a bounded prefix-rows cache: every request's
prompt rows are kept under the digest of its prompt's first k * block_size tokens (the only places a
hit can end), up to `TRACE_FP4_PREFIX_ROWS_MAX_BYTES` (default 256 MiB, oldest first out, counted).
The rows served are exactly the ones the engine used: the cached KV blocks hold the earlier request's
codes. A hit that the cache cannot serve makes that request's record fail with the reason (never a
record with a gap). Otherwise (the default) prefix caching is switched off while capturing.

Weights: each record carries the weights version (the number of weight updates since load, or what
the RL driver set with `set_weights_version`) and the digest of the expert weights, taken when the
request's first rows were captured (a weight update in the middle of a request is counted).

Forward passes without an open step (vLLM's profiling / warm-up dummy runs) quantize as usual and are
counted (`unattributed_forwards`); their rows belong to no request.
"""

import hashlib
import os
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from trace_kernels import NVFP4Tensor, SaturationCounter
from trace_kernels.weight_digest import model_digest

DEFAULT_MAX_BYTES = 2 << 30
DEFAULT_PREFIX_ROWS_MAX_BYTES = 256 << 20
PREFIX_CACHING_ENV = "TRACE_FP4_PREFIX_CACHING"


def prefix_caching_requested() -> bool:
    return os.environ.get(PREFIX_CACHING_ENV, "0") not in ("", "0", "false", "False")


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
    prompt_ids: list | None = None  # each request's prompt token ids (serves prefix-cache hits)


@dataclass
class RequestCapture:
    # One entry per appended chunk: {(layer, site): NVFP4Tensor rows} and {layer: ids rows}.
    chunks: list[tuple[int, dict, dict]] = field(default_factory=list)  # (num_rows, sites, routing)
    num_rows: int = 0
    nbytes: int = 0
    error: str | None = None  # set when the capture cannot be a complete record
    weights: tuple = (None, None)  # (weights version, expert-weights digest) at the first captured rows
    prompt_registered: bool = False  # its prompt rows are in the prefix-rows cache
    prompt_ids: list | None = None  # its prompt token ids (when serving prefix-cache hits)

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
        self.lock = threading.RLock()  # re-entrant: current_weights() settles pending updates under it
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
        # Weights identity (set by the MoE method at every weight (re)quantization).
        self.layer_digests: dict[int, str] = {}
        self.layer_versions: dict[int, int] = {}
        self._pending_weights: dict = {}  # layer -> digest function, for updates not yet settled
        self.version_override = None
        self._digest = None
        # Prefix-cache hits (see the module docstring).
        self.serve_prefix_hits = False
        self.block_size = 16
        self.prefix_max_bytes = int(os.environ.get("TRACE_FP4_PREFIX_ROWS_MAX_BYTES", DEFAULT_PREFIX_ROWS_MAX_BYTES))
        self._prefix_index: dict[str, tuple[int, int]] = {}  # prefix digest -> (entry id, rows)
        self._prefix_entries: OrderedDict[int, tuple[int, dict, dict, list[str]]] = OrderedDict()
        self._prefix_bytes = 0
        self._next_entry = 0
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

    # ---- weights identity ------------------------------------------------------------------------
    def weights_updated(self, layer: int, digest: str | None, version: int) -> None:
        """A layer re-quantized its expert weights (version: how many times, 1 at load)."""
        with self.lock:
            self._pending_weights.pop(layer, None)
            self._set_layer_weights(layer, digest, version)

    def weights_changed(self, layer: int, digest_fn) -> None:
        """An expert of `layer` was requantized by its weight loader. An RL sync may call only the model's
        `load_weights` (no `process_weights_after_loading` after it), so the layer's new digest and
        version are settled lazily, once per update, before the next record is stamped."""
        with self.lock:
            self._pending_weights[layer] = digest_fn

    def _set_layer_weights(self, layer: int, digest: str | None, version: int) -> None:
        self.layer_digests[layer] = digest
        self.layer_versions[layer] = version
        self._digest = None
        if self.version_override is not None:
            self.version_override = None  # set for the previous weights; the counter takes over
            self.counters["weights_version_override_cleared"] += 1

    def _settle_weights(self) -> None:
        pending, self._pending_weights = self._pending_weights, {}
        for layer, digest_fn in sorted(pending.items()):
            self._set_layer_weights(layer, digest_fn(), self.layer_versions.get(layer, 0) + 1)
            self.counters["weights_updates_settled_lazily"] += 1

    def set_weights_version(self, version) -> None:
        with self.lock:
            self.version_override = version

    def current_weights(self) -> tuple:
        if self._pending_weights:
            with self.lock:
                self._settle_weights()
        if not self.layer_versions:
            return None, None
        if self._digest is None and all(d is not None for d in self.layer_digests.values()):
            self._digest = model_digest(self.layer_digests)
        version = self.version_override
        if version is None:
            version = min(self.layer_versions.values()) - 1  # 0 after load, +1 per update
        return version, self._digest

    # ---- prefix-rows cache -----------------------------------------------------------------------
    def _register_prompt(self, cap: RequestCapture, prompt_ids) -> None:
        P = len(prompt_ids)
        B = self.block_size
        if P < B:
            cap.prompt_registered = True
            return
        sites, routing = _concat(cap.chunks, P)
        nbytes = sum(_nbytes(q) for q in sites.values()) + sum(t.numel() * t.element_size() for t in routing.values())
        if nbytes > self.prefix_max_bytes:
            self.counters["prefix_rows_too_large"] += 1
            cap.prompt_registered = True
            return
        h = hashlib.sha256()
        ids = np.asarray(prompt_ids, dtype="<i8")
        keys = []
        for k in range(B, P + 1, B):
            h.update(ids[k - B : k].tobytes())
            keys.append((h.copy().hexdigest(), k))
        entry = self._next_entry
        self._next_entry += 1
        self._prefix_entries[entry] = (nbytes, sites, routing, [d for d, _ in keys])
        for d, k in keys:
            self._prefix_index[d] = (entry, k)
        self._prefix_bytes += nbytes
        self.counters["prefix_prompts_cached"] += 1
        cap.prompt_registered = True
        while self._prefix_bytes > self.prefix_max_bytes and len(self._prefix_entries) > 1:
            evicted, (nb, _, _, digests) = self._prefix_entries.popitem(last=False)
            for d in digests:
                if self._prefix_index.get(d, (None,))[0] == evicted:
                    self._prefix_index.pop(d, None)
            self._prefix_bytes -= nb
            self.counters["prefix_prompts_evicted"] += 1

    def _serve_prefix(self, cap: RequestCapture, prompt_ids, start: int) -> bool:
        if start > len(prompt_ids):
            return False
        d = hashlib.sha256(np.asarray(prompt_ids[:start], dtype="<i8").tobytes()).hexdigest()
        hit = self._prefix_index.get(d)
        if hit is not None and hit[1] == start and hit[0] in self._prefix_entries:
            _, sites, routing, _ = self._prefix_entries[hit[0]]
            self._prefix_entries.move_to_end(hit[0])
        else:
            # Not registered yet (the earlier request is still in its chunked prefill, or its prompt
            # is not complete): a capture in flight that already holds those rows serves it.
            donor = next((c for c in (*self.live.values(), *self.done.values())
                          if c is not cap and c.error is None and c.prompt_ids is not None and c.num_rows >= start
                          and len(c.prompt_ids) >= start and list(c.prompt_ids[:start]) == list(prompt_ids[:start])), None)
            if donor is None:
                return False
            sites, routing = _concat(donor.chunks, start)
            self.counters["prefix_hits_served_from_running"] += 1
        chunk_sites = {k: _rows(q, 0, start) for k, q in sites.items()}
        chunk_routing = {k: t[:start].clone() for k, t in routing.items()}
        nbytes = sum(_nbytes(q) for q in chunk_sites.values()) + sum(t.numel() * t.element_size() for t in chunk_routing.values())
        cap.chunks.append((start, chunk_sites, chunk_routing))
        cap.num_rows += start
        cap.nbytes += nbytes
        self.counters["prefix_hit_rows_served"] += start
        self.counters["prefix_hits_served"] += 1
        return True

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
        moe_layers = self.shape.moe_layer_list()
        if sorted(routing) != moe_layers:
            # Every routed-expert layer runs our MoE method, so a missing one is a bug.
            raise RuntimeError(
                f"trace_fp4: the forward captured routing of layers {sorted(routing)}, the model's "
                f"routed-expert layers are {moe_layers}"
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
                start = layout.start_positions[i]
                prompt_ids = layout.prompt_ids[i] if layout.prompt_ids is not None else None
                if cap is None:
                    cap = self.live[req_id] = RequestCapture(weights=self.current_weights(), prompt_ids=prompt_ids)
                    self.counters["requests_started"] += 1
                    if start > 0 and self.serve_prefix_hits and prompt_ids is not None:
                        if not self._serve_prefix(cap, prompt_ids, start):
                            cap.error = (
                                f"a prefix-cache hit of {start} tokens that the prefix-rows cache cannot serve "
                                "(its prompt rows were evicted or never captured; raise "
                                "TRACE_FP4_PREFIX_ROWS_MAX_BYTES, or unset TRACE_FP4_PREFIX_CACHING)"
                            )
                            self.counters["prefix_hits_not_served"] += 1
                            self.counters["incomplete_requests"] += 1
                elif cap.weights != self.current_weights():
                    self.counters["requests_spanning_weight_update"] += 1
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
                if (self.serve_prefix_hits and prompt_ids is not None and not cap.prompt_registered
                        and cap.error is None and cap.num_rows >= len(prompt_ids)):
                    # Before the next request of this step: a hit can be on blocks scheduled this step.
                    self._register_prompt(cap, prompt_ids)
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
                "prefix_rows_bytes": self._prefix_bytes,
                "max_bytes": self.max_bytes,
            }


def _concat(chunks, rows: int) -> tuple[dict, dict]:
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
        amax = [p.global_amax.reshape(1).expand(p.codes.shape[:-1]) if p.global_amax.numel() == 1 else p.global_amax for p in parts]
        cat[k] = NVFP4Tensor(torch.cat([p.codes for p in parts])[:rows].clone(),
                             torch.cat([p.scales for p in parts])[:rows].clone(), torch.cat(amax)[:rows].clone())
    return cat, {k: torch.cat(parts)[:rows].clone() for k, parts in routing.items()}


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

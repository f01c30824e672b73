"""The vLLM worker's capture store: which captured rows belong to which request (one per engine).

The quantized layers call `store.put(...)` during a forward pass with rows of the whole flattened batch.
The model-runner hook (patches/vllm_v1_runner.py, through `RunnerListener`) opens a step with the batch
layout (request ids in batch order, `query_start_loc`, each request's first position) before the
forward and closes it after; the close splits every captured tensor by request and appends the rows to
that request's capture.

The store is owned by the engine's `TraceFP4Config` (`capture_store`) and handed to every layer method
it builds; it composes the engine-independent parts of `trace_kernels.engine`, one job each:
  RequestCaptures   request lifecycle (live / done / taken) and the memory budget
  PrefixRowsCache   rows for prefix-cache hits (TRACE_FP4_PREFIX_CACHING=1)
  WeightsIdentity   the weights version and digest each record carries
  EngineCounters    the counters `trace_vllm_plugin.stats` returns
and keeps the one vLLM-specific job itself: attributing a step's rows to its requests.

Prefix caching: a prefix-cache hit skips the forward of the cached tokens, so their rows are not
computed for the request. With `TRACE_FP4_PREFIX_CACHING=1` (in the worker's environment) the plugin
keeps vLLM's prefix caching on and serves such a hit from the prefix-rows cache; a hit it cannot serve
makes that request's record fail with the reason (never a record with a gap). Otherwise (the default)
prefix caching is switched off while capturing.

Forward passes without an open step (vLLM's profiling / warm-up dummy runs) quantize as usual and are
counted (`unattributed_layer_calls`); their rows belong to no request.
"""

import threading
from dataclasses import dataclass

import torch

from trace_kernels import NVFP4Tensor, envs
from trace_kernels.engine import EngineCounters, WeightsIdentity
from trace_kernels.engine.captured_rows import RequestCapture, split_rows, to_host
from trace_kernels.engine.prefix_rows import PrefixRowsCache
from trace_kernels.engine.request_captures import RequestCaptures

__all__ = ["CaptureStore", "RequestCapture", "RunnerListener", "StepLayout", "prefix_caching_requested"]


def prefix_caching_requested() -> bool:
    return envs.TRACE_FP4_PREFIX_CACHING


@dataclass
class StepLayout:
    """Which rows of the flattened batch belong to which request (batch order)."""

    req_ids: list[str]
    query_start_loc: list[int]  # len(req_ids) + 1
    start_positions: list[int]  # first position (num computed tokens) of each request's rows
    prompt_ids: list | None = None  # each request's prompt token ids (serves prefix-cache hits)


class CaptureStore:
    def __init__(self, shape=None, config=None, owner=None):
        """`shape`: trace_kernels.ModelShape; `config`: TraceConfig (None: a store that captures
        nothing); `owner`: the engine's quant config (the runner hook captures for its engine only)."""
        self.lock = threading.RLock()
        self.shape, self.config, self.owner = shape, config, owner
        self.capture_layers: set[int] = set()
        if config is not None:
            self.capture_layers = {
                i for i, mode in enumerate(config.layer_modes(shape.num_layers)) if mode is not None
            }
        self.counters = EngineCounters()
        self.saturation = self.counters.saturation  # values above a static amax, per "<layer>.<site>"
        self.weights = WeightsIdentity(self.counters)
        self.requests = RequestCaptures(self.counters, envs.TRACE_FP4_CAPTURE_MAX_BYTES)
        self.prefix = PrefixRowsCache(self.counters, envs.TRACE_FP4_PREFIX_ROWS_MAX_BYTES)
        self.serve_prefix_hits = False
        self.step: StepLayout | None = None
        self._step_sites: dict[tuple[int, str], NVFP4Tensor] = {}
        self._step_routing: dict[int, torch.Tensor] = {}
        self.listener = RunnerListener(self)

    @property
    def capturing(self) -> bool:
        return self.config is not None and self.config.capture

    def wants(self, layer: int) -> bool:
        """Whether codes of `layer` are captured (routing ids are captured for every layer)."""
        return self.capturing and layer in self.capture_layers

    def count(self, key: str, n: int = 1) -> None:
        self.counters[key] += n

    # The parts' settings and state, where callers and tests reach them.
    @property
    def max_bytes(self) -> int:
        return self.requests.max_bytes

    @max_bytes.setter
    def max_bytes(self, value: int) -> None:
        self.requests.max_bytes = value

    @property
    def block_size(self) -> int:
        return self.prefix.block_size

    @block_size.setter
    def block_size(self, value: int) -> None:
        self.prefix.block_size = value

    @property
    def live(self):
        return self.requests.live

    @property
    def done(self):
        return self.requests.done

    # ---- weights identity (reported by the MoE method) -------------------------------------------
    def current_weights(self) -> tuple:
        return self.weights.current()

    def set_weights_version(self, version) -> None:
        self.weights.set_version(version)

    # ---- during a forward pass -------------------------------------------------------------------
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

    def abandon_step(self) -> None:
        self.step = None

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
        # copies on the hot path; the record concatenates them when it is taken).
        site_rows = {k: split_rows(to_host(q), qsl[0], sizes) for k, q in sites.items()}
        route_rows = {k: t[qsl[0] : qsl[-1]].to("cpu", torch.int16).split(sizes) for k, t in routing.items()}
        with self.lock:
            for i, req_id in enumerate(layout.req_ids):
                a, b = qsl[i], qsl[i + 1]
                if b <= a or req_id in self.requests.taken:
                    continue
                prompt_ids = layout.prompt_ids[i] if layout.prompt_ids is not None else None
                cap = self._capture_for(req_id, layout.start_positions[i], prompt_ids)
                cap.append(b - a, {k: v[i] for k, v in site_rows.items()}, {k: v[i] for k, v in route_rows.items()})
                self.counters["captured_rows"] += b - a
                if (self.serve_prefix_hits and prompt_ids is not None and not cap.prompt_registered
                        and cap.error is None and cap.num_rows >= len(prompt_ids)):
                    # Before the next request of this step: a hit can be on blocks scheduled this step.
                    self.prefix.register(cap, prompt_ids)
            self.requests.enforce_budget()

    def _capture_for(self, req_id: str, start: int, prompt_ids) -> RequestCapture:
        """The request's capture, ready for rows from position `start` on."""
        cap = self.requests.live.get(req_id)
        if cap is None:
            cap = self.requests.start(req_id, self.current_weights(), prompt_ids)
            if start > 0 and self.serve_prefix_hits and prompt_ids is not None:
                if not self.prefix.serve(cap, prompt_ids, start, self.requests.all()):
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
        return cap

    # ---- request lifecycle -----------------------------------------------------------------------
    def finish(self, req_id: str, aborted: bool = False) -> None:
        with self.lock:
            self.requests.finish(req_id, aborted)

    def take(self, req_id: str, num_rows: int | None = None) -> RequestCapture:
        with self.lock:
            return self.requests.take(req_id, num_rows)

    def keep_sequence_rows(self, cap: RequestCapture, token_ids) -> None:
        """Keep a finished request's rows (prompt and generated) for prefix-cache hits: the next turn of
        a multi-turn trajectory re-reads them, and vLLM caches the generated tokens' KV blocks too."""
        if not self.serve_prefix_hits or cap.error is not None:
            return
        with self.lock:
            self.prefix.register(cap, list(token_ids)[: cap.num_rows])
            self.counters["prefix_sequences_kept"] += 1

    def find(self, external_id: str) -> list[str]:
        with self.lock:
            return self.requests.find(external_id)

    def discard(self, req_ids=None) -> int:
        with self.lock:
            return self.requests.discard(req_ids)

    def stats(self) -> dict:
        with self.lock:
            return {
                "counters": dict(self.counters),
                "saturated_values": self.saturation.counts(),
                "live_requests": len(self.requests.live),
                "done_requests": len(self.requests.done),
                "capture_bytes": self.requests.total_bytes(),
                "prefix_rows_bytes": self.prefix.nbytes,
                "max_bytes": self.requests.max_bytes,
            }


class RunnerListener:
    """What the model-runner patch calls (patches/vllm_v1_runner.py knows only this interface)."""

    def __init__(self, store: CaptureStore):
        self.store = store

    @property
    def wants_prompt_ids(self) -> bool:
        return self.store.serve_prefix_hits

    def begin_step(self, req_ids, query_start_loc, start_positions, prompt_ids=None) -> None:
        self.store.begin_step(StepLayout(req_ids, query_start_loc, start_positions, prompt_ids))

    def abandon_step(self) -> None:
        self.store.abandon_step()

    def end_step(self) -> None:
        self.store.end_step()
        self.store.count("steps")

    def request_removed(self, req_id: str, aborted: bool) -> None:
        self.store.finish(req_id, aborted=aborted)


def runner_listener(runner):
    """The listener of `runner`'s engine, or None when trace_fp4 does not capture there (another
    engine in this process, or capture off)."""
    store = getattr(runner.vllm_config.quant_config, "capture_store", None)
    if store is None or not store.capturing or store.owner is not runner.vllm_config.quant_config:
        return None
    return store.listener

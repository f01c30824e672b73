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

CUDA graphs. The layers do not hand tensors to Python during the forward: `put` / `put_routing` write
the rows into static per-layer buffers (`trace_kernels.engine.step_buffers`, sized for the engine's
maximum batched tokens), which a CUDA-graph replay writes as well. `end_step` reads the step's valid
rows from them. A batch larger than the buffers (which vLLM's scheduler does not make) is kept the eager
way for that step, counted (`capture_buffer_overflow_writes`) and logged, never dropped; a step whose
forward did not write a key it must have written makes the records of that step's requests fail with
the reason (`steps_missing_capture`), never a record with stale rows.
"""

import logging
import threading
from dataclasses import dataclass

import torch

from trace_kernels import NVFP4Tensor, cpu_native, envs
from trace_kernels.engine import EngineCounters, WeightsIdentity
from trace_kernels.engine.captured_rows import RequestCapture, StepCapture, StepRows, to_host
from trace_kernels.engine.host_arena import HostArena
from trace_kernels.engine.prefix_rows import PrefixRowsCache
from trace_kernels.engine.request_captures import RequestCaptures
from trace_kernels.engine.step_run import RunState, StepRun
from trace_kernels.engine.step_buffers import ROUTING, StepBuffers

logger = logging.getLogger(__name__)

# Rows of the static capture buffers when the engine does not say (stores built outside an engine).
DEFAULT_CAPACITY = 8192

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
    def __init__(self, shape=None, config=None, owner=None, capacity: int = DEFAULT_CAPACITY):
        """`shape`: trace_kernels.ModelShape; `config`: TraceConfig (None: a store that captures
        nothing); `owner`: the engine's quant config (the runner hook captures for its engine only);
        `capacity`: rows of the static capture buffers (the engine's max batched tokens)."""
        self.lock = threading.RLock()
        self.shape, self.config, self.owner = shape, config, owner
        self.capture_layers: set[int] = set()
        # Pipeline parallel: the decoder layers this worker's stage holds (None: all of them).
        self.stage_layers: set[int] | None = None
        self.pp_rank, self.pp_size = 0, 1
        if config is not None:
            self.capture_layers = {
                i for i, mode in enumerate(config.layer_modes(shape.num_layers)) if mode is not None
            }
        self.counters = EngineCounters()
        self.saturation = self.counters.saturation  # values above a static amax, per "<layer>.<site>"
        self.weights = WeightsIdentity(self.counters)
        self.requests = RequestCaptures(self.counters, envs.TRACE_FP4_CAPTURE_MAX_BYTES, envs.TRACE_FP4_KEEP_ABORTED)
        self.prefix = PrefixRowsCache(self.counters, envs.TRACE_FP4_PREFIX_ROWS_MAX_BYTES)
        self.serve_prefix_hits = False
        # trace_kernels backend of the layers: "auto" (Triton on CUDA tensors, torch on the CPU);
        # tests run the Triton path on a CPU (interpreter) by setting "triton".
        self.kernel_backend = "auto"
        self.step: StepLayout | None = None
        self.buffers = StepBuffers(capacity)
        self.step_index = 0
        # Rows of a step that did not fit the buffers, kept the eager way (see end_step).
        self._step_sites: dict[tuple[int, str], NVFP4Tensor] = {}
        self._expected = None  # (what the keys depend on, the keys): see _expected_keys
        self._row_sizes = None  # (expected keys, site row bytes, routing row bytes): see end_step
        # The steps of an unchanged batch, appended once for all its requests (step_run.py), or None.
        self._run: RunState | None = None
        # The native CPU engine (TRACE_FP4_CPU_BACKEND=native, decided per engine): no CUDA graph replays
        # its forward, and its kernels hand the capture fresh tensors, so a step keeps those tensors
        # themselves (`_host_rows`, see put_owned) instead of copying them into the static buffers and
        # cloning them back out in end_step (about 1,300 copies and 3,300 clones a 64-step generate of
        # the tiny model). Every other engine keeps the static buffers (what a graph replays).
        self.host_rows = cpu_native.enabled()
        self._host_rows: dict = {}  # key -> this step's rows, kept as the layer call made them
        # The native kernels write their capture outputs into the arena's arrays for the step, copied into
        # its chunk at end_step (host_arena.py: why); a step whose every key is there is one ArenaStep. put_owned stays for the
        # calls that cannot (a key's first write, a step whose rows the arena fixed at another count).
        self.arena = HostArena()
        # Whether this step may keep host rows at all (host_rows, capturing, kernel_backend "auto", a step
        # open): decided once per step in begin_step instead of in each of the ~20 puts of a step.
        self._host_open = False
        self.listener = RunnerListener(self)

    def set_pipeline_stage(self, pp_rank: int, pp_size: int, layers) -> None:
        """This worker runs pipeline stage `pp_rank` of `pp_size`, holding decoder `layers`: it captures
        (and expects every forward to write) those layers only."""
        self.pp_rank, self.pp_size = int(pp_rank), int(pp_size)
        self.stage_layers = set(int(x) for x in layers)
        self.capture_layers &= self.stage_layers

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

    def set_rates(self, config) -> None:
        """Take a rate controller's config (trace_kernels.guides.sparse.controller): records built from
        now on are encoded with its sparse rates and audit, and carry its rates_version. Anything else
        that differs from the engine's config is refused by name (it would change what the engine runs)."""
        from trace_kernels.config import RATE_KEYS

        if self.config is None:
            raise ValueError("trace_fp4: this engine captures nothing: there are no rates to set")
        mine, theirs = self.config.to_dict(), config.to_dict()
        other = sorted(k for k in set(mine) | set(theirs) if k not in RATE_KEYS and mine.get(k) != theirs.get(k))
        if other:
            raise ValueError(f"trace_fp4: set_rates may change only {list(RATE_KEYS)}; the config also changes {other}")
        with self.lock:
            self.config = config

    # ---- during a forward pass (what a CUDA graph replays: device writes only) --------------------
    def put(self, layer: int, site: str, q: NVFP4Tensor, into=None) -> None:
        """`into`: (buffers, stamp, step) when the caller holds them as operands (the MoE op)."""
        if not self.capturing:
            return
        if not self.buffers.write_site(layer, site, q, into):
            self._overflow((layer, site), q, q.codes.shape[0])

    def put_owned(self, layer: int, site: str, q: NVFP4Tensor, into=None) -> None:
        """`put` of rows whose tensors are the layer call's own fresh outputs, never written again (the
        native kernels' codes, scales and per-row amax): on the host-rows path (see __init__) the step
        keeps them as they are, no copy; anything else (a key the buffers do not know yet, whose first
        write makes its buffers and its place among the expected keys; no open step; an amax that is
        not one contiguous float32 per row; a device tensor) goes through `put`."""
        if self._host_open:  # the step's conditions that hold for every call (begin_step)
            key = (layer, site)
            codes, amax = q.codes, q.global_amax
            # is_cpu, not device.type == "cpu": the same test at a tenth of the cost (~60 ns against ~800)
            if (key in self.buffers.stamps and codes.is_cpu and amax.dtype == torch.float32
                    and amax.shape == codes.shape[:-1] and amax.is_contiguous()):
                self._host_rows[key] = q
                return
        elif not self.capturing:
            return
        self.put(layer, site, q, into)

    def host_kv_rows(self, layer: int, T: int, H: int, D: int, DV: int):
        """The native KV write's capture outputs (K amax, V amax, K codes, K scales, V codes, V scales: the host
        arena's arrays for this step's rows, copied into its chunk at end_step; kv_row_write's `_outputs`
        order) to write into, then `host_wrote`;
        None where the host-rows path does not hold (the caller makes fresh ones and calls put_owned)."""
        if not self._host_open:
            return None
        arena = self.arena
        if T == arena.rows:  # a later call of the step (its rows reserved): the tuple made before, if any
            held = arena.scratch.get(("kv out", layer))
            if held is not None:
                return held
        kk, kv = (layer, "k"), (layer, "v")
        stamps = self.buffers.stamps
        if kk not in stamps or kv not in stamps:  # a key's first write makes its buffers (put)
            return None
        k = arena.site_rows(kk, T, (H, D // 2), (H, D // 16), (H,))
        if k is None:
            return None
        v = arena.site_rows(kv, T, (H, DV // 2), (H, DV // 16), (H,))
        out = k[2], v[2], k[0], k[1], v[0], v[1]
        # Kept beside the arrays it names, for as long as they are this row count's scratch: the next call
        # of this layer at T rows gets the same arrays back without the two key checks and site_rows calls
        # (~1.5 us a call in the engine; the buffers' keys are never removed, so the checks stay true).
        arena.scratch[("kv out", layer)] = out
        return out

    def host_moe_rows(self, layer: int, T: int, H: int, k: int, I: int, ids: bool = False):
        """The native MoE call's capture outputs (fc1 codes, scales, amax; fc2 codes, scales, amax: the host
        arena's arrays for this step's rows) to write into, then `host_wrote`; None as host_kv_rows.
        `ids`: also the layer's int16 [T, k] routing rows, a seventh entry (routed_experts.engine_call's
        `ids_into`: the kernel writes the ids, no put_routing), None where the routing key has no buffers
        yet (its first write makes them: put_routing)."""
        if not self._host_open:
            return None
        arena = self.arena
        tag = ("moe out", layer, ids)
        if T == arena.rows:  # as host_kv_rows
            held = arena.scratch.get(tag)
            if held is not None:
                return held
        k1, k2 = (layer, "moe_fc1_in"), (layer, "moe_fc2_in")
        stamps = self.buffers.stamps
        if k1 not in stamps or k2 not in stamps:
            return None
        one = arena.site_rows(k1, T, (H // 2,), (H // 16,), ())
        if one is None:
            return None
        rows = one + arena.site_rows(k2, T, (k, I // 2), (k, I // 16), (k,))
        if ids:
            key = (ROUTING, layer)
            if key not in stamps:  # its first write makes its buffers (put_routing); not kept: the next call asks again
                return rows + (None,)
            rows += (arena.routing_rows(key, T, k),)
        arena.scratch[tag] = rows
        return rows

    def host_wrote(self, layer: int, site_a: str, site_b: str, routing: bool = False) -> None:
        """The kernel wrote the rows host_kv_rows / host_moe_rows handed out for these two sites (and, with
        `routing`, the layer's routing rows)."""
        w = self.arena.written
        w.add((layer, site_a))
        w.add((layer, site_b))
        if routing:
            w.add((ROUTING, layer))

    def routing_by_kernel(self, layer: int) -> bool:
        """Whether the MoE call of `layer` may leave its routing ids to the native kernel (host_moe_rows with
        `ids`): a step open on the host-rows path and the layer's codes captured (that path's arena rows).
        The caller then calls put_routing itself wherever the kernel did not write them."""
        return self._host_open and layer in self.capture_layers

    def put_routing(self, layer: int, topk_ids: torch.Tensor, into=None) -> None:
        if self.step is None:
            self.counters["unattributed_layer_calls"] += 1
        if not self.capturing:
            return
        key = (ROUTING, layer)
        if self._host_open and key in self.buffers.stamps and topk_ids.is_cpu:
            rows = self.arena.routing_rows(key, topk_ids.shape[0], topk_ids.shape[1]) if topk_ids.dim() == 2 else None
            if rows is not None:
                # numpy's assignment casts as torch's .to(torch.int16) (C casts of the int32 / int64 ids)
                rows[...] = topk_ids.numpy()
                self.arena.written.add(key)
                return
            # The host-rows path (see __init__): a copy of its own (routers may reuse their output buffers).
            self._host_rows[key] = topk_ids.to(torch.int16, copy=True)
            return
        if not self.buffers.write_routing(layer, topk_ids, into):
            self._overflow((ROUTING, layer), topk_ids.to(torch.int16, copy=True), topk_ids.shape[0])

    def _overflow(self, key, value, rows: int) -> None:
        """A batch larger than the static buffers: only in an eager forward (a captured graph's batch
        is at most the max batched tokens the buffers are sized for), so Python runs here."""
        self.counters["capture_buffer_overflow_writes"] += 1
        if self.step is None:
            return
        if not self._step_sites:
            logger.warning(
                "trace_fp4: a forward of %d rows exceeds the static capture buffers (%d rows); this "
                "step is captured eagerly", rows, self.buffers.capacity,
            )
            self.counters["capture_buffer_overflow_steps"] += 1
        self._step_sites[key] = value

    def begin_step(self, layout: StepLayout) -> None:
        self.step = layout
        self.step_index += 1
        self.buffers.begin(self.step_index)
        self._step_sites.clear()
        self._host_rows.clear()
        self.arena.begin()
        self._host_open = self.host_rows and self.capturing and self.kernel_backend == "auto"

    def abandon_step(self) -> None:
        self.step = None
        self._host_open = False
        self._step_sites.clear()
        self._host_rows.clear()
        self.arena.begin()

    def _expected_keys(self) -> list[tuple]:
        """What every forward writes: the routed ids of every routed-expert layer, and each site the
        buffers know of a captured layer (their first write was the profiling run's). Kept while the
        buffers' keys and the captured layers stay the same (every step asks)."""
        # What the keys depend on, compared in place (a set equals the frozenset of its items): no two
        # frozensets made a step only to find them unchanged (~0.3 us a step).
        held, n = self._expected, len(self.buffers.tensors)
        if (held is not None and held[0] == n and held[1] == self.capture_layers
                and held[2] == self.stage_layers):
            return held[3]
        routing = [(ROUTING, i) for i in self.shape.moe_layer_list()
                   if self.stage_layers is None or i in self.stage_layers]
        sites = [k for k in self.buffers.written_keys() if k[0] != ROUTING and self.wants(k[0])]
        self._expected = (n, frozenset(self.capture_layers),
                          None if self.stage_layers is None else frozenset(self.stage_layers), routing + sites)
        return self._expected[3]

    def end_step(self) -> None:
        """Split the step's captures by request and append them (called after the forward)."""
        layout, self.step = self.step, None
        self._host_open = False
        overflow = dict(self._step_sites) if self._step_sites else {}
        self._step_sites.clear()
        host, self._host_rows = self._host_rows, {}
        arena = self.arena
        if layout is None or not self.capturing:
            arena.begin()
            return
        qsl = layout.query_start_loc
        expected = self._expected_keys()
        if arena.written:
            covered = arena.commit_covers(expected, qsl[-1])
            if covered and not host and not overflow and qsl[-1] > qsl[0]:
                # Every expected key written into the arena this step: the step is its rows there.
                arena.written.clear()
                self.counters["capture_steps_arena"] += 1
                self._append_step(layout, expected, None, None, False, arena)
                return
            # Anything else: the arena's rows as the host-rows path's tensors (views), and the general path.
            host = {**arena.views(), **host}
            arena.written.clear()
        if host and not overflow:
            split = _host_step(host, expected, qsl[0], qsl[-1])
            if split is not None:  # every key kept on the host, with the step's rows
                self.counters["capture_steps_host_rows"] += 1
                self._append_step(layout, *split, False)
                return
        keys = [k for k in expected if k not in overflow] if overflow else expected
        # Keys the step kept on the host (put_owned) are checked by their rows here; the others by their
        # stamps in the buffers, and read from there.
        buffered = [k for k in keys if k not in host] if host else keys
        missing = self.buffers.missing(self.step_index, buffered, qsl[-1]) if buffered else []
        if host:
            missing += [k for k in keys if k in host and _nrows(host[k]) < qsl[-1]]
        missing = [k for k in missing if k not in overflow]
        if missing:
            self._refuse_step(layout, missing)
            return
        # The path every step of an engine without the native kernels takes; on the native engine, a step the
        # arena or the host rows could not hold alone (a key's first write, an overflow). Counted, so a native
        # engine that leaves the arena is seen.
        self.counters["capture_steps_general"] += 1
        step_rows = self.buffers.read(buffered, qsl[0], qsl[-1]) if buffered else {}
        if host:
            # In the expected keys' order, as a read of every key from the buffers gives them.
            read, step_rows = step_rows, {}
            whole = qsl[0] == 0
            for k in keys:
                v = host.get(k)
                if v is None:
                    step_rows[k] = read[k]
                elif whole and _nrows(v) == qsl[-1]:
                    step_rows[k] = v
                else:
                    step_rows[k] = v[qsl[0] : qsl[-1]]
        for key, value in overflow.items():
            step_rows[key] = value[qsl[0] : qsl[-1]] if key[0] == ROUTING else _rows(value, qsl[0], qsl[-1])
        # Each request's chunk names its rows of the step's host copy (StepRows): no per-request views
        # or copies on the hot path; the record joins a request's chunks when it is taken.
        site_rows, route_rows = {}, {}
        for key, value in step_rows.items():
            if key[0] == ROUTING:
                route_rows[key[1]] = value if _on_host(value, torch.int16) else value.to("cpu", torch.int16)
            else:
                site_rows[key] = value if _on_host(value.codes) else to_host(value)
        self._append_step(layout, keys, site_rows, route_rows, bool(overflow))

    def _append_step(self, layout: StepLayout, keys: list, site_rows: dict, route_rows: dict, overflow: bool,
                     arena: HostArena | None = None) -> None:
        """Append each request's rows of the step (`site_rows` / `route_rows`: the step's host rows of
        every key, in `keys`' order; or `arena`: this step's rows of every key there) to its capture: the
        step's one StepCapture (ArenaStep) and the request's row range of it (no object per request and
        step, see RequestCapture.append_step)."""
        qsl = layout.query_start_loc
        # Bytes of one row of every key: fixed by the keys' buffers, so kept while the keys are (a step
        # without overflow rows reads the same expected-keys list every time).
        sizes = self._row_sizes
        if sizes is not None and sizes[0] is keys:
            site_bytes, route_bytes = sizes[1], sizes[2]
        else:
            if arena is not None:  # the same per-row bytes (the arena step has rows)
                site_bytes, route_bytes = arena.row_bytes(keys)
            else:
                site_bytes, route_bytes = StepRows.row_bytes(site_rows), StepRows.row_bytes(route_rows)
            # Kept only from a step with rows: a step of none measures 0 bytes a row (row_bytes divides by
            # the rows), and the steps after it would count their rows as 0 bytes against the budget.
            self._row_sizes = (keys, site_bytes, route_bytes) if not overflow and qsl[-1] > qsl[0] else None
        if arena is not None:
            step = arena.step(keys, qsl[0], qsl[-1], site_bytes, route_bytes)
        else:
            step = StepCapture(site_rows, route_rows, site_bytes, route_bytes)
        base = qsl[0]
        prompts = layout.prompt_ids
        serve = self.serve_prefix_hits and prompts is not None
        with self.lock:
            weights = self.current_weights()
            run = self._run
            if run is not None and run.extends(layout, weights, self.requests.version):
                # The batch of the run's last step again, each request at its next position: every member
                # gets its same row range of this step (step_run.py), one append for all of them.
                run.run.append(step)
                run.advance()
                self.counters["captured_rows"] += run.rows
                self.requests.grew(run.rows * (site_bytes + route_bytes))
                return
            live, taken = self.requests.live, self.requests.taken
            # This step is the first of a new run, each request joining it with its rows (no append of its
            # own); no run where a later step could need per-request work with the batch unchanged: prefix
            # serving (registers prompts as they complete), or a request twice in the batch.
            run = None if serve or len(set(layout.req_ids)) != len(layout.req_ids) else StepRun()
            if run is not None:
                run.append(step)
            rows = 0
            for i, (req_id, start) in enumerate(zip(layout.req_ids, layout.start_positions)):
                a, b = qsl[i], qsl[i + 1]
                if b <= a or req_id in taken:
                    continue
                cap = live.get(req_id)
                # The usual step: a running request's next rows under the same weights, where
                # _capture_for would change nothing (this loop runs per request and step).
                if cap is None or cap.num_rows != start or cap.newest_weights() != weights:
                    cap = self._capture_for(req_id, start, prompts[i] if prompts is not None else None)
                if run is None:
                    cap.append_step(step, a - base, b - base)
                else:
                    cap.join_run(run, a - base, b - base, 0)  # from this step, the run's first, on
                rows += b - a
                if (serve and prompts[i] is not None and not cap.prompt_registered and cap.error is None
                        and cap.num_rows >= len(prompts[i])):
                    # Before the next request of this step: a hit can be on blocks scheduled this step.
                    self.prefix.register(cap, prompts[i])
            self.counters["captured_rows"] += rows
            version = self.requests.version  # before the budget: a member it evicts ends the run
            self.requests.enforce_budget()
            self._run = None
            if run is not None and rows:
                self._run = RunState(layout.req_ids, qsl, layout.start_positions, weights, version, run, rows)

    def _refuse_step(self, layout: StepLayout, missing: list[tuple]) -> None:
        """The forward did not write `missing` this step: the step's requests get no record (their
        rows for this step would be stale or absent)."""
        names = ", ".join(f"{k[0]}.{k[1]}" if k[0] != ROUTING else f"routing of layer {k[1]}" for k in missing[:6])
        reason = (
            f"step {self.step_index}: the forward did not write the capture of {names}"
            f"{' ...' if len(missing) > 6 else ''} (a layer that bypassed trace_fp4, or a graph "
            "replayed without the capture writes); the record would miss this step"
        )
        logger.error("trace_fp4: %s", reason)
        self.counters["steps_missing_capture"] += 1
        with self.lock:
            self._run = None  # no later step extends the run: its requests' captures are refused
            for i, req_id in enumerate(layout.req_ids):
                if layout.query_start_loc[i + 1] <= layout.query_start_loc[i] or req_id in self.requests.taken:
                    continue
                prompt_ids = layout.prompt_ids[i] if layout.prompt_ids is not None else None
                cap = self._capture_for(req_id, layout.start_positions[i], prompt_ids)
                if cap.error is None:
                    cap.error = reason
                    self.counters["incomplete_requests"] += 1

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
        if cap.num_rows > start:
            # Preempted and recomputed: the recomputed rows replace the old ones.
            self.counters["recomputed_rows"] += cap.num_rows - start
            cap.truncate(start)
        now = self.current_weights()
        if cap.newest_weights() != now:
            # A weight update while the request ran (kept running through it): its rows from here on
            # are the new weights'; the record says which version made which rows (version_ranges).
            self.counters["requests_spanning_weight_update"] += 1
            cap.weights_at(start, now)
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

    def peek(self, external_id: str) -> RequestCapture | None:
        """The capture of the one request with this external id, not taken (None if not exactly one)."""
        with self.lock:
            matches = self.requests.find(external_id)
            if len(matches) != 1:
                return None
            return self.requests.done.get(matches[0]) or self.requests.live.get(matches[0])

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
                # Device memory of the static capture buffers (max batched tokens x every captured row).
                "capture_buffer_bytes": self.buffers.nbytes(),
                # Host memory the native engine's arena holds besides the rows capture_bytes counts (its current
                # chunk, freed chunks kept for reuse, the kernels' scratch); 0 on an engine without it.
                "host_arena_bytes": self.arena.held_bytes(),
                "max_bytes": self.requests.max_bytes,
                # which pipeline stage this worker is, so the driver can merge the stages' per-layer counts
                "pp_rank": self.pp_rank,
                "pp_size": self.pp_size,
            }


def _nrows(v) -> int:
    return (v.codes if isinstance(v, NVFP4Tensor) else v).shape[0]


def _host_step(host: dict, keys: list, start: int, stop: int):
    """(keys, {site key: rows}, {layer: routing ids}) of a step whose every expected key the step kept on
    the host (put_owned / put_routing: host tensors, int16 ids), rows [start, stop) of each in `keys`'
    order: what end_step's general path makes of them, in one pass over the keys. None when a key is
    not kept or has fewer rows than the step (the general path reads the buffers, or names it missing)."""
    if len(host) != len(keys):
        return None
    sites, routes = {}, {}
    whole = start == 0
    for k in keys:
        v = host.get(k)
        if v is None:
            return None
        routing = k[0] == ROUTING
        n = (v if routing else v.codes).shape[0]
        if n < stop:
            return None
        rows = v if whole and n == stop else v[start:stop]
        if routing:
            routes[k[1]] = rows
        else:
            sites[k] = rows
    return keys, sites, routes


def _on_host(t: torch.Tensor, dtype=None) -> bool:
    """Already a host tensor (of `dtype`): the CPU engine's step rows need no conversion."""
    return t.device.type == "cpu" and (dtype is None or t.dtype == dtype)


def _rows(q: NVFP4Tensor, start: int, stop: int) -> NVFP4Tensor:
    amax = q.global_amax
    amax = amax.reshape(1).expand(q.codes.shape[:-1]) if amax.numel() == 1 else amax
    return NVFP4Tensor(q.codes[start:stop], q.scales[start:stop], amax[start:stop])


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
        store = self.store
        if aborted and store.pp_rank < store.pp_size - 1:
            # A stage before the last learns each sampled token only when its request is scheduled
            # again, so it never sees the last one and cannot tell an abort from a natural end: the
            # rows are kept (taken by get_records, or freed by discard_records / the capture budget).
            store.count("pipeline_ends_kept_unjudged")
            aborted = False
        store.finish(req_id, aborted=aborted)


def runner_listener(runner):
    """The listener of `runner`'s engine, or None when trace_fp4 does not capture there (another
    engine in this process, or capture off)."""
    store = getattr(runner.vllm_config.quant_config, "capture_store", None)
    if store is None or not store.capturing or store.owner is not runner.vllm_config.quant_config:
        return None
    return store.listener

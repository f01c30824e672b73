"""The state of trace_fp4 in one SGLang engine (one model runner: one TP rank): owned by its quant config.

`TraceFp4SGLangConfig` makes one `EngineState`; its MoE methods report to it while the model loads,
`capture_setup.init_capture` fills in the rest once the KV pool exists and hangs it on the SGLang
objects the hooks receive (model runner, KV pool, request-to-token pool, attention layers), and the
hooks find it there (`state_of`). Nothing here imports the plugin's setup or hooks.

Lifecycle (driven by the hooks in hooks.py):
  model load     -> each MoE method registers its layer and reports its weights
  KV pool ready  -> capture_setup.init_capture: validates the model, sizes the capture buffers
  each forward   -> `begin_forward` / MoE + KV capture / `end_forward` (staging -> host by KV slot)
  request finish -> `build_record`: gathers the request's rows into its GuidanceRecord
"""

import threading

import torch

from trace_kernels import ModelShape, TraceConfig
from trace_kernels.engine import EngineCounters, WeightsIdentity, assemble_record

from .capture_buffers import KV_LOC, KV_SITES, MOE_SITES, CaptureBuffers

STATE_ATTR = "trace_fp4_state"  # the attribute init_capture sets on the SGLang objects hooks receive
_EARLY_COUNTERS_ATTR = "trace_fp4_counters"


def state_of(obj):
    """The EngineState hung on an SGLang object by init_capture, or None (not a trace_fp4 engine)."""
    return getattr(obj, STATE_ATTR, None)


def model_counters(model_config) -> EngineCounters:
    """Counters of the hooks that run before the model exists (model class choice, KV pool sizing),
    kept on SGLang's ModelConfig of the engine; its EngineState adopts them at init_capture."""
    counters = getattr(model_config, _EARLY_COUNTERS_ATTR, None)
    if counters is None:
        counters = EngineCounters()
        setattr(model_config, _EARLY_COUNTERS_ATTR, counters)
    return counters


class EngineState:
    def __init__(self, trace: TraceConfig):
        self.trace = trace
        self.counters = EngineCounters()
        self.weights = WeightsIdentity(self.counters)
        self.moe_layers: set[int] = set()
        self.shape: ModelShape | None = None
        self.kv_pool = None  # the model runner's token-to-KV pool, once init_capture ran
        self.buffers: CaptureBuffers | None = None
        self.tp_rank, self.tp_size = 0, 1  # this scheduler's tensor-parallel rank (tensor_parallel.py)
        self._local = threading.local()

    @property
    def active(self) -> bool:
        return self.shape is not None

    def register_moe_layer(self, layer_id: int) -> None:
        self.moe_layers.add(layer_id)

    def adopt_counters(self, model_config) -> None:
        """Take over the counts made before this state was reachable; later ones come here."""
        self.counters.update(model_counters(model_config))
        setattr(model_config, _EARLY_COUNTERS_ATTR, self.counters)

    # ---- forward -------------------------------------------------------------------------------
    def current_forward_batch(self):
        return getattr(self._local, "forward_batch", None)

    def stash_kv(self, layer: int, kq, vq=None, qk=None, qv=None) -> None:
        """Keep (or with kq=None drop) the NVFP4 K/V a layer's attention got, for its cache write."""
        stash = getattr(self._local, "kv_stash", None)
        if stash is None:
            stash = self._local.kv_stash = {}
        if kq is None:
            stash.pop(layer, None)
        else:
            stash[layer] = (kq, vq, qk, qv)

    def stashed_kv(self, layer: int):
        return getattr(self._local, "kv_stash", {}).get(layer)

    def begin_forward(self, forward_batch) -> None:
        self._local.forward_batch = forward_batch
        self._local.kv_stash = {}
        if self.buffers is not None:
            self.buffers.begin()

    def abandon_forward(self) -> None:
        self._local.forward_batch = None

    def end_forward(self, forward_batch) -> None:
        self._local.forward_batch = None
        loc = forward_batch.out_cache_loc
        if loc is None or loc.numel() == 0:
            return
        if self.buffers is None:
            return
        # Which layers wrote this forward, from the staging stamps (a cuda graph replay runs no Python).
        missing = self.buffers.missing(loc.shape[0], with_kv=self.trace.quantize_kv)
        moe = sorted({k[1] if k[0] == "routing" else k[0] for k in missing if k[0] == "routing" or k[1] in MOE_SITES})
        kv = sorted({k[1] if k[0] == KV_LOC else k[0] for k in missing if k[0] == KV_LOC or k[1] in KV_SITES})
        if moe:
            raise RuntimeError(f"trace_fp4: a forward did not run MoE layers {moe} through trace_fp4's capture")
        if kv:
            raise RuntimeError(
                f"trace_fp4: a forward did not write K/V through MHATokenToKVPool.set_kv_buffer in layers {kv} "
                "(a fused RoPE+KV-write path bypassed the NVFP4 KV cache; it is not supported)"
            )
        self.buffers.commit(loc, with_kv=self.trace.quantize_kv)
        self.counters.count("forwards_captured")

    def _in_forward(self, what: str) -> bool:
        if getattr(self._local, "forward_batch", None) is None:
            # e.g. SGLang's memory profiling / dummy runs outside ModelRunner.forward.
            self.counters.count(f"capture_outside_forward.{what}")
            return False
        return True

    # Outside ModelRunner.forward (SGLang's cuda graph capture, profiling and dummy runs) the writes
    # still go to the staging buffers: a captured graph must hold them. They are counted, and only a
    # forward's commit reads them.
    def capture_moe(self, layer: int, topk_ids: torch.Tensor, q1, q2) -> None:
        if self._in_forward("moe"):
            fb = self._local.forward_batch
            T = topk_ids.shape[0]
            if fb.out_cache_loc is not None and T != fb.out_cache_loc.shape[0]:
                raise RuntimeError(
                    f"trace_fp4: MoE layer {layer} saw {T} tokens but the forward writes {fb.out_cache_loc.shape[0]} "
                    "KV slots (padded or scattered batches are not supported by the capture)"
                )
        if self.buffers is not None:
            self.buffers.stage_moe(layer, topk_ids, q1, q2)

    def capture_kv(self, layer: int, loc: torch.Tensor, qk, qv) -> None:
        self._in_forward("kv")
        if self.buffers is not None:
            self.buffers.write_kv(layer, loc, qk, qv)

    # ---- request finish ------------------------------------------------------------------------
    def _rows(self, slots: torch.Tensor):
        routing, sites = self.buffers.gather(slots)
        shape = self.shape
        chunk_routing = {layer: routing[:, layer].to(torch.int64) for layer in range(shape.num_layers) if shape.has_moe(layer)}
        chunk_sites = {
            (layer, site): sites[(layer, site)]
            for layer in range(shape.num_layers) if self.buffers.guided[layer]
            for site in shape.layer_sites(layer)
        }
        return chunk_routing, chunk_sites

    def build_record(self, slots: torch.Tensor, token_ids=None, num_prompt_tokens=None):
        """The request's record (on tensor-parallel TP rank 0; None on the other ranks): with TP every
        rank sends its part (a collective) and rank 0 assembles them (trace_kernels.engine.rank_parts)."""
        routing, sites = self._rows(slots)
        identity = {"token_ids": token_ids, "num_prompt_tokens": num_prompt_tokens}
        if self.tp_size == 1:
            return assemble_record(self.shape, self.trace, [(routing, sites)], weights=self.weights.current(),
                                   identity=identity)
        from trace_kernels.engine.rank_parts import assemble_rank_parts, rank_part

        from .tensor_parallel import gather_parts

        n = int(slots.shape[0])
        part = rank_part([(n, sites, routing)], n, rank=self.tp_rank, tp_size=self.tp_size, shape=self.shape,
                         config=self.trace, weights=self.weights.current())
        parts = gather_parts(part)
        if parts is None:
            self.counters.count("record_parts_sent")
            return None
        record, seconds = assemble_rank_parts(parts, identity=identity, where="trace_fp4 (SGLang)")
        self.counters.count("records_assembled_from_ranks")
        return record

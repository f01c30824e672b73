"""Packed NVFP4 KV pool for SGLang 0.5.23 (`MHATokenToKVPool`, NHD layout).

Once SGLang has built its token-to-KV pool (capture_setup.init_capture), `make_packed` swaps each layer's
K and V buffers for uint8 `[slots, kv_heads, row_bytes]` buffers of packed NVFP4 rows
(`trace_kernels.kv_layout`: codes, E4M3 scales, float32 amax; head_dim 128: 76 B instead of 256 B per
row) and turns the pool into `TraceFp4PackedKVPool`. SGLang's slot moves and copies work on bytes
(`data_ptrs` / `data_strides`), so they carry packed rows unchanged.

Write: kv.py stores the packed rows of the codes it quantized (`write_rows`).
Read: attention backends take a layer's whole K (or V) buffer and index it by their requests' slots.
`get_key_buffer` returns a model-dtype buffer of the pool's shape in which only the slots of the
current forward batch's requests (`req_to_token[req, :seq_len]`) are filled with dequantized values;
the other slots are left unset (never read). Outside a forward (no batch known) every slot is
dequantized, counted as `kv_full_pool_reads`.
"""

import torch

from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from trace_kernels.kv_layout import pack_rows, packed_row_bytes, unpack_rows


class TraceFp4PackedKVPool(MHATokenToKVPool):
    """An MHATokenToKVPool whose buffers hold packed NVFP4 rows (see the module docstring)."""

    trace_fp4_packed = True
    trace_fp4_forward_batch = None  # callable -> the current ForwardBatch or None (set by make_packed)
    trace_fp4_req_to_token_pool = None  # the model runner's ReqToTokenPool (set by make_packed)
    trace_fp4_counters = None  # the engine's EngineCounters (set by make_packed)
    trace_fp4_block_scale = "6"  # TraceConfig.block_scale: sets the rows' global scale (set by make_packed)

    def write_rows(self, layer_id: int, loc: torch.Tensor, qk, qv) -> None:
        local = layer_id - self.start_layer
        n = loc.shape[0]
        self.k_buffer[local][loc] = pack_rows(qk[:n]).to(self.k_buffer[local].device)
        self.v_buffer[local][loc] = pack_rows(qv[:n]).to(self.v_buffer[local].device)

    def _read_slots(self):
        fb = self.trace_fp4_forward_batch() if self.trace_fp4_forward_batch else None
        if fb is None or fb.req_pool_indices is None or fb.seq_lens is None:
            return None
        cached = getattr(fb, "_trace_fp4_read_slots", None)
        if cached is not None:
            return cached
        table = self.trace_fp4_req_to_token_pool.req_to_token[fb.req_pool_indices.to(torch.int64)]
        seq_lens = fb.seq_lens.to(table.device, torch.int64)
        cols = torch.arange(table.shape[1], device=table.device)
        slots = table[cols[None, :] < seq_lens[:, None]].to(torch.int64)
        fb._trace_fp4_read_slots = slots
        return slots

    def _dequantized(self, buffers, layer_id: int, head_dim: int, site: str) -> torch.Tensor:
        packed = buffers[layer_id - self.start_layer]
        out = torch.empty((packed.shape[0], packed.shape[1], head_dim), dtype=self.dtype, device=packed.device)
        slots = self._read_slots()
        if slots is None:
            self.trace_fp4_counters.count("kv_full_pool_reads")
            out.copy_(unpack_rows(packed, head_dim).dequantize(self.dtype, block_scale=self.trace_fp4_block_scale))
            return out
        out[slots] = unpack_rows(packed[slots], head_dim).dequantize(self.dtype, block_scale=self.trace_fp4_block_scale)
        self.trace_fp4_counters.count(f"kv_rows_dequantized.{site}", int(slots.shape[0]))
        return out

    def _get_key_buffer(self, layer_id: int):
        return self._dequantized(self.k_buffer, layer_id, self.head_dim, "k")

    def _get_value_buffer(self, layer_id: int):
        return self._dequantized(self.v_buffer, layer_id, self.v_head_dim, "v")

    def get_packed_rows(self, layer_id: int, loc: torch.Tensor):
        """(K rows, V rows) uint8 `[len(loc), kv_heads, row_bytes]` as stored (for tests and tools)."""
        local = layer_id - self.start_layer
        return self.k_buffer[local][loc], self.v_buffer[local][loc]


def make_packed(pool: MHATokenToKVPool, forward_batch_getter, req_to_token_pool, counters, block_scale: str = "6") -> None:
    """Replace `pool`'s model-dtype K/V buffers by packed NVFP4 ones (frees the old buffers)."""
    layout = getattr(pool, "kv_cache_layout", "nhd")
    if layout != "nhd":
        raise NotImplementedError(
            f"trace_fp4: the packed NVFP4 KV pool supports the NHD layout only, got {layout!r} "
            "(unset SGLANG_USE_HND_KVCACHE, or set TRACE_FP4_KV_CACHE=dequantized)"
        )
    if getattr(pool, "post_capture_active", False):
        raise NotImplementedError("trace_fp4: the packed NVFP4 KV pool does not support post-capture KV backing")
    if getattr(pool, "layer_transfer_counter", None) is not None:
        raise NotImplementedError("trace_fp4: the packed NVFP4 KV pool does not support layer-wise KV loading")
    rows = pool.k_buffer[0].shape[0] if pool.layer_num else pool.size + pool.page_size
    device = pool.k_buffer[0].device if pool.layer_num else pool.device
    rk, rv = packed_row_bytes(pool.head_dim), packed_row_bytes(pool.v_head_dim)
    pool.k_buffer = [torch.zeros((rows, pool.head_num, rk), dtype=torch.uint8, device=device) for _ in range(pool.layer_num)]
    pool.v_buffer = [torch.zeros((rows, pool.head_num, rv), dtype=torch.uint8, device=device) for _ in range(pool.layer_num)]
    pool.store_dtype = torch.uint8
    pool.__class__ = TraceFp4PackedKVPool
    pool.trace_fp4_forward_batch = forward_batch_getter
    pool.trace_fp4_req_to_token_pool = req_to_token_pool
    pool.trace_fp4_counters = counters
    pool.trace_fp4_block_scale = block_scale
    pool._kv_buffer_descs = pool._build_kv_buffer_descs()
    pool._init_data_ptrs_and_strides()
    if getattr(pool, "_kv_copy_config", None) is not None:
        pool._init_kv_copy_and_warmup()
    counters.count("kv_pool_packed_layers", pool.layer_num)


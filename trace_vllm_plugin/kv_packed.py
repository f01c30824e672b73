"""Packed NVFP4 KV cache on vLLM's attention backends (CPU_ATTN; TRITON_ATTN / FLASH_ATTN with the Triton
decode read, vLLM 0.32).

Storage. The layer's backend becomes a subclass of CPU_ATTN whose `customize_spec` (vLLM's hook for
backends that pack their KV cache) declares a uint8 page: per block, per KV head, per token, one
packed K row and one packed V row (`trace_kernels.kv_layout`: codes, E4M3 scales, float32 amax; for
head_dim 128 that is 2 x 76 bytes instead of 2 x 256). vLLM's own block accounting divides
`kv_cache_memory_bytes` by that page, so the same memory holds about 3.4x the tokens of BF16
(head_dim 128). The cache tensor vLLM binds to the layer is `[num_blocks, kv_heads, block_size,
2 * row_bytes]` uint8.

Write. `do_kv_cache_update` quantizes K and V with capture (`activations.quantize_input`: the one place
where K/V get their global amax) and stores the packed rows at the tokens' slots.

Read. The CPU attention kernel is a C++ op over a model-dtype cache, so `forward` dequantizes the
blocks this batch's block table references (the first ceil(seq_len / block_size) entries of each
request's row, each block once), writes them with the backend's own cache-write op into a model-dtype
scratch cache of just those blocks, remaps the block table onto the scratch, and runs the base kernel.
The scratch holds exactly the values today's dequantized cache holds, so attention outputs are the same
bits; it lives for one layer call. The used-block set is computed once per step (per metadata object).

Decode read through Triton (`TRACE_FP4_KV_DECODE_ATTENTION=triton`). A batch of single-token decodes
(`max_query_len == 1`) skips the scratch: `trace_kernels.attention.packed_decode_attention` reads the
packed pages directly (K/V decoded in registers to the very values the scratch would hold; outputs
within a BF16 ulp of the scratch path, tests/vllm/test_vllm_kv_packed.py). It has no host
synchronisation and no data-dependent shape, so it runs inside vLLM's full decode CUDA graphs; the
scratch path (a data-dependent block set) does not, so the backend's CUDA-graph support is capped at
single-token decode batches (`_capped_builder`): mixed and prefill batches run piecewise, their attention
outside the graphs. This is how the GPU backends (TRITON_ATTN, FLASH_ATTN: the same logical
`[blocks, kv_heads, block_size, 2 * head_size]` cache view and `do_kv_cache_update` as CPU_ATTN) keep a
packed cache; on a CPU the kernel runs under the Triton interpreter (tests only: seconds per call).
Native read (the default on the native CPU path, `TRACE_FP4_KV_DECODE_ATTENTION=auto` or `native`): every
batch, decode and prefill, is attended by `trace_kernels.cpu_native.attention` (numba) straight from the
packed pages: no scratch, no re-layout, each row decoded once per call. Outputs are within a bf16 ulp of
the scratch path's (same K/V values, a different float32 summation order than vLLM's CPU kernel), so
log-probs can differ in their last bits; `TRACE_FP4_KV_DECODE_ATTENTION=scratch` keeps the scratch read
(bit-identical to the eager engine). Layers or calls it does not cover run the scratch read, counted
(`eager:kv_attention` in cpu_native.FALLBACKS, with the reason).

Not supported by the decode kernel, so such layers use the scratch path (or, on a GPU backend, the
dequantized cache): sliding windows, ALiBi, logits soft-capping, attention sinks.
"""

import dataclasses
import functools

import numpy as np
import torch

from trace_kernels.kv_layout import pack_rows, packed_row_bytes, unpack_rows
from trace_kernels.tensor import NVFP4Tensor

from .activations import quantize_input

_PACKED_BACKENDS: dict[type, type] = {}
_PACKED_IMPLS: dict[type, type] = {}


def _customize_spec(cls, spec):
    spec = cls._trace_fp4_base.customize_spec(spec)
    if spec.state_content_bytes is not None:
        raise NotImplementedError(
            f"trace_fp4: backend {cls._trace_fp4_base.get_name()} already packs its KV cache "
            f"({spec.state_content_bytes} B per cell); the packed NVFP4 cache needs a plain one"
        )
    content = packed_row_bytes(spec.head_size) + packed_row_bytes(spec.head_size_v)
    return dataclasses.replace(spec, dtype=torch.uint8, state_content_bytes=content)


def _capped_builder(base_builder: type) -> type:
    """`base_builder` with its CUDA-graph support capped at single-token decode batches: the packed
    forward is graph safe only on its Triton decode path."""
    from vllm.v1.attention.backend import AttentionCGSupport

    cap = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
        support = base_builder.get_cudagraph_support.__func__(cls, vllm_config, kv_cache_spec)
        return support if support.value <= cap.value else cap

    return type(f"TraceFP4Packed{base_builder.__name__}", (base_builder,), {"get_cudagraph_support": get_cudagraph_support})


def packed_backend_class(base: type) -> type:
    """A subclass of attention backend `base` whose KV cache pages hold packed NVFP4 rows."""
    if base not in _PACKED_BACKENDS:
        builder = _capped_builder(base.get_builder_cls())
        _PACKED_BACKENDS[base] = type(
            f"TraceFP4Packed{base.__name__}",
            (base,),
            {"customize_spec": classmethod(_customize_spec), "_trace_fp4_base": base,
             "get_builder_cls": staticmethod(lambda: builder)},
        )
    return _PACKED_BACKENDS[base]


def attention_feature_unsupported(impl) -> str | None:
    """The attention features neither packed-page kernel (Triton decode, native CPU) implements, or None."""
    window = getattr(impl, "sliding_window", None)
    if window not in (None, -1, (-1, -1)):
        return f"sliding window {window}"
    if getattr(impl, "alibi_slopes", None) is not None:
        return "ALiBi"
    if getattr(impl, "logits_soft_cap", None):
        return f"logits soft-cap {impl.logits_soft_cap}"
    if getattr(impl, "sinks", None) is not None:
        return "attention sinks"
    return None


def decode_kernel_unsupported(impl, head_size_v: int | None = None, block_size: int | None = None) -> str | None:
    """Why `impl`'s layer cannot attend through the Triton decode kernel, or None."""
    for what, n in (("head_size", getattr(impl, "head_size", None)), ("head_size_v", head_size_v), ("block_size", block_size)):
        if n is not None and n & (n - 1):
            return f"{what} {n} (the kernel's tiles need a power of two)"
    return attention_feature_unsupported(impl)


def native_attention_unsupported(impl, dtype: torch.dtype, head_size_v: int, block_scale: str) -> str | None:
    """Why `impl`'s layer cannot attend through the native CPU kernel (it then reads through the scratch,
    each call counted in cpu_native.FALLBACKS as `eager:kv_attention`), or None."""
    from trace_kernels.cpu_native.attention import unsupported

    return attention_feature_unsupported(impl) or unsupported(
        dtype, block_scale, impl.head_size, head_size_v, impl.num_heads, impl.num_kv_heads)


def write_packed(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, qk, qv) -> None:
    """Store packed K and V rows `[T, H, *]` at their slots of `kv_cache` `[B, H, block, 2 * row]`.

    vLLM marks padded tokens with slot -1. They are not filtered out (a boolean mask is a
    data-dependent shape, and a test of it a host synchronisation): each one writes what some real
    write already puts there, so every slot gets one value however the writes are ordered. That is
    the row of the token with the largest slot, or, when no token is real, slot 0's current value.
    On the native CPU path (TRACE_FP4_CPU_BACKEND=native) one kernel stores the same bytes."""
    from trace_kernels import cpu_native

    if cpu_native.applies(kv_cache):
        if kv_cache.is_contiguous():
            from trace_kernels.cpu_native import kv

            return kv.write_rows(kv_cache, slot_mapping, qk, qv)
        cpu_native.count_eager("kv_write", "the cache tensor is not contiguous")
    n = slot_mapping.shape[0]
    rows = torch.cat((pack_rows(qk[:n]), pack_rows(qv[:n])), dim=-1)  # [n, H, 2 * row]
    slots = slot_mapping.to(torch.int64)
    block_size = kv_cache.shape[2]
    valid = slots >= 0
    last = slots.argmax().reshape(1)  # index tensors, not Python ints: no host read
    any_valid = valid.index_select(0, last)  # [1]
    fill_slot = torch.where(any_valid, slots.index_select(0, last), 0)  # [1]
    current = kv_cache[fill_slot // block_size, :, fill_slot % block_size]  # [1, H, 2 * row]
    fill_row = torch.where(any_valid[:, None, None], rows.index_select(0, last), current)
    slots = torch.where(valid, slots, fill_slot)
    rows = torch.where(valid[:, None, None], rows, fill_row)
    kv_cache[slots // block_size, :, slots % block_size] = rows


def used_blocks(attn_metadata, block_size: int, num_blocks: int):
    """(ids of the cache blocks this batch reads, block table remapped onto those ids' order)."""
    cached = getattr(attn_metadata, "_trace_fp4_used_blocks", None)
    if cached is not None and cached[0] == (block_size, num_blocks):
        return cached[1], cached[2]
    table = attn_metadata.block_table
    seq_lens = attn_metadata.seq_lens.to(torch.int64)
    table = table[: seq_lens.shape[0]]
    per_req = (seq_lens + block_size - 1) // block_size
    cols = torch.arange(table.shape[1], device=table.device)
    ids = torch.unique(table[cols[None, :] < per_req[:, None]].to(torch.int64))
    if ids.numel() == 0:  # no request has context yet: keep one (unread) block so the remap is valid
        ids = torch.zeros(1, dtype=torch.int64, device=table.device)
    remap = torch.zeros(num_blocks, dtype=attn_metadata.block_table.dtype, device=table.device)
    remap[ids] = torch.arange(ids.shape[0], dtype=remap.dtype, device=remap.device)
    # Entries past a request's length map to scratch block 0; the kernel never reads them.
    remapped = remap[attn_metadata.block_table.to(torch.int64)]
    attn_metadata._trace_fp4_used_blocks = ((block_size, num_blocks), ids, remapped)
    return ids, remapped


def dequantize_blocks(packed: torch.Tensor, head_size: int, head_size_v: int, dtype: torch.dtype, block_scale: str = "6"):
    """Packed blocks `[U, H, block, 2 * row]` -> (K, V) `[U * block, H, D]` in `dtype`, token-major
    (`block_scale`: TraceConfig.block_scale, which sets the rows' global scale)."""
    rk = packed_row_bytes(head_size)
    k = unpack_rows(packed[..., :rk], head_size).dequantize(dtype, block_scale=block_scale)
    v = unpack_rows(packed[..., rk:], head_size_v).dequantize(dtype, block_scale=block_scale)
    U, H, block = packed.shape[:3]
    return (
        k.permute(0, 2, 1, 3).reshape(U * block, H, head_size),
        v.permute(0, 2, 1, 3).reshape(U * block, H, head_size_v),
    )


def _do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
    idx, store = self._trace_fp4_layer_idx, self._trace_fp4_store
    store.count("kv_calls")
    store.count(_layer_calls_key(idx))
    if _native_write(self, store, key, value, kv_cache):
        return _native_quantize_write(store, idx, key, value, kv_cache, slot_mapping)
    # The cache stores the packed rows: their dequantized values would be thrown away here.
    _, qk = quantize_input(store, key, idx, "k", dequantized=False)
    _, qv = quantize_input(store, value, idx, "v", dequantized=False)
    write_packed(kv_cache, slot_mapping, qk, qv)


def _native_write(self, store, key, value, kv_cache) -> bool:
    """Whether this layer's KV write takes the native fused path: decided at its first call (backend,
    block scale, K / V dtype and head size: what trace_kernels.quantize checks per call), the cache's
    contiguity checked per call (cheap)."""
    ok = getattr(self, "_trace_fp4_native_kv", None)
    if ok is None:
        from trace_kernels import cpu_native
        from trace_kernels.backend import resolve_backend

        ok = (
            kv_cache.device.type == "cpu"
            and resolve_backend(store.kernel_backend, kv_cache.device, store.config.block_scale) == "native"
            and store.config.block_scale == "6"
            and all(t.dtype in (torch.float32, torch.bfloat16, torch.float16) and t.dim() == 3 and t.shape[-1] % 16 == 0
                    for t in (key, value))
        )
        if not ok and cpu_native.applies(kv_cache):
            cpu_native.count_eager("kv_quantize_write", "block scale, K / V dtype or head size outside the native kernel")
        self._trace_fp4_native_kv = ok
    if ok and not kv_cache.is_contiguous():
        from trace_kernels import cpu_native

        cpu_native.count_eager("kv_quantize_write", "the cache tensor is not contiguous")
        return False
    return ok


def _native_quantize_write(store, idx, key, value, kv_cache, slot_mapping) -> None:
    """quantize_input of K and V (dequantized=False) and write_packed, in one native call: the same
    amax decision (site_amax), codes, bytes and capture."""
    per_row = store.config.activation_scale != "static"
    if per_row and key.dtype == torch.bfloat16 and value.dtype == torch.bfloat16:
        # The engine's case: what site_amax gives here computed in the kernel, K / V read as their bf16 bits,
        # the rows kept only for the capture (kv_row_write: why).
        keep = store.wants(idx)
        into = store.host_kv_rows(idx, key.shape[0], key.shape[1], key.shape[2], value.shape[2]) if keep else None
        rows = _native_kv().quantize_write_rows(_page_view(kv_cache), _step_slots(slot_mapping), key, value, keep, into)
        if into is not None:  # written into the step's host arena rows (capture.py: host_kv_rows)
            store.host_wrote(idx, "k", "v")
        elif keep:  # fresh tensors of this call: the native CPU engine's step keeps them without a copy (put_owned)
            (kc, ks, ka), (vc, vs, va) = rows
            store.put_owned(idx, "k", NVFP4Tensor(kc, ks, ka), None)
            store.put_owned(idx, "v", NVFP4Tensor(vc, vs, va), None)
        return
    import trace_kernels
    from trace_kernels.cpu_native import kv

    if per_row:  # what site_amax gives here, computed inside the native kernel (no torch ops per call)
        # numpy-made (np.empty + from_numpy: a third of torch.empty's cost here), fresh per call (put_owned).
        ka = torch.from_numpy(np.empty(key.shape[:-1], dtype=np.float32))
        va = torch.from_numpy(np.empty(value.shape[:-1], dtype=np.float32))
    else:
        ka = trace_kernels.site_amax(store.config, idx, "k", key, saturated=store.saturation)
        va = trace_kernels.site_amax(store.config, idx, "v", value, saturated=store.saturation)
    (kc, ks), (vc, vs) = kv.quantize_write(kv_cache, slot_mapping, key, value, ka, va, compute_amax=per_row)
    if store.wants(idx):
        # kc / ks / vc / vs are this call's own tensors (kv.quantize_write allocates them), ka / va too
        # unless a static amax: the native CPU engine's step keeps them without a copy (put_owned).
        store.put_owned(idx, "k", NVFP4Tensor(kc, ks, ka), None)
        store.put_owned(idx, "v", NVFP4Tensor(vc, vs, va), None)


@functools.cache
def _layer_calls_key(idx: int) -> str:
    """The per-layer call counter's name, made once (an f-string per layer call cost ~0.3 us)."""
    return f"kv_calls.layer{idx}"


def _page_view(kv_cache: torch.Tensor) -> np.ndarray:
    """The cache tensor's numpy view, made at its first native write and held on the tensor object: vLLM binds
    one cache tensor per layer for the engine's life, and `.numpy()` per layer call cost ~1 us in the engine.
    A view shares the tensor's memory, so it sees every write; it is remade if the tensor's data moved."""
    held = getattr(kv_cache, "_trace_fp4_page", None)
    ptr = kv_cache.data_ptr()
    if held is None or held[0] != ptr:
        held = (ptr, kv_cache.numpy())
        kv_cache._trace_fp4_page = held
    return held[1]


_STEP_SLOTS: tuple = (None, None)  # (the last int64 slot-mapping tensor written with, its numpy view)


def _step_slots(slot_mapping: torch.Tensor) -> np.ndarray:
    """The slot mapping as int64 numpy: vLLM hands every layer of a step the same tensor object (a fresh
    slice each step), so its view is made once a step, not once a layer (`.numpy()` and the dtype test
    cost ~2-3 us a layer call in the engine). Held with the tensor itself, so the identity test cannot
    match a new tensor at a freed one's address; a view reads the memory as it is at each call, so it is
    right even if the same tensor's values were rewritten. An int32 mapping is cast per call (a copy)."""
    global _STEP_SLOTS
    held = _STEP_SLOTS
    if held[0] is slot_mapping:
        return held[1]
    if slot_mapping.dtype != torch.int64:
        return slot_mapping.to(torch.int64).numpy()
    slots = slot_mapping.numpy()
    _STEP_SLOTS = (slot_mapping, slots)
    return slots


@functools.cache
def _native_kv():
    """trace_kernels.cpu_native.kv_row_write, imported at the first native write (numba's import is ~0.5 s,
    which the default path must not pay), then held: an import statement per layer call costs ~1 us."""
    from trace_kernels.cpu_native import kv_row_write

    return kv_row_write


def _decode_forward(self, query, kv_cache, attn_metadata, output):
    """A batch of single-token decodes, attended by the Triton kernel straight from the packed pages."""
    from trace_kernels.attention import packed_decode_attention

    n = attn_metadata.seq_lens.shape[0]  # requests (in a CUDA graph: the padded count, padding has length 0)
    Hq, DV = self.num_heads, self._trace_fp4_head_size_v
    out = output.view(output.shape[0], Hq, DV)[:n]
    packed_decode_attention(query[:n], kv_cache, attn_metadata.block_table, attn_metadata.seq_lens, self.scale, DV, out=out)
    self._trace_fp4_store.count("kv_decode_attention_triton_calls")  # eager calls (a replay runs no Python)
    return output


def _forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
    base = self._trace_fp4_base
    if attn_metadata is None:  # vLLM's warm-up / profiling call: nothing to read
        return base.forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
    fused_output_quant = args or kwargs.get("output_scale") is not None or kwargs.get("output_block_scale") is not None
    if self._trace_fp4_decode_kernel and attn_metadata.max_query_len == 1 and not fused_output_quant:
        return _decode_forward(self, query, kv_cache, attn_metadata, output)
    wants, why = _reads_native(self, kv_cache)
    if wants:
        why = why or _native_call_why(attn_metadata, fused_output_quant)
        if why is None:
            return _native_forward(self, layer, query, key, value, kv_cache, attn_metadata, output)
        _cpu_native().count_eager("kv_attention", why)
    return _scratch_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)


def _scratch_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
    """The used blocks dequantized into a model-dtype scratch, laid out by the backend's own cache write and
    attended by its own kernel (bit-identical to a model-dtype cache of the dequantized rows)."""
    from trace_kernels import cpu_native

    base = self._trace_fp4_base
    num_blocks, num_heads, block_size, _ = kv_cache.shape
    ids, table = used_blocks(attn_metadata, block_size, num_blocks)
    shape = (ids.shape[0], num_heads, block_size, self.head_size + self._trace_fp4_head_size_v)
    if cpu_native.applies(kv_cache):
        k, v, slots = _native_read(self, kv_cache, ids, table, attn_metadata, block_size)
        scratch = torch.zeros(shape, dtype=self._trace_fp4_dtype)  # rows nobody attends to: 0, never read
    else:
        k, v = dequantize_blocks(kv_cache[ids], self.head_size, self._trace_fp4_head_size_v, self._trace_fp4_dtype,
                                 self._trace_fp4_block_scale)
        scratch = torch.empty(shape, dtype=self._trace_fp4_dtype, device=kv_cache.device)
        slots = torch.arange(k.shape[0], dtype=torch.int64, device=kv_cache.device)
    # The backend's own cache write lays the values out as its kernel expects (e.g. AMX tiles).
    base.do_kv_cache_update(self, layer, k, v, scratch, slots)
    self._trace_fp4_store.count("kv_blocks_dequantized", int(ids.shape[0]))
    meta = dataclasses.replace(attn_metadata, block_table=table)
    return base.forward(self, layer, query, key, value, scratch, meta, output, *args, **kwargs)


@functools.cache
def _cpu_native():
    """trace_kernels.cpu_native, imported at the first attention call and then held (an import statement per
    layer call costs ~1 us)."""
    from trace_kernels import cpu_native

    return cpu_native


def _reads_native(self, kv_cache) -> tuple[bool, str | None]:
    """(wants, why): whether this layer is to attend through the native kernel (its mode "native", or "auto" with
    TRACE_FP4_CPU_BACKEND=native on a CPU cache), and the layer's reason it cannot (its shape or config, the cache
    tensor), or None. Decided once per layer and cache tensor, at its first call, and held on the layer: every
    input is fixed for an engine's life (the mode and shape at build; the backend variable is set before an engine
    starts, the benches and tests start a new engine to switch it; the cache is allocated once), and testing it
    all on every call cost ~2 us a layer call. Keyed by the cache's address, so a call on another cache decides
    anew."""
    held = getattr(self, "_trace_fp4_reads_native", None)
    ptr = kv_cache.data_ptr()
    if held is not None and held[0] == ptr:
        return held[1], held[2]
    mode = getattr(self, "_trace_fp4_attention", "scratch")
    wants = mode == "native" or (mode == "auto" and _cpu_native().applies(kv_cache))
    why = getattr(self, "_trace_fp4_native_why", "the layer was not set up for it")
    if why is None and (kv_cache.device.type != "cpu" or not kv_cache.is_contiguous()):
        why = "the cache tensor is not a contiguous CPU tensor"
    self._trace_fp4_reads_native = (ptr, wants, why)
    return wants, why


def _native_call_why(attn_metadata, fused_output_quant) -> str | None:
    """Why this call (not the layer) cannot attend through the native kernel, or None."""
    if fused_output_quant:
        return "fused output quantization"
    if attn_metadata.causal is not True or getattr(attn_metadata, "dynamic_causal", None) is not None:
        return "non-causal attention"
    return None


@functools.cache
def _packed_attention():
    """trace_kernels.cpu_native.attention.packed_attention, imported at the first native call, then held."""
    from trace_kernels.cpu_native.attention import packed_attention

    return packed_attention


def _native_forward(self, layer, query, key, value, kv_cache, attn_metadata, output):
    """Every request's query tokens attended straight from the packed pages (trace_kernels.cpu_native.attention):
    no scratch, no re-layout; outputs within a bf16 ulp of `_scratch_forward`'s (its own summation order).
    (layer, key, value: unused, the scratch path's arguments, so a test can run both on one call.)"""
    n = attn_metadata.num_actual_tokens
    table, lens, qsl = attn_metadata.block_table, attn_metadata.seq_lens, attn_metadata.query_start_loc
    if kv_cache.is_contiguous():
        # The engine's usual call (bf16, contiguous query and output): the query and the output by address, the
        # layer's checks done once (attention.packed_attention_bf16: why); None where packed_attention must run.
        held = (_page_view(kv_cache), *_step_index(attn_metadata, table, lens, qsl))
        if _attention_bf16()(query, output, n, held, _layer_consts(self, kv_cache)) is not None:
            self._trace_fp4_store.count("kv_attention_native_calls")
            return output
    _packed_attention()(query[:n], kv_cache, table, lens, qsl, self.scale, self._trace_fp4_head_size_v,
                        self._trace_fp4_block_scale, out=output[:n],
                        held=(_page_view(kv_cache), *_step_index(attn_metadata, table, lens, qsl))
                        if kv_cache.is_contiguous() else None)  # (vLLM's cache is; a strided one is copied there)
    self._trace_fp4_store.count("kv_attention_native_calls")
    return output


@functools.cache
def _attention_bf16():
    """trace_kernels.cpu_native.attention.packed_attention_bf16, imported at the first native call, then held."""
    from trace_kernels.cpu_native.attention import packed_attention_bf16

    return packed_attention_bf16


def _layer_consts(self, kv_cache) -> tuple:
    """The layer's fixed arguments of packed_attention_bf16 (attention.layer_consts: the cache's and the shape's
    checks, the tables, the scale as float32), made at its first native call and held on the layer, keyed by the
    cache's address as _reads_native is (vLLM binds a layer one cache tensor; a call on another decides anew)."""
    held = getattr(self, "_trace_fp4_attention_consts", None)
    ptr = kv_cache.data_ptr()
    if held is not None and held[0] == ptr:
        return held[1]
    from trace_kernels.cpu_native.attention import layer_consts

    consts = layer_consts(kv_cache, self.num_heads, self.head_size, self._trace_fp4_head_size_v,
                          self._trace_fp4_block_scale, self.scale)
    self._trace_fp4_attention_consts = (ptr, consts)
    return consts


def _step_index(attn_metadata, table, lens, qsl) -> tuple:
    """The step's block table, sequence lengths and query start locations as the native attention reads them
    (attention.index_views), made at a step's first layer call and held on its metadata, which vLLM hands every
    layer of the step: three `.numpy()` calls and two slices cost ~8 us a layer call. Held with the tensors
    themselves, so the identity test cannot match new tensors at freed ones' addresses; views read the values
    as they are at each call. Tensors the views would have to copy (another dtype, not contiguous) are
    converted per call, as before."""
    held = getattr(attn_metadata, "_trace_fp4_native_index", None)
    if held is not None and held[0] is table and held[1] is lens and held[2] is qsl:
        return held[3]
    from trace_kernels.cpu_native.attention import index_views

    *views, are_views = index_views(table, lens, qsl)
    if are_views:
        attn_metadata._trace_fp4_native_index = (table, lens, qsl, views)
    return views


def _native_read(self, kv_cache, ids, table, attn_metadata, block_size: int):
    """The native CPU path's read (TRACE_FP4_CPU_BACKEND=native): one kernel dequantizes, straight from the
    pages, only the rows some request attends to (its first seq_len tokens), the same values the torch
    path puts there; returns (K, V, their scratch slots). The valid rows are counted once per step."""
    from trace_kernels.cpu_native import kv

    key = (block_size, kv_cache.shape[0])  # the key used_blocks caches the ids under
    cached = getattr(attn_metadata, "_trace_fp4_valid_rows", None)
    if cached is not None and cached[0] == key:
        valid = cached[1]
    else:
        valid = kv.valid_rows(table, attn_metadata.seq_lens, block_size, ids.shape[0])
        attn_metadata._trace_fp4_valid_rows = (key, valid)
    return kv.dequantize_blocks(kv_cache, ids, self.head_size, self._trace_fp4_head_size_v, self._trace_fp4_dtype,
                                self._trace_fp4_block_scale, valid=valid)


def packed_impl_class(base: type) -> type:
    """A subclass of backend impl `base` that writes packed NVFP4 K/V and dequantizes on read."""
    if base not in _PACKED_IMPLS:
        _PACKED_IMPLS[base] = type(
            f"TraceFP4Packed{base.__name__}",
            (base,),
            {"do_kv_cache_update": _do_kv_cache_update, "forward": _forward, "_trace_fp4_base": base},
        )
    return _PACKED_IMPLS[base]

"""Compile (or load from the disk cache) every native kernel ahead of first use: `trace-fp4 compile-kernels`.

Why: a numba kernel compiles on its first call in a process whose cache directory (cache.py) holds no
entry for its sources yet. On 2 cores the whole set takes about two and a half minutes, the sparse
decode alone ~50 s. Paid inside a rollout worker, that is a first step minutes long on every fresh
image or edited checkout (and on every Ray worker that starts before the first one has written the
cache); paid inside the test suite, it is most of the fast tier. Run once where the cache is written
(an image build, scripts/setup_venv.sh), later processes load the machine code in milliseconds.

Nothing here is required: a kernel not compiled ahead still compiles on its first call, as before.
Each warm-up calls a public entry point on a tiny input with the native backend, so it compiles the
signatures the engines and the trainer use (bf16 and float32 inputs, int32 and int64 ids, with and
without capture); a caller with another array layout compiles its own signature on first use. Every
warm-up checks that it ran natively (no counted fallback), so a kernel that stopped compiling is an
error here, not a silent eager path.
"""

import time
from collections.abc import Callable

import numpy as np
import torch

from . import api, cpu_native
from .backend import dequantize


def _rows(rows: int, K: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, K, generator=g) * 3).to(dtype)


def quantize() -> None:
    """quantize / dequantize / quantize_dequantize (both block-scale rules), bf16 and float32 input."""
    for dtype in (torch.bfloat16, torch.float32):
        x = _rows(8, 64, 0, dtype)
        for rule in ("6", "4over6"):
            q = api.quantize(x, api.row_amax(x), backend="native", block_scale=rule)
            dequantize(q, dtype, backend="native", block_scale=rule)
            api.quantize_dequantize(x, backend="native", block_scale=rule)


def guided() -> None:
    """Guided rounding toward a full and a compact guide (the trainer's sites), bf16 and float32."""
    from .guides.compact import compact

    for dtype in (torch.bfloat16, torch.float32):
        x = _rows(8, 64, 1, dtype)
        guide = api.quantize(x * 1.01, api.row_amax(x), backend="native")
        api.quantize_guided(x, guide, backend="native")
        api.quantize_guided(x, compact(guide), backend="native")


def sparse() -> None:
    """Sparse encode (one record, and a take's batched encode) and the trainer's decode, bf16 and float32."""
    from .guides import sparse as sg
    from .guides.sparse.fused_encode import encode_payload

    x = _rows(96, 64, 2)
    q = api.quantize(x, api.row_amax(x))
    for site in ("moe_fc1_in", "k"):
        encode_payload(q, site, backend="native")
        guide = sg.unpack(sg.pack(sg.encode(q, site)), (96,), 64)
        noisy = x.float() * (1 + 0.01 * torch.randn(x.shape, generator=torch.Generator().manual_seed(3)))
        for values in (noisy, noisy.to(torch.bfloat16)):
            sg.decode(guide, values, sg.DecodeReport(), backend="native")
    take_encode()


def take_encode() -> None:
    """The engine take's batched encode (every record of a take in one call per site, engine/take.py), as
    the take calls it: it has its own machine code, which a process would otherwise load (or compile) at
    its first take."""
    from .config import TraceConfig
    from .cpu_native import sparse_encode
    from .guides.sparse.rates import layer_rates, segment
    from .guides.sparse.wire import version_for

    x = _rows(12, 64, 8)
    q = api.quantize(x, api.row_amax(x), backend="native")
    rates = layer_rates(TraceConfig(), 0, "moe_fc1_in", 64)
    sparse_encode.encode_many(q.codes, q.scales, q.global_amax, np.array([0, 5, 12], dtype=np.int64), 64, segment(64),
                              rates, version_for(rates))
    # the one call a take makes for every site (cpu_native.take_encode): two records, one audited row
    from .cpu_native import take_encode
    from .engine.take import _site_plan

    shape = _WarmShape()
    meta, cols = _site_plan(shape, TraceConfig(), [(0, "moe_fc1_in")])
    arrays = [{(0, "moe_fc1_in"): (q.codes.numpy(), q.scales.numpy(), q.global_amax.numpy())}]
    take_encode.encode_take(arrays, [(0, "moe_fc1_in")], np.zeros(12, dtype=np.int64), np.arange(12, dtype=np.int64),
                            np.array([0, 5, 12], dtype=np.int64), meta, cols, np.array([0, 1, 1], dtype=np.int64),
                            np.array([2], dtype=np.int64))
    take_routing()


def take_routing() -> None:
    """The engine take's routing packer (every packed MoE layer of every record of a take in one call,
    cpu_native.take_routing), as the take calls it: two records of 3 and 2 tokens, top_k 2, 8 experts."""
    from .cpu_native import take_routing as tr

    ids = np.arange(10, dtype=np.int16).reshape(5, 2) % 8
    tr.pack_take([[ids]], np.zeros(5, dtype=np.int64), np.arange(5, dtype=np.int64), np.array([0, 3, 5], dtype=np.int64),
                 2, 8, 3)


class _WarmShape:
    """The one thing the take's site plan asks of a shape: a site's row (64 values)."""

    @staticmethod
    def row_shape(site):
        return (64,)


def engine_take() -> None:
    """The kernels an engine's take runs (the batched encode, the audit draw). The vLLM plugin loads them
    at model load, inside the engine's constructor: vLLM freezes the heap there (gc.freeze at the end of
    EngineCore.__init__), so their dispatchers and compile results are never scanned by the collector
    again, and the first take does not pay the load (~50 ms; a compile when the cache is empty)."""
    take_encode()
    audit_draw()


def kv_and_attention() -> None:
    """The packed KV write (float32 and bf16 rows) and attention over it (serial and parallel), its block
    read-back."""
    from .cpu_native import attention, kv, kv_row_write
    from .kv_layout import packed_row_bytes

    blocks, heads, block, D = 2, 2, 16, 64
    cache = torch.zeros(blocks, heads, block, 2 * packed_row_bytes(D), dtype=torch.uint8)
    slots = torch.arange(20, dtype=torch.int64)
    for dtype in (torch.float32, torch.bfloat16):
        k, v = _rows(20 * heads, D, 4, dtype).view(20, heads, D), _rows(20 * heads, D, 5, dtype).view(20, heads, D)
        ka, va = torch.empty(20, heads), torch.empty(20, heads)
        kv.quantize_write(cache, slots, k, v, ka, va, compute_amax=True)
        if dtype == torch.bfloat16:
            kv_row_write.quantize_write_per_row(cache, slots, k, v, keep=True)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    for dtype in (torch.bfloat16, torch.float32):
        q = _rows(20 * 4, D, 6, dtype).view(20, 4, D)
        for ints in (torch.int32, torch.int64):
            lens, qsl = torch.tensor([20], dtype=ints), torch.tensor([0, 20], dtype=ints)
            for parallel in (False, True):
                with cpu_native.parallel_launch() if parallel else _nothing():
                    attention.packed_attention(q, cache, table.to(ints), lens, qsl, D**-0.5, parallel=parallel)
            if dtype == torch.bfloat16:  # the engine's entry (query and result by address)
                held = (cache.numpy(), *attention.index_views(table.to(ints), lens, qsl)[:3])
                consts = attention.layer_consts(cache, 4, D, D, "6", D**-0.5)
                attention.packed_attention_bf16(q, torch.empty_like(q), 20, held, consts)
        kv.dequantize_blocks(cache, torch.tensor([0, 1]), D, D, dtype)
    # the capture store's host arena commit (engine/host_arena.py), once a step of the native engine
    from .cpu_native.row_copy import copy_rows_kernel

    src, dst = np.arange(8, dtype=np.uint8), np.zeros(16, dtype=np.uint8)
    copy_rows_kernel(np.array([src.ctypes.data], dtype=np.int64), np.array([dst.ctypes.data], dtype=np.int64),
                     np.array([4], dtype=np.int64), 2, 1)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def experts() -> None:
    """Routed experts (the engine's one-call case and the general two-call one), with and without capture,
    int32 and int64 expert ids; the grouped GEMM alone."""
    from .grouped_mm import grouped_mm
    from .grouped_mm.weights import PackedExperts
    from .routed_experts import routed_experts

    E, H, I, k, T = 4, 64, 32, 2, 8
    g = torch.Generator().manual_seed(7)
    w13, w2 = PackedExperts.empty(E, 2 * I, H), PackedExperts.empty(E, H, I)
    for e in range(E):
        w13.quantize_expert_(e, torch.randn(2 * I, H, generator=g) / H**0.5)
        w2.quantize_expert_(e, torch.randn(H, I, generator=g) / I**0.5)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    weights = torch.softmax(torch.randn(T, k, generator=g), -1)
    for ints in (torch.int32, torch.int64):
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(ints)
        for capture in (False, True):
            routed_experts(x, weights, ids, w13, w2, "silu", capture=capture, backend="native")
    static = lambda site, rows: torch.full((rows.shape[0],), 4.0)  # noqa: E731  (a static site amax: the general path)
    routed_experts(x, weights, ids, w13, w2, "silu", capture=True, amax=static, backend="native")
    offs = torch.tensor([2, 4, 6, 8], dtype=torch.int32)
    grouped_mm(x, w13, offs, backend="native")


def audit_draw() -> None:
    """The audit's row draw (both sides derive it from the record's identity)."""
    from .cpu_native import audit_draw as draw

    draw.first_uniforms([1, 2, 3])


WARMUPS: dict[str, Callable[[], None]] = {
    "quantize": quantize,
    "guided": guided,
    "sparse": sparse,
    "kv_and_attention": kv_and_attention,
    "experts": experts,
    "audit_draw": audit_draw,
}


def compile_all(names=None, log=print) -> dict[str, float]:
    """Run the named warm-ups (default: all) with the native backend; seconds each. Raises if any of them
    ran a counted eager fallback instead of its kernel."""
    unknown = sorted(set(names or ()) - set(WARMUPS))
    if unknown:
        raise ValueError(f"unknown kernel groups {unknown}; known: {sorted(WARMUPS)}")
    seconds = {}
    for name in names or WARMUPS:
        before = cpu_native.fallbacks()
        t0 = time.perf_counter()
        WARMUPS[name]()
        seconds[name] = time.perf_counter() - t0
        after = cpu_native.fallbacks()
        fell = {p: n - before.get(p, 0) for p, n in after.items() if n != before.get(p, 0)}
        if fell:
            raise RuntimeError(f"warm-up {name!r} ran the torch reference instead of its kernel: {fell} "
                               f"({ {p: cpu_native.NOT_NATIVE.get(p.split(':', 1)[1]) for p in fell} })")
        log(f"{name}: {seconds[name]:.1f} s")
    return seconds

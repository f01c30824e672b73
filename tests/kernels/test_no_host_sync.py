"""The captured forward's device path can live in a CUDA graph: the MoE computation with capture and
the K/V quantize-and-write, on the Triton backend (interpreted here), make no host synchronisation and
no data-dependent shape, and their captures land in the static step buffers. The mode itself is shown
to catch what it must (otherwise a pass would prove nothing). The same check through vLLM's own layer
calls is in tests/vllm/test_vllm_graph_capture.py."""

import pytest
import torch

import trace_kernels as tk
from host_sync_mode import HostSyncError, NoHostSync
from trace_kernels import ModelShape, TraceConfig
from trace_kernels.grouped_mm import PackedExperts
from trace_kernels.routed_experts import routed_experts
from trace_vllm_plugin.activations import quantize_input
from trace_vllm_plugin.capture import CaptureStore
from trace_vllm_plugin.kv_packed import write_packed

E, H, I, K_TOP = 4, 32, 16, 2
SHAPE = ModelShape(num_layers=1, hidden_size=H, moe_intermediate_size=I, num_experts=E, top_k=K_TOP, num_kv_heads=2, head_dim=16)


def _store():
    store = CaptureStore(SHAPE, TraceConfig(guidance="full", guided_layers="all"), capacity=16)
    store.kernel_backend = "triton"
    return store


@pytest.mark.parametrize("op", [lambda t: t.sum().item(), lambda t: t.nonzero(), lambda t: t[t > 0],
                                lambda t: torch.unique(t), lambda t: t.repeat_interleave(t.long().abs() % 3)])
def test_the_mode_catches_syncs_and_data_dependent_shapes(op):
    with pytest.raises(HostSyncError):
        with NoHostSync():
            op(torch.randn(6))


def test_moe_with_capture_on_triton_has_no_host_sync():
    g = torch.Generator().manual_seed(0)
    w13, w2 = PackedExperts.empty(E, 2 * I, H), PackedExperts.empty(E, H, I)
    for e in range(E):
        w13.quantize_expert_(e, torch.randn(2 * I, H, generator=g))
        w2.quantize_expert_(e, torch.randn(H, I, generator=g))
    T = 5
    x = torch.randn(T, H, generator=g).bfloat16()
    ids, wts = torch.randint(0, E, (T, K_TOP), generator=g), torch.rand(T, K_TOP, generator=g)
    store = _store()
    mode = NoHostSync()
    with mode:
        out, q1, q2 = routed_experts(x, wts, ids, w13, w2, "silu", capture=True, backend="triton")
        store.put_routing(0, ids)
        store.put(0, "moe_fc1_in", q1)
        store.put(0, "moe_fc2_in", q2)
    assert mode.ops > 50 and mode.allowed == 0
    ref, r1, r2 = routed_experts(x, wts, ids, w13, w2, "silu", capture=True, backend="torch")
    assert torch.equal(out, ref)
    rows = store.buffers.read([(0, "moe_fc1_in"), (0, "moe_fc2_in"), ("routing", 0)], 0, T)
    assert torch.equal(rows[(0, "moe_fc1_in")].codes, r1.codes) and torch.equal(rows[(0, "moe_fc2_in")].scales, r2.scales)
    assert torch.equal(rows[("routing", 0)], ids.to(torch.int16))
    assert store.counters["capture_buffer_overflow_writes"] == 0


def test_kv_quantize_and_packed_write_have_no_host_sync():
    from trace_kernels.kv_layout import packed_row_bytes, unpack_rows

    g = torch.Generator().manual_seed(1)
    T, heads, D, blocks, block = 4, 2, 16, 3, 4
    key, value = (torch.randn(T, heads, D, generator=g).bfloat16() for _ in range(2))
    slots = torch.tensor([5, 0, -1, -1])  # two padded tokens, as a CUDA graph's padded batch has
    cache = torch.randint(0, 255, (blocks, heads, block, 2 * packed_row_bytes(D)), generator=g, dtype=torch.uint8)
    before = cache.clone()
    store = _store()
    mode = NoHostSync()
    with mode:
        _, qk = quantize_input(store, key, 0, "k")
        _, qv = quantize_input(store, value, 0, "v")
        write_packed(cache, slots, qk, qv)
    # Only the CPU branch of the global-amax sign check reads on the host (CUDA: torch._assert_async).
    assert mode.ops > 20 and mode.allowed > 0
    rk = packed_row_bytes(D)
    for t, s in ((0, 5), (1, 0)):
        got = unpack_rows(cache[s // block, :, s % block, :rk], D)
        assert torch.equal(got.codes, qk.codes[t]) and torch.equal(got.scales, qk.scales[t])
    untouched = torch.ones(blocks * block, dtype=torch.bool)
    untouched[[0, 5]] = False
    flat = lambda c: c.permute(0, 2, 1, 3).reshape(blocks * block, heads, -1)  # noqa: E731
    assert torch.equal(flat(cache)[untouched], flat(before)[untouched])
    assert torch.equal(store.buffers.read([(0, "k")], 0, T)[(0, "k")].codes, qk.codes)


def test_packed_write_of_only_padded_tokens_changes_nothing():
    from trace_kernels.kv_layout import packed_row_bytes

    x = torch.randn(2, 1, 16)
    q = tk.quantize(x, tk.row_amax(x))
    cache = torch.randint(0, 255, (2, 1, 4, 2 * packed_row_bytes(16)), dtype=torch.uint8)
    before = cache.clone()
    with NoHostSync():
        write_packed(cache, torch.tensor([-1, -1]), q, q)
    assert torch.equal(cache, before)

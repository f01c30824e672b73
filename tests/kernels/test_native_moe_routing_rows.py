"""The native MoE call writes the step's routing rows itself (routed_experts.engine_call's `ids_into`, what the
capture store's host_moe_rows(..., ids=True) hands out on the native engine's host-rows path): the ids the
kernel writes are the router's ids cast to int16 as put_routing casts them, the call's output and captures
are the same bits with or without them, and a step where a layer's call wrote no routing rows is refused
by name. The real kernel and the real store; random ids and rows."""

import numpy as np
import pytest
import torch

import trace_kernels
from trace_kernels import ModelShape, TraceConfig
from trace_kernels.cpu_native import routed_experts as native
from trace_vllm_plugin.capture import CaptureStore, StepLayout

from packed_experts import random_packed_experts

H, I, E, K = 64, 32, 8, 2
SHAPE = ModelShape(num_layers=2, hidden_size=H, moe_intermediate_size=I, num_experts=E, top_k=K, num_kv_heads=1, head_dim=16)


def _weights(seed):
    return random_packed_experts(E, H, I, seed)


def _call(T, ids_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(ids_dtype)
    wts = torch.softmax(torch.randn(T, K, generator=g), -1)
    return x, wts, ids


def _bits(t):
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().view(np.uint8).tobytes()


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("T", [1, 16, 37])
def test_the_kernel_writes_the_routers_ids_and_the_same_captures(ids_dtype, T):
    w13, w2 = _weights(T)
    x, wts, ids = _call(T, ids_dtype, seed=100 + T)
    out0, q1, q2 = native.engine_call(x, wts, ids, w13, w2, True)  # the store's put_owned path
    rows = (np.empty((T, H // 2), np.uint8), np.empty((T, H // 16), np.uint8), np.empty(T, np.float32),
            np.empty((T, K, I // 2), np.uint8), np.empty((T, K, I // 16), np.uint8), np.empty((T, K), np.float32))
    ids_rows = np.full((T, K), -7, dtype=np.int16)  # not the ids: the kernel must write every one
    out1, none1, none2 = native.engine_call(x, wts, ids, w13, w2, True, rows, ids_rows)
    assert none1 is None and none2 is None
    assert np.array_equal(ids_rows, ids.to(torch.int16).numpy())  # put_routing's cast
    assert _bits(out0) == _bits(out1)
    for q, r in ((q1, rows[:3]), (q2, rows[3:])):
        for t, a in zip((q.codes, q.scales, q.global_amax), r):
            assert _bits(t) == a.view(np.uint8).tobytes()


def test_ids_into_of_another_shape_or_dtype_is_refused():
    w13, w2 = _weights(0)
    x, wts, ids = _call(4, torch.int64, seed=1)
    for bad in (np.empty((4, K + 1), np.int16), np.empty((3, K), np.int16), np.empty((4, K), np.int32)):
        with pytest.raises(ValueError, match="ids_into"):
            native.engine_call(x, wts, ids, w13, w2, True, None, bad)


def _store():
    store = CaptureStore(SHAPE, TraceConfig(guidance="full", guided_layers="all"))
    store.host_rows = True
    store.max_bytes = 1 << 30
    return store


def _step(store, ids, lengths, starts, weights, rng, routing_of=(0, 1)):
    """One forward of the two layers as the native engine's layer calls make it: the KV rows random bytes, the
    MoE call the real kernel (its ids into the store's routing rows where the store hands them out, except for
    the layers not in `routing_of`, whose call writes its captures but no routing: a bypassed router capture).
    A key's first write (no buffers yet) goes through put_owned / put_routing. Returns {layer: the router's ids}."""
    N = sum(lengths)
    qsl = [int(v) for v in np.cumsum([0, *lengths])]
    store.begin_step(StepLayout(list(ids), qsl, list(starts)))
    routed = {}
    for layer in range(SHAPE.num_layers):
        out = store.host_kv_rows(layer, N, 1, 16, 16)
        if out is None:
            from trace_kernels.cpu_native.kv_row_write import _outputs

            out = tuple(torch.from_numpy(a) for a in _outputs(N, 1, 16, 16))
            store.put_owned(layer, "k", trace_kernels.NVFP4Tensor(out[2], out[3], out[0]))
            store.put_owned(layer, "v", trace_kernels.NVFP4Tensor(out[4], out[5], out[1]))
        else:
            for a in out:
                a[...] = rng.integers(0, 256, a.nbytes, dtype=np.uint8).view(a.dtype).reshape(a.shape)
            store.host_wrote(layer, "k", "v")
        x, wts, topk = _call(N, torch.int32, seed=int(rng.integers(1 << 30)))
        routed[layer] = topk.to(torch.int16).numpy()
        w13, w2 = weights
        rows = store.host_moe_rows(layer, N, H, K, I, True) if store.routing_by_kernel(layer) else None
        ids_rows = None
        if rows is not None:
            rows, ids_rows = rows[:6], rows[6]
        if ids_rows is None or layer not in routing_of:
            ids_rows = None
            if layer in routing_of:
                store.put_routing(layer, topk)
        done = native.engine_call(x, wts, topk, w13, w2, True, rows, ids_rows)
        if rows is not None:
            store.host_wrote(layer, "moe_fc1_in", "moe_fc2_in", ids_rows is not None)
        else:
            store.put_owned(layer, "moe_fc1_in", done[1])
            store.put_owned(layer, "moe_fc2_in", done[2])
    store.end_step()
    return routed


def test_the_store_keeps_the_ids_the_kernel_wrote_and_refuses_a_step_without_them_by_name():
    store, rng, weights = _store(), np.random.default_rng(3), _weights(9)
    want = {"a": [], "b": []}

    def run(lengths, starts, **kw):
        routed = _step(store, ["a", "b"], lengths, starts, weights, rng, **kw)
        for i, r in enumerate("ab"):
            lo = sum(lengths[:i])
            want[r].append({layer: ids[lo : lo + lengths[i]] for layer, ids in routed.items()})

    run([3, 2], [0, 0])  # the first step: every key's first write (put_owned / put_routing)
    for s in range(4):
        run([1, 1], [3 + s, 2 + s])  # the kernel's ids into the arena
    assert store.counters["steps_missing_capture"] == 0
    store.finish("a")
    cap = store.take("a", 7)
    routing = cap.record_chunks()
    from trace_kernels.engine.captured_rows import ChunkJoiner

    joined = ChunkJoiner().join([x for x, _ in routing])
    for layer in range(SHAPE.num_layers):
        assert np.array_equal(joined[layer].numpy(), np.concatenate([w[layer] for w in want["a"]]))
    # layer 1's MoE call wrote its captures but not its routing rows: the step is refused, naming them
    _step(store, ["b"], [1], [6], weights, rng, routing_of=(0,))
    assert store.counters["steps_missing_capture"] == 1
    err = store.live["b"].error
    assert err is not None and "routing of layer 1" in err and "did not write" in err

"""trace_sglang_plugin's engine-independent part, without SGLang: the capture buffers (staging per
forward -> host rows per KV slot -> a request's rows)."""

import torch

import trace_kernels
from trace_kernels import ModelShape
from trace_sglang_plugin.capture_buffers import CaptureBuffers
from trace_kernels.routed_experts import routed_experts_emulated as routed_experts  # BF16 weights + a quantize callback



def per_token(x, site):
    return trace_kernels.quantize_dequantize(x)


SHAPE = ModelShape(num_layers=2, hidden_size=32, moe_intermediate_size=16, num_experts=4, top_k=2, num_kv_heads=2, head_dim=16)


def _moe_inputs(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    H, I, E, k = SHAPE.hidden_size, SHAPE.moe_intermediate_size, SHAPE.num_experts, SHAPE.top_k
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, k, generator=g), -1)
    return x, w13, w2, ids, weights


def test_buffers_return_a_requests_rows_by_kv_slot_whatever_the_batch():
    bufs = CaptureBuffers(SHAPE, [True, True], num_slots=64, max_tokens=16, device="cpu")
    # Two forwards: a prefill of 6 tokens into slots 10..15, then a decode step into slot 40.
    steps = [torch.arange(10, 16), torch.tensor([40])]
    expect = {}
    for step, loc in enumerate(steps):
        x, w13, w2, ids, weights = _moe_inputs(len(loc), seed=step)
        for layer in range(2):
            _, q1, q2 = routed_experts(x, weights, ids, w13, w2, "silu", per_token)
            bufs.stage_moe(layer, ids, q1, q2)
            kv = torch.randn(len(loc), 2, 16)
            qk = trace_kernels.quantize(kv, trace_kernels.row_amax(kv))
            bufs.write_kv(layer, loc, qk, qk)
            expect.setdefault(layer, []).append((ids, q1, qk))
        bufs.commit(loc)
    routing, sites = bufs.gather(torch.cat(steps))
    for layer in range(2):
        assert torch.equal(routing[:, layer].long(), torch.cat([e[0] for e in expect[layer]]))
        fc1 = sites[(layer, "moe_fc1_in")]
        assert torch.equal(fc1.codes, torch.cat([e[1].codes for e in expect[layer]]))
        assert torch.equal(sites[(layer, "k")].codes, torch.cat([e[2].codes for e in expect[layer]]))


def test_a_forwards_capture_writes_stay_on_the_device_and_a_skipped_layer_is_named():
    """What SGLang's cuda graph runner would capture: staging writes only (no host sync, no
    data-dependent shape); the commit after the forward finds a layer whose write is missing."""
    from host_sync_mode import NoHostSync

    bufs = CaptureBuffers(SHAPE, [True, True], num_slots=64, max_tokens=16, device="cpu")
    loc = torch.tensor([3, 9, 4])
    x, w13, w2, ids, weights = _moe_inputs(3)
    _, q1, q2 = routed_experts(x, weights, ids, w13, w2, "silu", per_token)
    kv = torch.randn(3, 2, 16)
    qk = trace_kernels.quantize(kv, trace_kernels.row_amax(kv))
    for skip in (None, 1):
        bufs.begin()
        with NoHostSync():
            for layer in range(2):
                bufs.stage_moe(layer, ids, q1, q2)
                if layer != skip:
                    bufs.write_kv(layer, loc, qk, qk)
        missing = bufs.missing(3, with_kv=True)
        if skip is None:
            assert missing == []
            bufs.commit(loc)
        else:
            assert set(missing) == {(1, "k"), (1, "v"), ("kv_loc", 1)}
    routing, sites = bufs.gather(loc)
    assert torch.equal(sites[(1, "k")].codes, qk.codes) and torch.equal(routing[:, 0].long(), ids)

"""The capture store's static step buffers on their own (no engine): a step's rows are read from the
buffers the forward wrote, a batch larger than the buffers is captured eagerly (counted, same
records), and a step whose forward did not write a key (a replay that skipped the capture) makes the
records of that step's requests fail at assembly instead of carrying stale rows."""

import pytest
import torch

import trace_kernels
from trace_kernels import GuidanceRecord, ModelShape, TraceConfig
from trace_vllm_plugin.capture import CaptureStore, StepLayout
from trace_vllm_plugin.worker_rpc import encode

SHAPE = ModelShape(num_layers=2, hidden_size=32, moe_intermediate_size=16, num_experts=4, top_k=2, num_kv_heads=1, head_dim=16)
CONFIG = TraceConfig(guidance="full", guided_layers="all")
SITES = ("moe_fc1_in", "moe_fc2_in", "k", "v")


def _forward(store, n, seed, skip=()):
    """What the layers write in one forward of `n` rows (keys in `skip` are not written)."""
    g = torch.Generator().manual_seed(seed)
    for layer in range(SHAPE.num_layers):
        for site in SITES:
            x = torch.randn(n, *SHAPE.row_shape(site), generator=g)
            if (layer, site) not in skip:
                store.put(layer, site, trace_kernels.quantize(x, trace_kernels.row_amax(x)))
        ids = torch.randint(0, 4, (n, 2), generator=g)
        if ("routing", layer) not in skip:
            store.put_routing(layer, ids)


def _run(store, steps):
    """steps: (req_ids, lengths, starts, seed[, skip]); a warm-up forward first, as vLLM's profile run."""
    _forward(store, 12, seed=99)
    for req_ids, lengths, starts, seed, *skip in steps:
        qsl = [0]
        for n in lengths:
            qsl.append(qsl[-1] + n)
        store.begin_step(StepLayout(req_ids, qsl, starts))
        # A CUDA graph's batch is padded: 2 rows past the requests' rows.
        _forward(store, qsl[-1] + 2, seed, skip[0] if skip else ())
        store.end_step()


STEPS = [(["a", "b"], [3, 5], [0, 0], 0), (["b", "a"], [1, 1], [5, 3], 1), (["a", "b"], [1, 1], [4, 6], 2)]


def _records(store):
    store.finish("a")
    store.finish("b")
    return [GuidanceRecord.from_bytes(encode(store.take(r), store)) for r in ("a", "b")]


def test_an_oversized_batch_is_captured_eagerly_with_the_same_records():
    buffered = CaptureStore(SHAPE, CONFIG, capacity=16)
    _run(buffered, STEPS)
    small = CaptureStore(SHAPE, CONFIG, capacity=4)  # the prefill step (8 + 2 rows) does not fit
    _run(small, STEPS)
    assert buffered.counters["capture_buffer_overflow_steps"] == 0
    assert small.counters["capture_buffer_overflow_steps"] == 1
    assert small.counters["capture_buffer_overflow_writes"] > 0
    for a, b in zip(_records(buffered), _records(small)):
        assert a.num_tokens == b.num_tokens and set(a.tensors) == set(b.tensors)
        for name, t in a.tensors.items():
            assert torch.equal(t, b.tensors[name]), name


def test_buffers_are_written_in_place():
    store = CaptureStore(SHAPE, CONFIG, capacity=16)
    _run(store, STEPS[:1])
    ptrs = {k: tuple(t.data_ptr() for t in v) for k, v in store.buffers.tensors.items()}
    _run(store, STEPS[1:])
    assert ptrs == {k: tuple(t.data_ptr() for t in v) for k, v in store.buffers.tensors.items()}
    assert len(ptrs) == SHAPE.num_layers * (len(SITES) + 1)
    # Sized for 16 rows whatever the batch: per layer fc1 (16 + 2 + 4 B), fc2 (2 x (8 + 1 + 4) B),
    # K and V (8 + 1 + 4 B each), routing (2 x 2 B), per row.
    assert store.stats()["capture_buffer_bytes"] == SHAPE.num_layers * 16 * (22 + 26 + 13 + 13 + 4)


@pytest.mark.parametrize("skipped", [(1, "k"), ("routing", 0)])
def test_a_step_the_forward_did_not_write_is_refused_at_assembly(skipped):
    store = CaptureStore(SHAPE, CONFIG, capacity=16)
    _run(store, STEPS[:2] + [STEPS[2] + ({skipped},)])
    assert store.counters["steps_missing_capture"] == 1
    store.finish("a")
    what = "routing of layer 0" if skipped[0] == "routing" else "1.k"
    with pytest.raises(ValueError, match=rf"step 3: the forward did not write the capture of {what}"):
        encode(store.take("a"), store)

"""Edge cases the align job hits: experts that receive no tokens, and capture of unquantized inputs."""

import pytest
import torch

pytest.importorskip("megatron.core")
import megatron_cpu as mc  # noqa: E402

mc.init_parallel()

import trace_kernels as tk  # noqa: E402
import trace_megatron  # noqa: E402

FULL = tk.TraceConfig(guidance="full", guided_layers="all")
SITES = ("moe_fc1_in", "moe_fc2_in", "k", "v")


def test_one_token_leaves_most_experts_empty_and_still_guides():
    """One token, 8 experts, top-2: six experts get an empty input in every layer."""
    model = mc.tiny_model(mc.tiny_config(num_moe_experts=8), trace_config=FULL, seed=3)
    ids, pos, mask = mc.padded_batch([1], 1, seed=2)
    layout = trace_megatron.TokenLayout.padded([1], 1)
    with torch.no_grad(), trace_megatron.capture(model, layout, keep_values=True) as cap:
        ref = model(ids, pos, mask)
    records = cap.build_records()
    with torch.no_grad(), trace_megatron.guidance(model, records, layout) as batch:
        out = model(ids, pos, mask)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert batch.metrics()["trace/all/moe_fc2_in/mismatch_guided"] == 0


def test_captured_values_requantize_to_the_captured_codes():
    model = mc.tiny_model(mc.tiny_config(), trace_config=FULL, seed=5)
    ids, pos, mask = mc.padded_batch([12, 7], 12, seed=4)
    layout = trace_megatron.TokenLayout.padded([12, 7], 12)
    with torch.no_grad(), trace_megatron.capture(model, layout, keep_values=True) as cap:
        model(ids, pos, mask)
    for layer in range(model.config.num_layers):
        for site in SITES:
            x, q = cap.captured_values(layer, site), cap.captured(layer, site)
            filled = q.scales.reshape(q.scales.shape[0], -1).any(-1)  # padding positions stay empty
            assert filled.sum() > 0
            again = tk.quantize(x[filled], tk.row_amax(x[filled]))
            assert torch.equal(again.codes, q.codes[filled]), (layer, site)
            assert torch.equal(tk.adjacent(x[filled], q[filled]), torch.ones_like(tk.adjacent(x[filled], q[filled])))
    with torch.no_grad(), trace_megatron.capture(model, layout) as plain:
        model(ids, pos, mask)
    with pytest.raises(RuntimeError, match="keep_values=True"):
        plain.captured_values(0, "k")

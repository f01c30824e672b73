"""Sparse guidance in a real Megatron-Core model (CPU, world size 1): the trainer decodes the syndromes with
its own values in every forward, through the token dispatcher, and its codes match a second engine's."""

import pytest
import torch

pytest.importorskip("megatron.core")
import megatron_cpu as mc  # noqa: E402

mc.init_parallel()

import trace_megatron  # noqa: E402
import trace_kernels as tk  # noqa: E402
from trace_kernels import TraceConfig  # noqa: E402

SPARSE = TraceConfig(guidance="sparse", guided_layers="all")
FULL = TraceConfig(guidance="full", guided_layers="all")
LENGTHS, SEQ = [16, 11], 16


def noisy_engine(x):
    """A second engine for a BF16 model: about one BF16 ulp of relative noise, then BF16 (a function of
    the value, as in test_megatron_guidance.py)."""
    xf = x.float()
    noise = torch.frac(torch.sin(xf * 12345.678) * 43758.5453) - 0.5
    return (xf * (1 + 2.0**-7 * noise)).to(x.dtype)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_sparse_guidance_recovers_a_second_engines_codes(dispatcher):
    cfg = mc.tiny_config(dispatcher=dispatcher, params_dtype=torch.bfloat16, bf16=True)
    model = mc.tiny_model(cfg, trace_config=SPARSE, seed=7)
    inputs = mc.padded_batch(LENGTHS, SEQ, seed=1)
    layout = trace_megatron.TokenLayout.padded(LENGTHS, SEQ)
    with torch.no_grad(), trace_megatron.capture(model, layout, perturb=noisy_engine) as cap:
        model(*inputs)
    records = cap.build_records(SPARSE)
    assert records[0].modes == ("sparse", "sparse")
    full_records = cap.build_records(FULL)
    assert sum(r.nbytes for r in records) < 0.12 * sum(r.nbytes for r in full_records)
    with torch.no_grad(), trace_megatron.capture(model, layout, records=records) as run:
        model(*inputs)
    m = run.metrics()
    valid = layout.sample >= 0
    rtn = missed = 0
    for site in ("moe_fc1_in", "k", "v"):  # the correcting sites
        t = {k.split("/")[-1]: v for k, v in m.items() if k.startswith(f"trace/all/{site}/")}
        assert t["sparse_segments"] > 0 and t["fallback_rows"] == t["fallback_no_record"], (site, t)
        rtn += t["mismatch_rtn"] * t["guided_elements"]
        for layer in (0, 1):
            theirs = cap.captured(layer, site).dequantize()[valid]
            ours = run.captured(layer, site).dequantize()[valid]
            missed += int((ours != theirs).sum())
    assert rtn > 100  # the engine's noise flips the trainer's own rounding...
    assert missed <= 0.02 * rtn, (missed, rtn)  # ...and the syndromes flip (nearly) all of them back
    # moe_fc2_in is check-only: a real engine's fc2 inputs are the trainer's own wherever the fc1 codes
    # agree, but this emulated engine adds its noise there too. Those rows are caught and counted, not
    # silently kept: every segment that differs shows as unresolved, bar the few whose flips cancel in
    # the 4 check bits (an even number of flips: ~1 in 16 of those).
    t = {k.split("/")[-1]: v for k, v in m.items() if k.startswith("trace/all/moe_fc2_in/")}
    differing = 0
    for layer in (0, 1):
        theirs = tk.codewords(cap.captured(layer, "moe_fc2_in"))[valid]
        ours = tk.codewords(run.captured(layer, "moe_fc2_in"))[valid]
        differing += int((ours != theirs).reshape(-1, 32).any(-1).sum())
    assert differing > 20
    assert 0.8 * differing <= t["sparse_unresolved_code_segments"] <= t["sparse_segments"], (differing, t)
    assert t["sparse_code_flips"] == 0


def test_sparse_guidance_refuses_expert_tensor_parallel_columns():
    from trace_megatron.experts import _columns
    from trace_kernels.guides import sparse as sg
    import trace_kernels as tk

    x = torch.randn(4, 64)
    g = sg.encode(tk.quantize(x, tk.row_amax(x)))
    with pytest.raises(NotImplementedError, match="sparse guidance"):
        _columns(g, 0, 2)


def test_the_native_cpu_decode_trains_bit_identically(monkeypatch):
    """TRACE_FP4_CPU_BACKEND=native (the sparse decode of each site in one numba call) against the torch
    reference: the same logits, gradients and metrics for a sparse-guided forward and backward."""
    pytest.importorskip("numba")
    from trace_kernels import cpu_native

    cfg = mc.tiny_config(params_dtype=torch.bfloat16, bf16=True)
    inputs = mc.padded_batch(LENGTHS, SEQ, seed=2)
    layout = trace_megatron.TokenLayout.padded(LENGTHS, SEQ)
    ref_model = mc.tiny_model(cfg, trace_config=SPARSE, seed=5)
    with torch.no_grad(), trace_megatron.capture(ref_model, layout, perturb=noisy_engine) as cap:
        ref_model(*inputs)
    records = cap.build_records(SPARSE)
    results = []
    for backend in ("eager", "native"):
        monkeypatch.setenv("TRACE_FP4_CPU_BACKEND", backend)
        model = mc.tiny_model(cfg, trace_config=SPARSE, seed=5)
        before = cpu_native.fallbacks().get("eager:sparse_decode", 0)
        with trace_megatron.guidance(model, records, layout) as batch:
            out = model(*inputs)
        out.float().pow(2).mean().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        results.append((out.detach(), grads, batch.metrics()))
        assert cpu_native.fallbacks().get("eager:sparse_decode", 0) == before
    (o1, g1, m1), (o2, g2, m2) = results
    assert torch.equal(o1, o2) and len(g1) == len(g2) and all(torch.equal(a, b) for a, b in zip(g1, g2))
    assert m1 == m2 and any(k.endswith("/sparse_segments") and v > 0 for k, v in m1.items())


def test_a_one_token_sample_beside_longer_ones_trains():
    """A 1-token sample's records send moe_fc1_in static (its rows share the token's one amax) while the
    other samples' rows carry per-row amaxes: the layer's decode takes them together (it refused them,
    "inconsistent row headers", before header_groups), and guided codes match the engine's."""
    lengths = [10, 3, 16, 1]
    cfg = mc.tiny_config(params_dtype=torch.bfloat16, bf16=True)
    model = mc.tiny_model(cfg, trace_config=SPARSE, seed=1)
    inputs = mc.padded_batch(lengths, SEQ, seed=2)
    layout = trace_megatron.TokenLayout.padded(lengths, SEQ)
    with torch.no_grad(), trace_megatron.capture(model, layout, perturb=noisy_engine) as cap:
        model(*inputs)
    records = cap.build_records(SPARSE)
    with trace_megatron.guidance(model, records, layout):
        model(*inputs).float().sum().backward()
    with torch.no_grad(), trace_megatron.capture(model, layout, records=records) as run:
        model(*inputs)
    m = run.metrics()
    t = {k.split("/")[-1]: v for k, v in m.items() if k.startswith("trace/all/moe_fc1_in/")}
    assert t["sparse_segments"] > 0 and t["fallback_rows"] == t["fallback_no_record"], t

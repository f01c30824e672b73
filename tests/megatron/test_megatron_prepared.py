"""trace_megatron.prepare: a micro-batch's record tables built once, ahead of its forwards. Reusing them
must give what building them in the step gives (logits, gradients, every metric), over several forwards
on the same records (old log-probs then the update), on the eager and the native CPU path; a prepared
object made for another layout or model is refused, naming what differs."""

import pytest
import torch

pytest.importorskip("megatron.core")
import megatron_cpu as mc  # noqa: E402

mc.init_parallel()

import trace_megatron  # noqa: E402
from trace_kernels import TraceConfig  # noqa: E402

SPARSE = TraceConfig(guidance="sparse", guided_layers="all", sparse_audit=0.25)  # audits enough rows to compare
LENGTHS, SEQ = [16, 11], 16


def noisy_engine(x):
    xf = x.float()
    noise = torch.frac(torch.sin(xf * 12345.678) * 43758.5453) - 0.5
    return (xf * (1 + 2.0**-7 * noise)).to(x.dtype)


def _records(cfg, layout, inputs):
    model = mc.tiny_model(cfg, trace_config=SPARSE, seed=5)
    with torch.no_grad(), trace_megatron.capture(model, layout, perturb=noisy_engine) as cap:
        model(*inputs)
    return cap.build_records(SPARSE)


def _train(cfg, inputs, layout, feed, steps=2):
    """Two training steps (forward, backward, SGD) guided by `feed()`: their logits, gradients, metrics."""
    model = mc.tiny_model(cfg, trace_config=SPARSE, seed=5)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    out = []
    for _ in range(steps):
        with trace_megatron.guidance(model, feed(model), layout) as batch:
            logits = model(*inputs)
        logits.float().pow(2).mean().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append((logits.detach(), grads, batch.metrics()))
    return out


@pytest.mark.parametrize("backend", ["eager", "native"])
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_prepared_tables_train_like_tables_built_in_the_step(monkeypatch, backend, dispatcher):
    if backend == "native":
        pytest.importorskip("numba")
    monkeypatch.setenv("TRACE_FP4_CPU_BACKEND", backend)
    cfg = mc.tiny_config(dispatcher=dispatcher, params_dtype=torch.bfloat16, bf16=True)
    inputs = mc.padded_batch(LENGTHS, SEQ, seed=2)
    layout = trace_megatron.TokenLayout.padded(LENGTHS, SEQ)
    records = _records(cfg, layout, inputs)
    in_step = _train(cfg, inputs, layout, lambda m: records)
    prepared = {}

    def feed(model):  # prepared once, reused by every later forward of these records
        if "p" not in prepared:
            prepared["p"] = trace_megatron.prepare(model, records, layout)
        return prepared["p"]

    ahead = _train(cfg, inputs, layout, feed)
    for (o1, g1, m1), (o2, g2, m2) in zip(in_step, ahead):
        assert torch.equal(o1, o2) and len(g1) == len(g2) and all(torch.equal(a, b) for a, b in zip(g1, g2))
        assert m1 == m2 and any(k.endswith("/sparse_segments") and v > 0 for k, v in m1.items())
        assert m1["trace/all/k/audit_rows"] > 0 and m1["trace/all/moe_fc1_in/audit_rows"] > 0  # audits compared


def test_prepared_tables_refuse_another_batch():
    cfg = mc.tiny_config(params_dtype=torch.bfloat16, bf16=True)
    inputs = mc.padded_batch(LENGTHS, SEQ, seed=2)
    layout = trace_megatron.TokenLayout.padded(LENGTHS, SEQ)
    records = _records(cfg, layout, inputs)
    model = mc.tiny_model(cfg, trace_config=SPARSE, seed=5)
    prepared = trace_megatron.prepare(model, records, layout)
    assert isinstance(prepared, trace_megatron.PreparedRecords)
    other = trace_megatron.TokenLayout.padded([16, 12], SEQ)
    with pytest.raises(ValueError, match="another token layout"):
        trace_megatron.guidance(model, prepared, other)
    full = mc.tiny_model(cfg, trace_config=TraceConfig(guidance="full", guided_layers="all"), seed=5)
    with pytest.raises(ValueError, match="another TraceConfig"):
        trace_megatron.guidance(full, prepared, layout)
    # records that do not fit the layout are refused when preparing, as guidance refuses them
    with pytest.raises(ValueError, match="guidance records for a micro-batch"):
        trace_megatron.prepare(model, records[:1], layout)

"""block_scale="4over6" in the trainer (real Megatron-Core, CPU): every site quantizes with the rule, and
full and sparse guidance toward a second engine's 4over6 records remove every mismatch its own rounding
leaves (the sparse records carry each block's 4-or-6 choice)."""

import pytest
import torch

pytest.importorskip("megatron.core")
import megatron_cpu as mc  # noqa: E402

mc.init_parallel()

import trace_kernels as tk  # noqa: E402
import trace_megatron  # noqa: E402
from trace_kernels import TraceConfig  # noqa: E402

LENGTHS, SEQ = [16, 11], 16
SITES = ("moe_fc1_in", "moe_fc2_in", "k", "v")
FULL46 = TraceConfig(guidance="full", guided_layers="all", block_scale="4over6")


def noisy_engine(x):
    """About one BF16 ulp of relative noise (a function of the value), then the input dtype."""
    xf = x.float()
    noise = torch.frac(torch.sin(xf * 12345.678) * 43758.5453) - 0.5
    return (xf * (1 + 2.0**-7 * noise)).to(x.dtype)


@pytest.fixture(scope="module")
def captured():
    model = mc.tiny_model(mc.tiny_config(params_dtype=torch.bfloat16, bf16=True), trace_config=FULL46, seed=7)
    inputs = mc.padded_batch(LENGTHS, SEQ, seed=1)
    layout = trace_megatron.TokenLayout.padded(LENGTHS, SEQ)
    with torch.no_grad(), trace_megatron.capture(model, layout, perturb=noisy_engine, keep_values=True) as cap:
        model(*inputs)
    return model, inputs, layout, cap


def test_every_site_quantizes_with_the_4over6_rule(captured):
    """The trainer's own rows are tk.quantize(..., block_scale="4over6") of its values. Per-token rows: the
    block holding the row amax gets scale 256 (or 384 where it takes 4), other blocks at most 384, so a
    row's largest scale lies in 256..384 (the default rule puts it on 448)."""
    model, inputs, layout, _ = captured
    with torch.no_grad(), trace_megatron.capture(model, layout, keep_values=True) as own:
        model(*inputs)
    for site in SITES:
        x, q = own.captured_values(1, site), own.captured(1, site)
        assert torch.equal(tk.codewords(q), tk.codewords(tk.quantize(x, q.global_amax, block_scale="4over6"))), site
        top = q.scales.reshape(-1, q.scales.shape[-1]).amax(-1)
        assert set(top.unique().tolist()) <= set(range(0x78, 0x7D)), (site, top.unique())
    fc1 = model.decoder.layers[0].mlp.experts.local_experts[0].linear_fc1.trace_config
    assert fc1.block_scale == "4over6"


@pytest.mark.parametrize("guidance", ["full", "sparse"])
def test_guidance_toward_a_second_engines_4over6_records_removes_its_mismatches(captured, guidance):
    model, inputs, layout, cap = captured
    config = TraceConfig(guidance=guidance, guided_layers="all", block_scale="4over6")
    records = cap.build_records(config)
    assert records[0].config.block_scale == "4over6"
    if guidance != "full":  # the trainer runs the records' config (same weights: same seed)
        model = mc.tiny_model(mc.tiny_config(params_dtype=torch.bfloat16, bf16=True), trace_config=config, seed=7)
    with torch.no_grad(), trace_megatron.guidance(model, records, layout) as batch:
        model(*inputs)
    m = batch.metrics()
    for site in SITES:
        t = {k.split("/")[-1]: v for k, v in m.items() if k.startswith(f"trace/all/{site}/")}
        assert t["mismatch_guided"] == 0, (site, t)
        if site != "moe_fc2_in":  # fc2's inputs follow from fc1's guided codes (the engine GEMM)
            assert t["mismatch_rtn"] > 0, (site, t)  # the second engine's values flip some codes


def test_a_record_made_with_the_other_block_scale_is_refused(captured):
    model, inputs, layout, cap = captured
    records = cap.build_records(FULL46)
    plain = mc.tiny_model(mc.tiny_config(params_dtype=torch.bfloat16, bf16=True),
                          trace_config=TraceConfig(guidance="full", guided_layers="all"), seed=7)
    with pytest.raises(tk.RecordError, match="block_scale"):
        with torch.no_grad(), trace_megatron.guidance(plain, records, layout):
            plain(*inputs)

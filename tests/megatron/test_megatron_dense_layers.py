"""trace_megatron on the layer patterns of GLM-4.5 / DeepSeek-V3: dense-MLP layers among the MoE layers
(moe_layer_freq), an ungated shared expert, sigmoid routing with an expert bias and a scaling factor.
Real Megatron-Core on a CPU, world size 1."""

import pytest
import torch

pytest.importorskip("megatron.core")
import megatron_cpu as mc  # noqa: E402

mc.init_parallel()

import trace_megatron  # noqa: E402
from trace_kernels import RecordError, TraceConfig  # noqa: E402

FULL = TraceConfig(guidance="full", guided_layers="all")
LENGTHS, SEQ = [16, 11], 16
GLM_LIKE = dict(
    num_layers=3, moe_layer_freq=[0, 1, 1], moe_shared_expert_intermediate_size=32,
    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5,
    num_moe_experts=8,
)


def noisy_engine(x):
    """A second engine's numerics: about one BF16 ulp of value-determined relative noise."""
    xf = x.float()
    noise = torch.frac(torch.sin(xf * 12345.678) * 43758.5453) - 0.5
    return (xf * (1 + 2.0**-7 * noise)).to(x.dtype)


@pytest.fixture(scope="module")
def setup():
    model = mc.tiny_model(mc.tiny_config(**GLM_LIKE), trace_config=FULL, seed=3)
    g = torch.Generator().manual_seed(5)
    for layer in model.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is not None:  # a bias of the size of the sigmoid scores' spread: it changes the winners
            router.expert_bias.copy_(torch.randn(router.expert_bias.shape, generator=g) * 0.05)
    ids, pos, mask = mc.padded_batch(LENGTHS, SEQ, seed=1)
    layout = trace_megatron.TokenLayout.padded(LENGTHS, SEQ)
    with torch.no_grad(), trace_megatron.capture(model, layout, perturb=noisy_engine) as cap:
        model(ids, pos, mask)
    return model, (ids, pos, mask), layout, cap.build_records()


def test_model_shape_is_per_layer():
    shape = trace_megatron.model_shape(mc.tiny_config(**GLM_LIKE))
    assert shape.moe_layers == (1, 2)
    assert shape.layer_sites(0) == ("k", "v")
    assert shape.layer_sites(1) == ("moe_fc1_in", "moe_fc2_in", "k", "v")
    assert trace_megatron.model_shape(mc.tiny_config(num_layers=4, moe_layer_freq=2)).moe_layers == (0, 2)
    assert trace_megatron.model_shape(mc.tiny_config()).moe_layers is None  # every layer: the default shape
    with pytest.raises(ValueError, match="leaves no routed-expert layer"):
        trace_megatron.model_shape(mc.tiny_config(num_layers=2, moe_layer_freq=[0, 0]))


def test_dense_layers_and_shared_experts_stay_bf16(setup):
    model, *_ = setup
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    from trace_megatron.moe_layer import TraceMoELayer

    layers = model.decoder.layers
    assert type(layers[0].mlp) is MLP  # the dense layer: Megatron's own MLP, no trace module in it
    assert all(isinstance(layers[i].mlp, TraceMoELayer) for i in (1, 2))
    assert type(layers[1].mlp.shared_experts) is SharedExpertMLP
    assert not any(type(m).__module__.startswith("trace_megatron") for m in layers[0].mlp.modules())
    assert not any(type(m).__module__.startswith("trace_megatron") for m in layers[1].mlp.shared_experts.modules())


def test_records_have_routing_and_moe_sites_only_where_there_are_experts(setup):
    _, _, _, records = setup
    rec = records[0]
    assert rec.shape.moe_layers == (1, 2)
    assert rec.routed_experts(1).shape == (LENGTHS[0], 2)
    with pytest.raises(RecordError):
        rec.routed_experts(0)
    with pytest.raises(RecordError):
        rec.site(0, "moe_fc1_in")
    assert rec.site(0, "k").codes.shape[0] == LENGTHS[0]


def test_full_guidance_reproduces_every_code_of_a_second_engine(setup):
    model, inputs, layout, records = setup
    with torch.no_grad(), trace_megatron.guidance(model, records, layout) as batch:
        model(*inputs)
    m = batch.metrics()
    assert not any(k.startswith(("trace/layer0/moe", "trace/layer0/routing")) for k in m)
    for layer, sites in ((0, ("k", "v")), (1, ("moe_fc1_in", "moe_fc2_in", "k", "v")), (2, ("moe_fc1_in", "moe_fc2_in", "k", "v"))):
        for site in sites:
            p = f"trace/layer{layer}/{site}"
            assert m[f"{p}/guided_rows"] > 0 and m[f"{p}/mismatch_guided"] == 0, (p, m[f"{p}/mismatch_rtn"])
    # the second engine's noise made round-to-nearest disagree somewhere: guidance had work to do
    assert sum(m[f"trace/all/{s}/mismatch_rtn"] for s in ("moe_fc1_in", "moe_fc2_in", "k", "v")) > 0


def test_sigmoid_routing_with_expert_bias_is_replayed_from_the_record(setup):
    """Records made under another expert bias route differently; the trainer follows the record."""
    model, inputs, layout, records = setup
    routers = [model.decoder.layers[i].mlp.router for i in (1, 2)]
    saved = [r.expert_bias.clone() for r in routers]
    try:
        for r in routers:
            r.expert_bias.copy_(-r.expert_bias * 4)
        with torch.no_grad(), trace_megatron.capture(model, layout) as own:
            model(*inputs)
        with torch.no_grad(), trace_megatron.capture(model, layout, records=records) as replayed:
            model(*inputs)
    finally:
        for r, b in zip(routers, saved):
            r.expert_bias.copy_(b)
    for layer in (1, 2):
        rec_ids = torch.cat([rec.routed_experts(layer).to(torch.int64) for rec in records])
        pos = torch.cat([layout.positions_of(i) for i in range(len(records))])
        got = replayed.captured_routing(layer)[pos]
        mine = own.captured_routing(layer)[pos]
        assert torch.equal(got.sort(-1).values, rec_ids.sort(-1).values)
        assert not torch.equal(mine.sort(-1).values, rec_ids.sort(-1).values)  # the bias change mattered

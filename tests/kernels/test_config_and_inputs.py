"""TraceConfig validation and the public API's input checks: bad input gets an error naming it."""

import pytest
import torch

import trace_kernels as tk


def test_config_from_quantization_config():
    cfg = tk.TraceConfig.from_dict({"quant_method": "trace_fp4", "guidance": "full", "guided_layers": [1, 3]})
    assert cfg.layer_modes(4) == [None, "full", None, "full"]
    assert tk.TraceConfig.from_dict(cfg.to_dict()) == cfg
    assert tk.TraceConfig(guided_layers="all", full_layers=[0]).layer_modes(3) == ["full", "sparse", "sparse"]
    # the default: sparse at every layer; the paper's compact deeper half stays a named config
    assert tk.TraceConfig().layer_modes(4) == ["sparse"] * 4
    assert tk.PAPER_CONFIG.layer_modes(4) == [None, None, "compact", "compact"]


@pytest.mark.parametrize(
    "d,match",
    [
        ({"quant_method": "fp8"}, "quant_method='fp8'"),
        ({"guidence": "full"}, r"unknown TraceConfig key\(s\) \['guidence'\]"),
        ({"guidance": "half"}, "guidance must be one of"),
        ({"guided_layers": "shallow"}, "guided_layers must be"),
        ({"guided_layers": [-1]}, "guided_layers must be non-negative layer indices"),
        ({"capture": "yes"}, "capture must be true or false"),
        ({"activation_scale": "static"}, "needs static_activation_amax"),
        ({"activation_scale": "static", "static_activation_amax": {"0.q": 1.0}}, "key '0.q'"),
    ],
)
def test_bad_config_names_the_problem(d, match):
    with pytest.raises(ValueError, match=match):
        tk.TraceConfig.from_dict(d)


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match=r"shape \(4, 24\): NVFP4 needs a last dimension divisible by 16"):
        tk.quantize(torch.randn(4, 24), torch.tensor([1.0]))
    with pytest.raises(ValueError, match="must be float32, bfloat16 or float16, got torch.int32"):
        tk.quantize(torch.ones(4, 16, dtype=torch.int32), torch.tensor([1.0]))
    with pytest.raises(ValueError, match=r"global_amax has shape \(3,\): expected one element"):
        tk.quantize(torch.randn(4, 16), torch.ones(3))
    with pytest.raises(ValueError, match="global_amax must be float32"):
        tk.quantize(torch.randn(4, 16), torch.ones(1, dtype=torch.float64))
    with pytest.raises(ValueError, match="backend must be"):
        tk.quantize(torch.randn(4, 16), torch.ones(1), backend="cuda")
    q = tk.quantize(torch.randn(4, 32), torch.ones(4))
    with pytest.raises(ValueError, match=r"guide covers shape \(4, 32\) but x has shape \(2, 32\)"):
        tk.quantize_guided(torch.randn(2, 32), q)
    with pytest.raises(TypeError, match="guide must be a trace_kernels Guide"):
        tk.quantize_guided(torch.randn(4, 32), q.codes)
    with pytest.raises(ValueError, match="needs the trainer's own global_amax"):
        tk.quantize_guided(torch.randn(4, 32), None)
    with pytest.raises(ValueError, match="head_dim=40 is not divisible by 16"):
        tk.ModelShape(2, 64, 32, 4, 2, 2, 40)


def test_nvfp4_tensor_helpers():
    x = torch.randn(3, 5, 32)
    q = tk.quantize(x, tk.row_amax(x))
    assert q.shape == x.shape and q[1].shape == (5, 32) and q[1].global_amax.shape == (5,)
    assert torch.equal(q[1].dequantize(), q.dequantize()[1])
    c = tk.compact(q)
    assert c.shape == x.shape and c.mbits.shape == (3, 5, 4)
    bits = c.unpacked_bits()
    from trace_kernels.reference import unpack_nibbles

    assert torch.equal(bits, (unpack_nibbles(q.codes) & 1).to(torch.int32))


# ---- TraceConfig normalisation and bounds -----------------------------------------
STATIC_ALL = {f"{i}.{s}": 1.0 + i for i in range(4) for s in ("moe_fc1_in", "moe_fc2_in", "k", "v")}


def test_layer_lists_are_sorted_and_deduplicated_so_equal_configs_compare_equal():
    a = tk.TraceConfig(guided_layers=[2, 1, 2], full_layers={3, 1})
    assert a.guided_layers == (1, 2) and a.full_layers == (1, 3)
    assert a == tk.TraceConfig(guided_layers=(1, 2), full_layers=[1, 3])
    assert tk.TraceConfig.from_dict(json_roundtrip(a)) == a  # a set no longer breaks to_json
    # A record made with [2, 1] serves a trainer configured with [1, 2].
    from record_factory import captured_builder

    rec = captured_builder(tk.TraceConfig(guided_layers=[2, 1], guidance="full"), steps=(2,)).build()
    rec.check_compatible(rec.shape, tk.TraceConfig(guided_layers=[1, 2], guidance="full"))


def json_roundtrip(cfg):
    import json

    return json.loads(cfg.to_json())


def test_static_amax_values_are_normalised_and_bad_ones_refused():
    cfg = tk.TraceConfig(activation_scale="static", static_activation_amax={"01.k": 2, "0.v": 1.5})
    assert cfg.static_activation_amax == {"0.v": 1.5, "1.k": 2.0}
    for bad in (float("inf"), float("nan"), True, 0, -1.0, 1e39, "2.0", None):
        with pytest.raises(ValueError, match=r"static_activation_amax\['0.k'\] must be a finite number > 0"):
            tk.TraceConfig(activation_scale="static", static_activation_amax={"0.k": bad})
    with pytest.raises(ValueError, match="two entries for '1.k'"):
        tk.TraceConfig(activation_scale="static", static_activation_amax={"1.k": 1.0, "01.k": 2.0})
    with pytest.raises(ValueError, match="static_activation_amax is set but activation_scale is 'per_token'"):
        tk.TraceConfig(static_activation_amax={"0.k": 1.0})
    with pytest.raises(ValueError, match="must be a mapping"):
        tk.TraceConfig(activation_scale="static", static_activation_amax=[("0.k", 1.0)])


@pytest.mark.parametrize("value", [[], [1, 2], "all", None, 3])
def test_from_dict_needs_a_mapping(value):
    with pytest.raises(ValueError, match="a TraceConfig must be a mapping of settings"):
        tk.TraceConfig.from_dict(value)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"guided_layers": [0, 99]}, r"guided_layers names \[99\] but the model has 4 layers \(0..3\)"),
        ({"full_layers": [7]}, r"full_layers names \[7\] but the model has 4 layers"),
        ({"activation_scale": "static", "static_activation_amax": {**STATIC_ALL, "9.k": 1.0}},
         r"static_activation_amax names \['9.k'\] but the model has 4 layers"),
        ({"activation_scale": "static", "static_activation_amax": {k: v for k, v in STATIC_ALL.items() if k != "2.v"}},
         "no entry for 2.v"),
    ],
)
def test_check_layers_refuses_what_the_model_does_not_have(kwargs, match):
    cfg = tk.TraceConfig(**kwargs)
    if cfg.activation_scale != "static":
        cfg.check_layers(100)  # fine for a model that has those layers
    with pytest.raises(ValueError, match=match):
        cfg.check_layers(4)


def test_check_layers_accepts_a_complete_static_config():
    tk.TraceConfig(activation_scale="static", static_activation_amax=STATIC_ALL, full_layers=[3]).check_layers(4)
    # only the quantized sites need an amax
    kv_only = {k: v for k, v in STATIC_ALL.items() if k.endswith((".k", ".v"))}
    tk.TraceConfig(activation_scale="static", static_activation_amax=kv_only, quantize_expert_inputs=False,
                   capture=False).check_layers(4)


# ---- quantize inputs ------------------------------------------------------------
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_negative_global_amax_is_refused_on_every_backend(backend):
    x = torch.randn(4, 32)
    for amax in (torch.tensor([-1.0]), torch.tensor([1.0, 2.0, -0.5, 1.0]), torch.tensor([-0.0]), torch.tensor([-float("inf")])):
        with pytest.raises(ValueError, match=r"global_amax must be >= \+0 \(it is a magnitude\)"):
            tk.quantize(x, amax, backend=backend)
    with pytest.raises(ValueError, match="global_amax must be"):
        tk.quantize_dequantize(x, global_amax=torch.tensor([-2.0]), backend=backend)


def test_an_empty_last_dimension_is_named():
    with pytest.raises(ValueError, match=r"x has shape \(3, 0\): its last dimension is empty"):
        tk.quantize(torch.zeros(3, 0), torch.ones(1))


def test_values_above_the_amax_saturate_and_are_counted():
    # Documented contract (README, trace_kernels): values above their row's global amax saturate to
    # +-6 at block scale 448, as TransformerEngine's reference does; count_saturated counts them.
    x = torch.tensor([[3.0, -5.0] + [0.5] * 14, [1.0] * 16, [0.25] * 16])
    amax = torch.tensor([2.0, 0.0, 0.25])  # row 0: two above; row 1: amax 0 with non-zero data; row 2: none
    assert int(tk.count_saturated(x, amax)) == 2 + 16
    q = tk.quantize(x, amax)
    deq = q.dequantize()
    assert torch.equal(deq[2], x[2])  # at the amax: exact
    assert deq[0, 0] == deq[0, 1].abs()  # both saturated to the same magnitude
    assert (deq[1].abs() < 1e-30).all()  # amax 0: the 7.9e-36 of the contract; counted above
    counter = tk.SaturationCounter()
    cfg = tk.TraceConfig(activation_scale="static", static_activation_amax={"0.k": 2.0})
    got = tk.site_amax(cfg, 0, "k", x, saturated=counter)
    assert got.shape == (3,) and got.tolist() == [2.0, 2.0, 2.0]
    tk.site_amax(cfg, 0, "k", x, saturated=counter)
    assert counter.counts() == {"0.k": 2 * 2}  # rows 0 (two values) per call; rows 1, 2 are <= 2
    assert torch.equal(tk.site_amax(tk.TraceConfig(), 0, "k", x), tk.row_amax(x))
    assert torch.equal(tk.site_amax(None, 0, "k", x), tk.row_amax(x))


def test_torch_and_triton_agree_on_every_accepted_edge_amax():
    # One interpreted launch: each row is one edge case of the global amax.
    g = torch.Generator().manual_seed(5)
    x = torch.randn(10, 32, generator=g) * 3
    x[5] = 0.0
    amax = torch.tensor([0.0, float("nan"), float("inf"), 1e-38, 3.0e38, 0.0, 0.5, 448.0, 2688.0, 1e-45])
    a = tk.quantize(x, amax, backend="torch")
    b = tk.quantize(x, amax, backend="triton")
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
    da, db = a.dequantize(), b.dequantize()
    assert torch.equal(da.isnan(), db.isnan()) and torch.equal(da.nan_to_num(), db.nan_to_num())

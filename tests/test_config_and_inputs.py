"""TraceConfig validation and the public API's input checks: bad input gets an error naming it."""

import pytest
import torch

import trace_kernels as tk


def test_config_from_quantization_config():
    cfg = tk.TraceConfig.from_dict({"quant_method": "trace_fp4", "guidance": "full", "guided_layers": [1, 3]})
    assert cfg.layer_modes(4) == [None, "full", None, "full"]
    assert tk.TraceConfig.from_dict(cfg.to_dict()) == cfg
    assert tk.TraceConfig(guided_layers="all", full_layers=[0]).layer_modes(3) == ["full", "compact", "compact"]


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
    with pytest.raises(TypeError, match="guide must be an NVFP4Tensor or a CompactGuide"):
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

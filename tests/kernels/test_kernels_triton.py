"""Triton kernels == torch reference, bit for bit (interpreter on CPU; compiled when CUDA is present)."""

import pytest
import torch

import trace_kernels as tk
from adversarial import cases

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _same_values(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal values and equal NaN positions (NaN marks a poisoned block)."""
    torch.testing.assert_close(a.cpu(), b.cpu(), rtol=0, atol=0, equal_nan=True)


def _to(q, device):
    return type(q)(*(getattr(q, f).to(device) for f in q.__dataclass_fields__))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,x,amax", cases(), ids=[c[0] for c in cases()])
def test_quantize_with_capture_matches_reference(name, x, amax, device):
    ref = tk.quantize(x, amax, backend="torch")
    x_dev, amax_dev = x.to(device), amax.to(device)
    out, q = tk.quantize_dequantize(x_dev, global_amax=amax_dev, backend="triton")
    assert torch.equal(q.codes.cpu(), ref.codes) and torch.equal(q.scales.cpu(), ref.scales)
    _same_values(out, ref.dequantize(x.dtype))
    _same_values(tk.dequantize(_to(ref, device), backend="triton"), ref.dequantize())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fake_quant_output_dtype_rounding_matches_reference(dtype, device):
    """The kernel rounds float32 -> bfloat16 itself (the interpreter's cast truncates); float16 goes
    through torch. Both must equal the reference's dequantize(...).to(dtype)."""
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(24, 96, generator=g) * 3).to(dtype)
    ref_out, ref_q = tk.quantize_dequantize(x, backend="torch")
    out, q = tk.quantize_dequantize(x.to(device), backend="triton")
    assert out.dtype == dtype and torch.equal(out.cpu(), ref_out)
    no_capture, none = tk.quantize_dequantize(x.to(device), capture=False, backend="triton")
    assert none is None and torch.equal(no_capture.cpu(), ref_out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["full", "compact"])
@pytest.mark.parametrize("name,x,amax", cases()[:6], ids=[c[0] for c in cases()[:6]])
def test_guided_matches_reference(name, x, amax, mode, device):
    g = torch.Generator().manual_seed(3)
    rollout = tk.quantize(x, amax)
    guide = rollout if mode == "full" else tk.compact(rollout)
    # the trainer's values: the rollout's plus noise of a few bfloat16 ulps
    xt = x + x.abs() * (torch.rand(x.shape, generator=g) - 0.5) * 2**-6
    ref_out, ref_q = tk.quantize_dequantize(xt, guide=guide, backend="torch")
    out, q = tk.quantize_dequantize(xt.to(device), guide=_to(guide, device), backend="triton")
    assert torch.equal(q.codes.cpu(), ref_q.codes) and torch.equal(q.scales.cpu(), ref_q.scales)
    _same_values(out, ref_out)


def test_triton_on_cpu_needs_no_environment_variable():
    """The interpreted copy is made on demand; the process environment is left as it was."""
    import os

    before = os.environ.get("TRITON_INTERPRET")
    x = torch.randn(2, 32)
    tk.quantize(x, tk.row_amax(x), backend="triton")
    assert os.environ.get("TRITON_INTERPRET") == before


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_empty_inputs(backend):
    """An expert that receives no tokens quantizes an empty [0, K] tensor."""
    x = torch.zeros(0, 64, dtype=torch.bfloat16)
    out, q = tk.quantize_dequantize(x, backend=backend)
    assert out.shape == (0, 64) and out.dtype == torch.bfloat16 and q.codes.shape == (0, 32) and q.scales.shape == (0, 4)
    assert tk.dequantize(q, backend=backend).shape == (0, 64)
    guided, _ = tk.quantize_dequantize(x, guide=q, backend=backend)
    assert guided.shape == (0, 64)

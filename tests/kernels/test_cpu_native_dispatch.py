"""The native CPU backend's dispatch: selected by TRACE_FP4_CPU_BACKEND=native or backend="native", refused
off the CPU, and every piece without a native kernel runs the torch reference, counted with its reason."""

import pytest
import torch

import trace_kernels as tk
from trace_kernels import cpu_native
from trace_kernels.backend import resolve_backend


def test_env_selects_native_for_auto_on_cpu(monkeypatch):
    monkeypatch.setenv("TRACE_FP4_CPU_BACKEND", "native")
    assert resolve_backend("auto", torch.device("cpu")) == "native"
    monkeypatch.setenv("TRACE_FP4_CPU_BACKEND", "eager")
    assert resolve_backend("auto", torch.device("cpu")) == "torch"


def test_native_off_cpu_is_refused():
    with pytest.raises(ValueError, match="'native' is a CPU path"):
        resolve_backend("native", torch.device("meta"))


def test_bad_env_value_names_the_choices(monkeypatch):
    monkeypatch.setenv("TRACE_FP4_CPU_BACKEND", "numba")
    with pytest.raises(ValueError, match="native"):
        resolve_backend("auto", torch.device("cpu"))


def test_unported_piece_runs_torch_and_is_counted():
    cpu_native.FALLBACKS.clear()
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    amax = x.float().abs().amax().reshape(1)
    # dequantize stands for any piece without a kernel: it must equal torch bit for bit and be counted
    q = tk.quantize(x, amax, backend="torch")
    got = tk.dequantize(q, backend="native")
    want = tk.dequantize(q, backend="torch")
    if "dequantize" in cpu_native.NOT_NATIVE:
        assert cpu_native.fallbacks().get("eager:dequantize") == 1
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_as_numpy_views_bf16_bits():
    x = torch.tensor([1.0, -2.0], dtype=torch.bfloat16)
    a = cpu_native.as_numpy(x)
    assert a.dtype.name == "uint16" and a.tolist() == x.view(torch.int16).to(torch.int32).__and__(0xFFFF).tolist()

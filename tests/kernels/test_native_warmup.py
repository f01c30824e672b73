"""`trace-fp4 compile-kernels` (trace_kernels.native_warmup): every warm-up runs its kernels natively, a
warm-up that falls back to the torch reference is an error naming the piece, and the command refuses an
unknown group with exit status 2 before running anything."""

import pytest

from trace_fp4.cli import main
from trace_kernels import cpu_native, native_warmup

pytest.importorskip("numba")


def test_quantize_group_compiles_the_quantize_kernels():
    from trace_kernels.cpu_native import quantize as nq

    lines = []
    seconds = native_warmup.compile_all(["quantize"], log=lines.append)
    assert set(seconds) == {"quantize"} and lines and lines[0].startswith("quantize: ")
    # the kernels the group exists for now hold a compiled (or cache-loaded) signature each
    for kernel in (nq.quantize_kernel, nq.quantize_4over6_kernel, nq.dequantize_kernel):
        assert kernel.signatures, kernel


def test_a_warmup_that_falls_back_is_an_error_naming_the_piece(monkeypatch):
    def falls_back():
        cpu_native.count_eager("warm_probe", "made up for this test")

    monkeypatch.setitem(native_warmup.WARMUPS, "probe", falls_back)
    with pytest.raises(RuntimeError, match=r"'probe' ran the torch reference.*eager:warm_probe.*made up for this test"):
        native_warmup.compile_all(["probe"], log=lambda s: None)


def test_unknown_group_is_exit_2_before_anything_runs(monkeypatch, capsys):
    ran = []
    monkeypatch.setitem(native_warmup.WARMUPS, "quantize", lambda: ran.append(1))
    assert main(["compile-kernels", "--only", "quantize", "no_such_group"]) == 2
    assert ran == [] and "no_such_group" in capsys.readouterr().err

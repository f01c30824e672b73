"""The native sparse encoder (cpu_native/sparse_encode.py): payload bytes equal to the torch reference's
(wire.pack of the in-memory guide, and the fused torch encoder) across rates, segment sizes, static /
per-row / bf16-exact amaxes, 4over6 choice bits and compact rows; selected by backend="native" or
TRACE_FP4_CPU_BACKEND=native without a counted fallback; a record built on it equals the eager one."""

import pytest
import torch
from adversarial import cases
from record_factory import SHAPE, captured_builder

import trace_kernels as tk
from trace_kernels import cpu_native
from trace_kernels.cpu_native import sparse_encode
from trace_kernels.guides import sparse as sg
from trace_kernels.guides.compact import compact
from trace_kernels.guides.sparse import codec
from trace_kernels.guides.sparse.fused_encode import encode_payload
from trace_kernels.guides.sparse.rates import Rates, segment
from trace_kernels.errors import SparseError

pytest.importorskip("numba")


def reference_payload(q, rates):
    return sg.pack(sg.SparseGuide(*codec.encode_fields(q, None, rates)))


def check(q, rates):
    want = reference_payload(q, rates)
    assert torch.equal(encode_payload(q, None, rates, backend="torch"), want)
    got = encode_payload(q, None, rates, backend="native")
    assert got.dtype == torch.uint8 and torch.equal(got, want), (rates, got[:12].tolist(), want[:12].tolist())
    return got


def rows(lead, K, amax="row", seed=0, block_scale="6"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, K, generator=g) * torch.rand(*lead, 1, generator=g) * 4
    if amax == "static":
        a = x.abs().amax().reshape(1)
    else:
        a = x.abs().amax(-1)
        if amax == "bf16":  # bf16-exact amaxes: the key counts bf16 ulps (shift 16)
            a = a.to(torch.bfloat16).to(torch.float32)
    return tk.quantize(x, a, backend="torch", block_scale=block_scale)


# (K, rates): every segment size, S > 1, m_s = every block LSB (raw) and m_s < blocks (syndrome), m_c from
# 0 to 62, check-only, 0 and 8 amax coset bits
RATES = [
    (64, Rates(3, 3, 16)), (64, Rates(3, 4, 14)), (64, Rates(0, 0, 4, check=True)), (64, Rates(8, 1, 62)),
    (128, Rates(3, 2, 16)), (96, Rates(3, 2, 10)), (32, Rates(3, 1, 11)), (32, Rates(3, 2, 10)),
    (16, Rates(3, 1, 6)), (48, Rates(2, 0, 0)), (64, Rates(0, 4, 0)),
]


@pytest.mark.parametrize("amax", ["row", "static", "bf16"])
@pytest.mark.parametrize("K,rates", RATES)
def test_payload_bytes_equal_reference(K, rates, amax):
    got = check(rows((7, 3), K, amax, seed=K), rates)
    static = bool((got[1] >> 3) & 1)
    assert static == (amax == "static")
    assert bool((got[1] >> 4) & 1) == (amax == "bf16")  # shift 16 only for per-row bf16 amaxes


@pytest.mark.parametrize("amax", ["row", "static"])
@pytest.mark.parametrize("K,rates", [(64, Rates(3, 3, 16, choice=True)), (32, Rates(3, 1, 11, choice=True)),
                                     (128, Rates(3, 4, 14, choice=True))])
def test_4over6_choice_bits(K, rates, amax):
    q = rows((9, 2), K, amax, seed=1, block_scale="4over6")
    got = check(q, rates)
    assert got[0] >> 4 == sg.wire.CHOICE_VERSION
    # the rows took both candidates somewhere, so the choice bits are not all one value
    choices = codec.block_choices(q)
    assert 0 < int(choices.sum()) < choices.numel()


@pytest.mark.parametrize("amax", ["row", "static"])
def test_compact_rows(amax):
    q = compact(rows((11,), 64, amax, seed=3))
    check(q, Rates(3, 3, 16))
    check(compact(rows((5, 2), 32, amax, seed=4)), Rates(3, 1, 11))


def test_compact_rows_with_choice_bits_are_refused_as_by_the_reference():
    q = compact(rows((4,), 64, seed=5))
    with pytest.raises(SparseError, match="4over6"):
        encode_payload(q, None, Rates(3, 3, 16, choice=True), backend="native")


@pytest.mark.parametrize("name,x,amax", cases(), ids=[c[0] for c in cases()])
def test_adversarial_rows(name, x, amax):
    # ties, zero blocks, saturation, subnormal scales, NaN / Inf blocks and amaxes, +-0
    bps = segment(x.shape[-1]) // 16
    q = tk.quantize(x, amax, backend="torch")
    for rates in (Rates(3, min(3, bps), 16), Rates(8, bps, 62)):
        check(q, rates)


def test_empty_rows_keep_the_fixed_payload():
    q = rows((0,), 64)
    assert torch.equal(encode_payload(q, None, Rates(3, 3, 16), backend="native"), reference_payload(q, Rates(3, 3, 16)))


def test_env_selects_the_kernel_without_a_fallback(monkeypatch):
    monkeypatch.setenv("TRACE_FP4_CPU_BACKEND", "native")
    cpu_native.FALLBACKS.clear()
    q = rows((6,), 64)
    assert torch.equal(encode_payload(q, "moe_fc1_in"), reference_payload(q, Rates(3, 3, 16)))
    assert "eager:sparse_encode" not in cpu_native.fallbacks()


def test_record_built_natively_equals_eager(monkeypatch):
    builder = captured_builder(tk.TraceConfig(guidance="full", guided_layers="all"), steps=(9, 1, 1))
    eager = builder.build(tk.TraceConfig())
    monkeypatch.setenv("TRACE_FP4_CPU_BACKEND", "native")
    native = builder.build(tk.TraceConfig())
    assert eager.tensors.keys() == native.tensors.keys()
    assert all(torch.equal(eager.tensors[n], native.tensors[n]) for n in eager.tensors)
    assert native.to_bytes() == eager.to_bytes()


def test_record_backend_selects_the_encoder_alone(monkeypatch):
    # TRACE_FP4_RECORD_BACKEND=native: the records' encoder runs the kernel, the layers keep their backend
    builder = captured_builder(tk.TraceConfig(guidance="full", guided_layers="all"), steps=(5, 1))
    eager = builder.build(tk.TraceConfig())
    monkeypatch.setenv("TRACE_FP4_RECORD_BACKEND", "native")
    calls = []
    kernel = sparse_encode.encode_payload
    monkeypatch.setattr(sparse_encode, "encode_payload", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    assert builder.build(tk.TraceConfig()).to_bytes() == eager.to_bytes()
    assert len(calls) == sum(len(SHAPE.layer_sites(i)) for i in range(SHAPE.num_layers))
    monkeypatch.setenv("TRACE_FP4_RECORD_BACKEND", "numba")
    with pytest.raises(ValueError, match="TRACE_FP4_RECORD_BACKEND"):
        builder.build(tk.TraceConfig())

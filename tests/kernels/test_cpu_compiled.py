"""The CPU compiled path (trace_kernels.cpu_compiled, TRACE_FP4_CPU_BACKEND=compiled) computes the same bits
as the eager torch reference on adversarial inputs, and every piece that runs eager on it is counted.

Compiling takes seconds per piece (cached on disk across runs), so this module is in SLOW.
"""

import math

import pytest
import torch

import trace_kernels as tk
from adversarial import bad_value_rows, cases
from trace_kernels import cpu_compiled, envs, reference
from trace_kernels.backend import resolve_backend
from trace_kernels.grouped_mm import grouped_mm
from trace_kernels.grouped_mm.weights import PackedExperts
from trace_kernels.guides import sparse as sg
from trace_kernels.guides.compact import compact
from trace_kernels.kv_layout import pack_rows

CASES = cases()


ALL = CASES + [bad_value_rows()]


def _rows(amax, R):
    return amax.expand(R).contiguous() if amax.numel() == 1 else amax


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns (floats viewed as integers: a -0.0 / +0.0 or NaN payload difference shows)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.is_floating_point():
        ints = {4: torch.int32, 2: torch.int16}[a.element_size()]
        return torch.equal(a.view(ints), b.view(ints))
    return torch.equal(a, b)


@pytest.fixture
def compiled_env(monkeypatch):
    monkeypatch.setenv("TRACE_FP4_CPU_BACKEND", "compiled")
    yield


@pytest.mark.parametrize("name,x,amax", ALL, ids=[c[0] for c in ALL])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_dequantize_bit_identical(name, x, amax, dtype):
    x = x.to(dtype)
    for out_dtype in (None, dtype):
        c0, s0, o0 = (*reference.quantize(x, _rows(amax, x.shape[0])), None)
        if out_dtype is not None:
            o0 = reference.dequantize(c0, s0, _rows(amax, x.shape[0])).to(out_dtype)
        c1, s1, o1 = cpu_compiled.quantize(x, _rows(amax, x.shape[0]), out_dtype)
        assert _same_bits(c0, c1) and _same_bits(s0, s1), name
        if out_dtype is not None:
            assert _same_bits(o0, o1), name
    # and through the public entry point
    q0 = tk.quantize(x, amax, backend="torch")
    q1 = tk.quantize(x, amax, backend="compiled")
    assert _same_bits(q0.codes, q1.codes) and _same_bits(q0.scales, q1.scales)


@pytest.mark.parametrize("name,x,amax", ALL, ids=[c[0] for c in ALL])
def test_guided_rounding_bit_identical(name, x, amax):
    """Full and compact guidance toward a rollout whose values differ from the trainer's by a few ulps
    and a few percent (many guided flips), on the adversarial rows."""
    g = torch.Generator().manual_seed(len(name))
    rollout = x * (1 + 0.03 * torch.randn(x.shape, generator=g))
    rollout = torch.where(torch.isfinite(x), rollout, x)
    guide = tk.quantize(rollout, amax, backend="torch")
    for gd in (guide, compact(guide)):
        d0, q0 = tk.quantize_dequantize(x, guide=gd, backend="torch")
        d1, q1 = tk.quantize_dequantize(x, guide=gd, backend="compiled")
        assert _same_bits(q0.codes, q1.codes) and _same_bits(q0.scales, q1.scales), (name, gd.encoding)
        assert _same_bits(d0, d1), (name, gd.encoding)


def test_dequantize_bit_identical():
    for name, x, amax in ALL:
        q = tk.quantize(x, amax)
        assert _same_bits(tk.dequantize(q, backend="torch"), tk.dequantize(q, backend="compiled")), name


def test_table_dequantize_equals_the_reference_on_every_byte():
    """The torch backend's dequantize (table lookups) against the reference's arithmetic: every code byte
    beside every scale byte (NaN scales 0x7F / 0xFF included), under amaxes of every kind."""
    from trace_kernels.grouped_mm.reference import dequantize_rows

    codes = torch.arange(256, dtype=torch.uint8).repeat(256).reshape(256, 256)  # [R, K/2]: K = 512
    scales = torch.arange(256, dtype=torch.uint8)[:, None].expand(256, 32).contiguous()  # row r: scale byte r
    amax = torch.tensor([2688.0, 448.0, 1e-30, 0.0, 3.3e38, 1.0, float("inf"), float("nan")]).repeat(32)
    assert _same_bits(reference.dequantize(codes, scales, amax), dequantize_rows(codes, scales, amax))


def test_packed_kv_rows_bit_identical():
    """The packed KV write's rows (codes | scales | amax) from the compiled quantization."""
    g = torch.Generator().manual_seed(3)
    k = (torch.randn(5, 2, 64, generator=g) * 7).to(torch.bfloat16)  # [tokens, kv heads, head_dim]
    k[1, 0, :16] = 0
    amax = tk.row_amax(k)
    assert torch.equal(pack_rows(tk.quantize(k, amax, backend="torch")), pack_rows(tk.quantize(k, amax, backend="compiled")))


def _experts(E, N, K, seed):
    g = torch.Generator().manual_seed(seed)
    packed = PackedExperts.empty(E, N, K)
    for e in range(E):
        packed.quantize_expert_(e, torch.randn(N, K, generator=g) * 0.05 * (e + 1))
    return packed


@pytest.mark.parametrize("capture", [False, True])
def test_grouped_mm_bit_identical(capture):
    E, N, K, T, k = 4, 32, 64, 9, 2
    w = _experts(E, N, K, 0)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(T, K, generator=g) * 3).to(torch.bfloat16)
    x[2, :16] = 0
    ids = torch.randint(0, E, (T, k), generator=g)
    ids[:, 1] = torch.where(ids[:, 1] == ids[:, 0], (ids[:, 0] + 1) % E, ids[:, 1])
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    outs = []
    for backend in ("torch", "compiled"):
        cap = None
        if capture:
            cap = (torch.where(order % k == 0, order // k, -1), torch.zeros(T, K // 2, dtype=torch.uint8),
                   torch.zeros(T, K // 16, dtype=torch.uint8))
        out = grouped_mm(x, w, offs, a_rows=order // k, capture=cap, backend=backend)
        outs.append((out, cap))
    assert _same_bits(outs[0][0], outs[1][0])
    if capture:
        assert torch.equal(outs[0][1][1], outs[1][1][1]) and torch.equal(outs[0][1][2], outs[1][1][2])


def _noisy_trainer(x_r, seed, rel):
    g = torch.Generator().manual_seed(seed)
    return x_r.float() * (1 + rel * torch.randn(x_r.shape, generator=g))


@pytest.mark.parametrize("site,rel", [("moe_fc1_in", 2e-3), ("k", 8e-3), ("moe_fc2_in", 0.0)])
def test_sparse_decode_bit_identical(site, rel, monkeypatch):
    """Decoding sparse rows (syndromes, staged search, amax list, guided codes) gives the same codes,
    scales, amax and counts compiled as eager, with noise large enough that the searches, the wide search
    and the amax list all run."""
    g = torch.Generator().manual_seed(11)
    K = 128
    x_r = (torch.randn(24, K, generator=g) * torch.rand(24, 1, generator=g) * 4).to(torch.bfloat16)
    q = tk.quantize(x_r, tk.row_amax(x_r))
    guide = sg.encode(q, site)
    x_t = _noisy_trainer(x_r, 5, rel)
    x_t[3] = x_t[3] * 1.01  # a row whose amax moves by several bf16 ulps: list decoding
    results = []
    for mode in ("eager", "compiled"):
        monkeypatch.setenv("TRACE_FP4_CPU_BACKEND", mode)
        report = sg.DecodeReport()
        results.append((sg.decode(guide, x_t, report), report))
    (a, ra), (b, rb) = results
    assert _same_bits(a.codes, b.codes) and _same_bits(a.scales, b.scales) and _same_bits(a.global_amax, b.global_amax)
    assert ra == rb
    if rel:
        assert ra.code_flips > 0  # the search did work here


def test_sparse_encode_bit_identical(monkeypatch):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(10, 3, 64, generator=g) * 2).to(torch.bfloat16)
    q = tk.quantize(x, tk.row_amax(x))
    from trace_kernels.guides.sparse.fused_encode import encode_payload

    blobs = []
    for mode in ("eager", "compiled"):
        monkeypatch.setenv("TRACE_FP4_CPU_BACKEND", mode)
        blobs.append([encode_payload(q, site) for site in ("moe_fc2_in", "k", "moe_fc1_in")])
        blobs[-1].append(encode_payload(compact(q), "moe_fc1_in"))
    for a, b in zip(*blobs):
        assert torch.equal(a, b)


def test_fake_quantize_auto_takes_compiled_and_counts_nothing(compiled_env):
    """With the env var, "auto" on CPU tensors is the compiled path; RTN and full-guide rounding run no
    piece eager."""
    assert resolve_backend("auto", torch.device("cpu")) == "compiled"
    before = cpu_compiled.fallbacks()
    x = torch.randn(8, 32)
    out = tk.fake_quantize(x)
    assert torch.equal(out, tk.fake_quantize(x, backend="torch"))
    assert cpu_compiled.fallbacks() == before


def test_backend_choice_and_bad_values(monkeypatch):
    monkeypatch.delenv("TRACE_FP4_CPU_BACKEND", raising=False)
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    monkeypatch.setenv("TRACE_FP4_CPU_BACKEND", "inductor")
    with pytest.raises(ValueError, match="TRACE_FP4_CPU_BACKEND"):
        envs.TRACE_FP4_CPU_BACKEND
    with pytest.raises(ValueError, match="CPU path"):
        resolve_backend("compiled", torch.device("meta"))


def test_a_piece_that_cannot_compile_runs_eager_counted():
    """A graph break is an error under fullgraph=True: the piece runs eager from then on, every call
    counted, the error kept."""

    def breaks(x):
        y = x + 1
        torch._dynamo.graph_break()  # what an untraceable step (a host read, a Python side effect) is
        return y * 2

    p = cpu_compiled.Piece("test_breaks", breaks)
    x = torch.ones(3)
    with pytest.warns(UserWarning, match="test_breaks"):
        assert torch.equal(p(x), breaks(x))
    assert torch.equal(p(x), breaks(x))
    assert cpu_compiled.FALLBACKS["compile_failed:test_breaks"] == 2
    assert "test_breaks" in cpu_compiled.FAILURES
    del cpu_compiled.FAILURES["test_breaks"]


def test_kept_eager_pieces_are_counted(compiled_env):
    g = torch.Generator().manual_seed(4)
    x_r = (torch.randn(16, 64, generator=g) * 3).to(torch.bfloat16)
    q = tk.quantize(x_r, tk.row_amax(x_r))
    before = cpu_compiled.FALLBACKS["kept_eager:sparse_search_staging"]
    sg.decode(sg.encode(q, "k"), _noisy_trainer(x_r, 1, 1e-2))
    assert cpu_compiled.FALLBACKS["kept_eager:sparse_search_staging"] > before
    assert set(k.split(":", 1)[1] for k in cpu_compiled.FALLBACKS if k.startswith("kept_eager:")) <= set(cpu_compiled.KEPT_EAGER) | {"grouped_mm_per_expert"}

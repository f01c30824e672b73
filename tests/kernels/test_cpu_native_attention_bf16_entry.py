"""The engine's entry of the native packed attention (`packed_attention_bf16`: a bf16 query and result by address,
the layer's checks once) against `packed_attention` on the same call: the same bits, including the NaN rule (a
call with a NaN result cast by torch, counted) and rows past T untouched; None where packed_attention must run."""

import numpy as np
import pytest
import torch

import trace_kernels as tk
from trace_kernels.cpu_native import attention as A
from trace_kernels.cpu_native.quantize import CALLS
from trace_kernels.kv_layout import pack_rows

NB, H, BS, D, HQ = 6, 2, 16, 32, 4


def _case(seed: int, dv: int):
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-3, 2, NB)[:, None, None, None]
    k, v = torch.randn(NB, H, BS, D, generator=g) * scale, torch.randn(NB, H, BS, dv, generator=g) * scale
    k[2, 1, 5, :16] *= 1e-6  # a subnormal scale block: the kernel's slow row path
    rk, rv = k.reshape(-1, D), v.reshape(-1, dv)
    qk, qv = tk.quantize(rk, tk.row_amax(rk)), tk.quantize(rv, tk.row_amax(rv))
    cache = torch.cat((pack_rows(qk), pack_rows(qv)), -1).reshape(NB, H, BS, -1).contiguous()
    # a prefill chunk over earlier blocks, two decodes, a request without query tokens
    seq = torch.tensor([37, 20, 70, 9], dtype=torch.int32)
    qsl = torch.tensor([0, 5, 6, 7, 7], dtype=torch.int32)
    table = torch.tensor([[4, 1, 0, 5, 2], [3, 0, 0, 0, 0], [2, 5, 1, 0, 3], [1, 0, 0, 0, 0]], dtype=torch.int32)
    q = (torch.randn(7, HQ, D, generator=g) * 3).to(torch.bfloat16)
    return cache, table, seq, qsl, q


@pytest.mark.parametrize("dv", [32, 48])
@pytest.mark.parametrize("nan", [False, True])
@pytest.mark.parametrize("out_3d", [False, True])
def test_entry_gives_packed_attentions_bits(dv, nan, out_3d):
    cache, table, seq, qsl, q = _case(7 + dv, dv)
    if nan:
        q[5, 1, 3] = float("nan")  # request 1's only query token: its KV head's outputs are NaN
    T, extra = q.shape[0], 3
    want = torch.full((T, HQ * dv), 7.0, dtype=torch.bfloat16)
    A.packed_attention(q, cache, table, seq, qsl, D**-0.5, dv, out=want)
    # rows past T in the query (NaN) and the output (7.0): neither read nor written
    qq = torch.cat((q, torch.full((extra, HQ, D), float("nan"), dtype=torch.bfloat16)))
    got = torch.full((T + extra, HQ, dv) if out_3d else (T + extra, HQ * dv), 7.0, dtype=torch.bfloat16)
    held = (cache.numpy(), *A.index_views(table, seq, qsl)[:3])
    before = CALLS["kv_attention_cast_by_torch"]
    assert A.packed_attention_bf16(qq, got, T, held, A.layer_consts(cache, HQ, D, dv, "6", D**-0.5)) is got
    assert CALLS["kv_attention_cast_by_torch"] - before == int(nan)
    assert torch.equal(got.reshape(T + extra, -1)[:T].view(torch.int16), want.view(torch.int16))
    assert torch.equal(got.reshape(T + extra, -1)[T:], torch.full((extra, HQ * dv), 7.0, dtype=torch.bfloat16))
    assert torch.isnan(want.float()).any() == nan


def test_entry_declines_what_it_does_not_take():
    cache, table, seq, qsl, q = _case(3, D)
    held = (cache.numpy(), *A.index_views(table, seq, qsl)[:3])
    consts = A.layer_consts(cache, HQ, D, D, "6", D**-0.5)
    out = torch.empty(7, HQ * D, dtype=torch.bfloat16)
    assert A.packed_attention_bf16(q.float(), out, 7, held, consts) is None  # a float32 query
    assert A.packed_attention_bf16(q, out.float(), 7, held, consts) is None  # a float32 result
    wide = torch.empty(7, HQ * D + 8, dtype=torch.bfloat16)
    assert A.packed_attention_bf16(q, wide[:, : HQ * D], 7, held, consts) is None  # a strided result
    assert A.packed_attention_bf16(q.transpose(0, 1).contiguous().transpose(0, 1), out, 7, held, consts) is None
    assert A.packed_attention_bf16(q[:, :2], out, 7, held, consts) is None  # another head count
    assert A.packed_attention_bf16(q, out, 8, held, consts) is None  # more tokens than the query holds


def test_layer_consts_checks_the_cache_once():
    cache, *_ = _case(3, D)
    with pytest.raises(ValueError, match="do not hold head sizes"):
        A.layer_consts(cache, HQ, D, 48, "6", D**-0.5)
    with pytest.raises(ValueError, match="query heads over"):
        A.layer_consts(cache, 3, D, D, "6", D**-0.5)
    with pytest.raises(ValueError, match="block scale"):
        A.layer_consts(cache, HQ, D, D, "nope", D**-0.5)

"""kv_packed._native_forward on the engine's bf16 call takes attention.packed_attention_bf16 (the query and output
by address, the layer's checks held on the layer) and writes packed_attention's bits for the first
num_actual_tokens rows, leaving the padded rows past them alone; a float32 call takes packed_attention as before.
No engine: a layer stand-in with the attributes the plugin sets at build."""

import types

import torch

import trace_kernels as tk
from trace_kernels.cpu_native.attention import packed_attention
from trace_kernels.cpu_native.quantize import CALLS
from trace_kernels.kv_layout import pack_rows
from trace_vllm_plugin import kv_packed

NB, H, BS, D, HQ = 5, 2, 16, 32, 4


def _cache():
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(NB * H * BS, D, generator=g) * 2, torch.randn(NB * H * BS, D, generator=g)
    qk, qv = tk.quantize(k, tk.row_amax(k)), tk.quantize(v, tk.row_amax(v))
    return torch.cat((pack_rows(qk), pack_rows(qv)), -1).reshape(NB, H, BS, -1).contiguous()


class _Store:
    def __init__(self):
        self.counts = {}

    def count(self, key, n=1):
        self.counts[key] = self.counts.get(key, 0) + n


def _layer():
    return types.SimpleNamespace(num_heads=HQ, head_size=D, scale=D**-0.5, _trace_fp4_head_size_v=D,
                                 _trace_fp4_block_scale="6", _trace_fp4_store=_Store())


def _metadata():
    return types.SimpleNamespace(num_actual_tokens=6, block_table=torch.tensor([[3, 1, 4], [2, 0, 0]], dtype=torch.int32),
                                 seq_lens=torch.tensor([40, 9], dtype=torch.int32),
                                 query_start_loc=torch.tensor([0, 5, 6], dtype=torch.int32))


def _run(dtype, layer, cache):
    g = torch.Generator().manual_seed(9)
    query = (torch.randn(8, HQ, D, generator=g) * 3).to(dtype)  # 8 rows: 2 padding rows past the 6 tokens
    md = _metadata()
    output = torch.full((8, HQ * D), 7.0, dtype=dtype)
    want = output.clone()
    packed_attention(query[:6], cache, md.block_table, md.seq_lens, md.query_start_loc, D**-0.5, D, out=want[:6])
    before = (CALLS["kv_attention"], layer.__dict__.get("_trace_fp4_attention_consts"))
    assert kv_packed._native_forward(layer, None, query, None, None, cache, md, output) is output
    assert torch.equal(output.view(torch.int16) if dtype == torch.bfloat16 else output, want.view(torch.int16)
                       if dtype == torch.bfloat16 else want)
    assert torch.equal(output[6:].float(), torch.full((2, HQ * D), 7.0))
    assert CALLS["kv_attention"] - before[0] == 1
    return layer.__dict__.get("_trace_fp4_attention_consts")


def test_bf16_call_takes_the_entry_with_the_layers_consts_held():
    layer, cache = _layer(), _cache()
    held = _run(torch.bfloat16, layer, cache)
    assert held is not None and held[0] == cache.data_ptr()
    assert _run(torch.bfloat16, layer, cache) is held  # the layer's next call: the same consts, not remade
    other = _cache()
    assert _run(torch.bfloat16, layer, other)[0] == other.data_ptr()  # another cache: decided anew
    assert layer._trace_fp4_store.counts["kv_attention_native_calls"] == 3


def test_float32_call_takes_packed_attention():
    layer = _layer()
    _run(torch.float32, layer, _cache())
    assert layer._trace_fp4_store.counts["kv_attention_native_calls"] == 1

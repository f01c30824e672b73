"""Attention over the packed NVFP4 KV cache (`trace_kernels.attention`), Triton under the interpreter.

- `dequantize_pages` gives, bit for bit, the model-dtype values the CPU_ATTN packed path builds its
  scratch from (`trace_vllm_plugin.kv_packed.dequantize_blocks`), edge rows included (zero rows, a
  NaN-marked block, subnormal scales).
- `packed_decode_attention` (one query token per sequence, grouped-query heads, paged blocks out of
  order, partial last blocks, a one-token sequence; a length-0 padding request gives 0) equals the torch reference over those same values
  to within one BF16 ulp per output: the values attended to are identical, and only the order of the
  float32 sums differs (a reduction tree in the kernel, einsum in the reference), which can move a sum
  across a BF16 rounding boundary. Garbage past a sequence's length (NaN-marked rows) is never read.
  It runs under a mode that fails on any host synchronisation or data-dependent shape (CUDA-graph safe).
The comparison with vLLM's own CPU attention kernel on the engine's packed cache is in
tests/vllm/test_vllm_kv_packed.py. Shapes are small: each interpreted launch costs seconds.
"""

import pytest
import torch

import trace_kernels as tk
from host_sync_mode import NoHostSync
from trace_kernels.attention import dequantize_pages, packed_decode_attention, reference
from trace_kernels.kv_layout import pack_rows
from trace_vllm_plugin.kv_packed import dequantize_blocks

NB, H, BS, D, HQ = 6, 2, 16, 32, 4
# The compiled kernels too where a GPU is present (bench/gpu_check.py runs the "cuda" cases).
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _cache(seed: int) -> torch.Tensor:
    """uint8 [NB, H, BS, 2 * row]: random rows with a few edge rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(NB, H, BS, 2, D, generator=g) * torch.logspace(-3, 2, NB)[:, None, None, None, None]
    x[1, 0, 3] = 0.0  # an all-zero row: amax 0
    x[2, 1, 5, 0, :16] *= 1e-6  # one tiny block next to a large one: subnormal E4M3 scale
    rows = x.reshape(-1, 2, D)
    qk = tk.quantize(rows[:, 0], tk.row_amax(rows[:, 0]))
    qv = tk.quantize(rows[:, 1], tk.row_amax(rows[:, 1]))
    return torch.cat((pack_rows(qk), pack_rows(qv)), -1).reshape(NB, H, BS, -1)


@pytest.mark.parametrize("device", DEVICES)
def test_dequantized_pages_equal_the_cpu_attn_scratch_values(device):
    cache = _cache(0)
    cache[3, 1, 7, D // 2] = 0x7F  # a NaN-marked block scale (a row that held NaN/Inf)
    ids = torch.tensor([3, 1, 2, 5])
    k, v = (t.cpu() for t in dequantize_pages(cache.to(device), ids.to(device), D, D, torch.bfloat16))
    want_k, want_v = dequantize_blocks(cache[ids], D, D, torch.bfloat16)
    assert k.dtype == v.dtype == torch.bfloat16 and k.shape == (4 * BS, H, D)
    for got, want in ((k, want_k), (v, want_v)):  # every value, and NaN exactly where the reference has one
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(0.0).view(torch.int16), want.nan_to_num(0.0).view(torch.int16))
    assert k.isnan().sum() == 16 and (k == 0).all(-1).any()


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(x.abs().to(torch.bfloat16), torch.tensor(float("inf"), dtype=torch.bfloat16)).float() - x.abs().float()


@pytest.mark.parametrize("device", DEVICES)
def test_decode_attention_over_packed_pages_matches_the_reference_without_host_sync(device):
    cache = _cache(1)
    # Rows past each sequence's length hold garbage the kernel must not read: NaN-marked K and V rows.
    cache[0, :, 9:, D // 2] = 0x7F
    cache[5, :, 1:, D // 2] = 0x7F
    g = torch.Generator().manual_seed(2)
    q = torch.randn(4, HQ, D, generator=g).to(torch.bfloat16)
    table = torch.tensor([[4, 1, 3], [2, 0, 5], [5, 4, 4], [0, 0, 0]], dtype=torch.int32)  # blocks out of order
    # Partial last blocks, a one-token sequence, and a CUDA graph's padding request (length 0).
    seq_lens = torch.tensor([40, 25, 1, 0], dtype=torch.int32)
    args = [t.to(device) for t in (q, cache, table, seq_lens)]
    mode = NoHostSync()
    with mode:
        out = packed_decode_attention(*args, D**-0.5)
    assert mode.ops > 0
    out = out.cpu()
    assert (out[3] == 0).all()  # the padding request reads nothing and gives 0, not NaN
    out = out[:3]
    ref = reference.packed_decode_attention(q[:3], cache, table[:3], seq_lens[:3], D**-0.5)
    assert out.shape == ref.shape == (3, HQ, D) and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    diff = (out.float() - ref.float()).abs()
    assert (diff <= _bf16_ulp(ref)).all(), diff.max()
    assert (diff == 0).float().mean() >= 0.99
    # A one-token sequence attends to its own V row only.
    assert torch.equal(out[2], reference.sequence_kv(cache, table[2, :1], 1, D, D, torch.bfloat16)[1][0].repeat_interleave(HQ // H, 0))

"""Triton source of attention over the packed NVFP4 KV cache (`trace_kernels.kv_layout` rows in paged
blocks): the K/V values are decoded in registers from the cache bytes, never materialised.

The cache is the one both engines' packed modes hold: uint8 `[num_blocks, kv_heads, block_size, row_k +
row_v]`, each token and KV head one packed K row then one packed V row (codes, E4M3 scales, float32
amax; `kv_layout.py`).

Decode (`_packed_decode_attention_kernel`): one program per (sequence, KV head) owns that head's G query
heads (grouped-query attention) and walks the sequence's blocks through its block-table row, with an
online softmax in float32:
  - each K/V value is decoded exactly as `reference.dequantize` does (E2M1 magnitude x (E4M3 scale x
    g_dec), float32, g_dec from the row's amax by `div_rn`) and rounded to the model dtype with integer
    arithmetic (`_bf16_bits`: the interpreter miscasts fp32 -> bf16), so the values attended to are bit
    for bit those of a model-dtype cache holding the dequantized rows (what the CPU_ATTN packed path
    builds in its scratch);
  - scores q.k in float32 (products of model-dtype values, summed by a tl.reduce), softmax with `exp`,
    probabilities times V summed in float32, divided by the softmax sum, rounded to the model dtype.
No tensor-core dot: decode is memory bound, and bf16 `tl.dot` is wrong under the interpreter.
No host synchronisation and no data-dependent shape: the grid is (sequences, KV heads) and each
program's loop bound is read on the device, so the launch can be captured in a CUDA graph.

`_dequantize_pages_kernel` writes the decoded values of listed blocks into a model-dtype scratch
(token-major, `[U * block_size, kv_heads, D]`), the same values, for backends that attend with their
own kernel (prefill).

This module is only source: `launch.py` imports it compiled (CUDA) and, with the helpers' interpreted
copy in place, under the Triton interpreter (CPU).
"""

import triton
import triton.language as tl

from trace_kernels.triton_jit import _bf16_bits, _decode_e4m3, _global_scales, _grid_value, _row_max

DTYPE_FP32 = 0
DTYPE_BF16 = 1
DTYPE_FP16 = 2


# The sums and maxima go through tl.reduce with combine functions of this module (and
# trace_kernels.triton_jit's `_row_max`), not tl.sum / tl.max / tl.zeros / tl.cdiv: those are themselves
# @triton.jit functions, decorated in whichever mode triton was first imported in, so the interpreted
# copy of this module could not call them.
@triton.jit
def _add_combine(a, b):
    return a + b


@triton.jit
def _sum(v, axis: tl.constexpr):
    return tl.reduce(v, axis, _add_combine)


@triton.jit
def _to_model_dtype(v, DTYPE: tl.constexpr):
    """float32 -> the value the model dtype holds (still as float32)."""
    if DTYPE == 1:
        return (_bf16_bits(v).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    elif DTYPE == 2:
        return v.to(tl.float16).to(tl.float32)
    else:
        return v


@triton.jit
def _decode_rows(row_ptr, valid, D: tl.constexpr, DTYPE: tl.constexpr):
    """Packed rows at `row_ptr` ([T, 1] byte pointers) -> their values [T, D] (float32 holding model-dtype
    values); rows not `valid` ([T, 1]) read nothing and give 0."""
    d = tl.arange(0, D)[None, :]
    byte = tl.load(row_ptr + d // 2, mask=valid, other=0).to(tl.int32)
    code = (byte >> ((d % 2) * 4)) & 0xF
    scale_byte = tl.load(row_ptr + D // 2 + d // 16, mask=valid, other=0).to(tl.int32)
    a = D // 2 + D // 16  # the float32 amax, little endian, not necessarily 4-byte aligned
    amax_bits = tl.load(row_ptr + a, mask=valid, other=0).to(tl.int32)
    amax_bits |= tl.load(row_ptr + a + 1, mask=valid, other=0).to(tl.int32) << 8
    amax_bits |= tl.load(row_ptr + a + 2, mask=valid, other=0).to(tl.int32) << 16
    amax_bits |= tl.load(row_ptr + a + 3, mask=valid, other=0).to(tl.int32) << 24
    amax = tl.where(valid, amax_bits.to(tl.float32, bitcast=True), 1.0)  # [T, 1]
    _, g_dec = _global_scales(amax, False)  # packed KV pages: 4over6 is refused for them (see kv_layout)
    scale = tl.where((scale_byte & 0x7F) == 0x7F, float("nan"), _decode_e4m3(scale_byte))
    mag = _grid_value(code & 7)
    value = _to_model_dtype(mag * (scale * g_dec), DTYPE)
    # The sign as the code's sign bit flipped into the rounded magnitude (rounding is sign-symmetric), not
    # `-mag`: compiled on an H200 (Triton 3.6), a code-8 value (-0) came out +0.0 where the reference holds -0.0.
    value = (value.to(tl.int32, bitcast=True) ^ ((code & 8) << 28)).to(tl.float32, bitcast=True)
    return tl.where(valid, value, 0.0)


@triton.jit
def _packed_decode_attention_kernel(
    q_ptr, kv_ptr, table_ptr, seq_lens_ptr, out_ptr,
    stride_q_seq, stride_q_head,
    stride_kv_block, stride_kv_head, stride_kv_token,
    stride_table, stride_out_seq, stride_out_head,
    scale,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, ROW_K: tl.constexpr,
    BLOCK: tl.constexpr, DTYPE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    g = tl.arange(0, G_PAD)
    heads = kv_head * G + g
    hmask = g < G
    d = tl.arange(0, D)
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_q_seq + heads[:, None] * stride_q_head + d[None, :],
                mask=hmask[:, None], other=0.0).to(tl.float32)  # [G_PAD, D]
    seq_len = tl.load(seq_lens_ptr + seq)
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    denom = tl.full([G_PAD], 0.0, tl.float32)
    acc = tl.full([G_PAD, DV], 0.0, tl.float32)
    t = tl.arange(0, BLOCK)
    for b in range(0, (seq_len + BLOCK - 1) // BLOCK):
        block_id = tl.load(table_ptr + seq.to(tl.int64) * stride_table + b).to(tl.int64)
        in_seq = b * BLOCK + t < seq_len  # [BLOCK]
        valid = in_seq[:, None]
        rows = kv_ptr + block_id * stride_kv_block + kv_head * stride_kv_head + t[:, None] * stride_kv_token
        k = _decode_rows(rows, valid, D, DTYPE)  # [BLOCK, D]
        s = _sum(q[:, None, :] * k[None, :, :], 2) * scale  # [G_PAD, BLOCK]
        s = tl.where(in_seq[None, :], s, float("-inf"))
        m_new = tl.maximum(m, _row_max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        denom = denom * alpha + _sum(p, 1)
        v = _decode_rows(rows + ROW_K, valid, DV, DTYPE)  # [BLOCK, DV]
        acc = acc * alpha[:, None] + _sum(p[:, :, None] * v[None, :, :], 1)
        m = m_new
    out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]  # a sequence of length 0 (CUDA-graph padding): 0
    dv = tl.arange(0, DV)
    out_off = seq.to(tl.int64) * stride_out_seq + heads[:, None] * stride_out_head + dv[None, :]
    if DTYPE == 1:
        tl.store(out_ptr + out_off, _bf16_bits(out), mask=hmask[:, None])  # out_ptr: an int16 view
    else:
        tl.store(out_ptr + out_off, out, mask=hmask[:, None])


@triton.jit
def _dequantize_pages_kernel(
    kv_ptr, ids_ptr, k_ptr, v_ptr,
    stride_kv_block, stride_kv_head, stride_kv_token,
    H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, ROW_K: tl.constexpr, BLOCK: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """Program (u, head): block ids[u]'s rows of KV head `head` -> K/V [u * BLOCK + t, head, :]."""
    u = tl.program_id(0)
    head = tl.program_id(1)
    block_id = tl.load(ids_ptr + u).to(tl.int64)
    t = tl.arange(0, BLOCK)[:, None]
    rows = kv_ptr + block_id * stride_kv_block + head * stride_kv_head + t * stride_kv_token
    valid = t >= 0
    k = _decode_rows(rows, valid, D, DTYPE)
    v = _decode_rows(rows + ROW_K, valid, DV, DTYPE)
    token = u.to(tl.int64) * BLOCK + t
    dk = tl.arange(0, D)[None, :]
    dv = tl.arange(0, DV)[None, :]
    if DTYPE == 1:
        tl.store(k_ptr + (token * H + head) * D + dk, _bf16_bits(k))
        tl.store(v_ptr + (token * H + head) * DV + dv, _bf16_bits(v))
    else:
        tl.store(k_ptr + (token * H + head) * D + dk, k)
        tl.store(v_ptr + (token * H + head) * DV + dv, v)

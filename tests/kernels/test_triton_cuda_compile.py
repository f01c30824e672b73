"""Every Triton kernel of trace_kernels compiles for CUDA, on a machine without a GPU.

The interpreter runs the kernels' source on a CPU (the bit-exactness tests) but does not check what
only the compiler refuses, e.g. a plain Python float global read inside a @triton.jit body (it must be
a tl.constexpr: trace_kernels.triton_jit's FLT_MAX and GLOBAL_ENC_NUMERATOR were not, and no kernel
compiled for a GPU). Here each kernel, in the configurations the launchers use, goes through Triton's
own CUDA pipeline (TTIR, LLVM, PTX, and the bundled ptxas to a cubin) for Hopper (sm_90, the device
machine's H200); nothing runs. (The compiled kernels' results are checked on a GPU by bench/gpu_check.py.)
"""

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from trace_kernels import triton_jit  # noqa: E402  (the compiled-mode sources)
from trace_kernels.attention import triton_jit as attention_jit  # noqa: E402
from trace_kernels.grouped_mm import triton_jit as grouped_jit  # noqa: E402
from trace_kernels.guides.sparse import triton_jit as sparse_jit  # noqa: E402


def _sig(**kinds):
    return kinds


QUANTIZE = _sig(x_ptr="*bf16", amax_ptr="*fp32", gcode_ptr="*u8", gscale_ptr="*u8", code_ptr="*u8", scale_ptr="*u8",
                out_ptr="*i16", R="i32", K="i32")
DEQUANTIZE = _sig(code_ptr="*u8", scale_ptr="*u8", amax_ptr="*fp32", out_ptr="*fp32", R="i32", K="i32")
GROUPED = _sig(a_ptr="*bf16", a_rows_ptr="*i64", a_amax_ptr="*fp32", w_codes_ptr="*u8", w_scales_ptr="*u8",
               w_amax_ptr="*fp32", offs_ptr="*i32", out_ptr="*fp32", cap_rows_ptr="*i64", cap_codes_ptr="*u8",
               cap_scales_ptr="*u8", bias_ptr="*fp32", N="i32", K="i32", E="i32")
DECODE = _sig(q_ptr="*bf16", kv_ptr="*u8", table_ptr="*i32", seq_lens_ptr="*i32", out_ptr="*i16", stride_q_seq="i32",
              stride_q_head="i32", stride_kv_block="i64", stride_kv_head="i64", stride_kv_token="i64",
              stride_table="i32", stride_out_seq="i32", stride_out_head="i32", scale="fp32")
PAGES = _sig(kv_ptr="*u8", ids_ptr="*i64", k_ptr="*i16", v_ptr="*i16", stride_kv_block="i64", stride_kv_head="i64",
             stride_kv_token="i64")
SPARSE_ENCODE = _sig(code_ptr="*u8", scale_ptr="*u8", key_ptr="*i64", ccol_ptr="*i64", scol_ptr="*i64", out_ptr="*u8",
                     R="i32", K="i32", ROW_BITS="i32", A_BITS="i32", M_S="i32", M_C="i32")
SPARSE_SYNDROME = _sig(bits_ptr="*i64", col_ptr="*i64", out_ptr="*i64", N="i32", n="i32")
SPARSE_SEARCH = _sig(res_ptr="*i64", col_ptr="*i64", cost_ptr="*fp32", bound_ptr="*fp32", pmask_ptr="*i32",
                     psize_ptr="*i32", out_idx_ptr="*i32", out_cost_ptr="*fp32", N="i32", P="i32")

KERNELS = [
    ("quantize rtn", triton_jit._quantize_kernel, QUANTIZE,
     dict(MODE=0, WRITE_CODES=True, WRITE_OUT=True, OUT_BF16=True, BLOCK_R=16, BLOCK_K=256, FOUR6=False, PTX_ADD=True)),
    ("quantize rtn 4over6", triton_jit._quantize_kernel, QUANTIZE,
     dict(MODE=0, WRITE_CODES=True, WRITE_OUT=True, OUT_BF16=True, BLOCK_R=16, BLOCK_K=256, FOUR6=True, PTX_ADD=True)),
    ("quantize guided full", triton_jit._quantize_kernel, QUANTIZE,
     dict(MODE=1, WRITE_CODES=True, WRITE_OUT=False, OUT_BF16=False, BLOCK_R=16, BLOCK_K=256, FOUR6=False, PTX_ADD=True)),
    ("quantize guided compact", triton_jit._quantize_kernel, QUANTIZE,
     dict(MODE=2, WRITE_CODES=False, WRITE_OUT=True, OUT_BF16=True, BLOCK_R=16, BLOCK_K=256, FOUR6=True, PTX_ADD=True)),
    ("dequantize", triton_jit._dequantize_kernel, DEQUANTIZE, dict(BLOCK_R=16, BLOCK_K=256, FOUR6=False)),
    ("grouped mm, gather + capture", grouped_jit._grouped_mm_kernel, GROUPED,
     dict(GATHER=True, CAPTURE=True, BIAS=False, PTX_ADD=True, BLOCK_M=16, BLOCK_N=64, FOUR6=False)),
    ("grouped mm, 4over6", grouped_jit._grouped_mm_kernel, GROUPED,
     dict(GATHER=True, CAPTURE=True, BIAS=False, PTX_ADD=True, BLOCK_M=16, BLOCK_N=64, FOUR6=True)),
    ("grouped mm, bias", grouped_jit._grouped_mm_kernel, GROUPED,
     dict(GATHER=False, CAPTURE=False, BIAS=True, PTX_ADD=True, BLOCK_M=64, BLOCK_N=128, FOUR6=False)),
    ("packed decode attention, bf16, GQA 4", attention_jit._packed_decode_attention_kernel, DECODE,
     dict(G=4, G_PAD=4, D=128, DV=128, ROW_K=76, BLOCK=16, DTYPE=1)),
    ("dequantize pages, bf16", attention_jit._dequantize_pages_kernel, PAGES,
     dict(H=8, D=128, DV=128, ROW_K=76, BLOCK=16, DTYPE=1)),
    ("sparse encode, scale syndrome", sparse_jit._encode_bits_kernel, SPARSE_ENCODE,
     dict(SEG=64, BPS=4, A_PAD=4, MS_PAD=4, MC_PAD=16, SCALE_RAW=False, BLOCK_R=8)),
    ("sparse encode, raw scale bits", sparse_jit._encode_bits_kernel, SPARSE_ENCODE,
     dict(SEG=32, BPS=2, A_PAD=4, MS_PAD=2, MC_PAD=16, SCALE_RAW=True, BLOCK_R=8)),
    ("sparse syndrome", sparse_jit._syndrome_kernel, SPARSE_SYNDROME, dict(N_PAD=64, M_PAD=16, BLOCK_N=4)),
    ("sparse search, staged", sparse_jit._search_kernel, SPARSE_SEARCH,
     dict(C=12, W=4, W_PAD=8, BLOCK_N=16, BLOCK_P=256)),
    ("sparse search, wide", sparse_jit._search_kernel, SPARSE_SEARCH,
     dict(C=20, W=6, W_PAD=8, BLOCK_N=16, BLOCK_P=256)),
]


def test_every_kernel_compiles_for_cuda():
    target = GPUTarget("cuda", 90, 32)
    for name, fn, signature, constexprs in KERNELS:
        sig = {**signature, **{k: "constexpr" for k in constexprs}}
        compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=target)
        assert compiled.asm["ptx"] and compiled.asm["cubin"], name

"""KV-cache capacity: how many tokens vLLM says fit in one `kv_cache_memory_bytes`, BF16 vs trace_fp4.

For each tiny Qwen3-MoE (head_dim 32 and the Qwen3-30B-A3B head_dim 128), and the tiny hybrid
Qwen3-Next (3 of 4 layers Gated DeltaNet: the packed pages live inside vLLM's hybrid KV manager, which
pads the linear-attention state page to the attention page), it starts a BF16 engine and a trace_fp4
engine (packed NVFP4 KV cache, the default) one after another in this process with the same budget, and prints vLLM's own reported capacity (`cache_config.num_gpu_blocks` x block size, the figure
vLLM logs as "KV cache size: N tokens") side by side with the ratio. Then the per-token bytes of a
Qwen3-30B-A3B-shaped cache (48 layers, 4 KV heads x 128), computed by vLLM's own page accounting
(`FullAttentionSpec.page_size_bytes`) through the packed backend's `customize_spec`. Not a test.

    python bench/kv_capacity.py [--kv-mib 64]
"""

import argparse
import gc
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def capacity(model, quant_config, kv_bytes):
    from vllm import LLM
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    kwargs = dict(
        model=str(model), dtype="bfloat16", enforce_eager=True, kv_cache_memory_bytes=kv_bytes,
        max_model_len=512, max_num_seqs=4, seed=0,
    )
    if quant_config is not None:
        kwargs["hf_overrides"] = {"quantization_config": quant_config}
    llm = LLM(**kwargs)
    cfg = llm.llm_engine.vllm_config.cache_config
    blocks, block_size = cfg.num_gpu_blocks, cfg.block_size
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
    return blocks * block_size


def qwen3_30b_a3b_bytes_per_token():
    """(BF16, packed) bytes per token of a 48-layer, 4 x 128 KV cache, by vLLM's page accounting."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from trace_vllm_plugin.kv_packed import packed_backend_class

    spec = FullAttentionSpec(block_size=1, num_kv_heads=4, head_size=128, dtype=torch.bfloat16)
    packed = packed_backend_class(CPUAttentionBackend).customize_spec(spec)
    return 48 * spec.page_size_bytes, 48 * packed.page_size_bytes


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kv-mib", type=int, default=64)
    p.add_argument("--model-dir", default="/tmp/trace_fp4_bench_models")
    from results_io import add_json_arg, write_results

    add_json_arg(p, "kv_capacity")
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from trace_fp4.tiny_model import build_tiny_qwen3_moe

    kv_bytes = args.kv_mib << 20
    rows = []
    for head_dim in (32, 128):
        model = build_tiny_qwen3_moe(Path(args.model_dir) / f"moe_hd{head_dim}", head_dim=head_dim)
        bf16 = capacity(model, None, kv_bytes)
        fp4 = capacity(model, {"quant_method": "trace_fp4"}, kv_bytes)
        rows.append((f"tiny Qwen3-MoE, 4 layers, 2 KV x {head_dim}", bf16, fp4))
    from trace_fp4.archs import qwen3_next

    hybrid = qwen3_next.build_tiny(Path(args.model_dir) / "qwen3_next", seed=0)
    t = qwen3_next.TINY
    rows.append((f"tiny Qwen3-Next, 1 of 4 layers full attention, {t['num_key_value_heads']} KV x {t['head_dim']}",
                 capacity(hybrid, None, kv_bytes), capacity(hybrid, {"quant_method": "trace_fp4"}, kv_bytes)))

    print(f"\nvLLM's reported KV capacity for kv_cache_memory_bytes = {args.kv_mib} MiB (CPU_ATTN)")
    print(f"{'model':<60}{'BF16 tokens':>13}{'trace_fp4 tokens':>18}{'ratio':>8}")
    for name, bf16, fp4 in rows:
        print(f"{name:<60}{bf16:>13,}{fp4:>18,}{fp4 / bf16:>7.2f}x")
    b, f = qwen3_30b_a3b_bytes_per_token()
    print(f"\nQwen3-30B-A3B shape (48 layers, 4 KV heads x 128), vLLM page bytes per token:")
    print(f"  BF16 {b:,} B, trace_fp4 packed {f:,} B ({b / f:.2f}x tokens per byte)")
    write_results(args.json, "kv_capacity", {
        "kv_mib": args.kv_mib,
        "models": [{"model": name, "bf16_tokens": bf16, "trace_fp4_tokens": fp4} for name, bf16, fp4 in rows],
        "qwen3_30b_a3b_bytes_per_token": {"bf16": b, "trace_fp4": f},
    })


if __name__ == "__main__":
    main()

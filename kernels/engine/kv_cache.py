"""Where an engine's NVFP4 KV cache keeps its rows (`TRACE_FP4_KV_CACHE`, see trace_kernels.envs).

'packed': the cache holds packed NVFP4 rows (codes, E4M3 scales, float32 amax; trace_kernels.kv_layout),
about 3.4x the tokens of BF16 at head_dim 128. 'dequantized': the cache holds the dequantized values in
the model dtype (the same bits every read sees, 1.0x memory), kept to compare against.
"""

from .. import envs
from ..envs import KV_CACHE_MODES

KV_CACHE_ENV = "TRACE_FP4_KV_CACHE"

__all__ = ["KV_CACHE_ENV", "KV_CACHE_MODES", "kv_cache_mode"]


def kv_cache_mode() -> str:
    return envs.read(KV_CACHE_ENV)

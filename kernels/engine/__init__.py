"""The engine core: what every engine plugin (vLLM, SGLang) does the same way, written once.

  counters.EngineCounters     per-engine counters and saturation tally (no module globals)
  weights.WeightsIdentity     weights version and expert-weights digest a record carries
  records.assemble_record     a request's captured rows -> its GuidanceRecord
  kv_cache.kv_cache_mode      packed or dequantized NVFP4 KV cache (TRACE_FP4_KV_CACHE)
  refusals                    set-ups refused at model build, one message each
  capture                     vLLM-style per-step capture bookkeeping: step attribution, request
                              captures and their memory budget, prefix rows

The plugins are thin adapters from their engine's extension points to these parts; see
docs/engines.md.
"""

from .counters import EngineCounters
from .kv_cache import KV_CACHE_ENV, KV_CACHE_MODES, kv_cache_mode
from .records import assemble_record
from .weights import WeightsIdentity

__all__ = ["EngineCounters", "KV_CACHE_ENV", "KV_CACHE_MODES", "WeightsIdentity", "assemble_record", "kv_cache_mode"]

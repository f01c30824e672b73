"""The expert-weights fingerprint returned with every record: `trace_kernels.weight_digest`, shared
with the vLLM plugin so both engines compute it the same way."""

from trace_kernels.weight_digest import layer_digest, model_digest

__all__ = ["layer_digest", "model_digest"]

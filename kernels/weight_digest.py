"""A fingerprint of the NVFP4 expert weights an engine runs (the same function for every engine).

SHA-256 per layer over (codes, scales, global amax) of the fused gate/up weights then the down weights,
and one SHA-256 over the per-layer digests in layer order. A record carries it (`identity.weights_digest`)
so a trainer can tell which weights produced it; a test checks that a weight update re-quantized to
exactly what a fresh load gives.
"""

import hashlib

import torch

from .grouped_mm.weights import PackedExperts
from .tensor import NVFP4Tensor


def layer_digest(w13: PackedExperts | NVFP4Tensor, w2: PackedExperts | NVFP4Tensor) -> str:
    """The engines' resident weights are `PackedExperts` (amax [E]); an `NVFP4Tensor` of the same
    weights (amax per expert) gives the same digest."""
    parts = []
    for q in (w13, w2):
        parts.append((q.codes, q.scales, q.amax if isinstance(q, PackedExperts) else q.global_amax))
    return digest_of_tensors(*parts)


def digest_of_tensors(w13: tuple, w2: tuple) -> str:
    """`layer_digest` of (codes, scales, amax) tensors of the fused gate/up and the down weights (e.g.
    reassembled from the shards of several tensor-parallel ranks)."""
    h = hashlib.sha256()
    for q in (w13, w2):
        for t in q:
            h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def model_digest(layer_digests: dict[int, str]) -> str:
    """One digest over every layer's `layer_digest`, in layer order."""
    return hashlib.sha256("".join(layer_digests[k] for k in sorted(layer_digests)).encode()).hexdigest()

"""A fingerprint of the NVFP4 expert weights in use, returned with every record (`weight_digest`).

SHA-256 per layer over (codes, scales, per-expert global amax) of the packed fused gate/up weights then
the down weights (`trace_kernels.grouped_mm.PackedExperts`),
and one SHA-256 over the per-layer digests in layer order. Lets a trainer check which weights produced
a record, and a test check that a weight update re-quantized to exactly what a fresh load gives.
"""

import hashlib

import torch

from trace_kernels.grouped_mm import PackedExperts


def layer_digest(w13: PackedExperts, w2: PackedExperts) -> str:
    h = hashlib.sha256()
    for q in (w13, w2):
        for t in (q.codes, q.scales, q.amax):
            h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def model_digest(layer_digests: dict[int, str]) -> str:
    return hashlib.sha256("".join(layer_digests[k] for k in sorted(layer_digests)).encode()).hexdigest()

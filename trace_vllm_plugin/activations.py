"""Activation quantization with capture, shared by the expert inputs and the K/V cache write.

One NVFP4 row per token (and per routed slot / KV head): the global amax is the row's own amax by
default (batch invariant), or a calibrated static value per layer and site (`activation_scale:
static`). The quantized rows go to the capture store when the layer is guided.
"""

import torch

import trace_kernels

from .capture import STORE


def quantize_input(x: torch.Tensor, layer_idx: int, site: str):
    """Fake-quantize activations with capture; returns (dequantized x, NVFP4Tensor)."""
    # Per-token amax (batch invariant) unless the config calibrated a static one; the same decision as
    # SGLang's and the trainer's (trace_kernels.site_amax). Values above a static amax are counted.
    amax = trace_kernels.site_amax(STORE.config, layer_idx, site, x, saturated=STORE.saturation)
    xq, q = trace_kernels.fake_quantize(x, global_amax=amax, return_quantized=True)
    if STORE.wants(layer_idx):
        STORE.put(layer_idx, site, q)
    return xq, q

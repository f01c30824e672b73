"""Activation quantization with capture, shared by the expert inputs and the K/V cache write.

One NVFP4 row per token (and per routed slot / KV head): the global amax is the row's own amax by
default (batch invariant), or a calibrated static value per layer and site (`activation_scale:
static`). The quantized rows go to the engine's capture store when the layer is guided.
"""

import torch

import trace_kernels


def quantize_input(store, x: torch.Tensor, layer_idx: int, site: str, into=None, dequantized: bool = True):
    """Fake-quantize activations with capture into `store` (the engine's CaptureStore; `into`: the
    caller's own capture buffers, see CaptureStore.put); returns (dequantized x, NVFP4Tensor).
    `dequantized=False`: only the NVFP4 rows (the packed KV write stores those), None in its place."""
    # Per-token amax (batch invariant) unless the config calibrated a static one; the same decision as
    # SGLang's and the trainer's (trace_kernels.site_amax). Values above a static amax are counted.
    amax = trace_kernels.site_amax(store.config, layer_idx, site, x, saturated=store.saturation)
    if dequantized:
        xq, q = trace_kernels.fake_quantize(x, global_amax=amax, return_quantized=True, backend=store.kernel_backend,
                                            block_scale=store.config.block_scale)
    else:
        xq, q = None, trace_kernels.quantize(x, amax, backend=store.kernel_backend, block_scale=store.config.block_scale)
    if store.wants(layer_idx):
        store.put(layer_idx, site, q, into)
    return xq, q

"""A forward hook SGLang attaches to each RadixAttention (`forward_hooks` server arg) to read the KV pool
after the layer wrote it: the bytes stored at the forward's KV slots, the pool's class, dtype and size.

Each call is saved as one numbered file in `config["dir"]`, in call order.
"""

import itertools
from pathlib import Path

import torch

_seq = itertools.count()


def pool_probe(config):
    def hook(module, inputs, output):
        from trace_sglang_plugin.state import state_of

        forward_batch = inputs[3]
        pool = state_of(module).kv_pool
        layer = int(module.layer_id)
        loc = forward_batch.out_cache_loc.detach().to(torch.int64)
        local = layer - pool.start_layer
        k_size, v_size = pool.get_kv_size_bytes()
        data = {
            "layer": layer,
            "loc": loc.cpu().clone(),
            "pool_class": type(pool).__name__,
            "buffer_dtype": str(pool.k_buffer[local].dtype),
            "pool_bytes": int(k_size + v_size),
            "slots": int(pool.k_buffer[local].shape[0]),
            "k_rows": pool.k_buffer[local][loc].cpu().clone(),
            "v_rows": pool.v_buffer[local][loc].cpu().clone(),
        }
        d = Path(config["dir"])
        d.mkdir(parents=True, exist_ok=True)
        torch.save(data, d / f"{next(_seq):08d}-pool-{layer}.pt")

    return hook

"""Builds guidance records from random captures (test helper)."""

import torch

import trace_kernels as tk

SHAPE = tk.ModelShape(
    num_layers=4, hidden_size=64, moe_intermediate_size=32, num_experts=8, top_k=2, num_kv_heads=2, head_dim=32
)


def captured_builder(config: tk.TraceConfig, steps=(5, 1, 1), seed=0, shape=SHAPE) -> tk.RecordBuilder:
    """A prefill of steps[0] tokens then one decode step per further entry, like an engine."""
    g = torch.Generator().manual_seed(seed)
    b = tk.RecordBuilder(shape, config)
    for T in steps:
        for layer in range(shape.num_layers):
            if shape.has_moe(layer):
                b.add_routing(layer, torch.randint(0, shape.num_experts, (T, shape.top_k), generator=g))
            for site in shape.layer_sites(layer):
                x = torch.randn(T, *shape.row_shape(site), generator=g)
                b.add(layer, site, tk.quantize(x, tk.row_amax(x)))
    return b


def worker_take(store, ids, **kwargs) -> dict:
    """The vLLM worker's take RPC (`worker_rpc.trace_fp4_take_records`) over a capture store, without an
    engine: the stand-in worker holds only the path to the store that the RPC reads."""
    from types import SimpleNamespace

    from trace_vllm_plugin import worker_rpc

    wrapper = SimpleNamespace(worker=SimpleNamespace(model_runner=SimpleNamespace(
        vllm_config=SimpleNamespace(quant_config=SimpleNamespace(capture_store=store)))))
    return worker_rpc.trace_fp4_take_records(wrapper, ids, **kwargs)

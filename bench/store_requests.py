"""Requests as vLLM's capture store holds them, without an engine: random rows of the embedded tiny
model's shape, pre-quantized, `put` step by step (a prefill of `prompt` tokens per request, then one
token per decode step), and the wrapper the worker's RPCs read their store from. Shared by
bench/record_encode.py (`store_figures`) and bench/take_records.py, so both time the same requests."""

import time
from types import SimpleNamespace

import torch

import trace_kernels as tk


def random_steps(shape, requests: int, prompt: int, tokens: int, seed: int = 1) -> list:
    """[(rows per request, {(layer, site): NVFP4Tensor}, {layer: expert ids})] per step: the prefill, then
    `tokens` decode steps; the same generator order in every caller, so the same rows for a seed."""
    g = torch.Generator().manual_seed(seed)

    def step(n):
        T = n * requests
        sites = {}
        for layer in range(shape.num_layers):
            for site in shape.layer_sites(layer):
                x = torch.randn(T, *shape.row_shape(site), generator=g)
                sites[(layer, site)] = tk.quantize(x, tk.row_amax(x))
        routing = {layer: torch.randint(0, shape.num_experts, (T, shape.top_k), generator=g)
                   for layer in range(shape.num_layers)}
        return n, sites, routing

    return [step(prompt)] + [step(1) for _ in range(tokens)]


def run_steps(store, ids: list, steps: list) -> list[float]:
    """Every step through the store as the engine's forward writes it; process CPU seconds per step."""
    from trace_vllm_plugin.capture import StepLayout

    R, pos, step_s = len(ids), 0, []
    for n, sites, routing in steps:
        t = time.process_time()
        store.begin_step(StepLayout(ids, [i * n for i in range(R + 1)], [pos] * R))
        for layer, t_ids in routing.items():
            store.put_routing(layer, t_ids)
        for (layer, site), q in sites.items():
            store.put(layer, site, q)
        store.end_step()
        step_s.append(time.process_time() - t)
        pos += n
    return step_s


def worker_of(store):
    """What `trace_fp4_take_records` reads its engine's store from."""
    return SimpleNamespace(worker=SimpleNamespace(model_runner=SimpleNamespace(
        vllm_config=SimpleNamespace(quant_config=SimpleNamespace(capture_store=store)))))

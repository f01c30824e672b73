"""Worker-side probes of what trace_fp4's ops receive, in eager and in compiled vLLM alike.

Module forward hooks do not fire inside vLLM's compiled model (Dynamo traced the forward before the
hook existed, and vLLM drops Dynamo's guards), so these probes wrap the two functions the opaque ops
call at run time in either mode: `routed_experts` inside the MoE op (its BF16 input rows and routed
ids) and `quantize_input` inside the packed KV write (K and V as handed to the cache write). Run them
through `llm.apply_model` (in-process engines).
"""

import torch


def install_op_probes(model) -> None:
    import trace_vllm_plugin.experts as experts
    import trace_vllm_plugin.kv_packed as kv_packed

    layer_of = {id(layer.mlp.experts.routed_experts.trace_w13): i for i, layer in enumerate(model.model.layers)}
    log = []
    routed, quantize = experts.routed_experts, kv_packed.quantize_input

    def routed_probe(x, topk_weights, topk_ids, w13, *args, **kwargs):
        layer = layer_of[id(w13)]
        log.append((layer, "moe_fc1_in", x.detach().clone()))
        log.append((layer, "routing", topk_ids.detach().to(torch.int16).clone()))
        return routed(x, topk_weights, topk_ids, w13, *args, **kwargs)

    def quantize_probe(store, x, layer, site, *args, **kwargs):
        log.append((layer, site, x.detach().clone()))
        return quantize(store, x, layer, site, *args, **kwargs)

    experts.routed_experts, kv_packed.quantize_input = routed_probe, quantize_probe
    model._trace_op_probes = (log, routed, quantize)


def drain_op_probes(model) -> dict:
    """{(layer, site): input rows} of the one forward since the last drain; refuses a second call of
    the same op (one forward per drain)."""
    log = model._trace_op_probes[0]
    out = {}
    for layer, site, x in log:
        if (layer, site) in out:
            raise AssertionError(f"layer {layer} {site}: called twice since the last drain")
        out[(layer, site)] = x
    log.clear()
    return out


def remove_op_probes(model) -> None:
    import trace_vllm_plugin.experts as experts
    import trace_vllm_plugin.kv_packed as kv_packed

    _, experts.routed_experts, kv_packed.quantize_input = model._trace_op_probes
    del model._trace_op_probes

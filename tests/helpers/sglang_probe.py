"""Forward hooks that SGLang attaches in its scheduler process (`forward_hooks` server arg) to record the
engine's own tensors, independently of trace_sglang_plugin's capture path:

* `moe_probe` on each FusedMoE (`model.layers.*.mlp.experts`): the hidden states entering the routed
  experts and the routed expert ids.
* `attn_probe` on each RadixAttention (`model.layers.*.self_attn.attn`): K and V as handed to the
  attention layer (after RoPE and the QK norm) and the KV slots they are written to.

Each call is saved as one numbered file in `config["dir"]`, in call order.
"""

import itertools
from pathlib import Path

import torch

_seq = itertools.count()


def _save(directory: str, kind: str, layer: int, data: dict) -> None:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    torch.save({"layer": layer, **data}, d / f"{next(_seq):08d}-{kind}-{layer}.pt")


def moe_probe(config):
    def hook(module, inputs, output):
        hidden, topk_output = inputs[0], inputs[1]
        _save(config["dir"], "moe", int(module.layer_id), {
            "x": hidden.detach().cpu().clone(),
            "topk_ids": topk_output.topk_ids.detach().cpu().clone(),
            "topk_weights": topk_output.topk_weights.detach().cpu().float().clone(),
        })

    return hook


def attn_probe(config):
    def hook(module, inputs, output):
        q, k, v, forward_batch = inputs[:4]
        _save(config["dir"], "attn", int(module.layer_id), {
            "k": k.detach().cpu().clone(),
            "v": v.detach().cpu().clone(),
            "loc": forward_batch.out_cache_loc.detach().cpu().clone(),
        })

    return hook


def storage_probe(config):
    """On each FusedMoE call: the storage address of every packed expert tensor (a refit must write
    in place, or a captured cuda graph would keep reading the old weights)."""
    def hook(module, inputs, output):
        ptrs = {f"{name}.{field}": getattr(getattr(module, f"trace_{name}"), field).data_ptr()
                for name in ("w13", "w2") for field in ("codes", "scales", "amax")}
        _save(config["dir"], "storage", int(module.layer_id), {"ptrs": ptrs})

    return hook

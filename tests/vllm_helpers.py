"""Shared pieces of the vLLM tests: tiny checkpoints, engine start/stop, worker-side probes.

Engines run on the CPU build of vLLM. Every engine here is real; probes run inside the worker through
`llm.apply_model` / `llm.collective_rpc` (in-process engines only: they pass Python callables).
"""

import gc
import json
import os
import shutil
from pathlib import Path

import torch

from trace_fp4.tiny_model import build_tiny_qwen3_dense, build_tiny_qwen3_moe

MODELS_DIR = Path(os.environ.get("TRACE_FP4_TEST_MODELS", "/tmp/trace_fp4_test_models"))
KV_BYTES = 64 << 20  # the default KV budget is 92% of RAM
FULL_ALL = {"quant_method": "trace_fp4", "guidance": "full", "guided_layers": "all"}

PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was a tiny model that learned to count",
    "Four bit",
]


def tiny_moe(**kwargs) -> Path:
    name = "moe" + "".join(f"_{k}{v}" for k, v in sorted(kwargs.items()))
    return build_tiny_qwen3_moe(MODELS_DIR / name, **kwargs)


def tiny_dense() -> Path:
    return build_tiny_qwen3_dense(MODELS_DIR / "dense")


def with_quant_config(src, name, quant_config):
    """A copy of a checkpoint whose config.json carries `quant_config` (the shipped-checkpoint path)."""
    dst = MODELS_DIR / name
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = quant_config
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def make_llm(model, *, quant_config: dict | None = None, multiprocess: bool = False, **kwargs):
    """A vLLM engine on the CPU with small, fixed resources; `quant_config` goes through
    hf_overrides as the model's quantization_config (as if it were in config.json)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    from vllm import LLM

    args = dict(
        model=str(model),
        dtype="bfloat16",
        enforce_eager=True,
        kv_cache_memory_bytes=KV_BYTES,
        max_model_len=512,
        max_num_seqs=8,
        seed=0,
    )
    if quant_config is not None:
        args["hf_overrides"] = {"quantization_config": quant_config}
    args.update(kwargs)
    return LLM(**args)


def shutdown(llm) -> None:
    """Stop an engine so the next one can start in this process."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    engine = getattr(llm, "llm_engine", None)
    if engine is not None and hasattr(engine, "engine_core"):
        engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def greedy(max_tokens: int, **kwargs):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


# ---- probes (run in the worker via llm.apply_model) ---------------------------------------------
def _decoder_layers(model):
    return model.model.layers


def install_probes(model) -> None:
    """Record, per forward call, the expert inputs and the K/V handed to attention of every layer."""
    probes = {"x": {}, "k": {}, "v": {}}
    model._trace_probes = probes
    model._trace_probe_handles = []
    for i, layer in enumerate(_decoder_layers(model)):
        def moe_hook(mod, args, kwargs, i=i):
            x = kwargs.get("hidden_states", args[0] if args else None)
            probes["x"].setdefault(i, []).append(x.detach().clone())

        def attn_hook(mod, args, kwargs, i=i):
            _, k, v = args[:3]
            D = mod.head_size
            probes["k"].setdefault(i, []).append(k.detach().reshape(k.shape[0], -1, D).clone())
            probes["v"].setdefault(i, []).append(v.detach().reshape(v.shape[0], -1, D).clone())

        h1 = layer.mlp.experts.register_forward_pre_hook(moe_hook, with_kwargs=True)
        h2 = layer.self_attn.attn.register_forward_pre_hook(attn_hook, with_kwargs=True)
        model._trace_probe_handles += [h1, h2]


def take_probes(model) -> dict:
    probes = model._trace_probes
    for h in model._trace_probe_handles:
        h.remove()
    del model._trace_probes, model._trace_probe_handles
    return probes


def expert_weights(model) -> dict:
    """Per layer: the engine's resident NVFP4 expert weights (codes, scales, per-expert amax)."""
    out = {}
    for i, layer in enumerate(_decoder_layers(model)):
        re = layer.mlp.experts.routed_experts
        out[i] = {
            f"{name}_{field}": getattr(getattr(re, f"trace_{name}"), field).detach().clone()
            for name in ("w13", "w2")
            for field in ("codes", "scales", "amax")
        }
    return out


def expert_residency(model) -> dict:
    """Per layer: every tensor the routed-expert module holds with storage (parameters, buffers and
    tensor attributes, packed weights included): {name: (dtype, bytes)}. Meta tensors hold nothing."""
    from trace_kernels.grouped_mm import PackedExperts

    out = {}
    for i, layer in enumerate(_decoder_layers(model)):
        re = layer.mlp.experts.routed_experts
        held = {}
        for name, t in list(re.named_parameters()) + list(re.named_buffers()):
            held[name] = t
        for name, v in vars(re).items():
            if isinstance(v, torch.Tensor):
                held[name] = v
            elif isinstance(v, PackedExperts):
                for f in ("codes", "scales", "amax"):
                    held[f"{name}.{f}"] = getattr(v, f)
        out[i] = {n: (t.dtype, 0 if t.is_meta else t.numel() * t.element_size()) for n, t in held.items()}
    return out


def checkpoint_expert_codes(path) -> dict:
    """What a fresh load of checkpoint `path` must hold: per layer, per-expert RTN NVFP4 of the BF16
    expert weights with each expert's own tensor amax (gate rows, then up rows)."""
    from safetensors.torch import load_file

    import trace_kernels

    w = load_file(str(path))
    out = {}
    layer = 0
    while f"model.layers.{layer}.mlp.experts.0.down_proj.weight" in w:
        pre = f"model.layers.{layer}.mlp.experts"
        E = sum(1 for k in w if k.startswith(pre) and k.endswith("down_proj.weight"))
        w13 = [torch.cat([w[f"{pre}.{e}.gate_proj.weight"], w[f"{pre}.{e}.up_proj.weight"]]) for e in range(E)]
        w2 = [w[f"{pre}.{e}.down_proj.weight"] for e in range(E)]
        entry = {}
        for name, ws in (("w13", w13), ("w2", w2)):
            qs = [trace_kernels.quantize(m, trace_kernels.tensor_amax(m)) for m in ws]
            entry[f"{name}_codes"] = torch.stack([q.codes for q in qs])
            entry[f"{name}_scales"] = torch.stack([q.scales for q in qs])
            entry[f"{name}_amax"] = torch.cat([trace_kernels.tensor_amax(m) for m in ws])
        out[layer] = entry
        layer += 1
    return out


def same_values(a, b) -> bool:
    """NVFP4 data equality: scales byte-equal, codes equal as values (+0 == -0)."""
    import trace_kernels

    if not torch.equal(a.scales, b.scales):
        return False
    da = trace_kernels.NVFP4Tensor(a.codes, a.scales, torch.ones(1)).dequantize()
    db = trace_kernels.NVFP4Tensor(b.codes, b.scales, torch.ones(1)).dequantize()
    return torch.equal(da, db)

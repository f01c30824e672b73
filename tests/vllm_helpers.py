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
    """Per layer: the master BF16 expert weights and what the engine computes with."""
    out = {}
    for i, layer in enumerate(_decoder_layers(model)):
        re = layer.mlp.experts.routed_experts
        out[i] = {
            "w13": re.w13_weight.detach().clone(),
            "w2": re.w2_weight.detach().clone(),
            "w13_codes": re.trace_w13.codes.clone(),
            "w2_codes": re.trace_w2.codes.clone(),
            "w13_scales": re.trace_w13.scales.clone(),
            "w2_scales": re.trace_w2.scales.clone(),
            "w13_deq": re.trace_w13_deq.clone(),
            "w2_deq": re.trace_w2_deq.clone(),
        }
    return out


def same_values(a, b) -> bool:
    """NVFP4 data equality: scales byte-equal, codes equal as values (+0 == -0)."""
    import trace_kernels

    if not torch.equal(a.scales, b.scales):
        return False
    da = trace_kernels.NVFP4Tensor(a.codes, a.scales, torch.ones(1)).dequantize()
    db = trace_kernels.NVFP4Tensor(b.codes, b.scales, torch.ones(1)).dequantize()
    return torch.equal(da, db)

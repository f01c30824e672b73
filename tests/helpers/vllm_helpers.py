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

import engine_gc
from trace_fp4.tiny_model import build_tiny_qwen3_dense, build_tiny_qwen3_moe

MODELS_DIR = Path(os.environ.get("TRACE_FP4_TEST_MODELS", "/tmp/trace_fp4_test_models"))
KV_BYTES = 64 << 20  # the default KV budget is 92% of RAM
# Longer than gpt-oss's tiny sliding window (8 tokens) and a KV block (16): both read paths are exercised.
LONG_PROMPT = " ".join(["The lazy dog jumps over the quick brown fox, and the fox runs away."] * 3)
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
    engine_gc.freeze()  # the engine's gc.collect() calls walk its own objects only (engine_gc.py)
    try:
        return LLM(**args)
    except BaseException:
        engine_gc.thaw()
        raise


def shutdown(llm) -> None:
    """Stop an engine so the next one can start in this process."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    from vllm.v1.engine.core_client import InprocClient

    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None:
        core.shutdown()
    del llm
    if not isinstance(core, InprocClient):
        # An in-process core's shutdown has just run cleanup_dist_env_and_memory (its gc.collect
        # included); a second round would only walk the whole heap twice more (~0.5 s each here).
        gc.collect()
        cleanup_dist_env_and_memory()
    engine_gc.thaw()


def greedy(max_tokens: int, **kwargs):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


# ---- probes (run in the worker via llm.apply_model) ---------------------------------------------
def _decoder_layers(model):
    return model.model.layers


def install_probes(model) -> None:
    """Record, per forward call, the expert inputs and the K/V handed to attention of every layer (of
    every attention layer: a linear-attention layer, e.g. Qwen3-Next's Gated DeltaNet, has no K/V)."""
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

        model._trace_probe_handles.append(layer.mlp.experts.register_forward_pre_hook(moe_hook, with_kwargs=True))
        if hasattr(layer, "self_attn"):
            model._trace_probe_handles.append(layer.self_attn.attn.register_forward_pre_hook(attn_hook, with_kwargs=True))


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


def expert_storage(model) -> dict:
    """Per layer: the storage address of every packed expert tensor, {"w13.codes": data_ptr, ...}. A
    CUDA graph captured before a refit keeps reading these addresses, so a refit must write in place."""
    out = {}
    for i, layer in enumerate(_decoder_layers(model)):
        re = layer.mlp.experts.routed_experts
        out[i] = {
            f"{name}.{field}": getattr(getattr(re, f"trace_{name}"), field).data_ptr()
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


def checkpoint_expert_codes(path, block_scale: str = "6") -> dict:
    """What a fresh load of checkpoint `path` must hold: per layer, per-expert RTN NVFP4 of the BF16
    expert weights with each expert's own tensor amax (gate rows, then up rows), with `block_scale`."""
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
            qs = [trace_kernels.quantize(m, trace_kernels.tensor_amax(m), block_scale=block_scale) for m in ws]
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


# ---- the records-vs-engine comparison (test_vllm_generate, test_qwen3_next_vllm, test_vllm_glm_mixtral) --
def gate_logits(gate, x) -> torch.Tensor:
    """In the worker: the router's logits for `x` (a vLLM gate returns logits or (logits, bias))."""
    out = gate(x)
    return (out[0] if isinstance(out, tuple) else out).detach().clone()


def fc2_inputs(xs, ids, w):
    """The down-projection inputs the engine computed, recomputed per forward call (`xs`: each call's
    expert input; `ids`: the recorded routes, all calls' rows in order) by trace_kernels' routed-expert
    computation on the engine's packed weights `w` (its numerics are tested in test_grouped_mm.py).
    act(gate) * up of each routed slot, before the routing weight."""
    from trace_kernels import NVFP4Tensor
    from trace_kernels.grouped_mm import PackedExperts
    from trace_kernels.routed_experts import routed_experts

    w13 = PackedExperts(w["w13_codes"], w["w13_scales"], w["w13_amax"])
    w2 = PackedExperts(w["w2_codes"], w["w2_scales"], w["w2_amax"])
    rows, row = [], 0
    for x in xs:
        step_ids = ids[row : row + x.shape[0]].long()
        ones = torch.ones(step_ids.shape, dtype=torch.float32)
        _, _, q2 = routed_experts(x, ones, step_ids, w13, w2, "silu", capture=True, backend="torch")
        rows.append(q2)
        row += x.shape[0]
    return NVFP4Tensor(*(torch.cat([getattr(q, f) for q in rows]) for f in ("codes", "scales", "global_amax")))


def assert_records_hold_the_engines_codes(llm, model_dir, prompt, *, num_layers, kv_layers,
                                          install=install_probes, take=take_probes):
    """Generate from the long `prompt` on `llm` (a capture engine with max_num_batched_tokens=32) with
    worker probes on (`install` / `take`), and assert that its record holds exactly the engine's codes:
    - the resident expert weights are RTN per expert of checkpoint `model_dir`'s BF16 weights;
    - every layer's moe_fc1_in, and K / V of the `kv_layers` (no K/V probed elsewhere), equal
      trace_kernels' quantization of what the engine's modules received;
    - moe_fc2_in equals fc2_inputs() of the probed inputs and the recorded routes;
    - the recorded experts are a top-k of the router's logits.
    Returns (out, record, probes) for the caller's own checks."""
    import trace_kernels
    import trace_vllm_plugin as tvp

    llm.apply_model(install)
    out = llm.generate([prompt], greedy(5))[0]
    assert len(out.prompt_token_ids) > 64  # prefilled in chunks of 32 tokens
    probes = llm.apply_model(take)[0]
    weights = llm.apply_model(expert_weights)[0]
    checkpoint = checkpoint_expert_codes(model_dir / "model.safetensors")
    record = tvp.get_record(llm, out)
    T = len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1
    assert record.num_tokens == T

    for layer in range(num_layers):
        w = weights[layer]
        # Expert weights: RTN with one global amax per expert, of the checkpoint's BF16 weights.
        for key, t in checkpoint[layer].items():
            assert torch.equal(t, w[key]), (layer, key)

        xs = probes["x"][layer]
        assert sum(x.shape[0] for x in xs) == T
        sites = [("moe_fc1_in", torch.cat(xs))]
        if layer in kv_layers:
            sites += [("k", torch.cat(probes["k"][layer])), ("v", torch.cat(probes["v"][layer]))]
        else:
            assert layer not in probes["k"]
        for site, data in sites:
            expect = trace_kernels.quantize(data, trace_kernels.row_amax(data))
            got = record.site(layer, site)
            assert same_values(expect, got), (layer, site)
            assert torch.equal(expect.global_amax, got.global_amax), (layer, site)

        ids = record.routed_experts(layer)
        assert same_values(fc2_inputs(xs, ids, w), record.site(layer, "moe_fc2_in")), (layer, "moe_fc2_in")

        # Routing ids: a top-k of the router's logits for every token. The gate is re-run on each
        # forward call's own input (the same GEMM shape as in the engine: a BF16 GEMM's rounding can
        # depend on the number of rows, so one GEMM over all tokens may differ in the last bit), and
        # "a top-k" rather than "the top-k" because experts with equal logits may be chosen either way:
        # the recorded experts' logits must be exactly the k largest values.
        logits = torch.cat([
            llm.apply_model(lambda m, i=layer, xx=xx: gate_logits(_decoder_layers(m)[i].mlp.gate, xx))[0] for xx in xs
        ]).float()
        top_vals = logits.topk(ids.shape[1], dim=-1).values
        rec_vals = logits.gather(-1, ids.long()).sort(-1, descending=True).values
        valid = (rec_vals == top_vals).all(-1)
        assert valid.all(), f"layer {layer}: recorded routing is a top-k of the router logits for only {valid.float().mean():.1%} of tokens"
    return out, record, probes

"""What the parallel-engine tests (vLLM TP / EP / PP, SGLang TP) check against: a single-rank engine's
weights digest computed from the checkpoint, and a single-rank Megatron trainer guided by a rollout's
records."""

import torch

import trace_kernels
from trace_kernels.grouped_mm import PackedExperts
from trace_kernels.weight_digest import layer_digest, model_digest


def fresh_load_digest(model_dir) -> str:
    """A single-rank engine's digest of these weights: per expert RTN NVFP4 with its own amax."""
    from trace_fp4.hf_checkpoint import load_tensors

    w = load_tensors(model_dir)
    layers = sorted({int(k.split(".")[2]) for k in w if ".mlp.experts." in k})
    digests = {}
    for layer in layers:
        pre = f"model.layers.{layer}.mlp.experts"
        E = len({k for k in w if k.startswith(pre) and k.endswith("down_proj.weight")})
        packed = []
        for mats in ([torch.cat([w[f"{pre}.{e}.gate_proj.weight"], w[f"{pre}.{e}.up_proj.weight"]]) for e in range(E)],
                     [w[f"{pre}.{e}.down_proj.weight"] for e in range(E)]):
            q = [trace_kernels.quantize(m, trace_kernels.tensor_amax(m)) for m in mats]
            packed.append(PackedExperts(torch.stack([x.codes for x in q]), torch.stack([x.scales for x in q]),
                                        torch.cat([trace_kernels.tensor_amax(m) for m in mats])))
        digests[layer] = layer_digest(*packed)
    return model_digest(digests)


def single_rank_trainer_mismatch(model_dir, samples: list[dict], records: list) -> tuple[dict, dict]:
    """(trace_full, fp4_rtn) results of a single-rank Megatron trainer recomputing `samples` (dicts with
    prompt_token_ids / output_token_ids) with `records`: per layer and site, the codeword mismatch."""
    from trace_fp4.align import _mode_result
    from trace_fp4.hf_checkpoint import read_config
    from trace_fp4.recompute import Trainer

    samples = [{**s, "logprobs": [0.0] * len(s["output_token_ids"])} for s in samples]
    hf = read_config(model_dir)
    shape = hf.model_shape()
    trainer = Trainer(model_dir, hf)
    guided = _mode_result(trainer.run("trace_full", samples, records), samples, {}, shape)
    rtn = _mode_result(trainer.run("fp4_rtn", samples, records), samples, {}, shape)
    return guided, rtn

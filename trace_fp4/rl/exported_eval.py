"""The miniature's "final FP4 performance": each arm's final policy exported as a compressed-tensors
NVFP4 checkpoint (`trace-fp4 export`), read back by compressed-tensors' decompressor, and evaluated
greedily on the held-out strings in a BF16 engine, which is what a stock engine without NVFP4 kernels
serves from that checkpoint (W4A16: NVFP4 weights, BF16 activations). Beside the engine's FP4 figure
(W4A4 with our per-token activations) it separates the weight rounding from the activation rounding.

Only the routed experts train, so the exported checkpoint is the SFT init with the policy's experts:
one BF16 engine on the init serves every arm, each arm's decompressed experts synced in turn.
"""

import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..export import export_checkpoint
from ..export.decompress import decompressed_experts


def export_policy(policy, init_dir, out_dir) -> Path:
    """Write the policy as a Hugging Face checkpoint (BF16, the init's config and tokenizer) and export it."""
    out_dir = Path(out_dir)
    hf_dir = out_dir.parent / f".{out_dir.name}.hf"
    shutil.rmtree(hf_dir, ignore_errors=True)
    shutil.copytree(init_dir, hf_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in policy.state_hf().items()}
    save_file(state, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    export_checkpoint(hf_dir, out_dir, fmt="compressed-tensors", overwrite=True)
    shutil.rmtree(hf_dir)
    return out_dir


def evaluate_exported(init_dir, exports: dict, task, evaluate, *, seed: int = 0) -> dict:
    """{key: held-out greedy reward} for each exported checkpoint directory in `exports`."""
    from .engine import RolloutEngine

    out = {}
    with RolloutEngine(init_dir, "bf16", seed=seed) as engine:
        for key, d in exports.items():
            experts = {k: v for k, v in decompressed_experts(d).items() if ".mlp.experts." in k}
            engine.sync(experts)
            out[key] = evaluate(engine, task)
    return out

"""The supervised initialisation shared by every arm: a few supervised steps on the task, cached.

Megatron-Core (BF16 compute, fp32 master weights, every parameter trained) fits the tiny random
Qwen3-MoE on teacher-forced answers until the held-out probability of the exact answer (the expected
reward of sampling at temperature 1 from the BF16 model) reaches `target`, then writes a Hugging Face
checkpoint the engines load. The directory is stamped with a hash of everything that made it, so
every arm and seed starts from the same weights and a second run reuses them.
"""

import hashlib
import json
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..tiny_model import build_tiny_qwen3_moe
from .task import ReverseDigits

STAMP = ".trace_rl_sft"


def _samples(task: ReverseDigits, strings: list[str]) -> list[dict]:
    return [{"prompt_token_ids": task.prompt_ids(s), "output_token_ids": task.answer_ids(s)} for s in strings]


def exact_match_probability(policy, task: ReverseDigits, strings: list[str]) -> float:
    """Mean over strings of P(answer + EOS) under the policy (teacher forced, no sampling noise)."""
    with torch.no_grad():
        logp, _ = policy.forward(_samples(task, strings))
    return float(torch.stack([x.sum() for x in logp]).exp().mean())


def build_sft_init(out_dir, *, length: int = 4, target: float = 0.3, max_steps: int = 400, batch: int = 64,
                   lr: float = 3e-3, seed: int = 0, model_kwargs: dict | None = None, log=print) -> Path:
    """Write (or reuse) the SFT checkpoint in `out_dir`; returns its path."""
    from .policy import Policy

    out = Path(out_dir)
    model_kwargs = dict(model_kwargs or {})
    params = dict(length=length, target=target, max_steps=max_steps, batch=batch, lr=lr, seed=seed,
                  model=model_kwargs, format=1)
    stamp = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]
    if (out / STAMP).exists() and json.loads((out / STAMP).read_text())["hash"] == stamp:
        return out
    base = build_tiny_qwen3_moe(out.parent / f"{out.name}.base", seed=seed, **model_kwargs)
    task = ReverseDigits.from_tokenizer(base, length)
    torch.manual_seed(seed)
    policy = Policy(base, "bf16", trainable="all", lr=lr)
    eval_strings = task.eval_strings()
    t0, step, p = time.perf_counter(), 0, 0.0
    while step < max_steps:
        strings = task.train_strings(batch, seed=seed * 100003 + step)
        logp, _ = policy.forward(_samples(task, strings))
        loss = -torch.cat(logp).mean()
        policy.step(loss)
        step += 1
        if step % 10 == 0:
            p = exact_match_probability(policy, task, eval_strings)
            log(f"sft step {step}: loss {loss.item():.3f}, held-out P(exact) {p:.3f}")
            if p >= target:
                break
    tmp = out.parent / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(base, tmp, ignore=shutil.ignore_patterns("model.safetensors", ".trace_fp4_tiny"))
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in policy.state_hf().items()}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    info = {"hash": stamp, "params": params, "steps": step, "heldout_exact_probability_bf16": p,
            "seconds": time.perf_counter() - t0}
    (tmp / STAMP).write_text(json.dumps(info, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def sft_info(model_dir) -> dict:
    return json.loads((Path(model_dir) / STAMP).read_text())

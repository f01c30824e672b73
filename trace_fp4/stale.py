"""`trace-fp4 align --stale K`: what guidance still removes when the trainer's weights have moved on.

Off-policy RL trains on a rollout made by weights some updates older than the trainer's. The job
recomputes the same FP4 rollout (and its records, made by the rollout's weights) with the trainer's
weights k = 0, 1, ..., K small deterministic updates newer, and reports codeword mismatch against the
rollout's record and |delta logp| against the rollout for fp4_rtn and each TRACE mode.

The update (documented, deterministic): one step of normalised gradient descent on the routed
experts' weights only, on the BF16 model's mean negative log-likelihood of the rollout's generated
tokens: each expert weight matrix W moves by STEP_SIZE * ||W|| along -grad / ||grad|| (so every
step changes each expert matrix by 0.1% of its norm, whatever the gradient's scale). Computed in
float32, stored in BF16 like the checkpoint.
"""

import torch

STEP_SIZE = 0.001


def _is_expert(name: str) -> bool:
    return ".experts." in name


@torch.enable_grad()
def expert_sgd_step(trainer, samples: list[dict]) -> tuple[dict, float]:
    """The trainer's state after one step (module docstring); (new state, relative update norm)."""
    from megatron.core import parallel_state  # noqa: F401  (initialised by Trainer)

    from . import hf_to_megatron as h2m
    from . import megatron_cpu

    hf = trainer.hf
    config = h2m.transformer_config(hf, params_dtype=torch.float32)
    model = h2m.build_gpt_model(hf, h2m.local_block_spec(hf, config), config)
    h2m.load_into(model, {k: v.float() for k, v in trainer.state.items()})
    model.train()
    nll, count = 0.0, 0
    for s in samples:
        prompt, out = s["prompt_token_ids"], s["output_token_ids"]
        tokens = torch.tensor(prompt + out[:-1])
        T = tokens.numel()
        logits = model(tokens[None], torch.arange(T)[None], megatron_cpu.causal_mask(T))
        logp = torch.log_softmax(logits[0, len(prompt) - 1 :].float(), dim=-1)
        generated = torch.tensor(out)
        mask = torch.tensor([t >= 0 for t in s.get("token_turns", [0] * len(out))], dtype=torch.bool)
        picked = logp.gather(-1, generated[:, None])[:, 0][mask]
        nll = nll - picked.sum()
        count += int(mask.sum())
    (nll / count).backward()
    new_state = dict(trainer.state)
    moved, total = 0.0, 0.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not _is_expert(name) or p.grad is None or name not in new_state:
                continue
            g = p.grad
            step = STEP_SIZE * p.norm() * g / g.norm().clamp_min(1e-30)
            updated = (p - step).to(new_state[name].dtype)
            moved += float((updated.float() - new_state[name].float()).norm() ** 2)
            total += float(new_state[name].float().norm() ** 2)
            new_state[name] = updated
    if not total:
        raise RuntimeError("--stale: no routed-expert weights were updated (no parameter named '.experts.')")
    return new_state, (moved / total) ** 0.5

"""Train-rollout gap of token log-probabilities: the figures RL frameworks log.

Both inputs are the log-probabilities of the same sampled tokens, under the rollout engine and under
the trainer. With r = logp_train - logp_rollout per token:
- `logprob_abs_diff_mean`: mean |r| (verl's `train_rollout_logprob_abs_diff`);
- `k3_kl`: mean of exp(r) - 1 - r, Schulman's k3 estimator of KL(rollout || train) from samples of the
  rollout policy (non-negative and unbiased).
"""

import torch


def gap(logp_train: torch.Tensor, logp_rollout: torch.Tensor) -> dict[str, float]:
    if logp_train.shape != logp_rollout.shape:
        raise ValueError(f"log-prob shapes differ: trainer {tuple(logp_train.shape)}, rollout {tuple(logp_rollout.shape)}")
    if logp_train.numel() == 0:
        raise ValueError("no tokens to compare")
    r = logp_train.double() - logp_rollout.double()
    return {
        "logprob_abs_diff_mean": r.abs().mean().item(),
        "logprob_abs_diff_max": r.abs().max().item(),
        "k3_kl": (torch.expm1(r) - r).mean().item(),
        "num_tokens": float(r.numel()),
    }


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logits [T, V] predicting tokens [T] -> float32 log-probabilities [T]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, tokens[:, None].long())[:, 0]

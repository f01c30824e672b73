"""GRPO as verl runs it with the rollout's log-probabilities as the old policy.

Advantages: each sample's reward minus its group's mean, divided by the group's standard deviation
(+ eps), the same value on every generated token. Loss: PPO-clip per token,
  ratio = exp(logp_train - logp_rollout),  loss = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A),
averaged over all generated tokens of the batch (verl's "token-mean"). No KL term (verl's GRPO
example keeps one, but against a reference policy that this miniature would have to run a third
time per step; with one update per rollout batch and a clip, the policy cannot move far per step).

The ratio's denominator is the rollout engine's probability, so any train-rollout mismatch enters
the ratio directly: a mismatched token looks off-policy, is clipped, and its gradient is biased.
"""

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """rewards [G * n] in group order -> advantages [G * n]."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.double().reshape(-1, group_size)
    adv = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + eps)
    return adv.reshape(-1).float()


def ppo_clip_loss(logp: list[torch.Tensor], logp_rollout: list[torch.Tensor], advantages: torch.Tensor,
                  clip: float = 0.2) -> tuple[torch.Tensor, dict]:
    """Token-mean PPO-clip loss over samples; also the clipped fraction of tokens."""
    new = torch.cat(logp)
    old = torch.cat(logp_rollout).to(new.dtype)
    adv = torch.cat([a.expand(x.numel()) for a, x in zip(advantages, logp)]).to(new.dtype)
    ratio = torch.exp(new - old)
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip, 1 + clip) * adv
    loss = -torch.minimum(unclipped, clipped).mean()
    clip_frac = ((ratio - 1).abs() > clip).float().mean().item()
    return loss, {"clip_fraction": clip_frac, "ratio_mean": ratio.detach().mean().item()}

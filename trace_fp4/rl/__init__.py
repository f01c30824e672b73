"""A miniature of RL post-training with FP4 rollouts (the paper's Table 1 in small).

    task.py     the toy verifiable task: prompts from a seed, exact-match reward, a held-out set
    engine.py   the rollout engine (real vLLM, trace_fp4 for FP4 arms) in its own process
    policy.py   the trainer's model (real Megatron-Core, trace spec for FP4 arms), fp32 master weights
    grpo.py     group-normalised advantages and the PPO-clip loss against the rollout's log-probs
    sft.py      the cached supervised initialisation shared by every arm
    loop.py     one arm x seed: rollout -> records -> train -> sync, metrics per step
    arms.py     what each arm means (engine precision, trainer spec, TraceConfig)
"""

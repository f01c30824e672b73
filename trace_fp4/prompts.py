"""The align job's default prompts: short, varied lengths, all in the tiny tokenizer's domain."""

DEFAULT_PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was a tiny model that learned to count",
    "Four bit floating point has only eight magnitudes",
    "Reinforcement learning for language models alternates between",
    "The engine records which codeword each value became;",
    "Mixture of experts models route every token to a few experts, so",
    "Tests run on a central processing unit",
    "Low precision rollouts are cheap, but the trainer and the engine",
]

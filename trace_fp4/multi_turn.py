"""`trace-fp4 align --turns N`: a scripted multi-turn rollout, stitched into one record per trajectory.

Each of N assistant turns is one engine request whose prompt is the whole trajectory so far; between
turns a fixed observation text (what a tool would return) is appended. Each trajectory's turn records
are stitched by token position with the same code the verl adapter uses
(`trace_kernels.records.stitch`), so the trainer recomputes the whole trajectory guided by one record.

A sample of a multi-turn rollout (rollout.json) has, besides the single-turn fields:
  output_token_ids   everything after the first prompt: turn 0's tokens, the observation, turn 1's, ...
  logprobs           the rollout's log-probability of each generated token (observation tokens have none)
  token_turns        per output token: the turn that generated it, or -1 for an observation token
"""

import torch

OBSERVATION = "\nObservation: the tool returned 42 and the fox ran away.\n"


def run_turns(llm, prompts: list[str], params, turns: int, observation: str = OBSERVATION, *, capture: bool):
    """Run `turns` assistant turns for every prompt; returns (samples, per sample its turns' records
    and token ids as `Turn`s, or None without capture)."""
    from vllm.inputs import TokensPrompt

    import trace_vllm_plugin
    from trace_kernels.records.stitch import Turn

    tokenizer = llm.get_tokenizer()
    obs_ids = tokenizer.encode(observation, add_special_tokens=False)
    firsts = [tokenizer.encode(p) for p in prompts]
    seqs = [list(p) for p in firsts]
    logprobs = [[] for _ in prompts]
    token_turns = [[] for _ in prompts]
    per_sample_turns = [[] for _ in prompts]
    for k in range(turns):
        if k:
            for i in range(len(seqs)):
                seqs[i] += obs_ids
                token_turns[i] += [-1] * len(obs_ids)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], params, use_tqdm=False)
        records = trace_vllm_plugin.get_records(llm, outputs, store=False) if capture else [None] * len(outputs)
        for i, (o, rec) in enumerate(zip(outputs, records)):
            gen = o.outputs[0]
            logprobs[i] += [step[t].logprob for step, t in zip(gen.logprobs, gen.token_ids)]
            token_turns[i] += [k] * len(gen.token_ids)
            seqs[i] += list(gen.token_ids)
            if capture:
                per_sample_turns[i].append(Turn(rec, list(seqs[i])))
    samples = [
        {"prompt": p, "prompt_token_ids": first, "output_token_ids": seq[len(first):], "logprobs": lp,
         "token_turns": tt}
        for p, first, seq, lp, tt in zip(prompts, firsts, seqs, logprobs, token_turns)
    ]
    return samples, (per_sample_turns if capture else None), len(obs_ids)


def generated_only(outcome, samples):
    """The outcome with each sample's trainer log-probabilities restricted to its generated tokens (the
    rollout has none for observation tokens), the same order as the rollout's `logprobs`."""
    import dataclasses

    lps = []
    for lp, s in zip(outcome.logprobs, samples):
        mask = torch.tensor([t >= 0 for t in s["token_turns"]], dtype=torch.bool)
        lps.append(lp[mask])
    return dataclasses.replace(outcome, logprobs=lps)


def row_turns(sample) -> torch.Tensor:
    """int64 [T]: per record row (token position, without the last sampled token), the turn that
    generated that token, -1 for the prompt and observation tokens."""
    P = len(sample["prompt_token_ids"])
    rows = torch.full((P + len(sample["output_token_ids"]) - 1,), -1, dtype=torch.int64)
    turns = torch.tensor(sample["token_turns"][:-1], dtype=torch.int64)
    rows[P:] = turns
    return rows


def per_turn(outcome, samples, turns: int) -> list[dict]:
    """Per turn: its generated tokens, |delta logp| over them, and codeword mismatch over their rows
    (the rows of the tokens it generated that entered the model)."""
    out = []
    for k in range(turns):
        train, roll = [], []
        for lp, s in zip(outcome.logprobs, samples):  # the trainer's: one per output token
            train.append(lp[torch.tensor([t == k for t in s["token_turns"]], dtype=torch.bool)])
            generated_turns = [t for t in s["token_turns"] if t >= 0]  # the rollout's: one per generated token
            roll.append(torch.tensor([v for v, t in zip(s["logprobs"], generated_turns) if t == k], dtype=torch.float32))
        r = (torch.cat(train).double() - torch.cat(roll).double()).abs()
        entry = {"turn": k, "generated_tokens": int(r.numel()),
                 "logprob_abs_diff_mean": r.mean().item() if r.numel() else None,
                 "logprob_abs_diff_max": r.max().item() if r.numel() else None}
        counts = outcome.group_sites.get(k) if getattr(outcome, "group_sites", None) is not None else None
        if counts is not None and counts.elements:
            entry["codeword_mismatch_rate"] = counts.mismatched / counts.elements
            entry["rows_compared_values"] = counts.elements
        else:
            entry["codeword_mismatch_rate"] = None
        out.append(entry)
    return out

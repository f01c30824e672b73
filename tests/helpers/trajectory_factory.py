"""Multi-turn trajectories of random captures, and their turns' records (test helper)."""

import torch

import trace_kernels as tk
from record_factory import SHAPE

# prompt 7, turn 0 generates 4, observation 3, turn 1 generates 5, observation 2, turn 2 generates 3
PROMPT, GEN, OBS = 7, (4, 5, 3), (3, 2)


def trajectory(seed=0):
    """Token ids of each turn's request (prompt = the trajectory so far) and the engine's rows of the
    whole trajectory, per layer and site, as one engine would compute them."""
    g = torch.Generator().manual_seed(seed)
    ids, turns = torch.randint(0, 1000, (PROMPT,), generator=g).tolist(), []
    for k, n in enumerate(GEN):
        ids = ids + torch.randint(0, 1000, (n,), generator=g).tolist()
        turns.append(list(ids))
        if k < len(OBS):
            ids = ids + torch.randint(0, 1000, (OBS[k],), generator=g).tolist()
    T = len(turns[-1]) - 1
    rows = {}
    for layer in range(SHAPE.num_layers):
        rows[(layer, "routing")] = torch.randint(0, SHAPE.num_experts, (T, SHAPE.top_k), generator=g)
        for site in SHAPE.layer_sites(layer):
            x = torch.randn(T, *SHAPE.row_shape(site), generator=g)
            rows[(layer, site)] = tk.quantize(x, tk.row_amax(x))
    return turns, rows


def turn_record(rows, tokens, n, config, **identity):
    """The record of a request over tokens[:n + 1]: its first n rows of the trajectory's."""
    b = tk.RecordBuilder(SHAPE, config, token_ids=tokens[: n + 1], num_prompt_tokens=PROMPT, **identity)
    for layer in range(SHAPE.num_layers):
        b.add_routing(layer, rows[(layer, "routing")][:n])
        for site in SHAPE.layer_sites(layer):
            q = rows[(layer, site)]
            b.add(layer, site, tk.NVFP4Tensor(q.codes[:n], q.scales[:n], q.global_amax[:n]))
    return b.build()




def turn_request(turns, k):
    """Turn k's request as a server sees it: (its prompt, the trajectory so far; what it generated)."""
    prompt_len = len(turns[k]) - GEN[k]
    return turns[k][:prompt_len], turns[k][prompt_len:]

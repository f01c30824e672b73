"""Routing replay from guidance records, on Megatron-Core's own replay hook.

With `moe_enable_routing_replay=True` every TopKRouter owns a `RouterReplay` whose `get_replay_topk` is
called for the top-k choice. `TraceRouterReplay` replaces that instance (same class family, same place in
`RouterReplay.global_router_replay_instances`): when a trace batch with records is active it returns the
record's expert ids for every token that has a record and the router's own choice for the others (padding,
the last sampled token); otherwise it behaves exactly like Megatron's RouterReplay (record / replay actions
still work). It also remembers the ids it returned, which the trace MoE layer sends along with each token.
"""

import torch
from megatron.core.transformer.moe.router_replay import RouterReplay


class TraceRouterReplay(RouterReplay):
    def __init__(self, replaced: RouterReplay):
        super().__init__()  # appends self to the global instance list; put it where `replaced` was
        instances = RouterReplay.global_router_replay_instances
        instances.pop()
        instances[instances.index(replaced)] = self
        self.layer_number = replaced.layer_number
        self.router_replay_action = replaced.router_replay_action
        self.trace_target: torch.Tensor | None = None  # int64 [n, top_k], -1 rows: use the router's own
        self.last_topk_idx: torch.Tensor | None = None
        self.replayed_rows = 0

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if self.trace_target is not None:
            target, self.trace_target = self.trace_target, None
            if target.shape != (scores.shape[0], topk):
                raise RuntimeError(
                    f"trace routing replay: {tuple(target.shape)} expert ids for {scores.shape[0]} tokens x top-{topk}"
                )
            missing = (target < 0).any(-1, keepdim=True)
            self.replayed_rows = int((~missing).sum())
            if self.replayed_rows == target.shape[0]:
                # every token has a record (the usual case): the router's own top-k would be discarded
                idx = target.to(device=scores.device, dtype=torch.int64)  # torch.topk's index dtype
                values = scores.gather(1, idx)
            else:
                own_values, own_idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                idx = torch.where(missing, own_idx, target.to(own_idx.device))
                values = torch.where(missing, own_values, scores.gather(1, idx))
        else:
            self.replayed_rows = 0
            values, idx = super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
        self.last_topk_idx = idx.detach()
        return values, idx

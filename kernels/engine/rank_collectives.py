"""What a tensor-parallel rank of either engine exchanges with its peers, over the engine's CPU (gloo)
process group (vLLM's and SGLang's TP groups both have one; the caller passes it).

- `all_reduce_row_amax`: the fc2 input rows (one per token and routed slot) are split along the
  intermediate dimension, so a row's amax is the max over every rank's slice (a few bytes per row),
  taken before the rows are quantized: the codes do not depend on the layout.
- `full_layer_digest`: the weights digest of a layer whose experts are split along the intermediate
  dimension, computed over every rank's slices put back in the single-rank layout, so it equals a
  single-rank engine's (`trace_kernels.weight_digest.layer_digest`). A collective.
- `gather_parts`: every rank's part of a request's record to the rank that assembles it.
"""

import torch

from ..weight_digest import digest_of_tensors


def all_reduce_row_amax(amax: torch.Tensor, group) -> torch.Tensor:
    """The max over the group's ranks of each row's amax. On a float32 CPU copy; returned on `amax`'s device."""
    host = amax.detach().to("cpu", torch.float32).contiguous()
    torch.distributed.all_reduce(host, op=torch.distributed.ReduceOp.MAX, group=group)
    return host.to(amax.device)


def all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    host = t.detach().to("cpu").contiguous()
    out = [torch.empty_like(host) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(out, host, group=group)
    return out


def full_layer_digest(w13, w2, group, where: str) -> str:
    """`layer_digest` of the whole layer (every rank's slice of the intermediate dimension put back in
    place), on every rank of `group`: a collective. Each rank must have quantized its slice with the
    amax of the whole expert (refused otherwise, naming the rank)."""
    w13_parts = [all_gather(t, group) for t in (w13.codes, w13.scales)]
    w2_parts = [all_gather(t, group) for t in (w2.codes, w2.scales)]
    for name, q in (("w13", w13), ("w2", w2)):
        amaxes = all_gather(q.amax, group)
        for r, a in enumerate(amaxes[1:], 1):
            if not torch.equal(a, amaxes[0]):
                raise RuntimeError(
                    f"trace_fp4: {where}: the {name} expert amax of rank {r} differs from rank 0's (each rank "
                    "must quantize its slice with the amax of the whole expert)"
                )
    return reassembled_digest(w13_parts, w2_parts, w13.amax, w2.amax)


def reassembled_digest(w13_parts, w2_parts, w13_amax, w2_amax) -> str:
    """`layer_digest` of a layer from its ranks' slices: `w13_parts` = (codes per rank, scales per
    rank) of [E, 2I/n, ...] ([gate slice; up slice] on each rank), `w2_parts` likewise [E, H, I/n ...]."""

    def w13_full(parts):
        # Each rank holds [gate slice; up slice]; the single-rank layout is [gate; up].
        half = parts[0].shape[1] // 2
        return torch.cat([p[:, :half] for p in parts] + [p[:, half:] for p in parts], dim=1)

    w13_t = (w13_full(w13_parts[0]), w13_full(w13_parts[1]), w13_amax)
    w2_t = (torch.cat(w2_parts[0], dim=2), torch.cat(w2_parts[1], dim=2), w2_amax)
    return digest_of_tensors(w13_t, w2_t)


def gather_parts(part: dict, group, dst_rank_in_group: int = 0) -> list[dict] | None:
    """Every rank's part (a picklable dict) at the group's rank `dst_rank_in_group` (in rank order);
    None on the other ranks. A collective: every rank calls it for the same request, in the same order."""
    size = torch.distributed.get_world_size(group)
    me = torch.distributed.get_rank(group)
    out = [None] * size if me == dst_rank_in_group else None
    dst = torch.distributed.get_global_rank(group, dst_rank_in_group)
    torch.distributed.gather_object(part, out, dst=dst, group=group)
    return out

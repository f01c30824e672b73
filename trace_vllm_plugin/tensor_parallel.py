"""What a tensor- or pipeline-parallel rank of the trace_fp4 engine does beyond a single worker.

- The fc2 input rows (one per token and routed slot) are split along the intermediate dimension over
  the ranks, so a row's amax must be the max over every rank's slice: `all_reduce_row_amax` (max, a
  few bytes per row) runs before the rows are quantized, and the codes do not depend on the layout.
- The weights digest covers every expert of every rank, reassembled in the single-rank layout
  (`full_layer_digest`), so it equals a single-rank engine's digest for the same weights.
  (Both are `trace_kernels.engine.rank_collectives`, which SGLang's plugin uses too.)
- Expert parallel: each rank holds whole experts; the digest gathers them at their global ids
  (`expert_parallel_digest`), and `local_expert_ids` tells the record which rank holds which expert.
- Pipeline parallel: each stage captures the layers it holds (`pipeline_stage`, vLLM's own split); its
  weights digest covers those layers, and the driver rebuilds the model's from every stage's layer
  digests (no collective: the stages run different steps at the same time).
- On a CPU, vLLM binds each rank's OpenMP threads to one NUMA node and refuses more ranks than nodes;
  `bind_cpu_threads` gives each rank one share of the allowed cores instead (VLLM_CPU_OMP_THREADS_BIND).

Everything here runs on the TP (or EP) group's CPU (gloo) group, which every vLLM worker has.
"""

import logging
import os

import torch

from trace_kernels.engine import cpu_binding, rank_collectives
from trace_kernels.engine.rank_collectives import reassembled_digest  # noqa: F401  (re-exported: tests)
from trace_kernels.weight_digest import digest_of_tensors

logger = logging.getLogger(__name__)

THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def tp_rank_and_size() -> tuple[int, int]:
    """(rank, size) of this worker in vLLM's tensor-parallel group ((0, 1) outside a vLLM worker)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    group = parallel_state.get_tp_group()
    return group.rank_in_group, group.world_size


def pipeline_stage(num_layers: int) -> tuple[int, int, list[int]]:
    """(stage, pipeline_parallel_size, the decoder layers this stage holds) of this worker, by vLLM's
    own split (`get_pp_indices`, VLLM_PP_LAYER_PARTITION included); (0, 1, every layer) without PP."""
    from vllm.distributed import parallel_state
    from vllm.distributed.utils import get_pp_indices

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1, list(range(num_layers))
    group = parallel_state.get_pp_group()
    rank, size = group.rank_in_group, group.world_size
    start, end = get_pp_indices(num_layers, rank, size)
    return rank, size, list(range(start, end))


def _cpu_group():
    from vllm.distributed import parallel_state

    return parallel_state.get_tp_group().cpu_group


def all_reduce_row_amax(amax: torch.Tensor) -> torch.Tensor:
    """The max over the TP ranks of each row's amax (every rank holds the same rows, split along the
    last dimension); `trace_kernels.engine.rank_collectives`, over vLLM's TP CPU group."""
    return rank_collectives.all_reduce_row_amax(amax, _cpu_group())


def full_layer_digest(w13, w2, where: str) -> str:
    """`trace_kernels.weight_digest.layer_digest` of the whole layer (every rank's slice of the
    intermediate dimension put back in place), computed on every rank: a collective."""
    return rank_collectives.full_layer_digest(w13, w2, _cpu_group(), where)


def _ep_cpu_group():
    from vllm.distributed import parallel_state

    return parallel_state.get_ep_group().cpu_group


def local_expert_ids(layer) -> list[int]:
    """Global expert id of each of this rank's local experts (vLLM's expert map: global -> local or -1)."""
    emap = layer.expert_map
    if emap is None:
        return list(range(layer.local_num_experts))
    ids = [-1] * int((emap >= 0).sum())
    for g, local in enumerate(emap.tolist()):
        if local >= 0:
            ids[local] = g
    return ids


def expert_parallel_digest(w13, w2, global_ids: list[int], num_experts: int, where: str) -> str:
    """`layer_digest` of the whole layer under expert parallelism: every rank's experts gathered and put
    at their global ids (a collective over the EP group). Refuses an expert held twice or by no rank."""
    group = _ep_cpu_group()
    size = torch.distributed.get_world_size(group)

    def gather(t):
        host = t.detach().to("cpu").contiguous()
        out = [torch.empty_like(host) for _ in range(size)]
        torch.distributed.all_gather(out, host, group=group)
        return out

    ids = gather(torch.tensor(global_ids, dtype=torch.int64))
    owner = {}
    for r, rank_ids in enumerate(ids):
        for g in rank_ids.tolist():
            if g in owner:
                raise RuntimeError(f"trace_fp4: {where}: expert {g} is held by rank {owner[g]} and rank {r}")
            owner[g] = r
    missing = sorted(set(range(num_experts)) - set(owner))
    if missing:
        raise RuntimeError(f"trace_fp4: {where}: expert {missing[0]} is held by no rank")

    def full(t):
        parts = gather(t)
        out = torch.empty((num_experts, *parts[0].shape[1:]), dtype=parts[0].dtype)
        for rank_ids, part in zip(ids, parts):
            out[rank_ids] = part
        return out

    return digest_of_tensors(*((full(q.codes), full(q.scales), full(q.amax)) for q in (w13, w2)))


def core_shares(cpus: list[int], ranks: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `ranks` workers (trace_kernels.engine.cpu_binding)."""
    return cpu_binding.core_shares(cpus, ranks, THREADS_BIND_ENV)


def bind_cpu_threads(ranks: int, environ=os.environ) -> str | None:
    """Before a vLLM engine with `ranks` CPU workers starts in this process: when the user set no
    binding, give each rank one share of this process's allowed cores and say so. Returns the binding
    set, or None (one rank, not a CPU build, or the user's own binding is kept)."""
    if ranks <= 1 or environ.get(THREADS_BIND_ENV, "auto") != "auto":
        return None
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    return cpu_binding.bind_ranks(ranks, THREADS_BIND_ENV, unset=("", "auto"), environ=environ)

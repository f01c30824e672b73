"""One share of this process's cores per engine rank, for CPU engines that bind each rank's OpenMP
threads to a NUMA node and refuse more ranks than nodes (vLLM-cpu: VLLM_CPU_OMP_THREADS_BIND; SGLang's
CPU engine: SGLANG_CPU_OMP_THREADS_BIND). Both take "cores of rank 0|cores of rank 1|...".
"""

import logging
import os

logger = logging.getLogger(__name__)


def core_shares(cpus: list[int], ranks: int, env_name: str = "the binding") -> str:
    """`ranks` contiguous, equal shares of `cpus` ("0|1", "0,1|2,3"); the remainder goes unused so that
    every rank runs the same number of threads."""
    cpus = sorted(cpus)
    if len(cpus) < ranks:
        raise ValueError(
            f"trace_fp4: {ranks} CPU workers but only {len(cpus)} allowed CPUs ({cpus}); set "
            f"{env_name} yourself or use fewer ranks"
        )
    n = len(cpus) // ranks
    return "|".join(",".join(str(c) for c in cpus[r * n : (r + 1) * n]) for r in range(ranks))


def bind_ranks(ranks: int, env_name: str, unset=("",), environ=os.environ) -> str | None:
    """When `env_name` is unset (or one of `unset`), set it to one share of the allowed cores per rank and
    log it. Returns the binding set, or None (one rank, or the user's own binding is kept)."""
    if ranks <= 1 or environ.get(env_name, "") not in unset:
        return None
    mask = core_shares(list(os.sched_getaffinity(0)), ranks, env_name)
    environ[env_name] = mask
    logger.warning("trace_fp4: %d CPU workers and no %s set: binding one share of the cores per rank: %s=%r",
                   ranks, env_name, env_name, mask)
    return mask

"""Run Megatron-Core on a machine without CUDA (the align job's CPU mode).

Megatron-Core assumes CUDA in a few places that a small model on a CPU still reaches: tensors placed
on `torch.cuda.current_device()`, CUDA streams and events, and the CUDA RNG tracker. `install()`
redirects those to the CPU; `init_parallel()` starts a gloo process group and Megatron's parallel
state. Nothing here runs when CUDA is available: `install()` refuses then, so a GPU job can never end
up on this path by accident.
"""

import contextlib
import socket

import torch

_installed = False


class _NoStream:
    """Stands in for torch.cuda.Stream / Event / current_stream(): a CPU runs everything in order."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: _NoStream()


def _redirect_streams() -> None:
    """torch.cuda streams and events -> _NoStream. Re-applied on every install(): vLLM's CPU worker
    (vllm/v1/worker/cpu/shm.py) puts its own placeholders there when an engine runs in the same
    process, and theirs return None from record_event(), which Megatron's alltoall dispatcher then
    synchronizes on. The dispatcher keeps one DtoH stream per class, made on first use: reset it too."""
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.Stream = _NoStream
    torch.cuda.Event = _NoStream
    torch.cuda.current_stream = lambda *a, **k: _NoStream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    if not isinstance(MoEAlltoAllTokenDispatcher.cuda_dtoh_stream, (_NoStream, type(None))):
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = None


def install() -> None:
    global _installed
    if torch.cuda.is_available():
        raise RuntimeError("trace_fp4.megatron_cpu is for machines without CUDA; use Megatron's own setup")
    _redirect_streams()
    if _installed:
        return
    torch.cuda.manual_seed = lambda seed: None
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: None

    from megatron.core.tensor_parallel import random as mp_random

    # The tracker forks CUDA generator states around dropout; dropout is off here, so not forking
    # is exact.
    mp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda *a, **k: None

    class _CpuTracker(mp_random.CudaRNGStatesTracker):
        def add(self, name, seed):
            self.states_[name] = torch.get_rng_state()
            self.seeds_.add(seed)

        @contextlib.contextmanager
        def fork(self, name=mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            yield

    # Megatron hands the alltoall split sizes over as numpy arrays (moved off the GPU); gloo's binding
    # only takes Python sequences of ints. Matters from expert parallelism 2 on.
    a2a = torch.distributed.all_to_all_single

    def _all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        as_list = lambda s: None if s is None else [int(v) for v in s]  # noqa: E731
        return a2a(output, input, as_list(output_split_sizes), as_list(input_split_sizes), *args, **kwargs)

    torch.distributed.all_to_all_single = _all_to_all_single

    _cpu_rope_cp_split()

    mp_random._CUDA_RNG_STATE_TRACKER = _CpuTracker()
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mp_random.initialize_rng_tracker = lambda *a, **k: None
    _installed = True


def _cpu_rope_cp_split() -> None:
    """Megatron's `get_pos_emb_on_this_cp_rank` (RoPE under context parallelism) builds its chunk index
    in pinned memory and moves it with .cuda(); the same selection, on the CPU."""
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding

    def get_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
        if cp_group is None:
            raise ValueError("cp_group must be provided to get positional embedding per CP rank")
        cp_size, cp_rank = cp_group.size(), cp_group.rank()
        cp_idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
        pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1 :])
        pos_emb = pos_emb.index_select(seq_dim, cp_idx)
        return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2 :])

    rope_utils.get_pos_emb_on_this_cp_rank = get_pos_emb_on_this_cp_rank
    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = get_pos_emb_on_this_cp_rank
    yarn_rotary_pos_embedding.get_pos_emb_on_this_cp_rank = get_pos_emb_on_this_cp_rank


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_parallel(rank: int = 0, world_size: int = 1, port: int | None = None, *, tp: int = 1, ep: int = 1, pp: int = 1,
                  cp: int = 1, etp: int | None = None):
    """gloo process group + Megatron parallel state (idempotent within one process)."""
    install()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port or free_port()}", rank=rank, world_size=world_size
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        context_parallel_size=cp, expert_tensor_parallel_size=etp,
    )
    model_parallel_cuda_manual_seed(1234)


def causal_mask(seq_len: int) -> torch.Tensor:
    """Megatron's boolean attention mask (True = masked); on a CPU it must be passed explicitly."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), 1)[None, None]

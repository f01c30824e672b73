"""What a tensor-parallel rank of SGLang's trace_fp4 engine does beyond a single one (SGLang 0.5.23).

Each TP rank's scheduler process runs its own model runner and capture (state.py), sized for what the
rank holds (`rank_shape`: its slice of the expert intermediate dimension, its KV heads). The numbers
shared with vLLM's plugin come from `trace_kernels.engine.rank_collectives`, over SGLang's MoE TP CPU
(gloo) group:
- the fc2 input rows are quantized with the row amax all-reduced over the ranks (`all_reduce_row_amax`),
  so the codes equal a single rank's;
- the weights digest is computed over every rank's slices put back in place (`full_layer_digest`);
- when a request finishes, every rank's scheduler builds its part of the record
  (`trace_kernels.engine.rank_parts.rank_part`) and the parts are gathered to TP rank 0, which assembles
  the one record in the single-rank layout (`assemble_rank_parts`, the code vLLM's driver runs) and
  returns it in meta_info. The schedulers of a TP group finish the same requests in the same order (they
  run the same batches), so the gather pairs up.
SGLang's CPU all-reduce itself is its own: `torch.ops.sgl_kernel.shm_allreduce` where sgl_kernel's CPU
build exists (AMX or arm64), else torch.distributed (gloo), which is what runs here.
"""

import dataclasses

from trace_kernels.engine import rank_collectives


def tp_rank_and_size() -> tuple[int, int]:
    """(rank, size) of this process in SGLang's MoE tensor-parallel group ((0, 1) before it exists)."""
    from sglang.srt.distributed import parallel_state

    if getattr(parallel_state, "_MOE_TP", None) is None:
        return 0, 1
    group = parallel_state.get_moe_tp_group()
    return group.rank_in_group, group.world_size


def cpu_group():
    from sglang.srt.distributed import parallel_state

    return parallel_state.get_moe_tp_group().cpu_group


def rank_shape(shape, tp_size: int):
    """The row shapes one rank captures: its slice of the expert intermediate dimension, its KV heads."""
    if tp_size == 1:
        return shape
    return dataclasses.replace(shape, moe_intermediate_size=shape.moe_intermediate_size // tp_size,
                               num_kv_heads=shape.num_kv_heads // tp_size)


def all_reduce_row_amax(amax):
    return rank_collectives.all_reduce_row_amax(amax, cpu_group())


def full_layer_digest(w13, w2, where: str) -> str:
    return rank_collectives.full_layer_digest(w13, w2, cpu_group(), where)


def gather_parts(part: dict) -> list[dict] | None:
    """Every rank's part of one request's record at TP rank 0 (None on the others)."""
    return rank_collectives.gather_parts(part, cpu_group())


def refuse_padded_layout(hf_text_config, tp_size: int) -> None:
    """SGLang's CPU engine pads `moe_intermediate_size` to a multiple of 32 x tp_size and the KV heads to
    a multiple of tp_size (configs/update_config.py, adjust_config_with_unaligned_cpu_tp), keeping the
    originals as `original_*`. A record must hold the model's own rows, so a padded layout is refused."""
    for name, original in (("moe_intermediate_size", "original_moe_intermediate_size"),
                           ("num_key_value_heads", "original_total_num_kv_heads")):
        was, now = getattr(hf_text_config, original, None), getattr(hf_text_config, name, None)
        if was is not None and now is not None and int(was) != int(now):
            raise NotImplementedError(
                f"trace_fp4: tp_size={tp_size}: SGLang padded {name} from {was} to {now} to split it over the "
                f"ranks, and a record holds the model's own rows; use a tp_size that divides it (on the CPU "
                f"moe_intermediate_size must be a multiple of 32 x tp_size)"
            )


THREADS_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"


def bind_cpu_threads(ranks: int, environ=None) -> str | None:
    """Before starting SGLang's CPU engine with `ranks` TP ranks from this process: SGLang binds each
    rank to a NUMA node and refuses more ranks than nodes ("SGLANG_CPU_OMP_THREADS_BIND is not set ...
    should be smaller than or equal to number of numa node"); when the user set no binding, give each
    rank one share of the allowed cores and say so (the schedulers inherit the environment)."""
    import os

    from trace_kernels.engine.cpu_binding import bind_ranks

    return bind_ranks(ranks, THREADS_BIND_ENV, environ=os.environ if environ is None else environ)

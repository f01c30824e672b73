"""Set-ups trace_fp4 refuses in every engine, with one message each, at model build.

A refusal is a NotImplementedError (or ValueError for a shape that cannot be NVFP4) raised before the
first forward, naming the layer and what to change, instead of a record that would be wrong: split
across ranks, with the routing weight in the wrong place, or with blocks that straddle a row.
"""

from ..format import BLOCK_SIZE


def check_expert_dims(where: str, hidden_size: int, intermediate_size: int) -> None:
    """Both GEMM K dimensions of the experts must hold whole NVFP4 blocks."""
    for name, size in (("hidden_size", hidden_size), ("moe_intermediate_size", intermediate_size)):
        if size % BLOCK_SIZE:
            raise ValueError(
                f"trace_fp4: {where}: {name}={size} is not divisible by "
                f"{BLOCK_SIZE} (NVFP4 quantizes blocks of 16 along the GEMM K dimension)"
            )


def refuse_router_weight_on_input(where: str, applied_on_input: bool) -> None:
    if applied_on_input:
        raise NotImplementedError(
            f"trace_fp4: {where}: apply_router_weight_on_input models are not supported (the routing "
            "weight must be applied after the down projection, as the trainer does)"
        )


def refuse_parallel_experts(where: str, tp_size: int, ep_size: int, hint: str) -> None:
    """Layouts whose expert rows the engine cannot assemble into one record yet."""
    if tp_size > 1 or ep_size > 1:
        what = "expert parallel" if ep_size > 1 else "tensor parallel"
        raise NotImplementedError(
            f"trace_fp4: {where}: {what} MoE (tp={tp_size}, ep={ep_size}) is not supported yet (records "
            f"would be split across ranks); {hint}"
        )


def refuse_non_gated(where: str, is_gated: bool, activation) -> None:
    if not is_gated:
        raise NotImplementedError(f"trace_fp4: {where}: non-gated MoE activation {activation!r} is not supported")


def refuse_multiple_ranks(sizes: dict[str, int]) -> None:
    """`sizes`: the engine's parallel sizes it cannot capture across, by its own option names."""
    over = {k: v for k, v in sizes.items() if int(v or 1) != 1}
    if over:
        raise NotImplementedError(
            f"trace_fp4: {', '.join(f'{k}={v}' for k, v in over.items())} is not supported with trace_fp4 "
            "(its records cannot be assembled across these ranks yet); set it to 1"
        )


def refuse_kv_head_split(shape, tp_size: int) -> None:
    """Under tensor parallelism each rank captures its own KV heads; a head replicated on several
    ranks (fewer KV heads than ranks) would give a record with parts present twice."""
    if tp_size > 1 and shape.kv_kind == "kv" and shape.num_kv_heads % tp_size:
        raise NotImplementedError(
            f"trace_fp4: tensor_parallel_size={tp_size} with {shape.num_kv_heads} KV heads: each rank must hold "
            f"whole, distinct KV heads (num_key_value_heads divisible by tensor_parallel_size)"
        )

"""config.json fields every registered family reads the same way (one line of error per bad field)."""

from trace_kernels import BLOCK_SIZE

from ..hf_checkpoint import CheckpointError, _int, _number


def attention_fields(cfg: dict, where: str) -> dict:
    """hidden_size, heads, KV heads and head_dim, with their divisibility rules."""
    hidden = _int(cfg, "hidden_size", where)
    heads = _int(cfg, "num_attention_heads", where)
    kv_heads = _int(cfg, "num_key_value_heads", where, default=heads)
    if heads % kv_heads:
        raise CheckpointError(f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    if cfg.get("head_dim") is None and hidden % heads:
        raise CheckpointError(f"{where}: hidden_size={hidden} is not a multiple of num_attention_heads={heads} (and no head_dim)")
    head_dim = _int(cfg, "head_dim", where, default=hidden // heads)
    return dict(hidden_size=hidden, num_attention_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)


def check_blocks(where: str, **sizes: int) -> None:
    """NVFP4 quantizes blocks of 16 along each of these dimensions."""
    for name, value in sizes.items():
        if value % BLOCK_SIZE:
            raise CheckpointError(
                f"{where}: {name}={value} is not divisible by {BLOCK_SIZE} (NVFP4 quantizes blocks of "
                f"{BLOCK_SIZE} along it)"
            )


def rope_fields(cfg: dict, where: str) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from the top level or transformers 5's rope_parameters;
    only default (unscaled) RoPE."""
    rope = cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise CheckpointError(f"{where}: config.json rope_parameters={rope!r} must be an object")
    if rope.get("rope_type", "default") != "default" or cfg.get("rope_scaling"):
        raise CheckpointError(f"{where}: only default RoPE is supported, got {rope or cfg.get('rope_scaling')}")
    theta = cfg.get("rope_theta", rope.get("rope_theta"))
    if theta is None:
        raise CheckpointError(f"{where}: config.json has no rope_theta")
    factor = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise CheckpointError(f"{where}: config.json partial_rotary_factor={factor!r} must be in (0, 1]")
    return _number({"rope_theta": theta}, "rope_theta", where, 1.0), float(factor)


def check_bools(cfg: dict, where: str, *keys: str) -> None:
    for key in keys:
        if key in cfg and not isinstance(cfg[key], bool):
            raise CheckpointError(f"{where}: config.json {key}={cfg[key]!r} must be true or false")


def checked_shape(cfg: dict, hf, where: str):
    """`hf` (a family's checked config) whose record shape is `trace_kernels.model_shape_from_hf`'s, the
    one definition both engine plugins use: the family reader takes the layer pattern from it, and a
    reader that disagreed with it on anything else would be a bug caught here, not in a record check."""
    import dataclasses

    from trace_kernels import model_shape_from_hf

    try:
        shape = model_shape_from_hf(cfg, where=where)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    hf = dataclasses.replace(hf, moe_layers=shape.moe_layers)
    if hf.model_shape() != shape:
        raise CheckpointError(f"{where}: {hf.architecture}: the converter's shape {hf.model_shape()} is not the engines' {shape}")
    return hf

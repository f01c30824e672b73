"""The `--trainer-parallel` spec ('tp=2,ep=2'), parsed without importing Megatron-Core.

Its own module so that `trace-fp4 align` can refuse a bad command line or model before it pays for
Megatron-Core's import (seconds on a 2-core machine): recompute.py, which needs Megatron, re-exports it.
"""

TRAINER_DIMS = ("tp", "ep", "cp", "pp")


def parse_trainer_parallel(spec: str) -> dict[str, int]:
    """'tp=2,ep=2' -> {'tp': 2, 'ep': 2, 'cp': 1, 'pp': 1}; '' is the single-rank trainer."""
    out = dict.fromkeys(TRAINER_DIMS, 1)
    for item in filter(None, (p.strip() for p in spec.split(","))):
        name, eq, value = item.partition("=")
        if not eq or name not in TRAINER_DIMS or not value.isdigit() or int(value) < 1:
            raise ValueError(f"--trainer-parallel {spec!r}: expected items like tp=2 with names {'/'.join(TRAINER_DIMS)}, got {item!r}")
        out[name] = int(value)
    return out

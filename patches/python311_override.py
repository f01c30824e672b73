"""`typing.override` on Python 3.11, for Megatron-Core's `megatron.training` (slime's trainer imports it).

`megatron.training` (megatron-core 0.19.x) does `from typing import override`, which exists from Python
3.12. On 3.11 `typing_extensions.override` is the same decorator (it only sets `__override__`), so it is
put on `typing` before that import. Nothing happens on 3.12+, or when `typing` already has it.
"""

import sys
import typing

SUPPORTED = ((3, 11),)


def install() -> bool:
    """Put `typing_extensions.override` on `typing` (Python 3.11 only); True when it was installed."""
    if hasattr(typing, "override"):
        return False
    if sys.version_info[:2] not in SUPPORTED:
        raise RuntimeError(
            f"trace_fp4_patches.python311_override supports Python {SUPPORTED}; this is {sys.version_info[:2]} "
            "and its typing module has no `override`"
        )
    import typing_extensions

    typing.override = typing_extensions.override
    return True

"""Which implementation the sparse encode and decode run: the torch reference or the Triton kernels.

The choice follows `trace_kernels.backend.resolve_backend` ("auto": Triton for CUDA tensors, torch
elsewhere; the two agree bit for bit). Where Triton was chosen but a piece has no kernel (compact rows
into the encoder), or Triton itself cannot be imported, the torch reference runs instead, and that is
counted here per (stage, reason) and warned about once: never silent. `fallbacks()` reads the counts;
the decoder also adds its own to `DecodeReport.backend_fallback_rows`.
"""

import threading
import warnings
from collections import Counter

from ...backend import resolve_backend

_lock = threading.Lock()
_fallbacks: Counter = Counter()
_warned: set = set()


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(backend: str, device, stage: str, unsupported: str | None = None) -> bool:
    """True where `stage` ("encode" / "decode") runs its Triton kernels. `unsupported`: the reason this
    input has no kernel (then the torch reference runs, counted as a fallback)."""
    if resolve_backend(backend, device) != "triton":
        return False
    reason = unsupported or (None if _triton_importable() else "triton_not_importable")
    if reason is None:
        return True
    key = f"{stage}.{reason}"
    with _lock:
        _fallbacks[key] += 1
        first = key not in _warned
        _warned.add(key)
    if first:
        warnings.warn(f"trace_kernels sparse {stage}: Triton asked for, torch reference used ({reason}); counted in "
                      f"trace_kernels.guides.sparse.dispatch.fallbacks()", RuntimeWarning, stacklevel=3)
    return False


def fallbacks() -> dict[str, int]:
    """{"<stage>.<reason>": calls} that asked for Triton and ran the torch reference."""
    with _lock:
        return dict(_fallbacks)


def reset_fallbacks() -> None:
    with _lock:
        _fallbacks.clear()
        _warned.clear()

"""Process-wide counters: proof that the trace_fp4 paths really ran, and a tally of every fallback.

Counted per scheduler process; a snapshot travels with each finished request's guidance payload
(`meta_info["trace_fp4"][0]["counters"]`), so a test or an operator can see them without RPC.
"""

import threading
from collections import Counter

from trace_kernels import SaturationCounter

_lock = threading.Lock()
_counts: Counter = Counter()
# Values above a static activation amax, per "<layer>.<site>" (accumulated on the data's device; read
# in `snapshot` as `saturated.<layer>.<site>`).
SATURATION = SaturationCounter()


def count(name: str, n: int = 1) -> None:
    with _lock:
        _counts[name] += n


def set_value(name: str, value: int) -> None:
    """A gauge (e.g. bytes held), overwritten rather than added."""
    with _lock:
        _counts[name] = value


def snapshot() -> dict[str, int]:
    with _lock:
        out = dict(_counts)
        out.update({f"saturated.{k}": v for k, v in SATURATION.counts().items()})
        return out


def reset() -> None:
    with _lock:
        _counts.clear()
        SATURATION.reset()

"""The counters an engine keeps: proof that the trace_fp4 paths ran, and a tally of every fallback.

One `EngineCounters` per engine instance (owned by the engine's quant config or runtime, never a module
global). It is a `collections.Counter` (so `counters["x"] += n` and `dict(counters)` work) with a lock
for the calls that come from several threads, and the engine's `SaturationCounter` (values above a
static activation amax, per "<layer>.<site>").
"""

import threading
from collections import Counter

from ..site_scale import SaturationCounter


class EngineCounters(Counter):
    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()
        self.saturation = SaturationCounter()

    def count(self, name: str, n: int = 1) -> None:
        with self.lock:
            self[name] += n

    def set_value(self, name: str, value: int) -> None:
        """A gauge (e.g. bytes held), overwritten rather than added."""
        with self.lock:
            self[name] = value

    def snapshot(self) -> dict[str, int]:
        """The counts, and the saturated values as `saturated.<layer>.<site>` (one flat dict)."""
        with self.lock:
            out = dict(self)
            out.update({f"saturated.{k}": v for k, v in self.saturation.counts().items()})
            return out

    def reset(self) -> None:
        with self.lock:
            self.clear()
            self.saturation.reset()

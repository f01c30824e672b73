"""Which requests have captures, in which state, and the memory they may hold.

Lifecycle of one request's capture:
  live    rows are appended step by step (prefill chunks, then one row per decode step)
  done    the engine removed the finished request; waits to be taken (an aborted one is dropped,
          unless `keep_aborted`: a partial rollout resumes it after a weight update, and its rows
          are the record of the tokens it generated so far)
  taken   `take()` hands it over (to be encoded into a GuidanceRecord) and forgets it

Memory is bounded by `max_bytes` (TRACE_FP4_CAPTURE_MAX_BYTES): over it, the oldest `done` captures are
dropped first, then the largest `live` one; every drop is counted and a later `take()` of a dropped
request raises with the reason. Nothing is dropped silently.
"""

from collections import OrderedDict

from .captured_rows import RequestCapture

# Reasons of dropped captures kept for a later `take` (oldest forgotten first).
DROPPED_REASONS_KEPT = 4096


class RequestCaptures:
    def __init__(self, counters, max_bytes: int, keep_aborted: bool = False):
        self.counters = counters
        self.max_bytes = max_bytes
        self.keep_aborted = keep_aborted
        self.live: dict[str, RequestCapture] = {}
        self.done: OrderedDict[str, RequestCapture] = OrderedDict()
        self.dropped: OrderedDict[str, str] = OrderedDict()  # req_id -> reason
        self.taken: set[str] = set()  # taken before the engine saw them finish
        # +1 whenever a capture starts, leaves `live` (finished, taken, evicted) or joins `taken`: the
        # capture store's run of an unchanged batch (step_run.RunState) holds only while it is the same.
        self.version = 0
        # At least the bytes every capture holds (the total at the last `enforce_budget`, plus what
        # `grew` added since; takes, drops and truncations only lower the real total): a step that keeps
        # it within `max_bytes` cannot be over budget, so `grew` skips the sum over every capture.
        self._bound = 0

    def all(self):
        """Every capture not yet taken (running first), e.g. to find one that holds a prompt's rows."""
        return (*self.live.values(), *self.done.values())

    def start(self, req_id: str, weights: tuple, prompt_ids=None) -> RequestCapture:
        cap = self.live[req_id] = RequestCapture(weights=weights, prompt_ids=prompt_ids)
        self.version += 1
        self.counters["requests_started"] += 1
        return cap

    def finish(self, req_id: str, aborted: bool = False) -> None:
        """The engine removed the request: keep its capture to be taken, or drop it if aborted."""
        if req_id in self.taken:  # its next rows (if the engine still runs it) start a capture again
            self.taken.discard(req_id)
            self.version += 1
        cap = self.live.pop(req_id, None)
        if cap is None:
            return
        self.version += 1
        if aborted and self.keep_aborted:
            # Taken (the partial rollout's aborted part) or discarded by the caller; until then under
            # the memory budget like any finished capture.
            self.counters["aborted_records_kept"] += 1
        elif aborted:
            self.counters["aborted_records_dropped"] += 1
            self._drop(req_id, "the request was aborted")
            return
        self.done[req_id] = cap
        self.counters["requests_finished"] += 1

    def _drop(self, req_id: str, reason: str) -> None:
        self.dropped[req_id] = reason
        while len(self.dropped) > DROPPED_REASONS_KEPT:
            self.dropped.popitem(last=False)

    def total_bytes(self) -> int:
        return sum(c.nbytes for c in self.live.values()) + sum(c.nbytes for c in self.done.values())

    def grew(self, nbytes: int) -> None:
        """The captures hold `nbytes` more (a step appended to the store's run): `enforce_budget` when
        they may be over budget, as every step did (the same evictions, at the same step)."""
        self._bound += nbytes
        if self._bound > self.max_bytes:
            self.enforce_budget()

    def enforce_budget(self) -> None:
        total = self.total_bytes()
        while total > self.max_bytes and self.done:
            req_id, cap = self.done.popitem(last=False)
            total -= cap.nbytes
            self.counters["evicted_done_records"] += 1
            self._drop(req_id, f"evicted: capture memory over TRACE_FP4_CAPTURE_MAX_BYTES={self.max_bytes}")
        while total > self.max_bytes and self.live:
            req_id = max(self.live, key=lambda r: self.live[r].nbytes)
            cap = self.live.pop(req_id)
            self.version += 1
            total -= cap.nbytes
            self.counters["evicted_live_records"] += 1
            self._drop(req_id, f"evicted while running: capture memory over {self.max_bytes} bytes")
        self._bound = total

    def take(self, req_id: str, num_rows: int | None = None) -> RequestCapture:
        """Remove and return a finished request's capture; raises KeyError with the reason if none.

        The caller vouches that the request finished (its output says so): the engine may learn that
        only at its next step, so the capture may still be `live` here. `num_rows` (prompt + generated
        - 1) trims rows of a step that async scheduling ran past the end.
        """
        if req_id in self.dropped:
            raise KeyError(f"request {req_id}: record dropped ({self.dropped.pop(req_id)})")
        cap = self.done.pop(req_id, None)
        if cap is None:
            cap = self.live.pop(req_id, None)
            if cap is not None:
                self.taken.add(req_id)
                self.version += 1
        if cap is None:
            raise KeyError(f"request {req_id}: no record (unknown request, or already taken)")
        if num_rows is not None and cap.error is None:
            if cap.num_rows < num_rows:
                cap.error = f"captured {cap.num_rows} token rows, the output implies {num_rows}"
            elif cap.num_rows > num_rows:
                self.counters["trimmed_rows"] += cap.num_rows - num_rows
                cap.truncate(num_rows)
        return cap

    def find(self, external_id: str) -> list[str]:
        """Internal request ids (`<external>-<8 random chars>`, or the id itself) for an external id."""
        known = list(self.done) + list(self.live) + list(self.dropped)
        return [r for r in known if r == external_id or (r.rsplit("-", 1)[0] == external_id and len(r.rsplit("-", 1)[1]) == 8)]

    def discard(self, req_ids=None) -> int:
        """Drop finished captures (all, or the given ids); returns how many were dropped."""
        ids = list(self.done) if req_ids is None else [r for r in req_ids if r in self.done]
        for r in ids:
            del self.done[r]
        self.counters["discarded_records"] += len(ids)
        return len(ids)

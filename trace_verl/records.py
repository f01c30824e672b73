"""The trainer rank's side of the handles: resolve its own samples' records, keep them for the step.

A step runs the same samples through the actor more than once (compute_log_prob, then update_actor for
every PPO epoch and mini-batch, in micro-batches that share no sample), so records are read without
being consumed and kept here until the step ends. The step ends when the trainer exports its weights
to the rollout (the engine calls `end_step` from its weight export, which verl runs once per step
after update_actor): the records were made by the weights being replaced. Then they are deleted from
the store (by one rank of each model-parallel group: the others only drop their copies).
"""

import time

from .settings import HANDLE_FIELD


def handles_of(micro_batch) -> list[str | None]:
    """The micro-batch's handles in sample order (None where a sample has none), or [] if it has no field."""
    if HANDLE_FIELD not in micro_batch.keys():
        return []
    value = micro_batch.get(HANDLE_FIELD)
    items = value.tolist() if hasattr(value, "tolist") else list(value)
    return [h if isinstance(h, str) and h else None for h in items]


class RecordCache:
    def __init__(self, *, owner: bool = True, allowed=None):
        self.owner = owner  # this rank deletes the step's records from the store at the step's end
        # Handles arrive in the batch, so they are untrusted: only these stores' resolve (None: the
        # process's allowed stores, trace_kernels.stores.allowed_stores()).
        self.allowed = allowed
        self._records: dict[str, object] = {}
        self.resolved_bytes = 0
        self.resolve_seconds = 0.0
        self.resolved = 0
        self.deleted = 0

    def resolve(self, handles: list[str | None]) -> tuple[list, dict]:
        """Records for `handles` (None stays None), and this call's counters."""
        from trace_kernels import stores

        t0 = time.perf_counter()
        nbytes, fetched = 0, 0
        out = []
        for h in handles:
            if h is None:
                out.append(None)
                continue
            rec = self._records.get(h)
            if rec is None:
                rec = stores.get(h, consume=False, allowed=self.allowed)
                self._records[h] = rec
                nbytes += rec.nbytes
                fetched += 1
            out.append(rec)
        dt = time.perf_counter() - t0
        self.resolved_bytes += nbytes
        self.resolve_seconds += dt
        self.resolved += fetched
        return out, {"resolved_records": fetched, "resolved_bytes": nbytes, "resolve_seconds": dt,
                     "records_missing": sum(h is None for h in handles)}

    def end_step(self) -> None:
        """Delete the cached records from the store (owner rank) and forget them."""
        from trace_kernels import stores

        if self.owner:
            for h in self._records:
                stores.delete(h, allowed=self.allowed)
                self.deleted += 1
        self._records.clear()

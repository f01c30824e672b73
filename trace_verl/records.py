"""The trainer rank's side of the handles: resolve its own samples' records, keep them for the step.

A step runs the same samples through the actor more than once (compute_log_prob, then update_actor for
every PPO epoch and mini-batch, in micro-batches that share no sample), so records are read without
being consumed and kept here until the trainer step that uses them has finished. verl exports the
trainer's weights to the rollout once per step, after update_actor (synchronous PPO), or before the
next batch's compute_log_prob (one-step off-policy, fully async): so at an export (`end_step`) the
records a training forward used are done and deleted from the store (by one rank of each
model-parallel group: the others only drop their copies), while records resolved only for
compute_log_prob (a batch whose update_actor has not run yet) are kept for it. A record that no
training forward used by the export after next is dropped too (counted: `dropped_untrained`), so
nothing stays behind when a batch is filtered out after its log-probs.
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
        self._trained: set[str] = set()  # handles a training forward used since they were resolved
        self._exports_seen: dict[str, int] = {}  # untrained handles: exports they have survived
        self.resolved_bytes = 0
        self.resolve_seconds = 0.0
        self.resolved = 0
        self.deleted = 0
        self.kept_for_training = 0
        self.dropped_untrained = 0

    def resolve(self, handles: list[str | None], *, training: bool = False) -> tuple[list, dict]:
        """Records for `handles` (None stays None), and this call's counters. `training`: the call is a
        training forward (its records are done once the step ends)."""
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
            if training:
                self._trained.add(h)
            out.append(rec)
        dt = time.perf_counter() - t0
        self.resolved_bytes += nbytes
        self.resolve_seconds += dt
        self.resolved += fetched
        return out, {"resolved_records": fetched, "resolved_bytes": nbytes, "resolve_seconds": dt,
                     "records_missing": sum(h is None for h in handles)}

    def end_step(self, *, keep_untrained: bool = True) -> None:
        """At a weight export: delete the records training forwards used (owner rank) and forget them;
        keep the others for the training step still to come (at most until the export after next).
        `keep_untrained=False`: the caller knows the step that used them all is over (slime: the next
        rollout begins), so every cached record goes."""
        from trace_kernels import stores

        done = []
        for h in list(self._records):
            if h in self._trained or not keep_untrained:
                done.append(h)
                continue
            seen = self._exports_seen.get(h, 0) + 1
            if seen >= 2:
                done.append(h)
                self.dropped_untrained += 1
            else:
                self._exports_seen[h] = seen
                self.kept_for_training += 1
        for h in done:
            if self.owner:
                stores.delete(h, allowed=self.allowed)
                self.deleted += 1
            self._records.pop(h, None)
            self._trained.discard(h)
            self._exports_seen.pop(h, None)

    def __len__(self) -> int:
        return len(self._records)


def record_staleness(records: list, trainer_version, *, accept_stale: bool, max_staleness: int | None,
                     sources: list[str] | None = None) -> tuple[list[int], int]:
    """(per record, how many weights versions older than the trainer's its oldest rows are; how many
    token rows of all records were made by older weights than the trainer's), over records with int
    versions. A partial rollout's record (aborted at a weight update, resumed under the new weights)
    carries a version per row range: its rows are judged by their own versions.

    Refused (RecordError naming both versions): a record newer than the trainer, rows older without
    `accept_stale` (the identity check says so too), and rows more than `max_staleness` versions older."""
    from trace_kernels import RecordError

    if trainer_version is None:
        return [], 0
    lags, stale_tokens = [], 0
    for i, rec in enumerate(records):
        if rec is None:
            continue
        ranges = rec.identity.row_versions(rec.num_tokens)
        versions = [v for _, _, v in ranges]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in versions):
            continue  # named versions cannot be ordered: the identity check compares them for equality
        where = sources[i] if sources else f"sample {i}"
        partial = len(ranges) > 1
        for a, b, have in ranges:
            rows = f"rows {a}..{b - 1} of the record (a partial rollout)" if partial else "the record"
            lag = trainer_version - have
            if lag < 0:
                raise RecordError(f"{where}: {rows}: weights version {have} is newer than the trainer's {trainer_version}")
            if lag and not accept_stale:
                raise RecordError(
                    f"{where}: {rows} was made with weights version {have}, the trainer has {trainer_version} "
                    "(set override_mcore_model_config.trace_fp4.accept_stale=true to train off-policy; it is counted)"
                )
            if max_staleness is not None and lag > max_staleness:
                raise RecordError(
                    f"{where}: {rows} was made with weights version {have}, {lag} versions older than the trainer's "
                    f"{trainer_version}; the trainer accepts at most {max_staleness} (trace_fp4.max_staleness)"
                )
            if lag:
                stale_tokens += b - a
        lags.append(trainer_version - min(versions))
    return lags, stale_tokens
